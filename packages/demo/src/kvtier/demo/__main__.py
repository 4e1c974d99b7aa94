"""kvtier at work, on this machine: ``python -m kvtier.demo [--model PATH] [--out DIR]``.

Runs two workloads on vLLM (in-process), each without and with kvtier, and prints one
table per workload; writes ``report.json`` and ``report.png`` to the output folder.
Exits 1 if any run's outputs differ from the reference run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from kvtier.demo.model import ModelError, demo_model
from kvtier.demo.workloads import WorkloadReport, preemption_workload, prefix_workload


def _fmt_count(value: float) -> str:
    return f"{value:,.0f}"


def _fmt_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.1f} {unit}" if unit != "B" else f"{value:,.0f} B"
        value /= 1024
    return f"{value:.1f} GiB"


def format_table(report: WorkloadReport) -> str:
    """One workload as a fixed-width table."""
    header = (
        f"{'run':<36}{'preempt':>8}{'prefill tok':>12}{'moved':>11}{'wall s':>8}"
        f"  {'outputs':<8} restored / hit (tokens; chunks per tier)"
    )
    lines = [f"== {report.name}: {report.description}", header, "-" * len(header)]
    for row in report.rows:
        hit = ", ".join(f"{k} {_fmt_count(v)}" for k, v in row.restored_or_hit.items() if v)
        moved = _fmt_bytes(row.bytes_moved) if row.bytes_moved else "-"
        lines.append(
            f"{row.run:<36}{row.preemptions:>8}{_fmt_count(row.prefill_tokens):>12}"
            f"{moved:>11}{row.wall_s:>8.1f}  {'match' if row.outputs_match else 'DIFFER':<8} "
            f"{hit or '-'}"
        )
    lines.append(
        f"prompt tokens in the workload: {report.prompt_tokens:,}; "
        f"every output matches the reference: {'yes' if report.all_match else 'NO'}"
    )
    return "\n".join(lines)


def write_chart(reports: list[WorkloadReport], path: Path) -> None:
    """Prefill tokens computed per run, one panel per workload (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4.2))
    if len(reports) == 1:
        axes = [axes]
    for ax, report in zip(axes, reports):
        names = [
            r.run.replace("vLLM + kvtier ", "kvtier\n").replace(" (", "\n(") for r in report.rows
        ]
        values = [r.prefill_tokens for r in report.rows]
        colors = ["#999999"] + [
            "#c0504d" if "kvtier" not in r.run else "#4f81bd" for r in report.rows[1:]
        ]
        bars = ax.bar(range(len(values)), values, color=colors)
        ax.bar_label(bars, labels=[f"{v:,}" for v in values], fontsize=8)
        ax.set_xticks(range(len(values)), names, fontsize=8)
        ax.set_ylabel("prefill tokens computed")
        ax.set_title(f"{report.name} workload", fontsize=10)
    fig.suptitle("kvtier: prompt work the engine did (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Steps:
    """A progress bar over the demo's engine runs; call it as each run starts."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
        self.running = False

    def __call__(self, label: str) -> None:
        if self.running:
            self.bar.update(1)
        self.running = True
        self.bar.set_description(label)

    def close(self) -> None:
        if self.running:
            self.bar.update(1)
        self.bar.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.demo",
        description="Run vLLM with and without kvtier on a preemption-heavy and a "
        "prefix-heavy workload, on this machine, and compare.",
    )
    parser.add_argument(
        "--model",
        help="local Hugging Face model folder (default: a tiny random-weight model made here)",
    )
    parser.add_argument("--out", default="out/demo", help="folder for report.json and report.png")
    parser.add_argument(
        "--only",
        choices=("preemption", "prefix"),
        help="run one workload only",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {args.out}: exists and is not a folder")
    return args


def main(argv: list[str] | None = None) -> int:
    program = argv is None  # run as a program, not called from Python (tests)
    args = parse_args(argv)
    if program:
        # Before vLLM is imported: its own log lines would bury the tables. Only when run
        # as a program, so a caller's process environment is left as it was.
        logging.basicConfig(level=logging.WARNING)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        model = demo_model(args.model)
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"model: {model.path} ({model.layers} layers, {model.kv_heads} KV heads x "
        f"{model.head_dim}, {model.kv_bytes_per_block:,} bytes per 32-token KV block)"
    )
    runs = {"preemption": 3, "prefix": 4}
    todo = [args.only] if args.only else ["preemption", "prefix"]
    steps = Steps(sum(runs[w] for w in todo))
    started = time.perf_counter()
    reports: list[WorkloadReport] = []
    try:
        for name in todo:
            if name == "preemption":
                reports.append(preemption_workload(model, steps))
            else:
                reports.append(prefix_workload(model, out / "fs-tier", steps))
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        steps.close()
    print()
    for report in reports:
        print(format_table(report))
        print()
    all_match = all(r.all_match for r in reports)
    doc = {
        "model": str(model.path),
        "kv_bytes_per_block": model.kv_bytes_per_block,
        "wall_s": round(time.perf_counter() - started, 1),
        "workloads": {r.name: r.as_dict() for r in reports},
        "all_outputs_match": all_match,
    }
    (out / "report.json").write_text(json.dumps(doc, indent=2))
    write_chart(reports, out / "report.png")
    print(f"report: {out / 'report.json'}  chart: {out / 'report.png'}")
    if not all_match:
        print("some outputs differ from the reference run:", file=sys.stderr)
        for report in reports:
            for row in report.rows:
                if not row.outputs_match:
                    print(f"{report.name} / {row.run}:\n{row.mismatch_report}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
