"""Fixtures of the recompute connector's tests: reference runs of the forced-preemption
workload. Fault injection comes from ``kvtier.testkit.faults``, around in-process
engines; the connector itself has no test-only key or branch."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.testkit import (
    FORCED_PREEMPTION_ENGINE,
    FORCED_PREEMPTION_WORKLOAD,
    REFERENCE_ENGINE,
    WorkloadResult,
    run_with,
)

MIN_PREEMPTIONS = 10


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> WorkloadResult:
    """The workload with room for every request: no preemption."""
    result, _ = run_with(tiny_model, FORCED_PREEMPTION_WORKLOAD, **REFERENCE_ENGINE)
    assert result.preemptions == 0, "the reference run must not preempt"
    return result


@pytest.fixture(scope="session")
def without_connector(tiny_model: Path) -> WorkloadResult:
    """The forced-preemption workload with vLLM's ordinary recompute."""
    result, _ = run_with(tiny_model, FORCED_PREEMPTION_WORKLOAD, **FORCED_PREEMPTION_ENGINE)
    assert result.preemptions >= MIN_PREEMPTIONS, f"only {result.preemptions} preemptions"
    return result
