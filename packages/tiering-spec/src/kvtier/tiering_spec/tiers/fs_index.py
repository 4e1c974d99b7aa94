"""The fs tier's index: which files the tier holds, the bytes they and the writes in
flight take, and which files go first when room is needed. No I/O and no threads: the
tier calls it from the scheduler thread, and property tests drive it alone."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from typing import cast

from kvtier.blockpool.policies import finish_request, make_policy


class FsEntry:
    """One indexed file (all ranks' files of one key): its bytes, and its key where the
    tier wrote it (None for a file found on disk, whose key is only in its header)."""

    __slots__ = ("key", "nbytes")

    def __init__(self, nbytes: int, key: bytes | None) -> None:
        self.nbytes = nbytes
        self.key = key


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
        self._entries: dict[bytes, FsEntry] = {}
        self._policy = make_policy(policy, max(1, capacity_entries))

    def __contains__(self, digest: object) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    def add(self, digest: bytes, key: bytes | None) -> None:
        """Index ``digest`` (not indexed yet), the newest entry."""
        self._entries[digest] = FsEntry(self.entry_bytes, key)
        self.used += self.entry_bytes
        self._policy.insert([digest])

    def remove(self, digest: bytes) -> FsEntry | None:
        """Forget ``digest`` (no ghost is kept); its entry, or None if not indexed."""
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self._policy.remove(digest)
            self.used -= entry.nbytes
        return entry

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
        # The policy was given digests only, so it hands back digests.
        chosen = cast(
            "list[bytes] | None",
            self._policy.evict(
                -(-need // self.entry_bytes), lambda key: not busy(cast(bytes, key))
            ),
        )
        if chosen is None:
            return None
        evicted = []
        for digest in chosen:
            entry = self._entries.pop(digest)
            self.used -= entry.nbytes
            evicted.append((digest, entry))
        return evicted
