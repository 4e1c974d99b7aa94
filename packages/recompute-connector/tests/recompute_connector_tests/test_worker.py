"""The worker side on vLLM's CPU layout: stores, loads, failures, corruption (no engine)."""

from __future__ import annotations

import torch

from kvtier.recompute_connector import (
    RecomputeOffloadConfig,
    RecomputeOffloadWorker,
    StepPlan,
    TransferJob,
)
from kvtier.testkit.faults import corrupted_restores, failing_copies

NUM_BLOCKS = 8
# vLLM's CPU platform: one [num_blocks, 2, block_size, heads * head_dim] float32 tensor per layer
SHAPE = (NUM_BLOCKS, 2, 4, 16)
BLOCK_BYTES = 2 * (2 * 4 * 16 * 4)  # two layers


def make_worker(**extra) -> tuple[RecomputeOffloadWorker, dict[str, torch.Tensor]]:
    config = RecomputeOffloadConfig.from_settings(
        {"cpu_bytes_to_use_per_rank": 16 * BLOCK_BYTES, **extra}, world_size=1, kv_role="kv_both"
    )
    worker = RecomputeOffloadWorker(config, bytes_per_block=BLOCK_BYTES)
    kv = {f"layer{i}": torch.randn(SHAPE) for i in range(2)}
    worker.register_kv_caches(kv, NUM_BLOCKS)
    return worker, kv


def job(job_id: int, dev: list[int], host: list[int]) -> TransferJob:
    return TransferJob(job_id, "r", dev, host, 4 * len(dev))


def test_budget_gives_the_same_block_count_as_the_scheduler() -> None:
    worker, _ = make_worker()
    assert worker.num_host_blocks == 16
    assert worker.region is not None and worker.region.nbytes == 16 * BLOCK_BYTES


def test_store_then_load_round_trips_every_byte() -> None:
    worker, kv = make_worker()
    before = {k: v[[1, 2]].clone() for k, v in kv.items()}
    worker.run_stores([job(1, [1, 2], [5, 9])])
    for v in kv.values():
        v[[1, 2]] = 0  # the blocks are reused by another request
    worker.run_loads(StepPlan(loads=[job(2, [6, 3], [5, 9])]))
    assert worker.load_errors() == set()
    report = worker.take_report()
    assert report is not None
    assert report.stores == {1: [1, 0]} and report.loads == {2: [1, 0]}
    for k, v in kv.items():
        assert torch.equal(v[[6, 3]], before[k]), f"{k}: restored KV differs"
    stats = worker.take_stats()
    assert stats is not None
    assert stats.bytes == {"d2h": 2 * BLOCK_BYTES, "h2d": 2 * BLOCK_BYTES}
    assert worker.take_report() is None and worker.take_stats() is None


def test_failed_load_reports_its_device_blocks() -> None:
    worker, _ = make_worker()
    worker.run_stores([job(1, [1], [0])])
    with failing_copies(loads=True) as refused:
        worker.run_loads(StepPlan(loads=[job(2, [4, 5], [0, 1])]))
    assert refused["load"] == 1
    assert worker.load_errors() == {4, 5}
    report = worker.take_report()
    assert report is not None and report.loads == {2: [0, 1]} and report.stores == {1: [1, 0]}


def test_failed_store_is_reported() -> None:
    worker, _ = make_worker()
    with failing_copies(stores=True):
        worker.run_stores([job(1, [1], [0])])
    report = worker.take_report()
    assert report is not None and report.stores == {1: [0, 1]}


def test_unrestorable_blocks_are_reported_as_load_errors() -> None:
    worker, _ = make_worker()
    worker.run_loads(StepPlan(unrestorable_device_blocks=[3]))
    assert worker.load_errors() == {3}
    assert worker.load_errors() == set(), "errors are reported once"


def test_bad_plan_costs_a_failed_job_not_an_exception() -> None:
    worker, _ = make_worker()
    worker.run_stores([job(1, [99], [0])])  # device block out of range
    report = worker.take_report()
    assert report is not None and report.stores == {1: [0, 1]}


def test_corrupted_restores_change_restored_kv() -> None:
    worker, kv = make_worker()
    before = kv["layer0"][1].clone()
    worker.run_stores([job(1, [1], [0])])
    with corrupted_restores() as flipped:
        worker.run_loads(StepPlan(loads=[job(2, [2], [0])]))
    assert flipped["restore"] == 1
    assert not torch.equal(kv["layer0"][2], before), "corrupted restore left the KV intact"


def test_kv_tensors_it_cannot_copy_turn_every_store_into_a_recompute() -> None:
    # A device block larger than the scheduler's host block: start anyway, copy nothing.
    config = RecomputeOffloadConfig.from_settings(
        {"cpu_bytes_to_use_per_rank": 1 << 20}, world_size=1, kv_role="kv_both"
    )
    worker = RecomputeOffloadWorker(config, bytes_per_block=BLOCK_BYTES // 2)
    worker.register_kv_caches({"l": torch.zeros(SHAPE), "m": torch.zeros(SHAPE)}, NUM_BLOCKS)
    assert "KV cache config says" in worker.unsupported
    assert worker.engine is None and worker.region is None, "host memory taken for nothing"
    worker.run_stores([TransferJob(1, "r", [0, 1], [0, 1], 64)])
    report = worker.take_report()
    assert report is not None and report.stores == {1: [0, 1]}, report
