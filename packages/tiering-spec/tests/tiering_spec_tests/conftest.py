"""Fixtures of the tiering spec's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.tiering_spec.config import FsTierConfig
from kvtier.tiering_spec.tiers.fs.tier import FileSystemTier

from .tier_support import Region, layouts


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
        eviction_policy: str = "frecency",
        take_scan: bool = True,
        **layout_extra: object,
    ) -> FileSystemTier:
        cfg = FsTierConfig(
            root_dir=str(root or tmp_path / "fs"),
            n_read_threads=threads,
            n_write_threads=threads,
            capacity_bytes=capacity,
            eviction_policy=eviction_policy,
        )
        tier = FileSystemTier(
            cfg,
            layouts(world_size, **layout_extra),
            region.payload,
            region.views,
            enable_events=True,
        )
        made.append(tier)
        if take_scan:
            assert tier.wait_scan(30), "the start-up scan did not finish"
        return tier

    yield make
    for t in made:
        t.shutdown()
