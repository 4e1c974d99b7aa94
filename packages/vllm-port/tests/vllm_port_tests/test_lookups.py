"""kvtier's one-call prefix lookups and one-tier hit sources answer what vLLM's own
methods answer.

Each test builds vLLM's real ``OffloadingConnectorScheduler`` object without its
constructor, gives it the few attributes the two methods read, and compares vLLM's
method with :mod:`kvtier.vllm_port.lookups`'s on the same object, over random inputs.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

scheduler_mod = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
)

from kvtier.vllm_port import lookups  # noqa: E402

Scheduler = scheduler_mod.OffloadingConnectorScheduler
LookupResult = scheduler_mod.LookupResult
CacheHitSource = scheduler_mod.CacheHitSource


class _Tracker:
    def __init__(self) -> None:
        self.self_describing_enabled = True
        self.recorded: list[tuple[Any, ...]] = []

    def record_lookup(self, req: Any, group_config: Any, chunk_idx: int, key: Any) -> None:
        self.recorded.append((req, group_config, chunk_idx, key))


class _Manager:
    """Answers from a fixed map; ``lookup_prefix`` is the contract kvtier's managers
    keep (keys up to the first miss; None when all hit, else a flag per key)."""

    def __init__(self, answers: dict[Any, Any], sources: dict[Any, str]) -> None:
        self.answers = answers
        self.sources = sources

    def lookup(self, key: Any, req_context: Any) -> Any:
        return self.answers.get(key, LookupResult.MISS)

    def lookup_prefix(self, keys: list[Any], req_context: Any) -> tuple[int, list[bool] | None]:
        flags: list[bool] = []
        for key in keys:
            answer = self.lookup(key, req_context)
            if answer is LookupResult.MISS:
                break
            flags.append(answer is LookupResult.HIT)
        return len(flags), None if all(flags) else flags

    def get_load_source(self, key: Any, req_context: Any) -> str:
        return self.sources[key]


def _scheduler(
    manager: _Manager, statuses: dict[str, Any] | None = None, cls: type = Scheduler
) -> Any:
    scheduler = object.__new__(cls)
    scheduler.manager = manager
    scheduler._events_tracker = _Tracker()
    scheduler._req_status = statuses or {}
    return scheduler


class _RecordsPending(Scheduler):  # type: ignore[misc,valid-type]
    """vLLM 0.33's prefix loop, which records a KV event for a pending key too (0.32
    records hits only), written here for a vLLM 0.32 environment."""

    def _maximal_prefix_lookup(  # type: ignore[override]
        self, keys: Any, req_context: Any, req: Any, group_config: Any, start_chunk_idx: int
    ) -> int | None:
        found, deferred = 0, False
        for i, key in enumerate(keys):
            answer = self.manager.lookup(key, req_context)
            if answer is LookupResult.MISS:
                break
            if answer is LookupResult.RETRY:
                deferred = True
                continue
            self._events_tracker.record_lookup(req, group_config, start_chunk_idx + i, key)
            found += 1
            deferred |= answer is LookupResult.HIT_PENDING
        return None if deferred else found


@pytest.mark.parametrize("cls", [Scheduler, _RecordsPending], ids=["vllm-0.32", "pending-too"])
def test_prefix_lookups_answer_and_record_what_vllm_does(cls: type) -> None:
    rng = random.Random(7)
    answers = (LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS)
    for trial in range(400):
        keys = [f"k{trial}-{i}" for i in range(rng.randint(0, 12))]
        weights = rng.choice([(10, 0, 1), (6, 2, 1), (1, 1, 1)])
        table = {k: rng.choices(answers, weights)[0] for k in keys}
        start = rng.randint(0, 5)
        theirs = _scheduler(_Manager(table, {}), cls=cls)
        ours = _scheduler(_Manager(table, {}), cls=cls)
        assert lookups.batch_prefix_lookups(ours)
        want = cls._maximal_prefix_lookup(theirs, keys, "ctx", "req", "group", start)
        got = ours._maximal_prefix_lookup(iter(keys), "ctx", "req", "group", start)
        assert got == want, (table, keys)
        assert ours._events_tracker.recorded == theirs._events_tracker.recorded


def test_prefix_lookups_keep_vllms_loop_where_it_cannot_be_probed() -> None:
    class Unknown(Scheduler):  # type: ignore[misc,valid-type]
        def _maximal_prefix_lookup(  # type: ignore[override]
            self, keys: Any, req_context: Any, req: Any, group_config: Any, start_chunk_idx: int
        ) -> int | None:
            raise RuntimeError("needs state a probe does not have")

    scheduler = _scheduler(_Manager({}, {}), cls=Unknown)
    assert not lookups.batch_prefix_lookups(scheduler)


def test_prefix_lookups_record_nothing_where_vllm_records_nothing() -> None:
    keys = ["a", "b"]
    scheduler = _scheduler(_Manager(dict.fromkeys(keys, LookupResult.HIT), {}))
    scheduler._events_tracker.self_describing_enabled = False
    scheduler._events_tracker.record_lookup = lambda *a: pytest.fail("recorded")
    assert lookups.batch_prefix_lookups(scheduler)
    assert scheduler._maximal_prefix_lookup(keys, "ctx", "req", "group", 0) == 2


def test_prefix_lookups_need_a_manager_that_answers_a_prefix() -> None:
    manager = SimpleNamespace(lookup=lambda key, ctx: LookupResult.HIT)
    scheduler = _scheduler(manager)  # type: ignore[arg-type]
    assert not lookups.batch_prefix_lookups(scheduler)
    assert "_maximal_prefix_lookup" not in vars(scheduler)


def _status(rng: random.Random, keys: list[str]) -> SimpleNamespace:
    local = rng.choice([0, 16, 32])
    ranges = []
    pos = local - rng.choice([0, 0, 16])
    for key in keys:
        lo = pos + rng.choice([0, 0, 0, 0, 8, -8])
        hi = lo + rng.choice([16, 16, 16, 8, 32])
        ranges.append((lo, hi, key))
        pos = hi
    if rng.random() < 0.2:
        rng.shuffle(ranges)
    return SimpleNamespace(
        num_locally_computed_tokens=local, load_key_ranges=ranges, req_context="c"
    )


def _counted(sweep: Any, calls: list[int]) -> Any:
    def counted(*args: Any) -> Any:
        calls.append(1)
        return sweep(*args)

    return counted


class _SoleSource(_Manager):
    """A manager that names the one source of several keys in one call, as kvtier's
    does (``sole_load_source``), and notes the keys it is asked about one by one (only
    vLLM's sweep should)."""

    def __init__(self, answers: dict[Any, Any], sources: dict[Any, str]) -> None:
        super().__init__(answers, sources)
        self.asked: list[list[Any]] = []
        self.one_by_one = 0

    def sole_load_source(self, keys: list[Any], req_context: Any) -> Any:
        self.asked.append(list(keys))
        found = {self.sources[k] for k in keys}
        return found.pop() if len(found) == 1 else None

    def get_load_source(self, key: Any, req_context: Any) -> str:
        self.one_by_one += 1
        return super().get_load_source(key, req_context)


@pytest.mark.parametrize("manager_cls", [_Manager, _SoleSource], ids=["per-key", "sole"])
def test_hit_sources_are_what_vllm_sweeps(manager_cls: type) -> None:
    rng = random.Random(11)
    tiers = [CacheHitSource.HOST, CacheHitSource.DISK, "host", "disk"]
    fast = 0
    for trial in range(600):
        keys = [f"k{trial}-{i}" for i in range(rng.randint(0, 6))]
        one = rng.random() < 0.6
        first = rng.choice(tiers)
        sources = {k: first if one else rng.choice(tiers) for k in keys}
        status = _status(rng, keys)
        n = rng.choice([0, 8, 16, 24, 32, 48, 64, 100])
        request = SimpleNamespace(request_id="r")
        theirs = _scheduler(_Manager({}, sources), {"r": status})
        ours = _scheduler(manager_cls({}, sources), {"r": status})
        sweeps: list[int] = []
        ours.get_external_cache_hit_sources = _counted(ours.get_external_cache_hit_sources, sweeps)
        assert lookups.single_source_hits(ours)
        want = Scheduler.get_external_cache_hit_sources(theirs, request, n)
        got = ours.get_external_cache_hit_sources(request, n)
        assert got == want, (status, sources, n)
        assert all(isinstance(k, CacheHitSource) for k in got)
        fast += not sweeps and n > 0
        if manager_cls is _SoleSource:
            assert len(ours.manager.asked) <= 1, "asked more than once for a hit"
            if not sweeps:
                assert ours.manager.one_by_one == 0, "asked key by key"
    assert fast > 100, "the one-tier answer must be taken for most one-tier hits"


class _Asked(_Manager):
    """Answers from a map, noting each key asked (in order)."""

    def __init__(self, answers: dict[Any, Any]) -> None:
        super().__init__(answers, {})
        self.asked: list[Any] = []

    def lookup(self, key: Any, req_context: Any) -> Any:
        self.asked.append(key)
        return super().lookup(key, req_context)


class _AnswersAll(_Asked):
    """A manager with ``lookup_answers``, as kvtier's has: one generator for a scan."""

    def lookup_answers(self, keys: Any, req_context: Any) -> Any:
        for key in keys:
            yield self.lookup(key, req_context)


@pytest.mark.parametrize("manager_cls", [_Asked, _AnswersAll], ids=["lookup", "answers"])
def test_window_scans_answer_and_ask_what_vllm_does(manager_cls: type) -> None:
    rng = random.Random(11)
    kinds = (LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY, LookupResult.MISS)
    for trial in range(600):
        keys = [f"k{trial}-{i}" for i in range(rng.randint(0, 14))]
        weights = rng.choice([(10, 0, 0, 1), (6, 2, 1, 1), (1, 1, 1, 1), (3, 0, 1, 0)])
        table = {k: rng.choices(kinds, weights)[0] for k in keys}
        window = rng.randint(1, 4)
        first = rng.choice([None, window + rng.randint(0, 2)])
        theirs = _scheduler(_Asked(table))
        ours = _scheduler(manager_cls(table))
        assert lookups.sliding_window_scans(ours)
        want = Scheduler._sliding_window_lookup(theirs, keys, window, "ctx", first)
        got = ours._sliding_window_lookup(keys, window, "ctx", first)
        assert got == want, (table, keys, window, first)
        assert ours.manager.asked == theirs.manager.asked, "asked other keys than vLLM"


def test_window_scans_keep_vllms_method_where_it_answers_otherwise() -> None:
    class Other(Scheduler):  # type: ignore[misc,valid-type]
        def _sliding_window_lookup(  # type: ignore[override]
            self,
            keys: Any,
            sliding_window_size: int,
            req_context: Any,
            initial_window_size: int | None = None,
        ) -> int | None:
            return 0  # never a hit

    assert lookups.window_scan(Other) is None
    scheduler = _scheduler(_Manager({}, {}), cls=Other)
    assert not lookups.sliding_window_scans(scheduler)
    assert "_sliding_window_lookup" not in vars(scheduler)


def _arrived(groups: int = 1, hashes: int = 7) -> Any:
    """vLLM's own request state for a request vLLM just added, as ``on_new_request``
    makes it (its lookup has not run)."""
    req = SimpleNamespace(
        request_id="r",
        block_hashes=[b"h%d" % i for i in range(hashes)],
        kv_transfer_params=None,
        kv_hints=None,
    )
    config = SimpleNamespace(
        kv_group_configs=tuple(
            SimpleNamespace(group_idx=g, tokens_per_chunk=32, hashes_per_chunk=2)
            for g in range(groups)
        )
    )
    return scheduler_mod.RequestOffloadState(
        config=config,
        req=req,
        req_context=scheduler_mod._create_req_context(req),
        offloading_context=None,
    )


def test_arrival_keys_are_the_keys_the_lookup_asks_for() -> None:
    arrived, looked_up = _arrived(), _arrived()
    looked_up.update_offload_keys()  # what vLLM's get_num_new_matched_tokens does first
    scheduler = SimpleNamespace(_req_status={"r": arrived})
    keys = lookups.arrival_keys(scheduler, "r")
    want = list(looked_up.group_states[0].offload_keys)
    assert keys == want and len(keys) == 3, "one key per complete chunk of 2 hashes"
    arrived.update_offload_keys()  # the lookup's own call then adds nothing
    assert list(arrived.group_states[0].offload_keys) == want


def test_arrival_keys_are_none_for_several_groups_or_an_unknown_request() -> None:
    assert lookups.arrival_keys(SimpleNamespace(_req_status={"r": _arrived(2)}), "r") is None
    assert lookups.arrival_keys(SimpleNamespace(_req_status={}), "r") is None
    assert lookups.arrival_keys(SimpleNamespace(), "r") is None
