"""Store admission: a host block pool that stores a key only once it was asked for
often enough, so that keys seen once do not evict keys that are reused.

The pool knows nothing of it: ``StoreAdmissionFilter`` wraps a ``HostBlockPool`` and
changes what its own ``lookup`` and ``prepare_store`` do; every other operation is
the pool's, called on ``filter.pool``. Units: keys (one key is one block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping, Sequence
from types import MappingProxyType

from kvtier.blockpool.budget import require_positive_int
from kvtier.blockpool.pool import HostBlockPool, StorePlan

DEFAULT_MAX_TRACKER_SIZE = 64_000
"""Keys whose counts a filter remembers unless told otherwise."""


class StoreAdmissionFilter:
    """A pool behind an admission filter: a key that is not in the pool is stored only
    once it has been seen ``threshold`` times (by ``lookup`` or ``record``).

    Counts live in an LRU table of at most ``max_tracker_size`` keys, so the filter's
    memory is bounded whatever the traffic. ``stores_skipped`` counts the keys that
    ``prepare_store`` left out for not being admitted yet.

    Args:
        pool: the pool it stores into.
        threshold: times a key must be seen before it is stored (vLLM's
            ``store_threshold``; vLLM builds no filter below 2, nor should callers).
        max_tracker_size: keys whose counts are remembered.
    """

    __slots__ = ("_counts", "max_tracker_size", "pool", "stores_skipped", "threshold")

    def __init__(
        self,
        pool: HostBlockPool,
        threshold: int,
        max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
    ) -> None:
        self.pool = pool
        self.threshold = require_positive_int("store_threshold", threshold)
        self.max_tracker_size = require_positive_int("max_tracker_size", max_tracker_size)
        self.stores_skipped = 0
        self._counts: OrderedDict[Hashable, int] = OrderedDict()

    def record(self, keys: Sequence[Hashable]) -> None:
        """Count one more sighting of each of ``keys`` (the newest are forgotten last)."""
        counts = self._counts
        for key in keys:
            counts[key] = counts.pop(key, 0) + 1
        while len(counts) > self.max_tracker_size:
            counts.popitem(last=False)

    def admits(self, key: Hashable) -> bool:
        """Whether ``key`` has been seen ``threshold`` times (among the remembered keys)."""
        return self._counts.get(key, 0) >= self.threshold

    @property
    def counts(self) -> Mapping[Hashable, int]:
        """The remembered keys' counts, oldest first (read-only)."""
        return MappingProxyType(self._counts)

    def __len__(self) -> int:
        """Keys whose counts are remembered now."""
        return len(self._counts)

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """Record ``keys`` as seen, then the pool's ``lookup``: the number of leading
        ``keys`` cached and readable now."""
        self.record(keys)
        return self.pool.lookup(keys)

    def prepare_store(
        self, keys: Sequence[Hashable], keep: Collection[Hashable] = ()
    ) -> StorePlan | None:
        """The pool's ``prepare_store`` of ``keys`` without the new keys not admitted
        yet; those are counted once each in ``stores_skipped``. Keys already in the
        pool stay in the call, so its eviction still spares them."""
        pool = self.pool
        refused = {k for k in keys if pool.block_of(k) is None and not self.admits(k)}
        if refused:
            self.stores_skipped += len(refused)
            keys = [k for k in keys if k not in refused]
        return pool.prepare_store(keys, keep)
