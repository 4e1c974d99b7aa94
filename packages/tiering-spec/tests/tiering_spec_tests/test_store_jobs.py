"""kvtier's own store planner against vLLM's, step by step, inside a real engine.

:mod:`kvtier.vllm_port.store_jobs` plans a plain model's stores in place of vLLM's
``_build_store_jobs``. Here every call of it in a real engine is shadowed: the
scheduler's state before the call is copied, kvtier's planner runs on the engine, and
vLLM's own ``_build_store_jobs`` runs on the copy with a manager that gives the answers
the engine's manager gave (and checks it is asked for the same keys, in the same
order). The jobs planned (ids, requests, blocks, group sizes and offsets, destinations)
and every state both leave behind (job records, each request's stored-chunk index and
jobs, the blocks fenced, the jobs to flush, the job counter, the connector's counters)
must be the same. Workloads: preemptions, prefix reuse, stores during decode, a host
tier too small for a prompt (partial stores, refused stores), chunks of two blocks,
and steps where a block of a request's table is null (vLLM's own rules apply there).
"""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path
from typing import Any

import pytest

from .e2e_support import ENGINE, offload_config, prefix_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
import kvtier.testkit as testkit  # noqa: E402

pytest.importorskip("vllm")

from kvtier.testkit import Workload, free_llm, make_llm, run_workload  # noqa: E402
from kvtier.testkit.engine import kv_connector_of  # noqa: E402
from kvtier.vllm_port import store_jobs  # noqa: E402

TIGHT = {**ENGINE, "max_num_seqs": 4, "num_gpu_blocks_override": 16}


@pytest.fixture(scope="module")
def model() -> Path:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return testkit.make_tiny_llama()


class _Replay:
    """A manager that answers ``prepare_store`` as the engine's manager did."""

    def __init__(self, answers: list[tuple[list[Any], Any]]) -> None:
        self.answers = list(answers)

    def prepare_store(self, keys: Any, req_context: Any) -> Any:
        assert self.answers, f"vLLM asked to store {list(keys)}; kvtier asked nothing more"
        asked, answer = self.answers.pop(0)
        assert list(keys) == asked, "vLLM and kvtier asked the manager for different keys"
        return answer


def _ids(values: Any) -> list[int]:
    return [int(v) for v in (values if values is not None else ())]


def _jobs(jobs: dict[int, Any]) -> dict[int, Any]:
    return {
        job_id: (
            job.req_id,
            _ids(job.src_spec.block_ids),
            _ids(getattr(job.src_spec, "group_sizes", None)),
            _ids(getattr(job.src_spec, "block_indices", None)),
            id(job.dst_spec),
        )
        for job_id, job in jobs.items()
    }


def _state(sched: Any) -> dict[str, Any]:
    return {
        "jobs": {j: _plain(s) for j, s in sched._jobs.items()},
        "requests": {
            req_id: (
                [(g.next_stored_chunk_idx, len(g.offload_keys)) for g in st.group_states],
                sorted(st.transfer_jobs),
            )
            for req_id, st in sched._req_status.items()
        },
        "fenced": {b: sorted(j) for b, j in sched._block_id_to_pending_jobs.items()},
        "flush": sorted(sched._current_batch_jobs_to_flush),
        "counter": sched._job_counter,
        "stats": _plain(sched._connector_stats),
        "events": sorted(
            (k, repr(v))
            for k, v in getattr(sched._events_tracker, "_pending_event_metadata", {}).items()
        ),
    }


def _plain(obj: Any) -> dict[str, Any]:
    """An object's fields (attributes or slots), sets sorted."""
    if hasattr(obj, "__dict__"):
        fields = dict(vars(obj))
    else:
        slots = [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
        fields = {n: getattr(obj, n, None) for n in slots}
    return {n: sorted(v) if isinstance(v, set) else repr(v) for n, v in fields.items()}


def _shadowed(
    checks: list[tuple[int, int]], rng: random.Random, nulls: bool, batches: list[int]
) -> Any:
    real_planner = store_jobs.planner

    def planner(scheduler: Any) -> Any:
        plan = real_planner(scheduler)
        vllm_plan = type(scheduler)._build_store_jobs
        manager = scheduler.manager

        def checked(scheduler_output: Any) -> dict[int, Any]:
            if nulls and rng.random() < 0.3:
                # A null block where a request may store, any of the step's (requests
                # before it are asked for theirs first): both planners see it.
                groups = [
                    status.group_states[0]
                    for req_id in scheduler_output.num_scheduled_tokens
                    if (status := scheduler._req_status.get(req_id)) is not None
                    and len(status.group_states[0].block_ids)
                    > status.group_states[0].next_stored_chunk_idx
                ]
                if groups:
                    group = rng.choice(groups)
                    group.block_ids[group.next_stored_chunk_idx] = 0
            twin = copy.copy(scheduler)
            for name in (
                "_req_status",
                "_jobs",
                "_block_id_to_pending_jobs",
                "_current_batch_jobs_to_flush",
                "_connector_stats",
                "_events_tracker",
            ):
                setattr(twin, name, copy.deepcopy(getattr(scheduler, name)))
            answers: list[tuple[list[Any], Any]] = []
            prepare = manager.prepare_store

            def recorded(keys: Any, req_context: Any) -> Any:
                answer = prepare(keys, req_context)
                answers.append((list(keys), answer))
                return answer

            many = getattr(manager, "prepare_store_many", None)

            def recorded_many(requests: Any) -> Any:
                del manager.prepare_store  # (where it asks one by one, recorded here)
                try:
                    out = many(requests)
                finally:
                    manager.prepare_store = recorded
                answers.extend((list(keys), answer) for (keys, _), answer in zip(requests, out))
                batches.append(len(requests))
                return out

            manager.prepare_store = recorded
            if many is not None:
                manager.prepare_store_many = recorded_many
            try:
                ours = plan(scheduler_output)
            finally:
                del manager.prepare_store
                if many is not None:
                    del manager.prepare_store_many
            twin.manager = _Replay(answers)
            theirs = vllm_plan(twin, scheduler_output)
            assert not twin.manager.answers, "kvtier asked the manager for more than vLLM"
            assert _jobs(ours) == _jobs(theirs)
            assert _state(scheduler) == _state(twin)
            noted = getattr(scheduler._events_tracker, "_pending_event_metadata", ())
            checks.append((len(ours), len(noted)))
            return ours

        return checked

    return planner


def _prompts(rng: random.Random) -> tuple[tuple[int, ...], ...]:
    """The prefix workload, plus prompts that share a prefix mid-block, and prompts
    asked twice or extended in one batch (a store of keys another request is storing)."""
    base = prefix_prompts()
    top = max(max(p) for p in base)  # within the tiny model's vocabulary
    extra = [
        (
            *base[i][: rng.randint(1, 100)],
            *(rng.randint(1, top) for _ in range(rng.randint(20, 110))),
        )
        for i in range(6)
    ]
    twins = [extra[0], extra[1], (*extra[1], *(rng.randint(1, top) for _ in range(40)))]
    return (*base, *extra, *twins)


@pytest.mark.parametrize(
    ("host_chunks", "prompt_only", "block_size", "nulls", "events", "max_tokens"),
    [
        (256, True, None, False, False, 40),
        (256, False, None, False, True, 40),
        (6, False, None, False, False, 40),
        # Stores refused at prefill, planned again as the request finishes.
        (8, True, None, False, False, 1),
        (256, True, 64, False, False, 40),
        (256, False, None, True, False, 40),
    ],
    ids=[
        "prompt-only",
        "decode-stores-events",
        "small-host-tier",
        "stores-at-finish",
        "two-block-chunks",
        "nulls",
    ],
)
def test_kvtier_plans_the_stores_vllm_plans(
    model: Path,
    host_chunks: int,
    prompt_only: bool,
    block_size: int | None,
    nulls: bool,
    events: bool,
    max_tokens: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(host_chunks * 7 + int(prompt_only) + (block_size or 0) + int(nulls))
    checks: list[tuple[int, int]] = []
    batches: list[int] = []  # requests asked of the manager together, per step
    monkeypatch.setattr(store_jobs, "planner", _shadowed(checks, rng, nulls, batches))
    kv = offload_config("CPUOffloadingSpec", host_chunks=host_chunks)
    kv["kv_connector_extra_config"]["offload_prompt_only"] = prompt_only
    if block_size is not None:
        kv["kv_connector_extra_config"]["block_size"] = block_size
    engine: dict[str, Any] = dict(TIGHT)
    if events:  # vLLM's tracker then records every stored chunk's payload
        from vllm.config import KVEventsConfig

        kv["kv_connector_extra_config"]["self_describing_kv_events"] = True
        engine["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    llm = make_llm(model, **engine, kv_transfer_config=testkit.kv_transfer_config(kv))
    try:
        if events:
            tracker = kv_connector_of(llm).connector_scheduler._events_tracker
            assert getattr(tracker, "self_describing_enabled", True), "events must be recorded"
        scheduler = kv_connector_of(llm).connector_scheduler
        if not (store_jobs.plain_model(scheduler) and _installed(scheduler)):
            pytest.skip("this vLLM's store planning is not one kvtier's planner reproduces")
        run_workload(llm, Workload(_prompts(rng), max_tokens))
    finally:
        free_llm(llm)
    assert len(checks) >= 5, "the planner must have run"
    assert sum(jobs for jobs, _ in checks) > 5, "the workload must store"
    if events:
        assert max(noted for _, noted in checks) > 0, "the tracker must have noted stores"
    assert batches, "a step's stores must have been asked of the manager together"


def _installed(scheduler: Any) -> bool:
    return store_jobs.source_digest(type(scheduler)) in store_jobs.KNOWN_SOURCES


def test_only_the_planning_it_was_written_against_is_replaced(model: Path) -> None:
    """A scheduler whose store planning differs from vLLM 0.32's or 0.33's (a subclass
    with its own ``_build_store_jobs``) keeps it."""
    kv = offload_config("CPUOffloadingSpec", host_chunks=64)
    llm = make_llm(model, **TIGHT, kv_transfer_config=testkit.kv_transfer_config(kv))
    try:
        scheduler = kv_connector_of(llm).connector_scheduler
        if not _installed(scheduler):
            pytest.skip("this vLLM's store planning is not one kvtier's planner reproduces")
        assert store_jobs.plain_model(scheduler)

        class Own(type(scheduler)):  # type: ignore[misc]
            def _build_store_jobs(self, scheduler_output: Any) -> dict[int, Any]:
                return {}

        assert store_jobs.source_digest(Own) not in store_jobs.KNOWN_SOURCES
        other = copy.copy(scheduler)
        other.__class__ = Own
        before = vars(other).get("_build_store_jobs")
        assert not store_jobs.install(other)
        assert vars(other).get("_build_store_jobs") is before
    finally:
        free_llm(llm)
