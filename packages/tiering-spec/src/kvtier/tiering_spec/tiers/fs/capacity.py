"""The fs tier's capacity: the bytes its files may take, which files go when room is
needed, and how a full disk lowers the bound and the free space it shows later raises
it again.

:class:`TierCapacity` is a part of :class:`~kvtier.tiering_spec.tiers.fs.tier.
FileSystemTier` (a mixin): it works on the tier's index (:class:`~kvtier.tiering_spec.
tiers.fs.index.FsIndex`) and its bound (:class:`~kvtier.tiering_spec.tiers.fs.index.
FsCapacity`) on the scheduler thread, and hands the files it evicts to the tier's
removal (``_unlink``). The arithmetic itself is in ``index`` (no I/O).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.tiering_spec.tiers.base import TierFault, TierResult, TierStats
from kvtier.tiering_spec.tiers.fs.index import FsCapacity, FsIndex

logger = logging.getLogger("kvtier.tiering_spec")

# Without capacity_bytes the tier may fill this share of the free space it found.
DEFAULT_FREE_FRACTION = 0.5


class TierCapacity:
    """Budget and eviction of the fs tier's files (see the module docstring)."""

    name: str
    entry_bytes: int
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
    _retried: set[bytes]
    _closed: bool
    _views: Sequence[memoryview] | None
    _events: list[tuple[bool, list[bytes]]]

    if TYPE_CHECKING:

        def _unlink(self, digest: bytes) -> None: ...

        def _fault(self, kind: TierFault, res: TierResult) -> None: ...

        def _submit(self, kind: str, fn: Callable[..., Any], *args: Any) -> None: ...

        def _write_task(self, *args: Any, **kwargs: Any) -> None: ...

    @property
    def capacity_bytes(self) -> int | None:
        """The bytes of files the tier may hold now (None: no bound)."""
        return self._capacity.current

    @property
    def target_capacity(self) -> int | None:
        """What ``capacity_bytes`` returns to after a full disk lowered it."""
        return self._capacity.target

    def _default_capacity(self, held: int) -> int:
        """Half the free space at start plus what this tier's files already hold, at
        least one entry."""
        return max(self.entry_bytes, int(DEFAULT_FREE_FRACTION * (self._free_at_start + held)))

    def _make_room(
        self, nbytes: int, protect: bytes | None = None, *, reuse: bool = False
    ) -> tuple[bool, bytes | None]:
        """Evict the entries the policy picks (never ones being read) until ``nbytes``
        more fit. Returns (whether they fit, evicting nothing more when they cannot;
        with ``reuse``, one evicted entry whose files the caller's write takes over
        instead of creating new ones, or None). A reused digest stays in
        ``_unlinking`` until that write is polled."""
        reading = self._reading
        evicted = self._index.make_room(
            nbytes, self.capacity_bytes, lambda digest: digest in reading or digest == protect
        )
        if evicted is None:
            return False, None
        removed_keys: list[bytes] = []
        reused: bytes | None = None
        for digest, entry in evicted:
            self.stats.evictions += 1
            if entry.key is not None:
                removed_keys.append(entry.key)
            if reuse and reused is None and entry.nbytes == self.entry_bytes:
                reused = digest
                self._unlinking[digest] = self._unlinking.get(digest, 0) + 1
            else:
                self._unlink(digest)
        if removed_keys and self.enable_events:
            self._events.append((True, removed_keys))
        return True, reused

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
        if not self._make_room(self.entry_bytes)[0]:
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
