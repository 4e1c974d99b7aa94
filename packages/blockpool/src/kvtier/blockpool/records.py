"""What the host block pool hands out and the states of its blocks: ``StorePlan``,
``CacheEvent``, ``PoolStats``, the blocks-per-store histogram's buckets, and the
state codes of a block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

FREE, KEYED, OWNED = 0, 1, 2  # KEYED: storing or cached, told apart by the key map

# Upper bounds of the blocks-per-store histogram (powers of 4), then +Inf. A store of n
# blocks falls in bucket ceil(log4(n)).
ALLOCATION_BUCKETS: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class StorePlan(NamedTuple):
    """What ``prepare_store`` decided.

    Attributes:
        keys: the keys to write, in request order (keys already present dropped).
        block_ids: host block for each of ``keys``; write them, then ``complete_store(keys)``.
        evicted: keys evicted to make room (their blocks are reused).
    """

    keys: list[Any]
    block_ids: list[int]
    evicted: list[Any]


@dataclass(frozen=True)
class CacheEvent:
    """Keys that entered (``stored``) or left (``removed``) the keyed cache."""

    kind: str  # "stored" | "removed"
    keys: tuple[Any, ...]


@dataclass
class PoolStats:
    """A snapshot of the pool. Fractions are of the pool's capacity in blocks.

    ``holds`` counts holds by kind (``Hold``'s value; a block held twice counts
    twice): the kinds a cached block is held for always, the others while taken; a
    kind not listed reads 0.
    """

    capacity: int
    free: int
    storing: int
    cached: int
    owned: int
    read_pinned: int
    write_pinned: int
    allocation_histogram: list[int] = field(default_factory=list)
    holds: dict[str, int] = field(default_factory=dict)

    @property
    def usage(self) -> float:
        return (self.capacity - self.free) / self.capacity if self.capacity else 0.0

    @property
    def read_usage(self) -> float:
        return self.read_pinned / self.capacity if self.capacity else 0.0

    @property
    def write_usage(self) -> float:
        return self.write_pinned / self.capacity if self.capacity else 0.0
