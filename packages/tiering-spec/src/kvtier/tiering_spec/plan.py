"""Size kvtier from a trace of your own traffic: the capacity and policy that serve it.

``python -m kvtier.tiering_spec.plan --trace PATH`` (or ``kvtier-plan --trace PATH``)
reads a trace kvtier recorded (``record_traffic_dir``; its header says what an id
stands for and the bytes it takes) or one in Mooncake's format (then
``--tokens-per-id`` and ``--bytes-per-id`` say it), and prints:

* the share of prompt blocks the host tier serves, as the replay counts it
  (:mod:`kvtier.tiering_spec.replay`), against its capacity, on a grid from a few
  hundred blocks to where LRU serves every block it can: LRU exactly at every
  grid point in one pass (stack distances, :mod:`kvtier.tiering_spec.lru_curve`), the
  other policies by replay at the grid points, and the offline optimum and the reuse
  oracle as ceilings; with ``--device-ids``, the device's prefix cache in front (an LRU
  of that many blocks), and the share that comes from outside it;
* the bytes written into the host tier per block it serves, and with ``--fs-ids`` the
  same policies with an fs tier of that many blocks behind (replayed with real files);
* a recommendation: the host capacity at the knee (past which one more GiB saves fewer
  prompt tokens per second than ``--threshold``, at the trace's own request rate), the
  best policy there, and an fs tier behind it sized by the same rule at
  ``--fs-threshold``, as the ``kv_transfer_config`` to paste, with the memory and disk
  it takes.

``--json`` writes the report, ``--png`` draws the curves.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvtier.tiering_spec import replay
from kvtier.tiering_spec.planner import (
    DEFAULT_POLICIES,
    DEFAULT_THRESHOLD,
    GIB,
    GRID_POINTS,
    plan,
    trace_facts,
)
from kvtier.tiering_spec.tracefile import Trace, TraceError, load_trace_file, save_report


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:5.1f}%"


def _size(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _opt_size(n: float | None) -> str:
    return "-" if n is None else _size(n)


def format_report(report: dict[str, Any]) -> str:
    """The report as the command prints it."""
    t, rec = report["trace"], report["recommendation"]
    rate = t["request_rate"]
    lines = [
        f"{t['requests']:,} requests over {t['seconds']:.0f} s"
        + (f" ({rate:.2f}/s)" if rate else "")
        + f", {t['prompt_blocks']:,} prompt blocks of {t['tokens_per_id']} tokens, "
        f"{t['distinct_blocks']:,} distinct, {t['reused_blocks']:,} used twice or more; "
        f"{_size(t['bytes_per_id'])} per block",
        "",
        "share of prompt blocks the host tier serves, by capacity:",
    ]
    names = [*report["policies"], "reuse_oracle", "optimum"]
    head = f"{'blocks':>10} {'host mem':>10} " + " ".join(f"{n:>12}" for n in names)
    lines.append(head)
    for i, cap in enumerate(report["capacities"]):
        cells = " ".join(f"{_pct(report['served'][n][i]):>12}" for n in names)
        lines.append(f"{cap:>10,} {_size(report['gib'][i] * GIB):>10} {cells}")
    if report["device_ids"]:
        lines += [
            "",
            f"with a device prefix cache of {report['device_ids']:,} blocks in front "
            f"(serving {_pct(report['device_served']).strip()} itself), share of prompt "
            "tokens from outside the device:",
        ]
        for i, cap in enumerate(report["capacities"]):
            cells = " ".join(
                f"{_pct(report['outside_device_tokens'][n][i]):>12}" for n in report["policies"]
            )
            lines.append(f"{cap:>10,} {_size(report['gib'][i] * GIB):>10} {cells}")
    lines += ["", "bytes written into the host tier per block it serves:"]
    for i, cap in enumerate(report["capacities"]):
        cells = " ".join(
            f"{'-' if (v := report['written_per_served'][n][i]) is None else _size(v):>12}"
            for n in report["policies"]
        )
        lines.append(f"{cap:>10,} {_size(report['gib'][i] * GIB):>10} {cells}")
    with_fs = report.get("with_fs")
    if with_fs:
        lines += [
            "",
            f"with an fs tier of {with_fs['fs_ids']:,} blocks behind: share served from either "
            "tier; bytes written into the host tier / the fs tier per block served:",
        ]
        for i, cap in enumerate(report["capacities"]):
            cells = " ".join(
                f"{_pct(with_fs['served'][n][i]).strip()} "
                f"{_opt_size(with_fs['host_written_per_served'][n][i])}/"
                f"{_opt_size(with_fs['fs_written_per_served'][n][i])}"
                for n in report["policies"]
            )
            lines.append(f"{cap:>10,} {_size(report['gib'][i] * GIB):>10}  {cells}")
    fs = (
        f" plus an fs tier of {rec['fs_ids']:,} blocks ({_size(rec['fs_bytes'])} of disk, "
        f"serving {_pct(rec['with_fs']).strip()})"
        if rec["fs_ids"]
        else ", no fs tier (it would save little more)"
    )
    if report["capacities"][0] < report["lru_exact_from"]:
        lines.append(
            f"(below {report['lru_exact_from']:,} blocks, the longest prompt, a prompt is "
            "not stored whole: lru there is the one-pass model, not the replay)"
        )
    if not rec["pays"]:
        lines += [
            "",
            f"even the smallest host tier saves under {rec['threshold']:g} prompt tokens/s "
            "per GiB on this traffic: kvtier's host tier pays little here",
        ]
    lines += [
        "",
        f"recommended: a host tier of {rec['host_ids']:,} blocks ({_size(rec['host_bytes'])} "
        f"of host memory) with {rec['policy']}, serving {_pct(rec['served']).strip()} of "
        f"prompt blocks{fs}; past it one more GiB saves under {rec['threshold']:g} prompt "
        "tokens/s. kv_transfer_config:",
        json.dumps(rec["kv_transfer_config"]),
    ]
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, comma-separated, got {text!r}")
    return values


def write_png(report: dict[str, Any], path: str) -> str | None:
    """Draw the curves into ``path``; the reason where it cannot (no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--png needs matplotlib (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(8, 5))
    gib = report["gib"]
    for name in report["policies"]:
        ax.plot(gib, [100 * v for v in report["served"][name]], marker="o", label=name)
    for name, style in (("reuse_oracle", ":"), ("optimum", "--")):
        ax.plot(gib, [100 * v for v in report["served"][name]], style, label=name)
    rec = report["recommendation"]
    ax.axvline(rec["host_bytes"] / GIB, color="grey", lw=0.8)
    ax.annotate(
        f"recommended: {rec['policy']}",
        (rec["host_bytes"] / GIB, 100 * rec["served"]),
        textcoords="offset points",
        xytext=(6, -14),
    )
    ax.set_xscale("log")
    ax.set_xlabel("host tier, GiB")
    ax.set_ylabel("prompt blocks served, %")
    ax.set_title(f"{report['trace']['requests']:,} requests")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvtier.tiering_spec.plan",
        description="Size kvtier's host and fs tiers from a trace of your own traffic.",
    )
    p.add_argument("--trace", required=True, help="a trace file (plain, gzip or xz)")
    p.add_argument(
        "--tokens-per-id",
        type=int,
        help="tokens one id stands for (default: the trace's header; 512 for Mooncake's)",
    )
    p.add_argument(
        "--bytes-per-id",
        type=int,
        help="host bytes of one id, every rank together (default: the trace's header)",
    )
    p.add_argument(
        "--device-ids",
        type=int,
        help="blocks (ids) the device's prefix cache holds in front of the host tier "
        "(default: the trace's header; 0 for none)",
    )
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="policies to replay beside LRU's exact curve (comma-separated)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help="prompt tokens per second one more GiB of host memory must save (default "
        f"{DEFAULT_THRESHOLD:g})",
    )
    p.add_argument(
        "--fs-threshold",
        type=float,
        help="the same for a GiB of disk (default: a tenth of --threshold)",
    )
    p.add_argument("--fs-root", default="/var/lib/kvtier", help="root_dir in the config")
    p.add_argument(
        "--fs-ids",
        type=int,
        help="also replay each policy with an fs tier of this many blocks behind the host "
        "tier (real files in a temporary folder; slower): served and bytes written",
    )
    p.add_argument("--fs-dir", help="where --fs-ids's temporary folder goes")
    p.add_argument("--points", type=int, default=GRID_POINTS, help="capacities on the grid")
    p.add_argument(
        "--capacities",
        type=_int_list,
        help="host capacities in blocks, comma-separated, instead of the grid",
    )
    p.add_argument("--requests", type=int, help="plan from the first N requests only")
    p.add_argument("--workers", type=int, default=2, help="processes for the replays")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--png", help="draw the curves here (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("tokens_per_id", "bytes_per_id", "points", "workers", "requests", "fs_ids"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.threshold <= 0 or (args.fs_threshold is not None and args.fs_threshold <= 0):
        p.error("--threshold and --fs-threshold must be > 0")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    known = replay.kvtier_policies()
    unknown = [x for x in policies if x not in known]
    if unknown:
        p.error(f"--policies: unknown {unknown}; allowed: {', '.join(known)}")
    try:
        trace = load_trace_file(args.trace)
        if args.requests is not None:
            trace = Trace(trace.requests[: args.requests], trace.header, trace.end)
        if not trace.requests:
            raise TraceError(f"{args.trace}: no requests")
        flags = {
            "tokens_per_id": args.tokens_per_id,
            "bytes_per_id": args.bytes_per_id,
            "device_ids": args.device_ids,
        }
        facts = trace_facts(trace, args.trace, flags)
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    report = plan(
        trace,
        facts,
        policies=policies,
        threshold=args.threshold,
        fs_threshold=args.fs_threshold,
        fs_root=args.fs_root,
        points=args.points,
        capacities=args.capacities,
        fs_ids=args.fs_ids,
        fs_dir=args.fs_dir,
        workers=args.workers,
        progress=not args.no_progress,
    )
    print(format_report(report))
    print(f"\nplanned in {time.monotonic() - t0:.1f} s")
    save_report(report, args.json, args.png, write_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
