"""One engine with ngram speculative decoding, for test_e2e_scheduling.py.

A script, so that each engine runs in a process of its own: vLLM 0.32's kernel-override
scan of ``sys.modules`` trips over numba's llvmlite (which the ngram drafter imports)
when a second engine starts in the same process.

Usage (the tests folder on PYTHONPATH):
    python -m recompute_connector_tests.spec_decode_script MODEL OUT.json
        reference|connector sync|async
"""

from __future__ import annotations

import json
import os
import sys

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}


def main() -> None:
    model, out, name, mode = sys.argv[1:5]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvtier.testkit import FORCED_PREEMPTION_WORKLOAD, REFERENCE_ENGINE, run_with

    from .e2e_support import run_connector, standalone

    engine = {"speculative_config": NGRAM, "async_scheduling": mode == "async"}
    if name == "reference":
        result, _ = run_with(model, FORCED_PREEMPTION_WORKLOAD, **REFERENCE_ENGINE, **engine)
        report = {"outputs": result.outputs, "preemptions": result.preemptions}
    else:
        run = run_connector(model, FORCED_PREEMPTION_WORKLOAD, standalone(), **engine)
        result = run.result
        report = {
            "outputs": result.outputs,
            "preemptions": result.preemptions,
            "tokens_restored": run.counter("tokens_restored"),
            "accepted": result.metrics.get("vllm:spec_decode_num_accepted_tokens", 0),
            "left": [run.host_blocks_in_use, run.preempted_left, run.in_flight_left],
        }
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
