"""The fs tier's index: which files the tier holds, the bytes they and the writes in
flight take, which files go first when room is needed, and how a full disk moves the
capacity. No I/O and no threads: the tier calls it from the scheduler thread, and
property tests drive it alone."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import NamedTuple, cast

from kvtier.blockpool.policies import finish_request, make_policy


class FsEntry(NamedTuple):
    """One indexed file (all ranks' files of one key): its bytes, and its key where the
    tier wrote it (None for a file found on disk, whose key is only in its header)."""

    nbytes: int
    key: bytes | None


class FsIndex:
    """Entries by digest, ordered by an eviction policy of kvtier-blockpool.

    ``used`` is the bytes of the entries, ``reserved`` the bytes of writes in flight;
    a capacity bounds their sum (``make_room``). Every entry takes ``entry_bytes``.

    Args:
        entry_bytes: bytes of one entry.
        policy: the eviction policy's name (``lru``, ``arc``, ``frecency``).
        capacity_entries: the capacity in entries the policy is sized for.
    """

    def __init__(self, entry_bytes: int, policy: str, capacity_entries: int) -> None:
        self.entry_bytes = entry_bytes
        self.used = 0
        self.reserved = 0
        # digest -> (bytes, key): a plain tuple of a number and bytes, which the garbage
        # collector stops tracking, so a full collection does not visit every file of
        # a large tier (an object, or a named tuple, it would visit each time).
        self._entries: dict[bytes, tuple[int, bytes | None]] = {}
        # The same dict, to read membership from without a call (``digest in
        # index.table``: no Python frame, where ``digest in index`` makes one).
        self.table: Mapping[bytes, tuple[int, bytes | None]] = self._entries
        self._policy = make_policy(policy, max(1, capacity_entries))
        self._insert_each = getattr(self._policy, "insert_each", None)
        # Raised whenever a digest is added or removed: equal counts, the same digests.
        self.changes = 0

    def __contains__(self, digest: object) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    def add(self, digest: bytes, key: bytes | None) -> None:
        """Index ``digest`` (not indexed yet), the newest entry."""
        self.add_all(((digest, key),))

    def add_all(self, entries: Sequence[tuple[bytes, bytes | None]]) -> None:
        """:meth:`add` each (digest, key) of ``entries`` (none indexed yet), in order:
        the policy sees each stored on its own."""
        table, nbytes = self._entries, self.entry_bytes
        for digest, key in entries:
            table[digest] = (nbytes, key)
        if self._insert_each is not None:  # (frecency's: one call)
            self._insert_each([digest for digest, _key in entries])
        else:
            insert = self._policy.insert
            for digest, _key in entries:
                insert([digest])
        self.changes += len(entries)
        self.used += nbytes * len(entries)

    def remove(self, digest: bytes) -> FsEntry | None:
        """Forget ``digest`` (no ghost is kept); its entry, or None if not indexed."""
        entry = self._entries.pop(digest, None)
        if entry is None:
            return None
        self.changes += 1
        self._policy.remove(digest)
        self.used -= entry[0]
        return FsEntry(*entry)

    def touch(self, digests: Sequence[bytes]) -> None:
        """``digests`` were used, head first; unknown ones are ignored."""
        self._policy.touch(digests)

    def finish_request(self, digests: Sequence[bytes], reused: Collection[bytes]) -> None:
        """A request finished with ``digests`` (head first), having loaded ``reused``."""
        finish_request(self._policy, digests, reused)

    def make_room(
        self, nbytes: int, capacity: int | None, busy: Callable[[bytes], bool]
    ) -> list[tuple[bytes, FsEntry]] | None:
        """Evict the entries the policy picks, never a ``busy`` one, until ``nbytes`` more
        fit beside ``used`` and ``reserved`` within ``capacity`` (None: no bound).

        Returns the evicted ``(digest, entry)`` pairs, the policy's first first (empty
        when they fit already), or None, evicting nothing, when they cannot fit.
        """
        if capacity is None:
            return []
        if nbytes > capacity:
            return None
        need = self.used + self.reserved + nbytes - capacity
        if need <= 0:
            return []
        return self.evict(-(-need // self.entry_bytes), busy)

    def evict(self, n: int, busy: Callable[[bytes], bool]) -> list[tuple[bytes, FsEntry]] | None:
        """Evict the ``n`` entries the policy picks, never a ``busy`` one: the
        ``(digest, entry)`` pairs, the policy's first first, or None, evicting nothing,
        when fewer than ``n`` may go."""
        if n <= 0:
            return []
        # The policy was given digests only, so it hands back digests.
        chosen = cast(
            "list[bytes] | None",
            self._policy.evict(n, lambda key: not busy(cast(bytes, key))),
        )
        if chosen is None:
            return None
        evicted = []
        for digest in chosen:
            entry = FsEntry(*self._entries.pop(digest))
            self.used -= entry.nbytes
            evicted.append((digest, entry))
        self.changes += 1
        return evicted


class FsCapacity:
    """The bytes the tier may hold, and how a full disk moves that bound.

    ``target`` is what the configuration (or the default, from the free space at
    start) asks for; ``current`` the bound in force. A write that finds the disk full
    lowers ``current`` to the tier's own files plus what the disk shows free, never below
    ``floor`` (one entry per write thread, so that every writer keeps a block in flight,
    and never above ``target``); it grows back toward ``target`` as the disk shows room
    again. ``None`` means no bound.

    Args:
        target: the capacity asked for, in bytes, or None.
        entry_bytes: bytes of one entry.
        writers: write threads.
    """

    def __init__(self, target: int | None, entry_bytes: int, writers: int) -> None:
        self.entry_bytes = entry_bytes
        self.writers = max(1, writers)
        self.target = target
        self.current = target

    def reset(self, target: int | None) -> None:
        """A new target (the default recomputed after the start-up scan), in force now."""
        self.target = self.current = target

    @property
    def lowered(self) -> bool:
        """Whether a full disk holds the bound below its target."""
        return self.current != self.target

    @property
    def floor(self) -> int:
        """The least a full disk lowers the bound to."""
        target = self.target or self.entry_bytes
        return min(target, max(self.entry_bytes, self.writers * self.entry_bytes))

    def lower_for_full_disk(self, used: int, free: int) -> bool:
        """The disk filled up before the bound did, with ``used`` bytes of this tier's
        files and ``free`` bytes free: hold no more than both together (at least
        ``floor``). Whether the bound went down."""
        lowered = max(self.floor, used + free)
        if self.current is None or self.current > lowered:
            self.current = lowered
            return True
        return False

    def count_found(self, nbytes: int) -> None:
        """Files of ``nbytes`` that were on disk when a full disk lowered the bound (the
        start-up scan's, indexed since) count toward it: it rises by them, never above
        the target."""
        cap, target = self.current, self.target
        if cap is not None and cap != target:
            self.current = cap + nbytes if target is None else min(target, cap + nbytes)

    def regrow(self, used: int, reserved: int, free: int) -> bool:
        """After a full disk, with ``free`` bytes free again: raise the bound toward the
        target as far as the tier's files, its writes in flight and that room allow.
        Whether the bound went up."""
        cap, target = self.current, self.target
        if cap is None or target is None or cap >= target:
            return False
        grown = min(target, used + reserved + free)
        if grown > cap:
            self.current = grown
            return True
        return False
