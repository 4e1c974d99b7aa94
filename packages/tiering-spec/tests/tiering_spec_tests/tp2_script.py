"""Tensor parallel 2 on vLLM's CPU platform (run by test_e2e_tp2 in a subprocess).

Usage: VLLM_CPU_OMP_THREADS_BIND='0|1' python -m tiering_spec_tests.tp2_script ROOT_DIR
(with the tests folder on PYTHONPATH)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import kvtier.testkit as testkit
    from kvtier.testkit import Workload, compare_outputs, kv_transfer_config

    from .e2e_support import ENGINE, ROOMY, offload_config, prefix_prompts

    root = sys.argv[1]
    model = testkit.make_tiny_llama()
    workload = Workload(prefix_prompts(), 8)
    tp = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}

    def go(**engine: object) -> testkit.WorkloadResult:
        llm = testkit.make_llm(model, **engine, **tp)
        try:
            return testkit.run_workload(llm, workload, count_tokens=False)
        finally:
            testkit.free_llm(llm)

    ref = go(**ROOMY)
    # host chunks hold both ranks' halves: 10 chunks per rank
    cfg = offload_config("TieringOffloadingSpec", host_chunks=20, root_dir=root)
    res = go(kv_transfer_config=kv_transfer_config(cfg), **ENGINE)
    cmp = compare_outputs(ref.outputs, res.outputs)
    assert cmp.identical, cmp.report()
    hits = testkit.labelled_metric_values(
        res.raw_metrics, "vllm:kv_offload_tiering_chunk_hits", "tier"
    )
    assert hits.get("CPU", 0) > 0 and hits.get("fs", 0) > 0, hits
    assert res.metrics.get("vllm:external_prefix_cache_hits", 0) > 0, res.metrics
    dirs = [d for d in (Path(root) / "kvtier-kv-v1").iterdir() if d.is_dir()]
    ranks = sorted(json.loads((d / "layout.json").read_text())["rank"] for d in dirs)
    assert ranks == [0, 1], ranks
    counts = [len(list(d.rglob("*.kv"))) for d in dirs]
    assert counts[0] == counts[1] > 0, counts
    print("TP2 OK", hits, counts)


if __name__ == "__main__":
    main()
