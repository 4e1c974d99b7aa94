"""Replay a request trace through kvtier's host and fs tiers, vLLM's manager and the optimum.

``python -m kvtier.tiering_spec.trace --capacities 1000,4000,16000 --json out.json``

The command line and its reports (a table, Markdown, a chart) over
:mod:`kvtier.tiering_spec.tracefile` (the trace format, its checks and the offline
optimum) and :mod:`kvtier.tiering_spec.replay` (the managers, fed vLLM's calls). The
names of ``tracefile`` are importable from here too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.tiering_spec import replay
from kvtier.tiering_spec.config import EVICTION_POLICIES
from kvtier.tiering_spec.tracefile import (
    BLOCK_TOKENS,
    DEFAULT_TRACE,
    REQUIRED_KEYS,
    ModelShape,
    Optimum,
    Progress,
    TraceError,
    TraceRequest,
    load_trace,
    next_uses,
    open_trace,
    optimum,
    parse_trace,
    reuse_oracle,
    save_report,
)

__all__ = [
    "BLOCK_TOKENS",
    "DEFAULT_TRACE",
    "REQUIRED_KEYS",
    "ModelShape",
    "Optimum",
    "Progress",
    "TraceError",
    "TraceRequest",
    "format_markdown",
    "format_report",
    "load_trace",
    "main",
    "next_uses",
    "open_trace",
    "optimum",
    "parse_trace",
    "reuse_oracle",
    "write_png",
]


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n:.0f} B"


def format_report(report: dict[str, Any]) -> str:
    """The per-capacity table of a report (as written by ``--json``)."""
    caps = report["capacities"]
    block = report["bytes_per_block"]
    lines = [
        f"trace {report['trace']}: {report['requests']:,} requests, "
        f"{report['prompt_blocks']:,} prompt blocks, {report['distinct_blocks']:,} distinct; "
        f"a block = {_bytes(block)}"
    ]
    for i, cap in enumerate(caps):
        opt = report["optimum"][i]
        lines.append("")
        lines.append(
            f"capacity {cap:,} blocks (host {_bytes(cap * block)}): optimum serves "
            f"{100 * opt:.1f}% (no policy can exceed {100 * report['optimum_bound'][i]:.1f}%)"
            + (
                f"; knowing only which blocks come back, {100 * report['reuse_oracle'][i]:.1f}%"
                if report.get("reuse_oracle")
                else ""
            )
            + (
                f"; both for the host tier alone, the fs tier adds {report['fs_capacity']:,}"
                + (
                    f" (fs policy {report['fs_policy']})"
                    if report.get("fs_policy")
                    else " (fs policy: each row's)"
                )
                if report.get("fs_capacity")
                else ""
            )
        )
        lines.append(
            f"  {'policy':<12} {'served':>7} {'host':>7} {'fs':>7} "
            f"{'host B/served':>14} {'fs B/served':>12} {'vs optimum':>10}"
        )
        for name, row in report["policies"].items():
            served = row["served"][i]
            host_w = row["host_written_per_served"][i]
            fs_w = row["fs_written_per_served"][i]
            lines.append(
                f"  {name:<12} {100 * served:6.1f}% {100 * row['served_host'][i]:6.1f}% "
                f"{100 * row['served_fs'][i]:6.1f}% "
                f"{_bytes(host_w) if host_w is not None else '-':>14} "
                f"{_bytes(fs_w) if fs_w is not None else '-':>12} "
                f"{served / opt if opt else 0.0:10.2f}"
            )
    lines.append("")
    lines.append(
        "served: prompt blocks served from a tier / all prompt blocks; host/fs: the same by "
        "tier; B/served: bytes written to the tier per block served"
    )
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    """The served shares as a Markdown table: a row per policy (the ratio to the
    optimum in brackets), then the optimum and its bound; a column per capacity."""
    caps = report["capacities"]
    block = report["bytes_per_block"]
    head = " | ".join(f"{c:,} ({_bytes(c * block)})" for c in caps)
    lines = [
        f"| policy | {head} |",
        "| --- |" + " --- |" * len(caps),
    ]
    for name, row in report["policies"].items():
        cells = []
        for served, opt in zip(row["served"], report["optimum"]):
            cells.append(f"{100 * served:.1f}% ({served / opt:.2f})" if opt else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        "| optimum (MIN) | " + " | ".join(f"{100 * v:.1f}%" for v in report["optimum"]) + " |"
    )
    if report.get("reuse_oracle"):
        lines.append(
            "| knowing which blocks come back (offline, not MIN) | "
            + " | ".join(f"{100 * v:.1f}%" for v in report["reuse_oracle"])
            + " |"
        )
    lines.append(
        "| bound (MIN, any cached block) | "
        + " | ".join(f"{100 * v:.1f}%" for v in report["optimum_bound"])
        + " |"
    )
    return "\n".join(lines)


def write_png(report: dict[str, Any], path: str) -> str | None:
    """Draw hit ratio against capacity, one line per policy, the optimum as the ceiling.
    Returns None, or why no PNG was written (matplotlib missing: the ``trace`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "matplotlib is not installed, so no PNG was written "
            "(pip install 'kvtier-tiering-spec[trace]'; or draw it later from the JSON: "
            "python -m kvtier.tiering_spec.trace --plot JSON --png OUT)"
        )
    caps = report["capacities"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    ax.plot(caps, [100 * v for v in report["optimum"]], "k--", label="optimum (MIN)", lw=1.5)
    if report.get("reuse_oracle"):
        ax.plot(
            caps,
            [100 * v for v in report["reuse_oracle"]],
            "k:",
            label="knowing which blocks come back",
            lw=1.2,
        )
    for name, row in report["policies"].items():
        style = ":" if name.startswith("vllm-") else "-"
        ax.plot(caps, [100 * v for v in row["served"]], style, marker="o", ms=3, label=name)
    ax.set_xscale("log")
    ax.set_xticks(caps, [f"{c:,}" for c in caps])
    ax.minorticks_off()
    ax.set_xlabel(f"capacity (blocks of {report.get('block_tokens', BLOCK_TOKENS)} tokens)")
    ax.set_ylabel("prompt blocks served from cache (%)")
    ax.set_title(f"{Path(report['trace']).name}: hit ratio against capacity", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvtier.tiering_spec.trace",
        description=(
            "Replay a request trace (Mooncake's format) through kvtier's host tier (and fs "
            "tier), vLLM's CPUOffloadingManager and Belady's MIN, at several capacities."
        ),
    )
    p.add_argument(
        "--trace",
        help="trace file, plain, gzip or xz (default: the bundled Mooncake conversation trace)",
    )
    p.add_argument(
        "--capacities",
        type=_int_list,
        default=[1000, 4000, 16000],
        help="host tier capacities in blocks, comma-separated",
    )
    p.add_argument(
        "--policies",
        default=None,
        help="comma-separated: kvtier policies by name (every one kvtier.blockpool "
        "registers, by default) and vllm-lru, vllm-arc (vLLM's manager)",
    )
    p.add_argument(
        "--fs-capacity",
        type=int,
        default=None,
        help="add an fs tier of this many blocks behind kvtier's host tier "
        "(real files in a temporary directory)",
    )
    p.add_argument(
        "--fs-policy",
        default=None,
        help="the fs tier's eviction policy (lru, arc, frecency); default: each row's "
        "policy where the fs tier knows it",
    )
    p.add_argument("--fs-dir", default=None, help="where the fs tier's temporary directory goes")
    p.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--layers", type=int, default=ModelShape.layers)
    p.add_argument("--kv-heads", type=int, default=ModelShape.kv_heads)
    p.add_argument("--head-dim", type=int, default=ModelShape.head_dim)
    p.add_argument("--dtype-bytes", type=int, default=ModelShape.dtype_bytes)
    p.add_argument(
        "--tokens-per-block",
        type=int,
        default=BLOCK_TOKENS,
        help="tokens of one trace block (sizes only; the trace's blocks are 512)",
    )
    p.add_argument("--json", help="write the report here")
    p.add_argument("--png", help="draw the hit ratios here (needs matplotlib)")
    p.add_argument(
        "--plot",
        metavar="JSON",
        help="draw --png from a report written earlier by --json, and exit",
    )
    p.add_argument(
        "--markdown", action="store_true", help="also print the served shares as a Markdown table"
    )
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    if args.plot:
        if not args.png:
            p.error("--plot needs --png")
        with open(args.plot) as f:
            report = json.load(f)
        why = write_png(report, args.png)
        if why:
            print(why, file=sys.stderr)
            return 1
        print(f"wrote {args.png}")
        return 0

    if args.fs_policy is not None and args.fs_policy not in EVICTION_POLICIES:
        p.error(
            f"--fs-policy must be one of {', '.join(EVICTION_POLICIES)}, got {args.fs_policy!r}"
        )
    try:
        requests = load_trace(args.trace)
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.requests is not None:
        requests = requests[: args.requests]
    policies = replay.resolve_policies(args.policies)
    shape = ModelShape(
        args.layers, args.kv_heads, args.head_dim, args.dtype_bytes, args.tokens_per_block
    )
    t0 = time.monotonic()
    report = replay.run(
        requests,
        args.capacities,
        policies,
        shape=shape,
        fs_capacity=args.fs_capacity,
        fs_dir=args.fs_dir,
        fs_policy=args.fs_policy,
        trace_name=str(args.trace or DEFAULT_TRACE.name),
        progress=not args.no_progress,
    )
    print(format_report(report))
    if args.markdown:
        print("\n" + format_markdown(report))
    print(f"\nreplayed in {time.monotonic() - t0:.1f} s")
    save_report(report, args.json, args.png, write_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
