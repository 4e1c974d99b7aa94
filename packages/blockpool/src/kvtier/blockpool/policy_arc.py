"""The ARC eviction policy: Adaptive Replacement Cache (Megiddo and Modha, 2003),
adapted to keys the pool may not evict now."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence

from kvtier.blockpool.policy_base import NO_KEY, Key
from kvtier.blockpool.policy_order import ParkingOrder


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha, 2003), adapted to pinning.

    ``t1`` holds keys seen once since they entered the cache, ``t2`` keys seen at
    least twice; ``b1`` and ``b2`` remember keys recently evicted from ``t1`` and
    ``t2`` (ghosts: keys only, no blocks). Each list is oldest first (``t1`` and ``t2``
    are ``ParkingOrder`` objects, see ``policy_order``; the ghosts ordered dicts). ``p``
    is the target size of ``t1`` in keys: a key inserted while a ghost in
    ``b1`` grows it, one in ``b2`` shrinks it, and both go straight to ``t2``.

    Eviction takes the oldest evictable key of ``t1`` while ``t1`` (less the keys
    already chosen from it) is larger than ``p``, else the oldest of ``t2``; if the
    chosen list has no evictable key left, the other list's. Ghost lists are bounded
    so that ``|t1| + |b1| <= capacity`` and all four lists hold ``<= 2 * capacity``.
    """

    __slots__ = ("_t1", "_t2", "b1", "b2", "capacity", "p", "parked")
    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0
        # t1 and t2 park the keys an eviction with ``park`` passes over and finds
        # unevictable, in one dict, until :meth:`unpark` (see ``policy_order``).
        self._t1 = ParkingOrder()
        self._t2 = ParkingOrder(shared=self._t1)
        self.parked = self._t1.parked
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    @property
    def t1(self) -> ParkingOrder:
        """Keys seen once since they entered the cache, oldest first."""
        return self._t1

    @t1.setter
    def t1(self, keys: Iterable[Key]) -> None:
        self._t1.reset(keys)

    @property
    def t2(self) -> ParkingOrder:
        """Keys seen at least twice, oldest first."""
        return self._t2

    @t2.setter
    def t2(self, keys: Iterable[Key]) -> None:
        self._t2.reset(keys)

    def insert(self, keys: Sequence[Key]) -> None:
        """``keys`` entered the cache: each once, none already in ``t1`` or ``t2`` (the
        pool makes sure); the last is the newest."""
        o1, o2, b1, b2 = self._t1.order, self._t2.order, self.b1, self.b2
        for key in keys:
            if key in b1:
                self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
                del b1[key]
                o2[key] = None
            elif key in b2:
                self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
                del b2[key]
                o2[key] = None
            else:
                o1[key] = None
        self._trim_ghosts()

    def touch(self, keys: Sequence[Key]) -> None:
        """``keys`` were used again: each moves to the new end of ``t2``, the *first*
        key last (it is the newest). Unknown keys are ignored."""
        t1, t2 = self._t1, self._t2
        o1, o2 = t1.order, t2.order
        aside = t1.aside() or t2.aside()
        for key in reversed(keys):
            if key in o2:
                o2.move_to_end(key)
            elif key in o1:
                del o1[key]
                o2[key] = None
            elif aside and (t2.take_aside(key) or t1.take_aside(key)):
                o2[key] = None

    def touch_prefix(self, keys: Sequence[Key], reused: Collection[Key]) -> None:
        """A request finished with ``keys`` (head first): the keys in ``reused`` are
        touched; the others (stored by the request) move to the new end of the list
        they are in, as a store is not a second use. The head ends up the newest."""
        t1, t2 = self._t1, self._t2
        o1, o2 = t1.order, t2.order
        aside = t1.aside() or t2.aside()
        for key in reversed(keys):
            if key in o2:
                o2.move_to_end(key)
            elif key in o1:
                if key in reused:
                    del o1[key]
                    o2[key] = None
                else:
                    o1.move_to_end(key)
            elif aside:
                if t2.take_aside(key):
                    o2[key] = None
                elif t1.take_aside(key):
                    (o2 if key in reused else o1)[key] = None

    def remove(self, key: Key) -> None:
        """``key`` left the cache other than by ``evict``; it leaves no ghost."""
        if not self._t1.pop(key) and not self._t2.pop(key):
            raise KeyError(key)

    def unpark(self, keys: Iterable[Key]) -> None:
        """``keys`` may be evictable now (stored, or their last pin ended): those an
        eviction parked go back to their list, in their place."""
        self._t1.unpark(keys)  # (routes each to its own list)

    def evict(
        self,
        n: int,
        evictable: Callable[[Key], bool],
        *,
        park: bool = False,
        protected: Collection[Key] = (),
    ) -> list[Key] | None:
        """Choose ``n`` evictable keys, none of ``protected``, by the ARC rule and make
        them ghosts.

        Returns them in the order chosen, or ``None`` (forgetting nothing) when fewer
        than ``n`` keys are evictable. Each list is walked once, from its oldest key,
        and only as far as the victims taken from it. With ``park``, keys passed over
        and found unevictable are parked until the caller unparks them."""
        if n <= 0:
            return []
        t1, t2 = self._t1, self._t2
        walk1 = t1.walk(evictable, park=park, protected=protected)
        walk2 = t2.walk(evictable, park=park, protected=protected)
        from1: list[Key] = []
        from2: list[Key] = []
        victims: list[Key] = []
        size1 = len(t1)
        while len(victims) < n:
            if size1 - len(from1) > self.p:
                order = ((walk1, from1), (walk2, from2))
            else:
                order = ((walk2, from2), (walk1, from1))
            for walk, taken in order:
                key = next(walk, NO_KEY)
                if key is not NO_KEY:
                    taken.append(key)
                    victims.append(key)
                    break
            else:
                walk1.abort()
                walk2.abort()
                return None  # fewer than n evictable keys: nothing was evicted
        # The walks are over: the lists may change now.
        walk1.commit()
        walk2.commit()
        b1, b2 = self.b1, self.b2
        for key in from1:
            b1[key] = None
        for key in from2:
            b2[key] = None
        self._trim_ghosts()
        return victims

    def _trim_ghosts(self) -> None:
        """Forget the oldest ghosts beyond the bounds of the class docstring."""
        c, b1, b2 = self.capacity, self.b1, self.b2
        while b1 and len(self._t1) + len(b1) > c:
            b1.popitem(last=False)
        while b2 and len(self._t1) + len(self._t2) + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)

    def keys_in_eviction_order(self) -> list[Key]:
        """``t1`` then ``t2``, each oldest first (the order while ``|t1| > p``)."""
        return [*self._t1.keys(), *self._t2.keys()]
