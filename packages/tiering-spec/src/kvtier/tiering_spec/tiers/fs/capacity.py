"""The fs tier's capacity: the bytes its files may take, which files go when room is
needed, how a full disk lowers the bound and the free space it shows later raises it
again, and the writes that make that room: one at a time, or a job's writes together
(one eviction call for all of them, one task per write thread: the scheduler thread
pays a few Python calls per job, not per block).

:class:`TierCapacity` is a part of :class:`~kvtier.tiering_spec.tiers.fs.tier.
FileSystemTier` (a mixin): it works on the tier's index (:class:`~kvtier.tiering_spec.
tiers.fs.index.FsIndex`) and its bound (:class:`~kvtier.tiering_spec.tiers.fs.index.
FsCapacity`) on the scheduler thread, and hands the files it evicts to the tier's
removal (``_unlink``). The arithmetic itself is in ``index`` (no I/O).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.tiering_spec.errors import ConfigError
from kvtier.tiering_spec.tiers.base import JobBook, TierFault, TierJob, TierResult, TierStats
from kvtier.tiering_spec.tiers.fs.format import HEADER_SIZE, key_digest
from kvtier.tiering_spec.tiers.fs.index import FsCapacity, FsEntry, FsIndex
from kvtier.tiering_spec.tiers.fs.pool import IoThreads

if TYPE_CHECKING:
    from kvtier.tiering_spec.tier_config import TierConfig

logger = logging.getLogger("kvtier.tiering_spec")

# Without capacity_bytes the tier may fill this share of the free space it found.
DEFAULT_FREE_FRACTION = 0.5
# Entries one call evicts at most to bring the tier back within a capacity it went over
# (files indexed from disk, a capacity lowered or recomputed); the rest go at the next
# polls, and writes wait until the excess is within this (each entry costs a few µs of
# the scheduler's thread: 100,000 at once were about 0.3 s).
TRIM_ENTRIES = 256


class TierCapacity:
    """Budget and eviction of the fs tier's files (see the module docstring)."""

    name: str
    entry_bytes: int
    world_size: int
    payload_bytes: int
    enable_events: bool
    stats: TierStats
    _index: FsIndex
    _capacity: FsCapacity
    _free_at_start: int
    # Free bytes seen by the last write that found the disk full, and by the
    # background thread while the capacity is lowered (None: not looked).
    _free_seen: int | None
    _reading: dict[bytes, int]
    _writing: set[bytes]
    _unlinking: dict[bytes, int]
    _reusing: dict[bytes, bytes]
    _inflight: int
    _io: IoThreads
    cfg: TierConfig
    _retried: set[bytes]
    _closed: bool
    _views: Sequence[memoryview] | None
    _events: list[tuple[bool, list[bytes]]]

    if TYPE_CHECKING:

        def _unlink(self, digest: bytes) -> None: ...

        def _unlinked(self, digest: bytes) -> None: ...

        def _fault(self, kind: TierFault, res: TierResult) -> None: ...

        def _submit(self, kind: str, fn: Callable[..., Any], *args: Any) -> None: ...

        def _write_task(self, *args: Any, **kwargs: Any) -> None: ...

        def _write_tasks(self, *args: Any) -> None: ...

        def _submit_reads(self, items: Sequence[tuple[bytes, bytes, int]]) -> list[bool]: ...

        def _views_now(self) -> Sequence[memoryview] | None: ...

        def _job_book(self) -> JobBook: ...

    @property
    def capacity_bytes(self) -> int | None:
        """The bytes of files the tier may hold now (None: no bound)."""
        return self._capacity.current

    @property
    def target_capacity(self) -> int | None:
        """What ``capacity_bytes`` returns to after a full disk lowered it."""
        return self._capacity.target

    def _check_capacity(self) -> None:
        """Refuse a ``capacity_bytes`` below one entry (before any folder is made)."""
        if self.capacity_bytes is not None and self.capacity_bytes < self.entry_bytes:
            raise ConfigError(
                f"capacity_bytes={self.capacity_bytes} of fs tier {self.name!r} cannot hold "
                f"one entry: {self.entry_bytes} bytes ({self.world_size} rank file(s) of a "
                f"{HEADER_SIZE}-byte header plus a {self.payload_bytes}-byte "
                f"chunk); allowed: at least {self.entry_bytes}"
            )

    def _default_capacity(self, held: int) -> int:
        """Half the free space at start plus what this tier's files already hold, at
        least one entry."""
        return max(self.entry_bytes, int(DEFAULT_FREE_FRACTION * (self._free_at_start + held)))

    def _over_capacity(self) -> int:
        """Entries beyond the capacity, with the writes in flight (0 within it)."""
        cap = self.capacity_bytes
        if cap is None:
            return 0
        over = self._index.used + self._index.reserved - cap
        return -(-over // self.entry_bytes) if over > 0 else 0

    def _trim(self) -> None:
        """Evict toward the capacity, ``TRIM_ENTRIES`` entries at most (never ones being
        read; scheduler thread)."""
        over = self._over_capacity()
        if over:
            reading = self._reading
            evicted = self._index.evict(min(over, TRIM_ENTRIES), reading.__contains__)
            if evicted:
                self._forget_evicted(evicted, 0)

    def _make_room(
        self, nbytes: int, protect: bytes | None = None, *, reuse: int = 0, bounded: bool = True
    ) -> tuple[bool, list[bytes]]:
        """Evict the entries the policy picks (never ones being read) until ``nbytes``
        more fit. Returns (whether they fit, evicting nothing more when they cannot; up
        to ``reuse`` evicted entries, the policy's first first, whose files the caller's
        writes take over instead of creating new ones). A reused digest stays in
        ``_unlinking`` until the write that takes it over is polled. While the tier is
        over its capacity by more than ``TRIM_ENTRIES`` nothing fits (unless not
        ``bounded``): the excess is trimmed at the polls (:meth:`_trim`), not by one
        write."""
        if bounded and self._over_capacity() > TRIM_ENTRIES:
            return False, []
        reading = self._reading
        evicted = self._index.make_room(
            nbytes, self.capacity_bytes, lambda digest: digest in reading or digest == protect
        )
        if evicted is None:
            return False, []
        return True, self._forget_evicted(evicted, reuse)

    def _forget_evicted(self, evicted: Sequence[tuple[bytes, FsEntry]], reuse: int) -> list[bytes]:
        """Count and remove the files of ``evicted`` entries, but for the first ``reuse``
        of them, which the caller's writes take over (returned)."""
        removed_keys: list[bytes] = []
        reused: list[bytes] = []
        for digest, entry in evicted:
            self.stats.evictions += 1
            if entry.key is not None:
                removed_keys.append(entry.key)
            if len(reused) < reuse and entry.nbytes == self.entry_bytes:
                reused.append(digest)
                self._unlinking[digest] = self._unlinking.get(digest, 0) + 1
            else:
                self._unlink(digest)
        if removed_keys and self.enable_events:
            self._events.append((True, removed_keys))
        return reused

    def submit_write(self, key: bytes, digest: bytes, block_id: int) -> bool:
        """Write host block ``block_id`` (all ranks) as ``key``. False if not submitted:
        already present, no room under ``capacity_bytes``, or the region is not mapped."""
        started = self._submit_writes([(key, digest, block_id)])
        if started is None:  # no room, or the region is not mapped
            self.stats.writes_dropped += 1
            return False
        return started[0]

    def submit(self, job: TierJob) -> list[bool]:
        """A job's writes reserve their room together and go to the write threads in
        one task per thread (see :meth:`_submit_writes`), and its reads go to the read
        threads so (``_submit_reads``); writes that do not all fit start item by item
        (``SecondaryTier.submit``)."""
        if job.op == "read":
            reads = self._submit_reads(job.items)
            self._job_book().started(job, reads)
            return reads
        started = None if job.op != "write" else self._submit_writes(job.items)
        if started is None:
            return super().submit(job)  # type: ignore[misc, no-any-return]
        self._job_book().started(job, started)
        return started

    def submit_all(self, jobs: Sequence[TierJob]) -> list[list[bool]] | None:
        """A step's write jobs reserve their room together and go to the write threads
        in one task per thread: what submitting them in turn starts, with one eviction
        call and one hand-over for all (:meth:`_submit_writes`). None, changing nothing,
        where some are no write jobs or they do not all fit at once."""
        if any(job.op != "write" for job in jobs):
            return None
        started = self._submit_writes([item for job in jobs for item in job.items])
        if started is None:
            return None
        return self._job_book().started_all(jobs, started)

    def _submit_writes(self, items: Sequence[tuple[bytes, bytes, int]]) -> list[bool] | None:
        """Start the write of every item (key, digest, host block) not already indexed,
        written or being removed, with the room for all of them made at once (the same
        entries evicted, the same files taken over, as item by item): whether each
        started. None, changing nothing, when they do not all fit or the region is not
        mapped (item by item, the first ones may fit)."""
        if self._closed:
            return [False] * len(items)
        index, writing, unlinking = self._index, self._writing, self._unlinking
        table = index.table
        started: list[bool] = []
        wanted: list[tuple[bytes, bytes, int]] = []
        for item in items:
            digest = item[1]
            if digest in table or digest in writing or digest in unlinking:
                started.append(False)
                continue
            writing.add(digest)  # (a digest twice in the job starts once, as item by item)
            wanted.append(item)
            started.append(True)
        if not wanted:
            return started
        views = self._views_now()
        fits, reused = (
            (False, [])
            if views is None
            else self._make_room(len(wanted) * self.entry_bytes, reuse=len(wanted))
        )
        if not fits:
            writing.difference_update(digest for _key, digest, _block in wanted)
            return None
        index.reserved += len(wanted) * self.entry_bytes
        # The first writes take over the evicted files ``reused`` names, one each.
        writes = [(*item, reuse) for item, reuse in itertools.zip_longest(wanted, reused)]
        for _key, digest, _block, reuse in writes:
            if reuse is not None:
                self._reusing[digest] = reuse
        self._inflight += len(writes)
        self._io.put_shares("write", self._write_tasks, writes, views)
        return started

    def _writes_ended(self, digests: Sequence[bytes]) -> None:
        """End the writes of ``digests``, landed or failed: no longer being written,
        the files they took over gone from the books, their room's reservation ended."""
        self._writing.difference_update(digests)
        reusing = self._reusing
        if reusing:
            for digest in digests:
                reused = reusing.pop(digest, None)
                if reused is not None:
                    self._unlinked(reused)
        self._index.reserved -= len(digests) * self.entry_bytes

    def _writes_landed(self, written: Sequence[TierResult], out: list[TierResult]) -> None:
        """Apply writes that succeeded (``poll``, in the order they landed), together:
        what applying each alone does. Each ends its write and its room's reservation,
        indexes its entry, a KV event where enabled, its counters; each is handed back
        in ``out``."""
        self._inflight -= len(written)
        digests = [res.digest or key_digest(res.key) for res in written]
        self._writes_ended(digests)
        if self._retried:
            self._retried.difference_update(digests)
        self._index.add_all([(digest, res.key) for digest, res in zip(digests, written)])
        if self.enable_events:
            self._events.extend((False, [res.key]) for res in written)
        stats = self.stats
        stats.writes += len(written)
        nbytes, seconds = stats.write_bytes, stats.write_seconds
        for res in written:  # (in order: the same sums as one at a time)
            nbytes += res.nbytes
            seconds += res.seconds
        stats.write_bytes, stats.write_seconds = nbytes, seconds
        out.extend(written)

    def _forget(self, digest: bytes, key: bytes | None, unlink: bool) -> None:
        """Drop ``digest`` from the index (a KV event where enabled), removing its
        files with ``unlink``."""
        entry = self._index.remove(digest)
        if entry is not None and self.enable_events and (entry.key or key):
            self._events.append((True, [entry.key or key]))  # type: ignore[list-item]
        if unlink:
            self._unlink(digest)

    def _retry_on_full_disk(self, res: TierResult, digest: bytes) -> bool:
        """The disk filled up before the tier's capacity did: hold no more than this
        tier's files plus what the disk shows free (never less than ``FsCapacity.floor``;
        logged), evict least recently used entries down to that, and write once more.
        The capacity grows back as the disk shows room again (:meth:`_regrow`). False
        (not retried) for a second failure of the same write, or when no room can be
        made."""
        if digest in self._retried or self._closed or self._views is None:
            self._retried.discard(digest)
            return False
        free = self._free_seen or 0
        before = self.capacity_bytes
        if self._capacity.lower_for_full_disk(self._index.used, free):
            logger.warning(
                "kvtier fs tier %r: the disk is full (%d bytes free) with %d bytes of this "
                "tier's files; capacity lowered from %s to %d bytes until the disk shows "
                "room again, least recently used files evicted",
                self.name,
                free,
                self._index.used,
                before,
                self.capacity_bytes,
            )
        # (Unbounded: the excess of a capacity lowered to the tier's files and the free
        # space is at most the writes in flight, and this write is retried once.)
        if not self._make_room(self.entry_bytes, bounded=False)[0]:
            return False
        self._fault(TierFault.DISK_FULL, res)
        self._retried.add(digest)
        self._writing.add(digest)
        self._index.reserved += self.entry_bytes
        self._submit("write", self._write_task, res.key, digest, res.block_id, self._views)
        return True

    def _regrow(self) -> None:
        """After a full disk: raise the capacity toward its target as far as the room the
        background thread last saw allows (scheduler thread)."""
        free, self._free_seen = self._free_seen or 0, None
        before = self.capacity_bytes
        if self._capacity.regrow(self._index.used, self._index.reserved, free):
            logger.info(
                "kvtier fs tier %r: the disk shows %d bytes free again; capacity raised from "
                "%s to %s bytes (target %s)",
                self.name,
                free,
                before,
                self.capacity_bytes,
                self.target_capacity,
            )
