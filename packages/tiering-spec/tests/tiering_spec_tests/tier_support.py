"""Helpers of the fs tier's tests: host blocks as the tier sees them, and waiting for
its results."""

from __future__ import annotations

import mmap
import time
from collections.abc import Sequence

from kvtier.tiering_spec.tiers.fs.tier import FileSystemTier

PAYLOAD = 8192  # bytes of one rank's host block in the unit tests


def layouts(world_size: int = 1, **extra: object) -> list[dict[str, object]]:
    return [
        {"model": "unit", "dtype": "float32", "rank": r, "world_size": world_size, **extra}
        for r in range(world_size)
    ]


class Region:
    """Host blocks of every rank as bytearrays, the way the fs tier sees a region."""

    def __init__(self, num_blocks: int, world_size: int = 1, payload: int = PAYLOAD) -> None:
        self.payload = payload
        # mmap: page aligned, as a host region is (O_DIRECT needs aligned buffers)
        self.ranks = [mmap.mmap(-1, num_blocks * payload) for _ in range(world_size)]

    def views(self) -> Sequence[memoryview]:
        return [memoryview(r) for r in self.ranks]

    def block(self, rank: int, block: int) -> bytes:
        return bytes(self.ranks[rank][block * self.payload : (block + 1) * self.payload])

    def fill(self, rank: int, block: int, seed: int) -> bytes:
        data = (seed.to_bytes(4, "little") * (self.payload // 4))[: self.payload]
        self.ranks[rank][block * self.payload : (block + 1) * self.payload] = data
        return data


def wait_results(tier: FileSystemTier, n: int = 1, timeout: float = 20.0) -> list:
    """Poll until ``n`` read/write results arrived."""
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += [r for r in tier.poll() if r.op in ("read", "write")]
        if len(out) < n:
            time.sleep(0.002)
    assert len(out) >= n, f"only {len(out)} of {n} fs jobs finished within {timeout} s"
    return out
