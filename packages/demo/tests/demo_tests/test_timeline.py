"""bench-e2e's restore timeline on a real engine: every restore's four moments, in
order, for restores inside the step (kvtier's default) and between steps (budget 0)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvtier.demo.timeline import RestoreTimeline, copy_rate
from kvtier.testkit import requires_vllm


def test_the_copy_rate_is_measured() -> None:
    gbps = copy_rate(4, 16384, blocks=8, sets=4)
    assert 0.01 < gbps < 1000


def _restores(budget: int | None) -> tuple[list[Any], dict[str, Any]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import kvtier.testkit as testkit
    from kvtier.testkit import (
        PREFIX_ENGINE,
        PREFIX_WORKLOAD,
        free_llm,
        kv_transfer_config,
        make_llm,
        run_workload,
    )

    extra: dict[str, Any] = {"cpu_bytes_to_use": 64 << 20}
    if budget is not None:
        extra["sync_load_budget_bytes"] = budget
    kv = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    llm = make_llm(
        testkit.make_tiny_llama(), **PREFIX_ENGINE, kv_transfer_config=kv_transfer_config(kv)
    )
    timeline = RestoreTimeline(llm)
    try:
        run_workload(llm, PREFIX_WORKLOAD)
    finally:
        timeline.close()
        free_llm(llm)
    return timeline.restores, timeline.summary(bytes_per_token=2048, copy_gbps=10.0)


@requires_vllm
@pytest.mark.e2e
def test_restores_inside_the_step_wait_no_step() -> None:
    restores, summary = _restores(None)
    assert restores and all(r.complete for r in restores), restores
    if not any(r.sync for r in restores):
        pytest.skip("this vLLM's offloading scheduler is not the shape kvtier extends")
    for r in restores:
        assert r.sync and r.steps_waited == 0, r
        assert r.looked_up <= r.submitted <= r.scheduled <= r.loaded, r
    assert summary["restores"] == summary["sync"] == len(restores)
    assert summary["wall_over_copy"] > 0


@requires_vllm
@pytest.mark.e2e
def test_restores_between_steps_wait_a_step() -> None:
    restores, summary = _restores(0)
    assert restores and all(r.complete for r in restores), restores
    for r in restores:
        assert not r.sync and r.steps_waited >= 1, r
        assert r.looked_up <= r.submitted <= r.loaded <= r.scheduled, r
    assert summary["sync"] == 0 and summary["steps_waited_median"] >= 1
