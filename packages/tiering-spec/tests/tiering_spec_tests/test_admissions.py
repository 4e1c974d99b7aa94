"""kvtier's own admission path against vLLM's, call by call, inside a real engine.

:mod:`kvtier.vllm_port.admissions` answers ``get_num_new_matched_tokens`` and
``update_state_after_alloc`` of a plain model in place of vLLM's code. Here every call
of them in a real engine is shadowed: the scheduler's state before the call is copied,
kvtier's code runs on the engine, and vLLM's own methods (its ``_lookup`` and key-by-key
``_maximal_prefix_lookup`` included) run on the copy with a manager that gives the
answers the engine's manager gave, and checks that it is asked for the same keys. The
answers, and every state both leave behind, must be the same: the request's keys, their
token positions, blocks, hit chunks, computed tokens, deferred-lookup mark, stored-chunk
index, key ranges and jobs; the load jobs (ids, blocks, group sizes and offsets), job
records, job counter, the step's allocated blocks, the chunks being loaded, the
histograms observed and the lookups the events tracker noted. Workloads: prefixes
reused (loads, asynchronous and synchronous), preemptions (a request looked up while its
stores are in flight), a cap on the tokens a request may load, chunks of two blocks,
self-describing KV events, a lookup that finds a prefix still being stored, and an fs
tier behind a small host tier (arriving requests' keys made for promotions ahead,
lookups that promote). Every key update, an arrival's too, is checked against vLLM's
``update_offload_keys`` on a copy of the request's state.
"""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path
from typing import Any

import pytest

from .e2e_support import CHUNK_BYTES, ENGINE, offload_config, prefix_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
import kvtier.testkit as testkit  # noqa: E402

pytest.importorskip("vllm")

from kvtier.testkit import free_llm, greedy_params, make_llm  # noqa: E402
from kvtier.testkit.engine import kv_connector_of  # noqa: E402
from kvtier.vllm_port import admissions  # noqa: E402

TIGHT = {**ENGINE, "max_num_seqs": 4, "num_gpu_blocks_override": 16}
# The scheduler's state the two admission calls change: new entries only (copied
# shallow), or anything (copied deep). The request's own state is copied deep.
_NEW_ENTRIES = ("_jobs", "_current_batch_load_jobs", "_current_batch_allocated_block_ids")
_ANYTHING = ("_connector_stats", "_events_tracker")
# kvtier's methods on the engine's scheduler; the copy runs vLLM's (its class's).
_OURS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "_lookup",
    "_maximal_prefix_lookup",
    "get_external_cache_hit_sources",
)


@pytest.fixture(scope="module")
def model() -> Path:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return testkit.make_tiny_llama()


class _Replay:
    """A manager answering as the engine's manager did: each key's last lookup answer,
    and each ``prepare_load`` in turn (asked for the same keys)."""

    def __init__(self, answers: dict[Any, Any], loads: list[tuple[list[Any], Any]]) -> None:
        self.answers = answers
        self.loads = list(loads)
        self.asked: list[Any] = []

    def lookup(self, key: Any, req_context: Any) -> Any:
        assert key in self.answers, "vLLM looked up a key kvtier's manager was never asked"
        self.asked.append(key)
        return self.answers[key]

    def prepare_load(self, keys: Any, req_context: Any) -> Any:
        assert self.loads, f"vLLM loads {list(keys)}; kvtier loaded nothing more"
        asked, answer = self.loads.pop(0)
        assert list(keys) == asked, "vLLM and kvtier load different keys"
        return answer


def _twin(scheduler: Any, req_id: str) -> Any:
    """A copy of ``scheduler`` for an admission call on ``req_id``."""
    twin = copy.copy(scheduler)
    twin._req_status = {req_id: copy.deepcopy(scheduler._req_status[req_id])}
    for name in _NEW_ENTRIES:
        setattr(twin, name, copy.copy(getattr(scheduler, name)))
    loading = scheduler._chunks_being_loaded
    twin._chunks_being_loaded = None if loading is None else set(loading)
    for name in _ANYTHING:
        setattr(twin, name, copy.deepcopy(getattr(scheduler, name)))
    for name in _OURS:
        vars(twin).pop(name, None)
    return twin


def _histograms(stats: Any) -> dict[str, int]:
    """Observations per histogram (their values are times), counters as they are."""
    out: dict[str, Any] = {}
    data = stats.data.get("data", {}) if isinstance(stats.data, dict) else {}
    for name, by_labels in data.items():
        for labels, value in by_labels.items():
            out[f"{name}{labels}"] = len(value) if isinstance(value, list) else value
    return out


def _request(scheduler: Any, req_id: str) -> Any:
    status = scheduler._req_status.get(req_id)
    if status is None:
        return None
    return (
        [
            (
                list(g.offload_keys),
                list(g.block_ids),
                g.next_stored_chunk_idx,
                g.num_hit_chunks,
            )
            for g in status.group_states
        ],
        dict(status.req_context._offload_key_positions),
        status.num_locally_computed_tokens,
        status.deferred_lookup_start_time is None,
        status.partial_tail_boundary,
        list(status.load_key_ranges),
        sorted(status.transfer_jobs),
    )


def _ids(values: Any) -> list[int]:
    return [int(v) for v in (values if values is not None else ())]


def _state(scheduler: Any, req_id: str, held: list[float] | None = None) -> dict[str, Any]:
    """What an admission call leaves behind; ``held``: the delay samples kvtier's call
    held back (observed here as vLLM's call observes them at once)."""
    stats = scheduler._connector_stats
    if held:
        stats = copy.deepcopy(stats)
        for delay in held:
            stats.observe_histogram(scheduler._kvtier_admissions.sync_delay, delay)
    return {
        "request": _request(scheduler, req_id),
        "load_jobs": {
            job_id: (
                job.req_id,
                _ids(job.dst_spec.block_ids),
                _ids(getattr(job.dst_spec, "group_sizes", None)),
                _ids(getattr(job.dst_spec, "block_indices", None)),
                _ids(getattr(job.src_spec, "block_ids", None)),
            )
            for job_id, job in scheduler._current_batch_load_jobs.items()
        },
        "jobs": {
            j: (s.req_id, s.pending_count, sorted(s.keys), s.is_store)
            for j, s in scheduler._jobs.items()
        },
        "counter": scheduler._job_counter,
        "allocated": sorted(scheduler._current_batch_allocated_block_ids),
        "loading": None
        if scheduler._chunks_being_loaded is None
        else sorted(scheduler._chunks_being_loaded),
        "stats": _histograms(stats),
        "events": sorted(
            (k, repr(v))
            for k, v in getattr(scheduler._events_tracker, "_pending_event_metadata", {}).items()
        ),
    }


class _Shadow:
    """Wraps kvtier's two admission calls on one scheduler with the comparison."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.answers: dict[Any, Any] = {}  # each key's last lookup answer
        self.lookups = self.hits = self.loads = self.resumed = 0
        self.held = 0  # delay samples of memo answers held back (see admissions)
        module = __import__(type(scheduler).__module__, fromlist=["LookupResult"])
        self.results = module.LookupResult
        manager = scheduler.manager
        lookup_prefix = manager.lookup_prefix

        def recorded(keys: Any, req_context: Any) -> Any:
            found, ready = lookup_prefix(keys, req_context)
            keys = list(keys)
            for i, key in enumerate(keys[:found]):
                hit = ready is None or ready[i]
                self.answers[key] = self.results.HIT if hit else self.results.HIT_PENDING
            if found < len(keys):
                self.answers[keys[found]] = self.results.MISS
            return found, ready

        manager.lookup_prefix = recorded
        self.keyed = 0  # key updates checked (arrivals' and lookups')
        self.keying = 0  # lookups that make keys
        admit = scheduler._kvtier_admissions
        update_keys = admit.update_keys

        def checked_keys(status: Any) -> None:
            twin = copy.deepcopy(status)
            update_keys(status)
            type(status).update_offload_keys(twin)
            assert status.group_states[0].offload_keys == twin.group_states[0].offload_keys
            ours = status.req_context._offload_key_positions
            assert ours == twin.req_context._offload_key_positions
            self.keyed += 1

        admit.update_keys = checked_keys
        self.matched = self._matched(scheduler.get_num_new_matched_tokens)
        self.allocated = self._allocated(scheduler.update_state_after_alloc)

    def _matched(self, ours: Any) -> Any:
        scheduler = self.scheduler
        vllm_matched = type(scheduler).get_num_new_matched_tokens

        def matched(request: Any, num_computed_tokens: int, *args: Any, **kwargs: Any) -> Any:
            status = scheduler._req_status[request.request_id]
            # (vLLM clears a request's device blocks here: it held some, so it ran.)
            self.resumed += bool(status.group_states[0].block_ids)
            self.keying += not status.transfer_jobs  # (vLLM makes its keys then)
            twin = _twin(scheduler, request.request_id)
            admit = scheduler._kvtier_admissions
            held_before = len(admit.held)
            answer = ours(request, num_computed_tokens, *args, **kwargs)
            held = admit.held[held_before:]
            self.held += len(held)
            twin.manager = replay = _Replay(self.answers, [])
            theirs = vllm_matched(twin, request, num_computed_tokens, *args, **kwargs)
            assert answer == theirs, (request.request_id, answer, theirs)
            req_id = request.request_id
            assert _state(scheduler, req_id, held) == _state(twin, req_id)
            self.lookups += 1
            self.hits += bool(answer[0])
            assert replay.asked or not answer[0]
            return answer

        return matched

    def _allocated(self, ours: Any) -> Any:
        scheduler = self.scheduler
        vllm_allocated = type(scheduler).update_state_after_alloc

        def allocated(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            twin = _twin(scheduler, request.request_id)
            manager = scheduler.manager
            prepare = manager.prepare_load
            loads: list[tuple[list[Any], Any]] = []

            def recorded(keys: Any, req_context: Any) -> Any:
                answer = prepare(keys, req_context)
                loads.append((list(keys), answer))
                return answer

            manager.prepare_load = recorded
            try:
                ours(request, blocks, num_external_tokens)
            finally:
                del manager.prepare_load
            twin.manager = replay = _Replay(self.answers, loads)
            vllm_allocated(twin, request, blocks, num_external_tokens)
            assert not replay.loads, "kvtier loaded more than vLLM"
            req_id = request.request_id
            assert _state(scheduler, req_id) == _state(twin, req_id)
            self.loads += bool(loads)
            return None

        return allocated


def _shadowed(shadows: list[_Shadow]) -> Any:
    real_install = admissions.install

    def install(scheduler: Any) -> bool:
        if not real_install(scheduler):
            return False
        shadow = _Shadow(scheduler)
        scheduler.get_num_new_matched_tokens = shadow.matched
        scheduler.update_state_after_alloc = shadow.allocated
        shadows.append(shadow)
        return True

    return install


def _prompts(rng: random.Random) -> list[tuple[int, ...]]:
    """The prefix workload twice over, with prompts that share a prefix mid-block and
    prompts asked twice in one batch (a prefix still being stored or loaded)."""
    base = list(prefix_prompts())
    top = max(max(p) for p in base)  # within the tiny model's vocabulary
    extra = [
        (
            *base[i][: rng.randint(1, 100)],
            *(rng.randint(1, top) for _ in range(rng.randint(20, 110))),
        )
        for i in range(6)
    ]
    return [*base, *extra, extra[0], extra[1], *base]


@pytest.mark.parametrize(
    ("case", "extra", "engine_extra"),
    [
        ("prefixes", {}, {}),
        ("sync-loads", {"sync_load_budget_bytes": 1 << 30}, {}),
        ("preemptions", {}, {"num_gpu_blocks_override": 12}),
        ("two-block-chunks", {"block_size": 64}, {}),
        ("load-caps", {}, {}),
        ("events", {"self_describing_kv_events": True}, {}),
        ("fs-tier", {"cpu_bytes_to_use": 24 * CHUNK_BYTES}, {}),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_kvtier_admits_as_vllm_admits(
    model: Path,
    case: str,
    extra: dict[str, Any],
    engine_extra: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    rng = random.Random(case)
    shadows: list[_Shadow] = []
    monkeypatch.setattr(admissions, "install", _shadowed(shadows))
    if case == "fs-tier":  # arrivals' keys made for promotions ahead, lookups promote
        kv = offload_config("TieringOffloadingSpec", host_chunks=256, root_dir=str(tmp_path))
    else:
        kv = offload_config("CPUOffloadingSpec", host_chunks=256)
    kv["kv_connector_extra_config"].update(extra)
    engine: dict[str, Any] = {**TIGHT, **engine_extra}
    if case == "events":
        from vllm.config import KVEventsConfig

        engine["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    llm = make_llm(model, **engine, kv_transfer_config=testkit.kv_transfer_config(kv))
    try:
        scheduler = kv_connector_of(llm).connector_scheduler
        if not shadows:
            assert admissions.source_digest(type(scheduler)) not in admissions.KNOWN_SOURCES
            pytest.skip("this vLLM's admission code is not one kvtier's path reproduces")
        if case == "events":
            assert scheduler._events_tracker.self_describing_enabled, "events must be recorded"
        prompts = _prompts(rng)
        params = []
        for i in range(len(prompts)):
            p = greedy_params(24)
            if case == "load-caps" and i % 3:
                cap = rng.choice([0, 16, 32, 40, 70, 100])
                p.extra_args = {"kv_transfer_params": {"max_load_tokens": cap}}
            params.append(p)
        llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        # Every request finished: the connector has observed each held delay sample.
        assert not scheduler._kvtier_admissions.held
    finally:
        free_llm(llm)
    (shadow,) = shadows
    assert shadow.lookups >= len(prompts), "every request must have been looked up"
    assert shadow.hits >= 4 and shadow.loads >= 4, "the workload must load prefixes"
    assert shadow.keyed >= shadow.keying > 0, "every key update must have been checked"
    if case == "fs-tier":
        assert shadow.keyed > shadow.keying, "arrivals' keys must have been made"
    if case == "preemptions":
        assert shadow.resumed > 0, "a preempted request must have been looked up again"
        assert shadow.held > 0, "a memo answer's delay sample must have been held"


def test_only_the_code_it_was_written_against_is_replaced(model: Path) -> None:
    """A scheduler whose admission code differs from vLLM 0.32's (a subclass with its
    own lookup), or a model with two KV cache groups, keeps vLLM's."""
    kv = offload_config("CPUOffloadingSpec", host_chunks=64)
    llm = make_llm(model, **TIGHT, kv_transfer_config=testkit.kv_transfer_config(kv))
    try:
        scheduler = kv_connector_of(llm).connector_scheduler
        if admissions.source_digest(type(scheduler)) not in admissions.KNOWN_SOURCES:
            pytest.skip("this vLLM's admission code is not one kvtier's path reproduces")
        assert admissions.admitted(scheduler) is not None, "installed on a plain model"

        class Own(type(scheduler)):  # type: ignore[misc]
            def _lookup(self, req_status: Any, max_num_new_tokens: Any = None) -> Any:
                return 0

        assert admissions.source_digest(Own) not in admissions.KNOWN_SOURCES
        other = copy.copy(scheduler)
        other.__class__ = Own
        vars(other).pop("_kvtier_admissions", None)
        assert not admissions.install(other)
        two = copy.copy(scheduler)
        two.config = scheduler.config._replace(
            kv_group_configs=scheduler.config.kv_group_configs * 2
        )
        assert not admissions.applies(two)
    finally:
        free_llm(llm)
