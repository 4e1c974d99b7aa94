"""Benchmark: the forced-preemption workload with and without the connector, one run.

    python -m kvtier.recompute_connector.bench [--json out.json]

Three engines, one after another in this process (vLLM's CPU platform or whatever
this vLLM runs on), with the kvtier-testkit tiny model unless ``--model`` is given:

* ``reference``: room for every request, no preemption (the work an unpreempted run does);
* ``recompute``: few device blocks, vLLM's ordinary recompute after each preemption;
* ``kvtier``: the same engine with ``RecomputeCPUOffloadConnector``.

Printed as a table: preemptions, tokens scheduled, tokens recomputed (scheduled beyond
the reference), tokens restored, bytes moved each way, copy seconds, wall seconds, and
whether outputs match the reference token by token. Needs vLLM and kvtier-testkit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

CONNECTOR = "RecomputeCPUOffloadConnector"


def _worker_totals(llm: Any) -> dict[str, float]:
    """Wrap our worker connector's stats so the run's totals are kept (in-process engine)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    totals = {"bytes_d2h": 0.0, "bytes_h2d": 0.0, "seconds_d2h": 0.0, "seconds_h2d": 0.0}
    connector = get_kv_transfer_group()
    worker = getattr(connector, "worker", None)
    if worker is None:
        return totals
    original = worker.take_stats

    def take_stats() -> Any:
        stats = original()
        if stats is not None:
            for d in ("d2h", "h2d"):
                totals[f"bytes_{d}"] += stats.bytes[d]
                totals[f"seconds_{d}"] += stats.seconds[d]
        return stats

    worker.take_stats = take_stats
    return totals


def run_one(name: str, model: Path, workload: Any, engine: dict[str, Any], kv: Any) -> dict:
    from kvtier.testkit import free_llm, make_llm, run_workload

    args = dict(engine)
    if kv is not None:
        args["kv_transfer_config"] = kv
    llm = make_llm(model, **args)
    try:
        totals = _worker_totals(llm) if kv is not None else {}
        result = run_workload(llm, workload)
        # Stats flushed with the last step's output land in the totals by now.
    finally:
        free_llm(llm)
    metrics = result.metrics
    return {
        "name": name,
        "preemptions": result.preemptions,
        "scheduled_tokens": result.scheduled_tokens,
        "tokens_restored": int(metrics.get("vllm:kvtier_recompute_tokens_restored", 0)),
        "preemptions_offloaded": int(metrics.get("vllm:kvtier_recompute_preemptions_offloaded", 0)),
        "bytes_d2h": int(totals.get("bytes_d2h", 0)),
        "bytes_h2d": int(totals.get("bytes_h2d", 0)),
        "copy_seconds": round(totals.get("seconds_d2h", 0) + totals.get("seconds_h2d", 0), 4),
        "wall_s": round(result.wall_s, 3),
        "outputs": result.outputs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--model", help="model folder (default: the testkit tiny Llama)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--device-blocks", type=int, default=16, help="num_gpu_blocks_override")
    parser.add_argument("--budget-bytes", type=int, default=1 << 30, help="per rank")
    opts = parser.parse_args(argv)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvtier.testkit import (
        FORCED_PREEMPTION_ENGINE,
        REFERENCE_ENGINE,
        compare_outputs,
        kv_transfer_config,
        make_tiny_llama,
        make_workload,
    )

    model = Path(opts.model) if opts.model else make_tiny_llama()
    workload = make_workload(opts.requests, opts.prompt_tokens, opts.max_tokens)
    forced = {**FORCED_PREEMPTION_ENGINE, "num_gpu_blocks_override": opts.device_blocks}
    kv = kv_transfer_config(
        {
            "kv_connector": CONNECTOR,
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"cpu_bytes_to_use_per_rank": opts.budget_bytes},
        }
    )
    runs = [
        run_one("reference", model, workload, REFERENCE_ENGINE, None),
        run_one("recompute", model, workload, forced, None),
        run_one("kvtier", model, workload, forced, kv),
    ]
    ref = runs[0]
    for r in runs:
        r["tokens_recomputed"] = r["scheduled_tokens"] - ref["scheduled_tokens"]
        comparison = compare_outputs(ref["outputs"], r["outputs"])
        r["identical"] = comparison.identical
        r["mismatched_requests"] = comparison.mismatched_requests
    base, ours = runs[1], runs[2]
    reduction = (
        1 - ours["tokens_recomputed"] / base["tokens_recomputed"]
        if base["tokens_recomputed"] > 0
        else 0.0
    )
    summary = {
        "recompute_reduction": round(reduction, 4),
        "wall_speedup": round(base["wall_s"] / ours["wall_s"], 3) if ours["wall_s"] else None,
    }
    columns = [
        ("run", "name"),
        ("preempt", "preemptions"),
        ("scheduled", "scheduled_tokens"),
        ("recomputed", "tokens_recomputed"),
        ("restored", "tokens_restored"),
        ("d2h bytes", "bytes_d2h"),
        ("h2d bytes", "bytes_h2d"),
        ("copy s", "copy_seconds"),
        ("wall s", "wall_s"),
        ("identical", "identical"),
    ]
    widths = [max(len(h), *(len(str(r[k])) for r in runs)) for h, k in columns]
    print()
    print("  ".join(h.rjust(w) for (h, _), w in zip(columns, widths)))
    for r in runs:
        print("  ".join(str(r[k]).rjust(w) for (_, k), w in zip(columns, widths)))
    print(
        f"\nrecompute after preemption: {base['tokens_recomputed']} tokens without the "
        f"connector, {ours['tokens_recomputed']} with it ({reduction:.1%} less); wall "
        f"{base['wall_s']} s -> {ours['wall_s']} s"
    )
    if opts.json:
        out = {
            "workload": {
                "requests": opts.requests,
                "prompt_tokens": opts.prompt_tokens,
                "max_tokens": opts.max_tokens,
                "device_blocks": opts.device_blocks,
                "block_size": forced["block_size"],
                "model": str(model),
            },
            "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
            "summary": summary,
        }
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {opts.json}")
    ok = ours["identical"] and base["identical"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
