"""The LRU eviction policy: least recently used first."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import islice

from kvtier.blockpool.policy_base import Key
from kvtier.blockpool.policy_order import ParkingOrder


class LRUPolicy:
    """Least recently used first. Inserts and touches make a key the newest.

    An eviction with ``park`` takes the keys it passes over and finds unevictable
    (storing or pinned) out of the order into ``parked`` until the caller names them to
    :meth:`unpark`: later evictions do not go over them each time, and choose the same
    keys (see :mod:`kvtier.blockpool.policy_order`).
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self._keys = ParkingOrder()
        self._order = self._keys.order
        # (The same dict for the policy's life: a pool checks it before calling unpark.)
        self.parked = self._keys.parked

    def insert(self, keys: Sequence[Key]) -> None:
        order = self._order
        for key in keys:
            order[key] = None

    def touch(self, keys: Sequence[Key]) -> None:
        order = self._order
        move = order.move_to_end
        aside = self._keys.aside()
        for key in reversed(keys):
            if key in order:
                move(key)
            elif aside and self._keys.take_aside(key):
                order[key] = None  # the newest

    def touch_prefix(self, keys: Sequence[Key], reused: Collection[Key]) -> None:
        self.touch(keys)  # a store is as recent as a use

    def remove(self, key: Key) -> None:
        if not self._keys.pop(key):
            raise KeyError(key)

    def unpark(self, keys: Iterable[Key]) -> None:
        """``keys`` may be evictable now (stored, or their last pin ended): those an
        eviction parked go back, in their place."""
        self._keys.unpark(keys)

    def evict(
        self,
        n: int,
        evictable: Callable[[Key], bool],
        *,
        park: bool = False,
        protected: Collection[Key] = (),
    ) -> list[Key] | None:
        """Take the ``n`` least recently used keys that are evictable and not in
        ``protected``. Returns them oldest first, or ``None`` when fewer than ``n`` may
        go (forgetting nothing).

        With ``park``, keys passed over and found unevictable are parked until the
        caller unparks them, which it must do for every key that may have become
        evictable. Without it, parked keys are all unparked first."""
        if n <= 0:
            return []
        walk = self._keys.walk(evictable, park=park, protected=protected)
        victims = list(islice(walk, n))
        if len(victims) < n:
            walk.abort()
            return None
        walk.commit()
        return victims

    def keys_in_eviction_order(self) -> list[Key]:
        """Every cached key, the least recently used first (parked ones in their place)."""
        return self._keys.keys()
