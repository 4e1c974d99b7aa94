"""Free-block bookkeeping that hands out contiguous runs of block ids.

Copies of consecutive host blocks coalesce into one DMA, so the allocator keeps
free blocks as maximal runs ``[start, end)`` and serves a request of ``n`` blocks
from one run of at least ``n`` when there is one. Runs are bucketed by
``floor(log2(length))``; a bit mask of non-empty buckets finds a big-enough run in
O(1). Freed blocks merge with their neighbours at once, so fragmentation heals.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable


class RunAllocator:
    """Allocate and free host block ids ``0 .. num_blocks-1`` in contiguous runs."""

    __slots__ = ("_buckets", "_by_end", "_by_start", "_mask", "num_blocks", "num_free")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_free = 0
        self._by_start: dict[int, int] = {}  # start -> end (exclusive)
        self._by_end: dict[int, int] = {}  # end (exclusive) -> start
        self._buckets: list[set[int]] = [set() for _ in range(max(1, num_blocks).bit_length())]
        self._mask = 0  # bit k set <=> bucket k holds a run
        if num_blocks > 0:
            self._add_run(0, num_blocks)
            self.num_free = num_blocks

    def _add_run(self, start: int, end: int) -> None:
        self._by_start[start] = end
        self._by_end[end] = start
        k = (end - start).bit_length() - 1
        self._buckets[k].add(start)
        self._mask |= 1 << k

    def _drop_run(self, start: int, end: int) -> None:
        del self._by_start[start]
        del self._by_end[end]
        k = (end - start).bit_length() - 1
        bucket = self._buckets[k]
        bucket.discard(start)
        if not bucket:
            self._mask &= ~(1 << k)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, as few runs as possible, each run's ids ascending.

        Blocks are cut from the end of a run, so the run keeps its start (and
        usually its bucket): three dict updates in the common case. Where no run holds
        what is still wanted, the longest goes whole, the first in its bucket's order
        among equals; the longest bucket's runs are ranked once for that (as many as
        may be taken), not searched once per run taken: ``r`` runs out of ``R``
        scattered ones cost ``R log r``, not ``r * R``.
        """
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks, {self.num_free} free")
        self.num_free -= n
        by_start, by_end = self._by_start, self._by_end
        out: list[int] = []
        ranked: list[int] = []  # the longest bucket's runs, longest first
        taken = 0  # of ranked
        while n > 0:
            start = self._fit(n)
            if start is None:  # no run holds n: take the longest whole
                if taken == len(ranked):
                    b = self._mask.bit_length() - 1
                    bucket = self._buckets[b]
                    # Its runs hold 2 ** b blocks at least: this many may be taken.
                    most = min(len(bucket), -(-n >> b))
                    # Among equals, the bucket's order (stable, as max() picks), and in
                    # bucket 0 every run is one block long.
                    ranked = (
                        list(itertools.islice(bucket, most))
                        if b == 0
                        else heapq.nlargest(most, bucket, key=lambda s: by_start[s] - s)
                    )
                    taken = 0
                start = ranked[taken]
                taken += 1
            end = by_start[start]
            length = end - start
            if length <= n:
                self._drop_run(start, end)
                out += range(start, end)
                n -= length
                continue
            cut = end - n
            by_start[start] = cut
            del by_end[end]
            by_end[cut] = start
            old_k = length.bit_length() - 1
            new_k = (cut - start).bit_length() - 1
            if new_k != old_k:
                bucket = self._buckets[old_k]
                bucket.discard(start)
                if not bucket:
                    self._mask &= ~(1 << old_k)
                self._buckets[new_k].add(start)
                self._mask |= 1 << new_k
            out += range(cut, end)
            break
        return out

    def _fit(self, n: int) -> int | None:
        """Start of a run of >= n blocks, or None if there is none."""
        k = n.bit_length() - 1
        # Bucket k holds lengths [2^k, 2^(k+1)); it fits n for sure only if n == 2^k.
        first = k if n == 1 << k else k + 1
        mask = self._mask >> first
        if mask:
            b = first + (mask & -mask).bit_length() - 1
            return next(iter(self._buckets[b]))
        if n != 1 << k and self._mask >> k & 1:
            for start in self._buckets[k]:
                if self._by_start[start] - start >= n:
                    return start
        return None

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks; neighbouring free runs merge."""
        ids = sorted(block_ids)
        i = 0
        count = len(ids)
        while i < count:
            start = ids[i]
            end = start + 1
            i += 1
            while i < count and ids[i] == end:
                end += 1
                i += 1
            self._free_run(start, end)
        self.num_free += count

    def free_one(self, block_id: int) -> None:
        self._free_run(block_id, block_id + 1)
        self.num_free += 1

    def _free_run(self, start: int, end: int) -> None:
        left = self._by_end.get(start)
        if left is not None:
            self._drop_run(left, start)
            start = left
        right = self._by_start.get(end)
        if right is not None:
            self._drop_run(end, right)
            end = right
        self._add_run(start, end)

    def runs(self) -> list[tuple[int, int]]:
        """Free runs as sorted ``(start, end)`` pairs (for tests and stats)."""
        return sorted(self._by_start.items())
