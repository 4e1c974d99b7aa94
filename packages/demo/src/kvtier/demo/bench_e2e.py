"""End-to-end benchmark: seconds on a realistic-shaped model, kvtier against vLLM alone.

    python -m kvtier.demo.bench_e2e [--json out.json] [--png out.png] [--only NAME ...]

A random-weight Llama of 16 layers, hidden 1024, 16 heads / 4 KV heads, head_dim 64,
float32 (about 550 MB, 32 KiB of KV per token), made offline by kvtier-testkit. Each
workload runs, one engine after another in this process:

* ``reference``: room for every request's KV on the device (what kvtier aims at);
* ``vLLM alone``: the constrained device cache, nothing else;
* ``null connector``: the same with a KV connector that does nothing (the price of
  vLLM's connector plumbing alone);
* ``kvtier ...``: the same with kvtier.

Workloads:

* ``preemption``: 16 requests x (512 prompt + 384 generated tokens), 64 device blocks
  of 32 tokens, ``max_num_batched_tokens`` 64 as on a decode node: running requests
  grow until vLLM preempts them; kvtier's ``RecomputeCPUOffloadConnector`` restores
  what vLLM alone recomputes;
* ``prefix``: 4 prefixes of 768 tokens asked 3 times round-robin (own 32-token suffix,
  16 generated), 60 device blocks (two requests fit, the prefixes do not stay):
  ``CPUOffloadingSpec`` with 1 GiB, and a 24 MiB host tier plus an fs tier;
* ``roomy``: the prefix workload with room for everything (400 blocks): what kvtier
  costs when it is not needed.

Prints a table (wall seconds, ratio to vLLM alone, preemptions, tokens scheduled,
tokens served by kvtier, identical outputs) and the goals of the issue with their
measured values; writes JSON and a PNG chart. Exits 1 if any output differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_SHAPE: dict[str, int] = {
    "layers": 16,
    "hidden": 1024,
    "heads": 16,
    "kv_heads": 4,
    "head_dim": 64,
}
BASE_ENGINE: dict[str, Any] = {
    "block_size": 32,
    "enforce_eager": True,
    "dtype": "float32",
    "disable_log_stats": False,
    "max_model_len": 1024,
    # On vLLM's CPU platform: the share of host memory vLLM checks is free at start.
    "gpu_memory_utilization": 0.3,
}
HOST_BYTES = 1 << 30
SMALL_HOST_BYTES = 24 << 20  # 24 chunks of the model's 1 MiB blocks; the prefixes need 96


@dataclass
class Run:
    """One engine run of a workload."""

    label: str
    role: str  # "reference", "alone", "null" or "kvtier"
    engine: dict[str, Any]
    kv: dict[str, Any] | None = None


@dataclass
class Scenario:
    name: str
    description: str
    workload: Any
    runs: list[Run]
    results: list[dict[str, Any]] = field(default_factory=list)


def _recompute_kv() -> dict[str, Any]:
    return {
        "kv_connector": "RecomputeCPUOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use_per_rank": HOST_BYTES},
    }


def _offload_kv(spec: str, host_bytes: int, fs_root: str | None = None) -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu_bytes_to_use": host_bytes, "spec_name": spec}
    if fs_root is not None:
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": fs_root}]
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def scenarios(fs_root: str) -> list[Scenario]:
    from kvtier.testkit import make_prefix_workload, make_workload
    from kvtier.testkit.null_connector import NULL_CONNECTOR

    preempt = {**BASE_ENGINE, "max_num_seqs": 16, "max_num_batched_tokens": 64}
    prefix = {**BASE_ENGINE, "max_num_seqs": 2, "max_num_batched_tokens": 512}
    prefix_workload = make_prefix_workload(4, 768, 32, 3, max_tokens=16)
    tight_prefix = {**prefix, "num_gpu_blocks_override": 60}
    roomy_prefix = {**prefix, "num_gpu_blocks_override": 400}
    tight_preempt = {**preempt, "num_gpu_blocks_override": 64}
    return [
        Scenario(
            "preemption",
            "16 requests x (512 + 384 tokens), 64 device blocks, max_num_batched_tokens 64",
            make_workload(16, 512, 384),
            [
                Run(
                    "reference (room for all)",
                    "reference",
                    {**preempt, "num_gpu_blocks_override": 512},
                ),
                Run("vLLM alone (recompute)", "alone", tight_preempt),
                Run("null connector", "null", tight_preempt, NULL_CONNECTOR),
                Run("kvtier recompute connector", "kvtier", tight_preempt, _recompute_kv()),
            ],
        ),
        Scenario(
            "prefix",
            "4 prefixes x 768 tokens asked 3 times (+32, 16 generated), 60 device blocks",
            prefix_workload,
            [
                Run("reference (room for all)", "reference", roomy_prefix),
                Run("vLLM alone (device cache)", "alone", tight_prefix),
                Run("null connector", "null", tight_prefix, NULL_CONNECTOR),
                Run(
                    "kvtier host tier (1 GiB)",
                    "kvtier",
                    tight_prefix,
                    _offload_kv("CPUOffloadingSpec", HOST_BYTES),
                ),
                Run(
                    "kvtier host 24 MiB + fs tier",
                    "kvtier",
                    tight_prefix,
                    _offload_kv("TieringOffloadingSpec", SMALL_HOST_BYTES, fs_root),
                ),
            ],
        ),
        Scenario(
            "roomy",
            "the prefix workload with room for everything (400 device blocks)",
            prefix_workload,
            [
                Run("vLLM alone (room for all)", "reference", roomy_prefix),
                Run("null connector", "null", roomy_prefix, NULL_CONNECTOR),
                Run(
                    "kvtier host tier (1 GiB)",
                    "kvtier",
                    roomy_prefix,
                    _offload_kv("CPUOffloadingSpec", HOST_BYTES),
                ),
            ],
        ),
    ]


def run_scenario(model: Path, sc: Scenario, progress: Any) -> None:
    from kvtier.testkit import compare_outputs, kv_transfer_config, run_with

    outputs: dict[str, Any] = {}
    for run in sc.runs:
        progress.set_description(f"{sc.name}: {run.label}")
        engine = dict(run.engine)
        if run.kv is not None:
            engine["kv_transfer_config"] = kv_transfer_config(run.kv)
        result, _ = run_with(model, sc.workload, **engine)
        outputs[run.label] = result.outputs
        m = result.metrics
        sc.results.append(
            {
                "run": run.label,
                "role": run.role,
                "wall_s": round(result.wall_s, 2),
                "preemptions": result.preemptions,
                "scheduled_tokens": result.scheduled_tokens,
                "served_tokens": int(
                    m.get("vllm:kvtier_recompute_tokens_restored", 0)
                    + m.get("vllm:external_prefix_cache_hits", 0)
                ),
            }
        )
        progress.update(1)
    ref = next(r for r in sc.results if r["role"] == "reference")["run"]
    for r in sc.results:
        r["identical"] = compare_outputs(outputs[ref], outputs[r["run"]]).identical
    alone = next((r for r in sc.results if r["role"] == "alone"), None) or next(
        r for r in sc.results if r["role"] == "reference"
    )
    for r in sc.results:
        r["vs_alone"] = round(r["wall_s"] / alone["wall_s"], 3) if alone["wall_s"] else None


def _goal(goal: str, value: float | None, limit: float, *, at_most: bool) -> dict[str, Any]:
    met = value is not None and (value <= limit if at_most else value >= limit)
    return {
        "goal": goal,
        "value": value,
        "target": f"{'<=' if at_most else '>='} {limit}",
        "met": met,
    }


def goals(done: dict[str, Scenario]) -> list[dict[str, Any]]:
    """The goals kvtier is held to, each with its measured value (None: not measured)."""

    def wall(name: str, role: str, index: int = 0) -> float | None:
        runs = done[name].results if name in done else []
        found = [r["wall_s"] for r in runs if r["role"] == role]
        return found[index] if len(found) > index else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    worst = [r["vs_alone"] for sc in done.values() for r in sc.results if r["role"] == "kvtier"]
    out = [
        _goal(
            "kvtier never slower than vLLM alone (kvtier / alone, worst)",
            max(worst) if worst else None,
            1.0,
            at_most=True,
        ),
        _goal(
            "forced preemption: kvtier / vLLM alone wall time",
            ratio(wall("preemption", "kvtier"), wall("preemption", "alone")),
            0.85,
            at_most=True,
        ),
    ]
    ref, alone = wall("prefix", "reference"), wall("prefix", "alone")
    for index, label, target in ((0, "host tier", 0.8), (1, "host too small + fs tier", 0.5)):
        kv = wall("prefix", "kvtier", index)
        closed = None
        if ref is not None and alone is not None and kv is not None and alone > ref:
            closed = round((alone - kv) / (alone - ref), 3)
        out.append(
            _goal(
                f"prefix reuse, {label}: share of the gap alone -> reference closed",
                closed,
                target,
                at_most=False,
            )
        )
    out.append(
        _goal(
            "room for everything: kvtier on / off",
            ratio(wall("roomy", "kvtier"), wall("roomy", "reference")),
            1.05,
            at_most=True,
        )
    )
    out.append(
        _goal(
            "multi-turn chat through vllm serve: TTFT p50, vLLM alone / kvtier",
            None,
            2.0,
            at_most=False,
        )
    )
    return out


def print_table(done: dict[str, Scenario]) -> None:
    cols = [
        ("run", "run"),
        ("wall s", "wall_s"),
        ("x alone", "vs_alone"),
        ("preempt", "preemptions"),
        ("scheduled tok", "scheduled_tokens"),
        ("kvtier tok", "served_tokens"),
        ("outputs", "identical"),
    ]
    for sc in done.values():
        print(f"\n== {sc.name}: {sc.description}")
        cells = [
            [("match" if r[k] else "DIFFER") if k == "identical" else str(r[k]) for _, k in cols]
            for r in sc.results
        ]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(cols)]
        print(
            "  ".join(
                h.ljust(w) if i == 0 else h.rjust(w)
                for i, ((h, _), w) in enumerate(zip(cols, widths))
            )
        )
        for c in cells:
            print(
                "  ".join(
                    v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))
                )
            )


def plot(done: dict[str, Scenario], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(done), figsize=(5 * len(done), 4), squeeze=False)
    for ax, sc in zip(axes[0], done.values()):
        labels = [r["run"] for r in sc.results]
        values = [r["wall_s"] for r in sc.results]
        colors = [
            {"reference": "#999999", "alone": "#d62728", "null": "#ff9896"}.get(
                r["role"], "#1f77b4"
            )
            for r in sc.results
        ]
        ax.barh(labels[::-1], values[::-1], color=colors[::-1])
        ax.set_title(sc.name)
        ax.set_xlabel("wall seconds (lower is better)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--png", help="write a chart here (default: beside --json)")
    parser.add_argument(
        "--only", nargs="*", choices=("preemption", "prefix", "roomy"), help="workloads to run"
    )
    opts = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tqdm import tqdm

    from kvtier.testkit import make_tiny_llama

    model = make_tiny_llama(None, **MODEL_SHAPE)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-fs-") as fs_root:
        chosen = [s for s in scenarios(fs_root) if not opts.only or s.name in opts.only]
        done: dict[str, Scenario] = {}
        with tqdm(total=sum(len(s.runs) for s in chosen), unit="run") as progress:
            for sc in chosen:
                run_scenario(model, sc, progress)
                done[sc.name] = sc
    print_table(done)
    results = goals(done)
    print("\n== goals")
    for g in results:
        value = "not measured" if g["value"] is None else g["value"]
        print(f"  {'met ' if g['met'] else 'MISS'}  {g['goal']}: {value} (target {g['target']})")
    if opts.json:
        out = {
            "model": MODEL_SHAPE,
            "workloads": {
                name: {"description": sc.description, "runs": sc.results}
                for name, sc in done.items()
            },
            "goals": results,
        }
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {opts.json}")
    png = opts.png or (str(Path(opts.json).with_suffix(".png")) if opts.json else None)
    if png:
        plot(done, Path(png))
        print(f"wrote {png}")
    identical = all(r["identical"] for sc in done.values() for r in sc.results)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
