"""The step-cost benchmark: its timer, its anchor (vLLM's own connector and manager), and
one run end to end on a real engine."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.demo import bench_step
from kvtier.testkit import requires_vllm


def test_a_timed_call_counts_its_own_work_not_the_copies_inside() -> None:
    side = bench_step.Side()

    class Probe:
        def work(self) -> None:
            deadline = time.thread_time_ns() + 2_000_000
            while time.thread_time_ns() < deadline:
                pass
            bench_step.COPY_CLOCK.ns += 1_500_000  # as if 1.5 ms of it were a block copy

    probe = Probe()
    side.wrap(probe, ("work",))
    probe.work()
    spent = side.take()
    assert 300_000 <= spent <= 1_500_000, f"{spent} ns: the copy must be left out"
    assert side.take() == 0, "take() hands each step's time over once"


def test_nested_calls_count_once() -> None:
    side = bench_step.Side()

    class Probe:
        def inner(self) -> None:
            deadline = time.thread_time_ns() + 1_000_000
            while time.thread_time_ns() < deadline:
                pass

        def outer(self) -> None:
            self.inner()
            self.inner()

    probe = Probe()
    side.wrap(probe, ("inner", "outer"))
    probe.outer()
    spent = side.take()
    assert 2_000_000 <= spent <= 3_000_000, f"{spent} ns for 2 ms of work"
    assert side.methods["inner"].calls == 2 and side.methods["outer"].calls == 1


def test_the_timer_cost_is_measured_small_and_positive() -> None:
    cost = bench_step.calibrate(rounds=2, calls=500)
    assert 0 < cost.own_ns < 50_000 and 0 < cost.nested_ns < 50_000, cost


def test_percentiles() -> None:
    assert bench_step._pct([5_000, 1_000, 3_000], 0.5) == 3.0
    assert bench_step._pct([], 0.9) == 0.0


def test_an_admission_counts_the_step_that_allocated_it_and_the_one_that_scheduled_it() -> None:
    # An asynchronous load: looked up and allocated in step 2 (no token scheduled: every
    # request waits for its load), scheduled in step 3. Steps 1 and 4 admit nothing.
    rec = bench_step.StepRecorder()
    rec.schedule_calls = [(100_000, 10_000, 8), (90_000, 60_000, 0), (120_000, 40_000, 8)]
    rec.schedule_calls.append((100_000, 12_000, 8))
    rec.update_calls = [(5_000, 0)] * 4
    rec.admitted = [0, 0, 1, 0]
    rec.allocated = [0, 1, 1, 0]
    sched = bench_step.summarize(rec)["sched_us"]
    assert sched["per_admitted"] == 100.0  # (60 + 40) µs for one request
    assert sched["steady_steps"] == 2 and sched["steady_p90"] == 12.0
    # A step that allocates for a request it also schedules counts once.
    rec.allocated = [0, 0, 1, 0]
    rec.schedule_calls[1] = (90_000, 0, 0)
    assert bench_step.summarize(rec)["sched_us"]["per_admitted"] == 40.0


def test_counted_calls_leave_out_the_timing_wrappers() -> None:
    """--calls: each outermost timed call counts the Python calls and the calls of
    builtins made inside it, its own included, nested timed calls too, and none of the
    timing wrappers' own."""
    side = bench_step.Side()

    def helper() -> None:
        return None

    class Probe:
        def inner(self, items: list[int]) -> int:
            return len(items)  # 1 Python call (inner), 1 builtin

        def outer(self) -> None:
            items = [1, 2]
            helper()
            helper()
            len(items)
            len(items)
            self.inner(items)  # 3 Python calls (outer, helper x2) and 2 builtins above

    probe = Probe()
    side.wrap(probe, ("inner", "outer"))
    probe.outer()
    assert side.take_calls() == (0, 0), "nothing is counted unless --calls is on"
    bench_step.COUNTS.on = True
    try:
        probe.outer()
        probe.inner([3])
    finally:
        bench_step.COUNTS.on = False
    assert sys.getprofile() is None
    assert side.take_calls() == (4 + 1, 3 + 1)
    assert side.take_calls() == (0, 0), "take_calls() hands each step's count over once"


def test_calls_per_admitted_request_are_the_admitting_steps_counts() -> None:
    rec = bench_step.StepRecorder()
    rec.schedule_calls = [(100_000, 10_000, 8), (90_000, 60_000, 0), (120_000, 40_000, 8)]
    rec.update_calls = [(5_000, 0)] * 3
    rec.admitted = [0, 0, 2]
    rec.allocated = [0, 2, 0]
    rec.step_counts = [(10, 20), (300, 500), (100, 100)]
    calls = bench_step.summarize(rec)["calls"]
    assert calls["py_per_admitted"] == 200.0 and calls["c_per_admitted"] == 300.0
    assert calls["py_per_step"] == 100.0, "the median of the steps that scheduled tokens"


def engine_of(model: Path, name: str) -> Any:
    """An engine as the benchmark makes one for connector ``name`` (room-8's config)."""
    from kvtier.testkit import kv_transfer_config, make_llm

    kv = bench_step.connector_config(name, bench_step.workloads()[0], "")
    assert kv is not None
    engine: dict[str, Any] = {**bench_step.ENGINE, "max_num_seqs": 8}
    return make_llm(model, **engine, kv_transfer_config=kv_transfer_config(kv))


@requires_vllm
@pytest.mark.e2e
def test_the_anchor_is_vllms_own_connector_and_manager(tiny_model: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvtier.testkit import free_llm
    from kvtier.testkit.engine import kv_connector_of

    bench_step._register_anchor_connector()
    llm = engine_of(tiny_model, "vllm")
    try:
        connector = kv_connector_of(llm)
        assert type(connector) is OffloadingConnector, type(connector).__mro__
        assert type(connector.connector_scheduler.manager) is CPUOffloadingManager
    finally:
        free_llm(llm)


@requires_vllm
@pytest.mark.e2e
def test_one_run_reports_every_connector_beside_the_anchor(tmp_path: Path) -> None:
    out = tmp_path / "bench-step.json"
    code = bench_step.main(
        ["--only", "room-8", "--connectors", "none", "vllm", "kvtier-host", "--json", str(out)]
    )
    assert code == 0
    report = json.loads(out.read_text())
    runs = report["results"]["room-8"]
    for name in ("none", "vllm", "kvtier-host"):
        assert runs[name]["steps"] >= 128, (name, runs[name]["steps"])
        assert runs[name]["vllm_sched_us"]["median"] > 0, name
    assert runs["none"]["sched_us"]["median"] == 0, "no connector, no connector cost"
    for name in ("vllm", "kvtier-host"):
        assert runs[name]["sched_us"]["median"] > 0 and runs[name]["worker_us"]["median"] > 0
        assert "build_connector_meta" in runs[name]["methods"], name
    assert any(g["goal"].startswith("room-8: kvtier-host") for g in report["goals"])
    assert report["timer_ns"]["own"] > 0


@requires_vllm
@pytest.mark.e2e
def test_a_counted_run_reports_calls_per_step_and_per_admitted_request(tmp_path: Path) -> None:
    out = tmp_path / "calls.json"
    args = ["--calls", "--only", "room-8", "--connectors", "kvtier-host", "--json", str(out)]
    assert bench_step.main(args) == 0
    assert sys.getprofile() is None and not bench_step.COUNTS.on
    calls = json.loads(out.read_text())["calls"]["room-8"]["kvtier-host"]
    # Each of room-8's requests is looked up, stored and finished: dozens of calls each.
    assert calls["py_per_admitted"] > 10 and calls["c_per_admitted"] > 10, calls
    assert calls["py_per_step"] > 0, calls


@requires_vllm
@pytest.mark.e2e
def test_the_warm_up_leaves_nothing_cached_for_the_workload(tiny_model: Path) -> None:
    """Its requests ran (the connector stored their blocks), then every cache was
    emptied: a workload starts as on a fresh engine, with its code paths warm."""
    from kvtier.testkit import free_llm
    from kvtier.testkit.engine import kv_connector_of

    llm = engine_of(tiny_model, "kvtier-host")
    try:
        core = kv_connector_of(llm).connector_scheduler.manager.core
        before = core.pool
        bench_step.warm_up(llm)
        assert before.num_cached > 0, "the warm-up's requests stored their blocks"
        assert core.pool is not before, "the connector's cache was reset"
        assert core.pool.num_cached == 0 and core.pool.num_storing == 0
    finally:
        free_llm(llm)


def test_the_steady_profile_compares_the_costliest_steps_with_the_middle_ones() -> None:
    """With --breakdown, each step's method times are kept: the steps that admit nothing
    are ranked by their scheduler side, and each method's mean over the costliest 15% is
    set beside its mean over the middle fifth."""
    rec = bench_step.StepRecorder()
    rec.scheduler.in_step = rec.manager.in_step = {}
    costs = [10_000 + 1_000 * i for i in range(20)]  # step i: 10 + i µs
    rec.schedule_calls = [(50_000, c, 8) for c in costs] + [(50_000, 900_000, 8)]
    rec.update_calls = [(1_000, 0)] * 21
    rec.admitted = [0] * 20 + [3]  # the last step admits: left out
    rec.allocated = [0] * 21
    rec.step_methods = [
        {"build_connector_meta": c, "manager.poll": 5_000 if i >= 17 else 0}
        for i, c in enumerate(costs)
    ]
    rec.scheduler.in_step.update({"build_connector_meta": 900_000})  # the last step's
    profile = bench_step.summarize(rec)["steady_profile"]
    assert profile["build_connector_meta"] == [28.0, 19.5]  # steps 17-19; 8-11
    assert profile["manager.poll"] == [5.0, 0.0]
    rec.scheduler.in_step = None
    assert "steady_profile" not in bench_step.summarize(rec), "only with --breakdown"
