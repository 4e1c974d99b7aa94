"""The host regions: their names, the one region every rank of a replicated layout maps
(rank 0 creates it, the others wait for it), and the secondary tiers' mappings of every
copy. No vLLM import."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

from kvtier.blockpool import HostRegion

# How long a worker rank waits for rank 0 to create the one host region that every rank
# of a replicated layout maps; ranks start their workers at about the same time.
REPLICA_WAIT_S = 120.0


def region_name(engine_id: str, rank: int) -> str:
    """The shared host region of ``rank`` of the engine ``engine_id``."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:150] or "engine"
    return f"tiering-{safe}-r{rank}"


def replica_region(engine_id: str, rank: int, num_chunks: int, chunk_bytes: int) -> HostRegion:
    """The one host region of a replicated layout: rank 0 creates it, the other ranks
    map it, waiting for rank 0 as long as ``REPLICA_WAIT_S``."""
    name = region_name(engine_id, 0)
    if rank == 0:
        return HostRegion.create_shared(name, num_chunks, chunk_bytes)
    try:
        return HostRegion.attach_shared(name, num_chunks, chunk_bytes, wait_s=REPLICA_WAIT_S)
    except FileNotFoundError as exc:
        raise RuntimeError(
            f"kvtier: worker rank {rank} waited {REPLICA_WAIT_S:g} s for rank 0 to "
            f"create the host region {exc.filename} that all ranks share (vLLM reports "
            "the KV replicated across ranks); rank 0's worker did not start or failed "
            "first: see its log"
        ) from None


def attach_regions(
    engine_id: str, num_copies: int, num_chunks: int, chunk_bytes: int
) -> list[HostRegion] | None:
    """Map every copy's host region, one per rank or the one of a replicated layout
    (None while a worker has not created its own)."""
    regions: list[HostRegion] = []
    try:
        for rank in range(num_copies):
            regions.append(
                HostRegion.attach_shared(
                    region_name(engine_id, rank), num_chunks, chunk_bytes, pin=False
                )
            )
    except FileNotFoundError:
        for r in regions:
            r.close()
        return None
    return regions


class AttachedRegions:
    """The host regions of every copy, as the secondary tiers read and write them:
    attached on first use (by the scheduler, or a store tier's connect thread), once,
    and closed at shutdown.

    Args:
        attach: maps the regions, or returns None while a worker has not created its own.
    """

    def __init__(self, attach: Callable[[], list[HostRegion] | None]) -> None:
        self._attach = attach
        self._lock = threading.Lock()
        self._regions: list[HostRegion] = []
        self._views: list[memoryview] | None = None

    def views(self) -> list[memoryview] | None:
        """One writable byte view per copy, or None while they cannot be mapped yet."""
        with self._lock:
            if self._views is None:
                regions = self._attach()
                if regions is None:
                    return None
                self._regions = regions
                self._views = [r.tensor.numpy().data.cast("B") for r in regions]
            return self._views

    def close(self) -> None:
        with self._lock:
            for region in self._regions:
                region.close()
            self._regions = []
            self._views = None
