"""The LRU eviction policy: least recently used first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from kvtier.blockpool.policy_base import Key


class LRUPolicy:
    """Least recently used first. Inserts and touches make a key the newest."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, keys: Sequence[Key]) -> None:
        order = self._order
        for key in keys:
            order[key] = None

    def touch(self, keys: Sequence[Key]) -> None:
        order = self._order
        move = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key)

    def touch_prefix(self, keys: Sequence[Key], reused: Collection[Key]) -> None:
        self.touch(keys)  # a store is as recent as a use

    def remove(self, key: Key) -> None:
        del self._order[key]

    def evict(self, n: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        victims: list[Key] = []
        if n <= 0:
            return victims
        for key in self._order:
            if evictable(key):
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        order = self._order
        for key in victims:
            del order[key]
        return victims

    def keys_in_eviction_order(self) -> list[Key]:
        return list(self._order)
