"""Tensor parallel 2 with an MLA model on vLLM's CPU platform: the KV is replicated
across the ranks, so the host and fs tiers keep one copy; and since vLLM's CPU MLA
backend computes differently on top of cached KV, kvtier loads nothing there (run by
test_e2e_tp2 in a subprocess).

Usage: VLLM_CPU_OMP_THREADS_BIND='0|1' python -m tiering_spec_tests.tp2_mla_script ROOT_DIR
(with the tests folder on PYTHONPATH)
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

# One 16-token block of the tiny MLA model: 2 layers x 16 tokens x 576 elements x 4 B.
CHUNK_BYTES = 73728
HOST_CHUNKS = 20


def main() -> None:
    import kvtier.testkit as testkit
    from kvtier.testkit import Workload, kv_transfer_config

    from .e2e_support import ROOMY, prefix_prompts

    root = sys.argv[1]
    model = testkit.make_tiny_mla()
    workload = Workload(prefix_prompts(), 8)
    # vLLM's CPU MLA kernel takes 16-token blocks: twice the blocks for ROOMY's tokens.
    tp = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "block_size": 16}
    engine_id = f"kvtier-mla-{uuid.uuid4().hex[:12]}"
    regions: list[tuple[str, int]] = []

    def go(**engine: object) -> testkit.WorkloadResult:
        llm = testkit.make_llm(model, **{**engine, **tp})
        try:
            result = testkit.run_workload(llm, workload, count_tokens=False)
            for name in os.listdir("/dev/shm"):
                if engine_id in name:
                    regions.append((name, os.stat(os.path.join("/dev/shm", name)).st_size))
            return result
        finally:
            testkit.free_llm(llm)

    # Room for every request: vLLM's CPU MLA backend computes a prompt recomputed after
    # a preemption (prefill) differently from its decode steps.
    roomy = {**ROOMY, "num_gpu_blocks_override": 2 * ROOMY["num_gpu_blocks_override"]}
    cfg = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": HOST_CHUNKS * CHUNK_BYTES,
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [
                {"type": "fs", "root_dir": root, "n_read_threads": 2, "n_write_threads": 2}
            ],
        },
    }
    res = go(kv_transfer_config=kv_transfer_config(cfg), **roomy)
    # vLLM's CPU MLA backend gives other results on top of cached KV (vLLM turns its own
    # prefix cache off for it), so kvtier stores one copy here but loads nothing; with
    # kvtier storing, some runs differed from vLLM alone at one token, which no byte
    # kvtier moved can cause. So no reference run: what is asserted is the copies and
    # that nothing is loaded.
    hits = testkit.labelled_metric_values(
        res.raw_metrics, "vllm:kv_offload_tiering_chunk_hits", "tier"
    )
    assert sum(hits.values()) == 0, f"loads into a CPU MLA engine: {hits}"
    # One host region for both ranks, holding the whole budget: one copy.
    assert regions == [(f"kvtier-tiering-{engine_id}-r0", HOST_CHUNKS * CHUNK_BYTES)], regions
    dirs = [d for d in (Path(root) / "kvtier-kv-v1").iterdir() if d.is_dir()]
    assert len(dirs) == 1, f"one fingerprint directory (one copy) expected: {dirs}"
    layout = json.loads((dirs[0] / "layout.json").read_text())
    assert layout["rank"] == 0 and layout["replicated_layout"] is True, layout
    files = len(list(dirs[0].rglob("*.kv")))
    assert files > 0
    print("TP2 MLA OK", hits, regions, files)


if __name__ == "__main__":
    main()
