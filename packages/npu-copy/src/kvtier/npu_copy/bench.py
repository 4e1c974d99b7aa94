"""``kvtier-copy-bench``: kvtier's block copies against the limit and the per-block loop.

For each per-layer block size and direction, one run measures side by side:
(a) ``limit``: one contiguous ``copy_`` of the same bytes (what this host or link can do),
(b) ``kvtier``: ``TransferEngine.store``/``load`` of scattered blocks, submit to finished,
(c) ``loop``: the reference's per-block, per-layer ``copy_`` of the same blocks.
Methods are interleaved in every repeat; each reports its best repeat (least noise on a
shared host). All three run with the same ``torch.set_num_threads``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TextIO

import torch

from kvtier.npu_copy import native
from kvtier.npu_copy.__about__ import __version__
from kvtier.npu_copy.device import default_device, import_npu_backend
from kvtier.npu_copy.engine import TransferEngine

KiB = 1024
DEFAULT_SIZES = (4 * KiB, 64 * KiB, 512 * KiB)
# The bar a release meets on the CPU backend: near the limit for large pieces, and far
# ahead of the per-block loop for small ones (ratios; both directions).
BAR_VS_LIMIT = {64 * KiB: 0.8, 512 * KiB: 0.8}
BAR_VS_LOOP = {4 * KiB: 5.0}


class ProgressBar:
    """A one-line progress bar on a terminal stream (no dependency)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.total = max(1, total)
        self.count = 0
        self.stream = stream
        self.width = width
        self.enabled = stream.isatty()

    def step(self, label: str) -> None:
        self.count += 1
        if not self.enabled:
            return
        filled = self.width * self.count // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.count}/{self.total} {label:<32}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (self.width + 50) + "\r")
            self.stream.flush()


@dataclass
class Case:
    """One measured case; rates in GB/s (1e9 bytes per second)."""

    direction: str
    layer_block_bytes: int
    limit_gbps: float
    kvtier_gbps: float
    loop_gbps: float

    @property
    def vs_limit(self) -> float:
        return self.kvtier_gbps / self.limit_gbps

    @property
    def vs_loop(self) -> float:
        return self.kvtier_gbps / self.loop_gbps


def _sync(device: torch.device) -> None:
    # The benchmark (not the engine) may synchronize the device to time a method.
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _fmt_size(n: int) -> str:
    return f"{n // KiB} KiB" if n < 1024 * KiB else f"{n // (1024 * KiB)} MiB"


def run_size(
    device: torch.device,
    layer_block_bytes: int,
    *,
    layers: int,
    blocks: int,
    repeats: int,
    generator: torch.Generator,
    progress: ProgressBar,
) -> list[Case]:
    """Measure store and load for one per-layer block size; returns two cases."""
    num_device_blocks = 2 * blocks
    num_host_blocks = 2 * blocks
    pinned = device.type != "cpu"
    # vLLM's CPU layout: [num_blocks, 2 (K, V), ...] per layer, here float16.
    kv = [
        torch.empty(
            (num_device_blocks, 2, layer_block_bytes // 4), dtype=torch.float16, device=device
        ).fill_(float(i + 1))
        for i in range(layers)
    ]
    host = torch.zeros(
        (num_host_blocks, layers * layer_block_bytes), dtype=torch.uint8, pin_memory=pinned
    )
    total = blocks * layers * layer_block_bytes
    dev_flat = torch.ones(total, dtype=torch.uint8, device=device)
    host_flat = torch.zeros(total, dtype=torch.uint8, pin_memory=pinned)
    # Scattered on both sides, no two consecutive: the hardest case for batching.
    dev_ids = torch.randperm(num_device_blocks, generator=generator)[:blocks].tolist()
    host_ids = torch.randperm(num_host_blocks, generator=generator)[:blocks].tolist()

    engine = TransferEngine(kv, host)
    rows = [seg.rows for seg in engine.layout.segments]
    offsets = [(seg.host_offset, seg.host_end) for seg in engine.layout.segments]
    pairs = list(zip(dev_ids, host_ids))

    def loop_store() -> None:
        for d, h in pairs:
            for r, (a, b) in zip(rows, offsets):
                host[h, a:b].copy_(r[d])

    def loop_load() -> None:
        for d, h in pairs:
            for r, (a, b) in zip(rows, offsets):
                r[d].copy_(host[h, a:b])

    methods: dict[str, dict[str, Callable[[], object]]] = {
        "store": {
            "limit": lambda: host_flat.copy_(dev_flat, non_blocking=pinned),
            "kvtier": lambda: engine.store(dev_ids, host_ids).wait(),
            "loop": loop_store,
        },
        "load": {
            "limit": lambda: dev_flat.copy_(host_flat, non_blocking=pinned),
            "kvtier": lambda: engine.load(host_ids, dev_ids).wait(),
            "loop": loop_load,
        },
    }
    cases = []
    try:
        for direction, fns in methods.items():
            best = {name: float("inf") for name in fns}
            for fn in fns.values():  # warm-up: first touch, thread start, allocator
                fn()
            for r in range(repeats):
                for name, fn in fns.items():
                    best[name] = min(best[name], _timed(fn, device))
                progress.step(f"{direction} {_fmt_size(layer_block_bytes)} {r + 1}/{repeats}")
            _verify(engine, kv, host, dev_ids, host_ids, direction)
            gbps = {name: total / t / 1e9 for name, t in best.items()}
            cases.append(
                Case(direction, layer_block_bytes, gbps["limit"], gbps["kvtier"], gbps["loop"])
            )
    finally:
        engine.close()
    return cases


def _verify(
    engine: TransferEngine,
    kv: list[torch.Tensor],
    host: torch.Tensor,
    dev_ids: list[int],
    host_ids: list[int],
    direction: str,
) -> None:
    """Check that kvtier moved the right bytes (every method wrote the same bytes)."""
    if direction == "store":
        host.index_fill_(0, torch.tensor(host_ids), 0)
        if not engine.store(dev_ids, host_ids).wait():
            raise RuntimeError("kvtier store failed in the benchmark")
    else:
        for t in kv:
            t[dev_ids] = 0
        if not engine.load(host_ids, dev_ids).wait():
            raise RuntimeError("kvtier load failed in the benchmark")
    for seg in engine.layout.segments:
        got = host[host_ids, seg.host_offset : seg.host_end]
        want = seg.rows[dev_ids].cpu()
        if not torch.equal(got, want):
            raise RuntimeError(f"kvtier {direction} moved wrong bytes in segment {seg.name}")


def bar_misses(cases: Iterable[Case]) -> list[str]:
    """The measured cases below the bar (:data:`BAR_VS_LIMIT`, :data:`BAR_VS_LOOP`), each
    as ``"store 64 KiB: 0.71x the limit (bar 0.8x)"``; empty when every case meets it."""
    misses = []
    for c in cases:
        size = _fmt_size(c.layer_block_bytes)
        want = BAR_VS_LIMIT.get(c.layer_block_bytes)
        if want is not None and c.vs_limit < want:
            misses.append(f"{c.direction} {size}: {c.vs_limit:.2f}x the limit (bar {want}x)")
        want = BAR_VS_LOOP.get(c.layer_block_bytes)
        if want is not None and c.vs_loop < want:
            misses.append(f"{c.direction} {size}: {c.vs_loop:.1f}x the loop (bar {want}x)")
    return misses


def format_bar(cases: list[Case]) -> str:
    """One line: the bar, and whether the measured cases it covers meet it."""
    sizes = set(BAR_VS_LIMIT) | set(BAR_VS_LOOP)
    covered = [c for c in cases if c.layer_block_bytes in sizes]
    rule = "bar: " + ", ".join(
        [f"kvtier/limit >= {v}x at {_fmt_size(k)}" for k, v in BAR_VS_LIMIT.items()]
        + [f"kvtier/loop >= {v}x at {_fmt_size(k)}" for k, v in BAR_VS_LOOP.items()]
    )
    if not covered:
        return f"{rule}: not measured (no such sizes)"
    misses = bar_misses(covered)
    return f"{rule}: " + ("met" if not misses else "NOT met: " + "; ".join(misses))


def format_table(cases: Iterable[Case]) -> str:
    head = (
        f"{'direction':<9} {'block/layer':>11} {'limit GB/s':>10} {'kvtier GB/s':>11} "
        f"{'loop GB/s':>9} {'kvtier/limit':>12} {'kvtier/loop':>11}"
    )
    lines = [head, "-" * len(head)]
    for c in cases:
        lines.append(
            f"{c.direction:<9} {_fmt_size(c.layer_block_bytes):>11} {c.limit_gbps:>10.2f} "
            f"{c.kvtier_gbps:>11.2f} {c.loop_gbps:>9.2f} {c.vs_limit:>11.2f}x "
            f"{c.vs_loop:>10.1f}x"
        )
    return "\n".join(lines)


def write_plot(cases: list[Case], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'kvtier-npu-copy[plot]'") from e
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, direction in zip(axes, ("store", "load")):
        sel = [c for c in cases if c.direction == direction]
        xs = range(len(sel))
        width = 0.27
        for k, (name, attr) in enumerate(
            [("limit", "limit_gbps"), ("kvtier", "kvtier_gbps"), ("loop", "loop_gbps")]
        ):
            ax.bar(
                [x + (k - 1) * width for x in xs],
                [getattr(c, attr) for c in sel],
                width,
                label=name,
            )
        ax.set_xticks(list(xs), [_fmt_size(c.layer_block_bytes) for c in sel])
        ax.set_title(direction)
        ax.set_xlabel("bytes per block per layer")
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvtier-copy-bench",
        description="kvtier block copies vs one contiguous copy (limit) vs per-block loop.",
    )
    parser.add_argument("--device", help="cpu, cuda, npu, ... (default: accelerator, else cpu)")
    parser.add_argument(
        "--sizes",
        default=",".join(str(s) for s in DEFAULT_SIZES),
        help="per-layer block sizes in bytes, comma separated (default: 4/64/512 KiB)",
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=64, help="blocks per transfer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads for all methods"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the cases as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    args = parser.parse_args(argv)

    if args.device:
        if args.device.startswith("npu"):
            import_npu_backend()
        device = torch.device(args.device)
    else:
        device = default_device()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    gen = torch.Generator().manual_seed(args.seed)
    copier = native.source() if device.type == "cpu" else "unused"
    print(
        f"kvtier-copy-bench {__version__}: device {device}, torch {torch.__version__}, "
        f"{threads} threads, {args.layers} layers, {args.blocks} scattered blocks, "
        f"best of {args.repeats}, native copier {copier}",
        flush=True,
    )
    progress = ProgressBar(len(sizes) * 2 * args.repeats)
    cases: list[Case] = []
    try:
        for size in sizes:
            cases += run_size(
                device,
                size,
                layers=args.layers,
                blocks=args.blocks,
                repeats=args.repeats,
                generator=gen,
                progress=progress,
            )
    finally:
        progress.close()
    print(format_table(cases))
    print(format_bar(cases))
    if args.json:
        meta = {
            "device": str(device),
            "torch": torch.__version__,
            "kvtier_npu_copy": __version__,
            "threads": threads,
            "layers": args.layers,
            "blocks": args.blocks,
            "repeats": args.repeats,
            "native_copier": copier,
        }
        with open(args.json, "w") as f:
            json.dump({"cases": [asdict(c) for c in cases], "meta": meta}, f, indent=2)
    if args.plot:
        write_plot(cases, args.plot, f"kvtier-copy-bench on {device}, {threads} threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
