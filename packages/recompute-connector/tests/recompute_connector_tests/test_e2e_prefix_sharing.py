"""enable_offload_prefix_caching end to end: requests sharing a long prefix, preempted.

Sixteen prompts of 136 tokens share their first 128 (four 32-token blocks) and generate
100 tokens each on a 16-block device cache, so requests are preempted while others
still hold the same prefix. With sharing, a prefix block is stored on host once and
referenced by every preempted request holding it: the host blocks in use and the bytes
copied to host drop by about the shared part; outputs match an unpreempted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.testkit import (
    FORCED_PREEMPTION_ENGINE,
    REFERENCE_ENGINE,
    compare_outputs,
    labelled_metric_values,
    make_workload,
    requires_vllm,
    run_with,
)

from .e2e_support import ConnectorRun, run_connector, standalone

pytestmark = [pytest.mark.e2e, requires_vllm]

WORKLOAD = make_workload(16, prompt_tokens=136, max_tokens=100, shared_prefix_tokens=128)
ENGINE: dict[str, Any] = {**FORCED_PREEMPTION_ENGINE, "enable_prefix_caching": True}

_runs: dict[str, Any] = {}


def run(model: Path, name: str) -> Any:
    if name not in _runs:
        if name == "reference":
            _runs[name], _ = run_with(model, WORKLOAD, **REFERENCE_ENGINE)
        else:
            config = standalone(enable_offload_prefix_caching=name == "shared")
            _runs[name] = run_connector(model, WORKLOAD, config, engine=ENGINE)
    return _runs[name]


def d2h_bytes(r: ConnectorRun) -> float:
    values = labelled_metric_values(
        r.result.raw_metrics, "vllm:kvtier_recompute_transfer_bytes", "direction"
    )
    return values.get("d2h", 0.0)


@pytest.mark.parametrize("name", ["private", "shared"])
def test_outputs_identical_with_and_without_sharing(tiny_model: Path, name: str) -> None:
    got = run(tiny_model, name)
    comparison = compare_outputs(run(tiny_model, "reference").outputs, got.result.outputs)
    assert comparison.identical, comparison.report()
    assert got.result.preemptions >= 8, got.result.preemptions
    assert got.counter("tokens_restored") > 0
    assert (got.host_blocks_in_use, got.preempted_left, got.in_flight_left) == (0, 0, 0)


def test_sharing_stores_the_common_prefix_once(tiny_model: Path) -> None:
    private, shared = run(tiny_model, "private"), run(tiny_model, "shared")
    p_bytes, s_bytes = d2h_bytes(private), d2h_bytes(shared)
    print(
        f"d2h bytes {p_bytes:.0f} -> {s_bytes:.0f}; peak host blocks "
        f"{private.peak_host_blocks} -> {shared.peak_host_blocks}; preemptions "
        f"{private.result.preemptions} / {shared.result.preemptions}"
    )
    assert p_bytes > 0 and s_bytes < 0.8 * p_bytes, (p_bytes, s_bytes)
    assert shared.peak_host_blocks < private.peak_host_blocks
