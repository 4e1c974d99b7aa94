"""The connector's scheduler side fed scheduler outputs the way vLLM hands them (no
engine, no vLLM): a preemption's store, the resume's restore, a finish."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from kvtier.recompute_connector import KVGroup, Phase, RecomputeOffloadConfig, WorkerReport
from kvtier.recompute_connector.scheduler_side import SchedulerSide

BS = 4
BLOCK_BYTES = 1024


def side(*, hash_block_size: int = BS) -> SchedulerSide:
    config = RecomputeOffloadConfig.from_settings(
        {"cpu_bytes_to_use": 64 * BLOCK_BYTES}, world_size=1, kv_role="kv_both"
    )
    facts: Any = SimpleNamespace(
        kv=SimpleNamespace(groups=(), hash_block_size=hash_block_size),
        block_hash=SimpleNamespace(prefix_caching=True),
    )
    log = logging.getLogger("test.scheduler_side")
    return SchedulerSide(config, facts, [KVGroup(BS)], BLOCK_BYTES, False, log)


def output(
    *,
    new: tuple[tuple[str, list[int], int], ...] = (),
    cached: tuple[tuple[str, list[int] | None, int], ...] = (),
    scheduled: dict[str, int] | None = None,
    preempted: set[str] | None = None,
    resumed: set[str] | None = None,
) -> Any:
    cached_reqs = SimpleNamespace(
        req_ids=[c[0] for c in cached],
        new_block_ids=[None if c[1] is None else (c[1],) for c in cached],
        num_computed_tokens=[c[2] for c in cached],
    )
    if resumed is not None:
        cached_reqs.resumed_req_ids = resumed
    return SimpleNamespace(
        num_scheduled_tokens=scheduled or {},
        preempted_req_ids=preempted,
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=n) for r, b, n in new
        ],
        scheduled_cached_reqs=cached_reqs,
    )


def stored(s: SchedulerSide, job_id: int) -> None:
    report = WorkerReport()
    report.stores[job_id] = [1, 0]
    s.scheduler.on_worker_report(report)


def test_a_preempted_request_is_stored_from_the_mirrored_table_and_restored() -> None:
    s = side()
    plan = s.step_plan(output(new=(("r", [1, 2], 0),), scheduled={"r": 8}))
    assert not plan.stores and s.scheduler.running["r"].kv_tokens == 8
    plan = s.step_plan(output(preempted={"r"}))
    (job,) = plan.stores
    assert job.device_block_ids == [1, 2] and job.num_tokens == 8
    stored(s, job.job_id)
    assert s.scheduler.phase_of("r") == Phase.RESTORABLE
    request = SimpleNamespace(request_id="r", num_tokens=9)
    assert s.matched_tokens(request, 0) == (8, False)
    blocks = SimpleNamespace(get_block_ids=lambda: [[5, 6, 7]])
    s.after_alloc(request, blocks, 8)
    plan = s.step_plan(output(cached=(("r", [5, 6, 7], 0),), scheduled={"r": 9}, resumed={"r"}))
    (load,) = plan.loads
    assert load.device_block_ids == [5, 6] and load.host_block_ids == job.host_block_ids
    s.finished("r")
    assert not s.scheduler.running and s.scheduler.phase_of("r") is None
    s.scheduler.check_invariants()


def test_a_bound_kv_cache_manager_answers_block_tables() -> None:
    s = side()
    tables = {"r": ([3, 4],)}
    s.bind_kv_cache_manager(SimpleNamespace(get_block_ids=tables.__getitem__))
    s.step_plan(output(new=(("r", [9], 0),), scheduled={"r": 6}))
    assert s.scheduler.running["r"].block_ids == ([3, 4],), "the manager's table, not the output's"
    (job,) = s.step_plan(output(preempted={"r"})).stores
    assert job.device_block_ids == [3, 4]


def test_a_release_without_resumed_ids_reads_none_resumed() -> None:
    s = side()
    s.step_plan(output(new=(("r", [1], 0),), scheduled={"r": 3}))
    s.step_plan(output(cached=(("r", [2], 3),), scheduled={"r": 2}))
    assert s.scheduler.running["r"].block_ids == ([1, 2],)
    assert s.scheduler.running["r"].kv_tokens == 5


def test_nothing_to_restore_answers_zero_and_unknown_requests_are_left_alone() -> None:
    s = side()
    request = SimpleNamespace(request_id="x", num_tokens=12)
    assert s.matched_tokens(request, 4) == (0, False)
    s.after_alloc(request, SimpleNamespace(get_block_ids=lambda: [[1, 2, 3]]), 0)
    s.finished("x")
    s.scheduler.check_invariants()
