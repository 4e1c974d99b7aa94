"""The stats of a step where nothing changed: made once for the same gauge rows, then
copied, each copy vLLM's own ``OffloadingConnectorStats`` holding what ``set_gauge``
would, and none shared with another step's (vLLM aggregates into what it is handed)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
metrics = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
    reason="vLLM before 0.26 has no offloading stats of its own",
)

from kvtier.tiering_spec import vllm_compat as compat  # noqa: E402

from .vllm_configs import spec_without_engine as make_spec  # noqa: E402

ROWS = (("vllm:cpu_cache_usage_perc", 0.25), ("vllm:cpu_cache_write_usage_perc", 0.0))


def test_copies_hold_what_set_gauge_writes_and_share_nothing() -> None:
    quiet = compat.QuietGauges()
    first, second = quiet(ROWS), quiet(ROWS)
    reference = compat.gauge_stats(ROWS)
    assert type(first) is type(reference) is metrics.OffloadingConnectorStats
    assert first.data == second.data == reference.data
    assert first is not second
    # vLLM aggregates another step's stats into the first it holds: the next copies
    # keep their own values.
    later = compat.gauge_stats((("vllm:cpu_cache_usage_perc", 0.75),))
    first.aggregate(later)
    first.increase_counter("vllm:kvtier_host_queries", 3)
    assert first.data != reference.data
    assert second.data == quiet(ROWS).data == reference.data
    assert first.reduce()["vllm:cpu_cache_usage_perc"] == 0.75


def test_new_rows_make_new_stats() -> None:
    quiet = compat.QuietGauges()
    assert quiet(ROWS).data == compat.gauge_stats(ROWS).data
    rows = (("vllm:cpu_cache_usage_perc", 0.5),)
    assert quiet(rows).data == compat.gauge_stats(rows).data
    # The same values in a new tuple (the emitter writes new rows when something moved).
    again = tuple(list(ROWS))
    assert quiet(again).data == compat.gauge_stats(ROWS).data


# -- the manager's settled steps ------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Path:
    testkit = pytest.importorskip("kvtier.testkit")
    return testkit.make_tiny_llama()  # type: ignore[no-any-return]


def _managers(model: Path, tmp_path: Path, fs: bool, count: int) -> list[Any]:
    from kvtier.tiering_spec import CPUOffloadingSpec, TieringOffloadingSpec

    out = []
    for i in range(count):
        extra: dict[str, Any] = {"cpu_bytes_to_use": 16 * 65536}
        cls: type = CPUOffloadingSpec
        if fs:
            cls = TieringOffloadingSpec
            extra["secondary_tiers"] = [{"type": "fs", "root_dir": str(tmp_path / f"fs{i}")}]
        out.append(make_spec(cls, model, extra).get_manager())
    return out


def _steps(seed: int, steps: int) -> list[list[tuple[str, int, list[int]]]]:
    """A random schedule: per step, the calls vLLM makes on the manager (a lookup, a
    store of new keys or a load of stored ones, each completed in a later step, a
    request's end, a reset now and then), most steps none of them (a decode step), and
    now and then a longer stretch of such steps (longer than a change in lookups alone
    may wait to be reported)."""
    rng = random.Random(seed)
    schedule = []
    next_key = 0
    for _ in range(steps):
        calls: list[tuple[str, int, list[int]]] = []
        if rng.random() < 0.4:
            req = rng.randrange(6)
            what = rng.choice(["lookup", "store", "store", "load", "complete", "finish", "reset"])
            if what == "reset" and rng.random() < 0.7:
                what = "lookup"
            if what == "store":
                n = rng.randrange(1, 5)
                calls.append((what, req, list(range(next_key, next_key + n))))
                next_key += n
            else:
                start = rng.randrange(max(1, next_key))
                calls.append((what, req, list(range(start, min(next_key, start + 4)))))
        schedule.append(calls)
        if rng.random() < 0.04:
            schedule += [[] for _ in range(40)]
    return schedule


class _Run:
    """One manager run through a schedule: its stores and loads not completed yet."""

    def __init__(self, mgr: Any) -> None:
        self.mgr = mgr
        self.stores: list[tuple[Any, list[Any]]] = []
        self.loads: list[tuple[Any, list[Any]]] = []

    def step(self, calls: list[tuple[str, int, list[int]]]) -> None:
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key

        mgr = self.mgr
        for what, req, ints in calls:
            ctx = ReqContext(req_id=f"r{req}")
            keys = [make_offload_key(str(i).encode(), 0) for i in ints]
            if what == "lookup":
                for key in keys:
                    mgr.lookup(key, ctx)
            elif what == "store":
                out = mgr.prepare_store(keys, ctx)
                if out is not None:
                    self.stores.append((ctx, list(out.keys_to_store)))
            elif what == "load":
                hits = [k for k in keys if mgr.core.pool.contains(k)]
                if hits:
                    mgr.prepare_load(hits, ctx)
                    self.loads.append((ctx, hits))
            elif what == "complete":  # the oldest store or load in flight is done
                if self.stores and (not self.loads or req % 2):
                    ctx, done = self.stores.pop(0)
                    mgr.complete_store(done, ctx)
                elif self.loads:
                    ctx, done = self.loads.pop(0)
                    mgr.complete_load(done, ctx)
            elif what == "finish":
                mgr.on_request_finished(ctx)
            else:
                mgr.reset_cache()
                self.stores, self.loads = [], []
        mgr.on_schedule_end()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_settled_manager_reports_what_the_full_check_reports(
    model: Path, tmp_path: Path, seed: int
) -> None:
    """Step by step, the stats of a manager that answers settled steps from what it
    last reported equal those of one that reads its state every step."""
    pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM 0.32's manager interface")
    fast, full = _managers(model, tmp_path, fs=False, count=2)
    full._may_settle = False  # (never settles: every call reads the state)
    runs = [_Run(fast), _Run(full)]
    settled = 0
    for calls in _steps(seed, 400):
        for run in runs:
            run.step(calls)
        settled += fast._stats_settled
        got, want = fast.get_stats(), full.get_stats()
        assert (got is None) == (want is None)
        if got is not None:
            assert got.data == want.data
    assert settled > 100, "most steps call nothing: they should be answered settled"
    for mgr in (fast, full):
        mgr.shutdown()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_settled_answer_is_what_reading_the_state_finds(
    model: Path, tmp_path: Path, seed: int
) -> None:
    """With an fs tier (its writes dropped: no worker here), each step answered as
    settled is one where reading the state finds nothing changed and nothing waiting."""
    pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM 0.32's manager interface")
    (mgr,) = _managers(model, tmp_path, fs=True, count=1)
    mgr.core.secondary_tiers[0].wait_scan(30)
    run = _Run(mgr)
    settled = 0
    for calls in _steps(seed, 300):
        run.step(calls)
        if mgr._stats_settled:
            settled += 1
            rows = mgr._metrics.settled_rows
            assert rows is not None
            assert mgr._metrics.quiet_gauges(defer=True) is rows
        mgr.get_stats()
    assert settled > 50
    mgr.shutdown()
