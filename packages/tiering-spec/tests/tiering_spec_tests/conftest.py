"""Shared fixtures. kvtier-testkit is used by the end-to-end tests; in the monorepo it is
found from the working tree when it is not installed."""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

try:
    import kvtier.testkit  # noqa: F401
except ImportError:  # pragma: no cover - depends on how the tests are run
    _src = Path(__file__).resolve().parents[3] / "testkit" / "src"
    if _src.is_dir():
        sys.path.append(str(_src))

from kvtier.tiering_spec.config import FsTierConfig
from kvtier.tiering_spec.fstier import FileSystemTier

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


@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator[object]:
    made: list[FileSystemTier] = []

    def make(
        region: Region,
        *,
        root: Path | None = None,
        capacity: int | None = None,
        world_size: int = 1,
        threads: int = 2,
        **layout_extra: object,
    ) -> FileSystemTier:
        cfg = FsTierConfig(
            root_dir=str(root or tmp_path / "fs"),
            n_read_threads=threads,
            n_write_threads=threads,
            capacity_bytes=capacity,
        )
        tier = FileSystemTier(
            cfg,
            layouts(world_size, **layout_extra),
            region.payload,
            region.views,
            enable_events=True,
        )
        made.append(tier)
        assert tier.wait_scan(30), "the start-up scan did not finish"
        return tier

    yield make
    for t in made:
        t.shutdown()


def wait_results(tier: FileSystemTier, n: int = 1, timeout: float = 20.0) -> list:
    """Poll until ``n`` read/write results arrived."""
    import time

    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += [r for r in tier.poll() if r.op in ("read", "write")]
        if len(out) < n:
            time.sleep(0.002)
    assert len(out) >= n, f"only {len(out)} of {n} fs jobs finished within {timeout} s"
    return out


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")
