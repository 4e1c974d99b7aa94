"""A request trace in Mooncake's format, and what an offline policy could serve of it.

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
:mod:`kvtier.tiering_spec.replay` drives the managers, and
:mod:`kvtier.tiering_spec.trace` is the command line over both.
"""

from __future__ import annotations

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

# The first and last lines of a trace kvtier recorded.
from kvtier.tiering_spec.traffic import END_KEY, HEADER_KEY

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


@dataclass(frozen=True)
class Trace:
    """A trace's requests, with the header and end line of a recorded one (or None)."""

    requests: list[TraceRequest]
    header: dict[str, Any] | None = None
    end: dict[str, Any] | None = None


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> list[TraceRequest]:
    """The requests of a trace's ``lines``; raises :class:`TraceError` on bad input."""
    return parse_trace_file(lines, source).requests


def parse_trace_file(lines: Iterable[str], source: str = "<trace>") -> Trace:
    """A trace's ``lines``: its requests, and where kvtier recorded it its header (the
    first line, ``{"kvtier_trace": {...}}``) and end line (the last,
    ``{"kvtier_trace_end": {...}}``). Raises :class:`TraceError` on bad input."""
    header: dict[str, Any] | None = None
    end: dict[str, Any] | None = None
    end_line = 0
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
        if end is not None:
            raise TraceError(f"{where}: a line after the trace's end line (line {end_line})")
        if HEADER_KEY in obj:
            if requests or header is not None or not isinstance(obj[HEADER_KEY], dict):
                raise TraceError(
                    f"{where}: {HEADER_KEY!r} must be an object, on the trace's first line"
                )
            header = obj[HEADER_KEY]
            continue
        if END_KEY in obj:
            if not isinstance(obj[END_KEY], dict):
                raise TraceError(f"{where}: {END_KEY!r} must be an object")
            end, end_line = obj[END_KEY], lineno
            continue
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
    return Trace(requests, header, end)


def load_trace(path: str | os.PathLike[str] | None = None) -> list[TraceRequest]:
    """The requests of the trace at ``path`` (default: the bundled conversation trace)."""
    return load_trace_file(path).requests


def load_trace_file(path: str | os.PathLike[str] | None = None) -> Trace:
    """The trace at ``path`` with its header and end line (default: the bundled
    conversation trace, which has neither)."""
    path = DEFAULT_TRACE if path is None else Path(path)
    try:
        with open_trace(path) as f:
            return parse_trace_file(f, str(path))
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


def save_report(
    report: dict[str, Any],
    json_path: str | None,
    png_path: str | None,
    draw: Callable[[dict[str, Any], str], str | None],
) -> None:
    """Write a command's report as JSON to ``json_path`` and its chart (``draw``, which
    returns why it could not) to ``png_path``, each where given; say what was written."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    if png_path:
        why = draw(report, png_path)
        print(why if why else f"wrote {png_path}", file=sys.stderr if why else sys.stdout)
