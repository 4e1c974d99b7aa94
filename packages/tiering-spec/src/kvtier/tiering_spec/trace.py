"""Replay a request trace through kvtier's host and fs tiers, vLLM's manager and the optimum.

``python -m kvtier.tiering_spec.trace --capacities 1000,4000,16000 --json out.json``

A trace is Mooncake's format (the FAST'25 traces of kvcache-ai/Mooncake): one JSON
object a line with ``timestamp`` (ms since the first request), ``input_length``,
``output_length`` (tokens) and ``hash_ids``: the prompt's blocks of 512 tokens as
integers, where an id names a block together with its whole prefix. The conversation
trace ships with this package (``traces/``, Apache-2.0, see the NOTICE there) and is
the default; any file of the same format can be given by path, plain, gzip or xz.

Validation (a :class:`TraceError` names the file, the line and the field):

* every line is a JSON object with the four keys (others are ignored); blank lines
  are skipped;
* ``timestamp`` is a finite number >= 0 and never smaller than the line before's:
  the replay serves requests in arrival order, so a trace out of order is refused
  rather than silently reordered (equal timestamps are fine: keep file order);
* ``input_length`` and ``output_length`` are integers >= 0 (not checked against the
  number of blocks: only ``hash_ids`` is replayed);
* ``hash_ids`` is a list of integers >= 0 with no id twice, and an id always follows
  the same id (or is always first): ids name prefixes, so a block with two parents
  would be two different blocks of KV.

This module loads traces and computes the offline optimum without torch or vLLM;
:mod:`kvtier.tiering_spec.replay` drives the managers.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import heapq
import io
import json
import lzma
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

BLOCK_TOKENS = 512
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake-conversation.jsonl.xz"
REQUIRED_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace that does not follow the format; the message names the line and field."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace (``line``: its line number in the file, from 1)."""

    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def open_trace(path: str | os.PathLike[str]) -> IO[str]:
    """``path`` opened as text, decompressed when it is gzip, xz or bzip2 (by content)."""
    with open(path, "rb") as f:
        magic = f.read(6)
    opener: Any = open
    if magic.startswith(b"\x1f\x8b"):
        opener = gzip.open
    elif magic.startswith(b"\xfd7zXZ\x00"):
        opener = lzma.open
    elif magic.startswith(b"BZh"):
        opener = bz2.open
    return io.TextIOWrapper(opener(path, "rb"), encoding="utf-8")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> list[TraceRequest]:
    """The requests of a trace's ``lines``; raises :class:`TraceError` on bad input."""
    requests: list[TraceRequest] = []
    parent: dict[int, int] = {}  # block id -> id before it (-1: first in its prompt)
    first_seen: dict[int, int] = {}  # block id -> line where that parent was seen
    last_ts: float | None = None
    last_line = 0
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        for key in REQUIRED_KEYS:
            if key not in obj:
                raise TraceError(f"{where}: missing key {key!r} (needs {', '.join(REQUIRED_KEYS)})")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise TraceError(f"{where}: 'timestamp' must be a number, got {ts!r}")
        if ts < 0:
            raise TraceError(f"{where}: 'timestamp' must be >= 0, got {ts!r}")
        if last_ts is not None and ts < last_ts:
            raise TraceError(
                f"{where}: 'timestamp' {ts!r} is earlier than {last_ts!r} on line {last_line}: "
                "requests must be in arrival order (non-decreasing timestamps)"
            )
        for key in ("input_length", "output_length"):
            value = obj[key]
            if not _is_int(value):
                raise TraceError(f"{where}: {key!r} must be an integer, got {value!r}")
            if value < 0:
                raise TraceError(f"{where}: {key!r} must be >= 0, got {value!r}")
        ids = obj["hash_ids"]
        if not isinstance(ids, list):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers, got {ids!r}")
        prev = -1
        seen: set[int] = set()
        for pos, block in enumerate(ids):
            if not _is_int(block) or block < 0:
                raise TraceError(
                    f"{where}: 'hash_ids'[{pos}] must be an integer >= 0, got {block!r}"
                )
            if block in seen:
                raise TraceError(f"{where}: 'hash_ids'[{pos}] = {block} repeats an earlier id")
            seen.add(block)
            known = parent.setdefault(block, prev)
            if known != prev:
                here = f"follows {prev}" if prev >= 0 else "starts the prompt"
                there = f"follows {known}" if known >= 0 else "starts the prompt"
                raise TraceError(
                    f"{where}: 'hash_ids'[{pos}] = {block} {here} but {there} on line "
                    f"{first_seen[block]}: an id names a block with its whole prefix"
                )
            first_seen.setdefault(block, lineno)
            prev = block
        requests.append(
            TraceRequest(lineno, float(ts), obj["input_length"], obj["output_length"], tuple(ids))
        )
        last_ts, last_line = ts, lineno
    return requests


def load_trace(path: str | os.PathLike[str] | None = None) -> list[TraceRequest]:
    """The requests of the trace at ``path`` (default: the bundled conversation trace)."""
    path = DEFAULT_TRACE if path is None else Path(path)
    try:
        with open_trace(path) as f:
            return parse_trace(f, str(path))
    except (OSError, EOFError, UnicodeDecodeError, lzma.LZMAError) as exc:
        raise TraceError(f"{path}: cannot be read ({exc})") from None


# ---------------------------------------------------------------------------- optimum


@dataclass(frozen=True)
class Optimum:
    """Belady's MIN at one capacity: blocks served (longest cached prefix of each
    request) and ``bound``, the blocks it finds cached at all, prefix or not, which no
    policy of that capacity can beat."""

    served: int
    bound: int


def next_uses(requests: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
    """For each request and block: (index of the next request using the block, that
    request's position of it); never again is ``(len(requests), 0)``."""
    never = (len(requests), 0)
    nxt: dict[int, tuple[int, int]] = {}
    out: list[list[tuple[int, int]]] = [[]] * len(requests)
    for i in range(len(requests) - 1, -1, -1):
        ids = requests[i]
        out[i] = [nxt.get(b, never) for b in ids]
        for pos, b in enumerate(ids):
            nxt[b] = (i, pos)
    return out


def optimum(
    requests: Sequence[Sequence[int]],
    capacity: int,
    uses: list[list[tuple[int, int]]] | None = None,
    *,
    ties: str = "tail",
) -> Optimum:
    """Belady's MIN for ``capacity`` blocks, under the replay's serving rule.

    Requests come in order. A request is served the longest prefix of its blocks that
    is cached; then each of its blocks is inserted (or refreshed) with the index of the
    next request that uses it, and while more than ``capacity`` blocks are cached the
    block used again furthest in the future is dropped, the request's own blocks
    included (a block never used again is simply not kept). Blocks next used by the same
    request tie; ``ties="tail"`` drops the one deepest in that request's prompt first
    (its prefix stays servable), ``"head"`` the shallowest first (which reproduces the
    figures first quoted for this trace, slightly below the optimum).
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if uses is None:
        uses = next_uses(requests)
    sign = -1 if ties == "tail" else 1
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, tie, block), lazily invalidated
    served = present = 0
    push, pop = heapq.heappush, heapq.heappop
    for ids, nexts in zip(requests, uses):
        prefix = True
        for b in ids:
            if b in cache:
                present += 1
                served += prefix
            else:
                prefix = False
        for b, (nu, pos) in zip(ids, nexts):
            cache[b] = nu
            push(heap, (-nu, sign * pos, b))
        while len(cache) > capacity:
            neg, _, b = pop(heap)
            if cache.get(b) == -neg:
                del cache[b]
        if len(heap) > 4 * capacity + 1024:  # drop stale entries
            heap = [(-nu, 0, b) for b, nu in cache.items()]
            heapq.heapify(heap)
    return Optimum(served, present)


def reuse_oracle(
    requests: Sequence[Sequence[int]],
    capacity: int,
    uses: list[list[tuple[int, int]]] | None = None,
) -> int:
    """Blocks served by an offline policy that knows *whether* each block is used again,
    not when: a block used again is kept, the others are dropped at once; among the kept,
    the fewest uses so far go first, ties the least recently used.

    It marks what knowing the future's *set* of reuses is worth: an online policy learns
    at best who comes back from what it has seen, which is less, so where this
    serves under a target share of the optimum, no ranking by uses and recency can
    reach it; the rest of MIN's hits come from knowing *when* a block comes back.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if uses is None:
        uses = next_uses(requests)
    never = len(requests)
    counts: dict[int, int] = {}
    cache: dict[int, tuple[int, int, int]] = {}  # block -> its heap item
    heap: list[tuple[int, int, int]] = []  # (uses, order, block), lazily invalidated
    served = order = 0
    push, pop = heapq.heappush, heapq.heappop
    for ids, nexts in zip(requests, uses):
        for b in ids:
            if b not in cache:
                break
            served += 1
        for b, (nu, _) in zip(reversed(ids), reversed(nexts)):  # the head ends newest
            order += 1
            counts[b] = n = counts.get(b, 0) + 1
            if nu == never:
                cache.pop(b, None)
                continue
            item = cache[b] = (n, order, b)
            push(heap, item)
        while len(cache) > capacity:
            item = pop(heap)
            if cache.get(item[2]) is item:
                del cache[item[2]]
        if len(heap) > 4 * capacity + 1024:  # drop stale entries
            heap = list(cache.values())
            heapq.heapify(heap)
    return served


# ---------------------------------------------------------------------------- report


@dataclass(frozen=True)
class ModelShape:
    """The KV bytes a block of ``tokens`` tokens takes: Llama-3-8B in bf16 by default."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    tokens: int = BLOCK_TOKENS

    @property
    def block_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes * self.tokens


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


class Progress:
    """A plain-text progress bar on stderr (redrawn in place on a terminal)."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30) -> None:
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.width = width
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()
        self._last = -1.0

    def advance(self, n: int, label: str) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        final = self.done >= self.total
        if not final and now - self._last < (0.2 if self.tty else 10.0):
            return
        self._last = now
        frac = min(1.0, self.done / self.total)
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"[{bar}] {100 * frac:5.1f}% {now - self.start:6.1f} s  {label}"
        if self.tty:
            sys.stderr.write("\r" + text.ljust(100)[:100] + ("\n" if final else ""))
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()


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

    from kvtier.tiering_spec import replay
    from kvtier.tiering_spec.config import EVICTION_POLICIES

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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    if args.png:
        why = write_png(report, args.png)
        print(why if why else f"wrote {args.png}", file=sys.stderr if why else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
