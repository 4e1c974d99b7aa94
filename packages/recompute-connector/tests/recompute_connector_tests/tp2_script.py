"""Tensor parallel 2 runs for test_e2e_tp2.py (a script: vLLM's multiprocess engine needs
the ``__main__`` guard). Usage, with the tests folder on PYTHONPATH:
    python -m recompute_connector_tests.tp2_script MODEL OUT.json [connector] [reference]
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    wanted = set(sys.argv[3:]) or {"connector", "reference"}
    # The engine core in this process, a worker process per rank: a spawned engine core
    # (vLLM's CPU platform spawns) imports vLLM again, 20-25 s per engine on 2 cores.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm import LLM

    from kvtier.testkit import (
        FORCED_PREEMPTION_ENGINE,
        FORCED_PREEMPTION_WORKLOAD,
        REFERENCE_ENGINE,
        kv_transfer_config,
        labelled_metric_values,
    )
    from kvtier.testkit.engine import free_llm, run_workload

    results = {}
    kv = kv_transfer_config(
        {
            "kv_connector": "RecomputeCPUOffloadConnector",
            "kv_role": "kv_consumer",
            # total for both ranks: 64 MiB each
            "kv_connector_extra_config": {"cpu_bytes_to_use": 128 << 20},
        }
    )
    for name, engine, extra in (
        ("reference", REFERENCE_ENGINE, {}),
        ("connector", FORCED_PREEMPTION_ENGINE, {"kv_transfer_config": kv}),
    ):
        if name not in wanted:
            continue
        llm = LLM(model=model, tensor_parallel_size=2, **engine, **extra)
        try:
            r = run_workload(llm, FORCED_PREEMPTION_WORKLOAD, count_tokens=False)
        finally:
            free_llm(llm)
        results[name] = {
            "outputs": r.outputs,
            "preemptions": r.preemptions,
            "metrics": {k: v for k, v in r.metrics.items() if "kvtier" in k},
            "blocks": labelled_metric_values(
                r.raw_metrics, "vllm:kvtier_recompute_transfer_blocks", "direction"
            ),
            "bytes": labelled_metric_values(
                r.raw_metrics, "vllm:kvtier_recompute_transfer_bytes", "direction"
            ),
        }
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
