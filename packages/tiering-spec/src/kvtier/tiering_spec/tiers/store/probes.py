"""The store tier's existence checks and what they found: keys being asked about, the
answers not yet taken in, and the keys the store lacks, not asked about again for
``NEGATIVE_TTL_S``.

The scheduler thread asks (:meth:`ProbeCache.ask`) and takes the answers in
(:meth:`ProbeCache.take`); the probe thread takes batches off :attr:`ProbeCache.queue`
and answers (:meth:`ProbeCache.answer`). No store call here: the tier makes them.
"""

from __future__ import annotations

import queue
from collections import OrderedDict, deque
from typing import Any

from kvtier.tiering_spec.tiers.store.calls import MAX_BATCH

# How long a key the store lacks is not asked about again.
NEGATIVE_TTL_S = 2.0
MAX_PENDING_PROBES = 4 * MAX_BATCH
"""Existence checks queued or running at most; beyond, an unknown key is a miss (a hung
master must not make the queue grow with every lookup)."""


class ProbeCache:
    """Existence checks in flight, their answers, and the keys known absent.

    The absent keys are kept in the order they were found absent, which is the order
    they expire in (the time to live is one constant): the expired ones are dropped
    from the front as answers are taken in, and past ``max_absent`` the oldest go
    first. (A pass over all of them, once a million were remembered, held the
    scheduler's thread for 0.1 s.)

    Args:
        max_absent: absent keys remembered at most.
    """

    def __init__(self, max_absent: int) -> None:
        self.max_absent = max_absent
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.probing: set[bytes] = set()
        self._answers: deque[tuple[bytes, bool]] = deque()
        # digest -> when it may be asked again, the soonest first
        self._absent: OrderedDict[bytes, float] = OrderedDict()

    def known_absent(self, digest: bytes, now: float) -> bool:
        """Whether the store lacked ``digest`` less than ``NEGATIVE_TTL_S`` ago."""
        until = self._absent.get(digest)
        if until is None:
            return False
        if now < until:
            return True
        del self._absent[digest]
        return False

    def ask(self, digest: bytes) -> bool:
        """Have ``digest`` checked (unless it is already); False when too many checks
        are pending (the key is then a miss)."""
        if digest not in self.probing:
            if len(self.probing) >= MAX_PENDING_PROBES:
                return False
            self.probing.add(digest)
            self.queue.put(digest)
        return True

    def answer(self, digest: bytes, present: bool) -> None:
        """The store holds ``digest`` or not (any thread)."""
        self._answers.append((digest, present))

    def fail_queued(self) -> None:
        """Answer every queued check "absent" (no thread serves them); a stop marker
        stays queued for the thread that comes back."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self.queue.put(None)
                return
            self.answer(item, False)

    @property
    def unanswered(self) -> int:
        """Checks started whose answer has not come yet."""
        return len(self.probing) - len(self._answers)

    def take(self, now: float) -> list[bytes]:
        """The digests the store holds, of the answers since the last call (scheduler
        thread); those it lacks are remembered absent."""
        present: list[bytes] = []
        absent = self._absent
        while self._answers:
            digest, found = self._answers.popleft()
            self.probing.discard(digest)
            if found:
                present.append(digest)
            else:
                absent[digest] = now + NEGATIVE_TTL_S
                absent.move_to_end(digest)  # (found absent again: expires last)
        while absent and (len(absent) > self.max_absent or next(iter(absent.values())) <= now):
            absent.popitem(last=False)
        return present
