"""A recency order whose evictions park the keys they pass over and find unevictable:
the lists of the LRU and ARC policies.

A slow tier's writes pin up to three quarters of a pool, and an eviction that goes
over them every time costs tens of milliseconds of the scheduler's thread at 100,000
blocks. :class:`ParkingOrder` takes such keys out of the order while they cannot go
(``parked``), until the pool names them to :meth:`ParkingOrder.unpark`. Every key taken
out is older than every key left in the order, and keys taken out by a later eviction
are newer than those of an earlier one: each keeps the count of the walk that passed
it, and unparked keys wait in a heap by that count, which evictions look at before the
order. An eviction therefore chooses what a walk over every key chooses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator
from heapq import heappop, heappush
from itertools import chain

from kvtier.blockpool.policy_base import Key


class ParkingOrder:
    """Keys oldest first: an ``OrderedDict`` (``order``), and the keys evictions took out
    of it, older than all of it: parked (unevictable when passed over) and those
    unparked since, by walk count (see the module).

    Orders made with ``shared`` (ARC's two lists) share its ``parked`` dict, so that one
    :meth:`unpark` serves them all: each parked key maps to an int, its walk count times
    4 plus its order's place among them (an int, not a tuple naming the order, so that
    the garbage collector tracks no object per parked key).
    """

    __slots__ = ("_back", "_heap", "_num_parked", "_owners", "_tag", "_walked", "order", "parked")

    def __init__(self, shared: ParkingOrder | None = None) -> None:
        self.order: OrderedDict[Key, None] = OrderedDict()
        if shared is None:
            self.parked: dict[Key, int] = {}
            self._owners: list[ParkingOrder] = []
        else:
            self.parked, self._owners = shared.parked, shared._owners
        if len(self._owners) >= _TAGS:
            raise ValueError(f"at most {_TAGS} orders share one parked dict")
        self._tag = len(self._owners)
        self._owners.append(self)
        self._num_parked = 0  # keys of this order in ``parked``
        self._back: dict[Key, int] = {}  # unparked keys, by walk count
        self._heap: list[tuple[int, Key]] = []  # (walk count, key); stale where not in _back
        self._walked = 0

    def __len__(self) -> int:
        return len(self.order) + self._num_parked + len(self._back)

    def __iter__(self) -> Iterator[Key]:
        return iter(self.keys())

    def __contains__(self, key: Key) -> bool:
        if key in self.order or key in self._back:
            return True
        mark = self.parked.get(key)
        return mark is not None and mark & _TAG_MASK == self._tag

    def aside(self) -> bool:
        """Whether some keys are out of ``order``."""
        return bool(self._num_parked or self._back)

    def take_aside(self, key: Key) -> bool:
        """Take ``key`` from the keys out of the order; whether it was one."""
        if self._num_parked:
            parked = self.parked
            mark = parked.get(key)
            if mark is not None and mark & _TAG_MASK == self._tag:
                del parked[key]
                self._num_parked -= 1
                return True
        return self._back.pop(key, None) is not None  # (its heap entry goes stale)

    def pop(self, key: Key) -> bool:
        """Take ``key`` out, wherever it is; whether it was here."""
        order = self.order
        if key in order:
            del order[key]
            return True
        return self.take_aside(key)

    def unpark(self, keys: Iterable[Key]) -> None:
        """``keys`` may be evictable now: those parked (in any order sharing ``parked``)
        go back, in their place among the keys out of their order."""
        parked = self.parked
        if parked:
            owners = self._owners
            for key in keys:
                mark = parked.pop(key, None)
                if mark is not None:
                    owner = owners[mark & _TAG_MASK]
                    walked = mark >> _TAG_BITS
                    owner._num_parked -= 1
                    owner._back[key] = walked
                    heappush(owner._heap, (walked, key))

    def items(self) -> Iterator[tuple[Key, None]]:
        """``(key, None)`` for every key, oldest first (an ordered dict's view)."""
        return ((key, None) for key in self.keys())

    def reset(self, keys: Iterable[Key]) -> None:
        """Make ``keys`` the whole order, oldest first, nothing out of it: an
        ``OrderedDict`` is used as it is (vLLM's tests set one that counts its
        ``items()``), anything else copied."""
        if self._num_parked:
            parked, tag = self.parked, self._tag
            for key in [k for k, mark in parked.items() if mark & _TAG_MASK == tag]:
                del parked[key]
            self._num_parked = 0
        self._back.clear()
        self._heap.clear()
        self.order = keys if isinstance(keys, OrderedDict) else OrderedDict.fromkeys(keys)

    def keys(self) -> list[Key]:
        """Every key, oldest first."""
        tag = self._tag
        aside = [
            (mark >> _TAG_BITS, key) for key, mark in self.parked.items() if mark & _TAG_MASK == tag
        ]
        aside += [(walked, key) for key, walked in self._back.items()]
        aside.sort(key=lambda e: e[0])
        return [*(key for _, key in aside), *self.order]

    def walk(
        self, evictable: Callable[[Key], bool], *, park: bool, protected: Collection[Key] = ()
    ) -> Walk:
        """The evictable keys, oldest first, none of ``protected``, as a :class:`Walk`
        (nothing changes until it is committed; without ``park`` this order's parked
        keys are all unparked first)."""
        if self._num_parked and not park:  # a caller that does not unpark: all go back
            tag = self._tag
            self.unpark([key for key, mark in self.parked.items() if mark & _TAG_MASK == tag])
        return Walk(self, evictable, park, protected)


_TAG_BITS = 2
_TAGS = 1 << _TAG_BITS
_TAG_MASK = _TAGS - 1


class Walk:
    """One eviction's walk over a :class:`ParkingOrder`: iterating yields its evictable
    keys oldest first; :meth:`commit` evicts every key yielded and parks the keys passed
    over (with ``park``; protected ones wait among the keys out of the order, for the
    next eviction to look at first), :meth:`abort` evicts none and leaves the order as
    it was (keys parked from the heap on the way stay parked: their place is kept)."""

    __slots__ = (
        "_chosen",
        "_evictable",
        "_from_order",
        "_it",
        "_kept",
        "_park",
        "_passed",
        "_protected",
        "_src",
    )

    def __init__(
        self,
        src: ParkingOrder,
        evictable: Callable[[Key], bool],
        park: bool,
        protected: Collection[Key],
    ) -> None:
        self._src = src
        self._evictable = evictable
        self._park = park
        self._protected = protected
        self._chosen: list[tuple[int, Key]] = []  # heap entries yielded
        self._kept: list[tuple[int, Key]] = []  # heap entries to queue again
        self._from_order: list[Key] = []  # keys of the order yielded
        self._passed: list[Key] = []  # keys of the order passed over
        self._it = self._keys()

    def __iter__(self) -> Iterator[Key]:
        return self._it

    def __next__(self) -> Key:
        return next(self._it)

    def _keys(self) -> Iterator[Key]:
        src, evictable, park, protected = self._src, self._evictable, self._park, self._protected
        back, heap = src._back, src._heap
        chosen, kept = self._chosen, self._kept
        # The keys passed over by earlier evictions first: they are the oldest.
        while heap:
            walked, key = entry = heappop(heap)
            if back.get(key) != walked:
                continue  # stale: used, removed or evicted since
            if key not in protected and evictable(key):
                chosen.append(entry)
                yield key
            elif park and key not in protected:
                del back[key]
                src.parked[key] = walked << _TAG_BITS | src._tag
                src._num_parked += 1
            else:
                kept.append(entry)
        passed, taken = self._passed, self._from_order
        for key, _ in src.order.items():  # (items(): an ordered dict a test set may count)
            if key not in protected and evictable(key):
                taken.append(key)
                yield key
            elif park:
                passed.append(key)

    def commit(self) -> None:
        src = self._src
        back, heap = src._back, src._heap
        for entry in self._kept:
            heappush(heap, entry)
        for _, key in self._chosen:
            del back[key]
        order = src.order
        for key in self._from_order:
            del order[key]
        passed = self._passed
        if passed:
            protected, parked, tag = self._protected, src.parked, src._tag
            walked = src._walked
            if protected:
                for key in passed:  # oldest first: their counts follow their order
                    del order[key]
                    walked += 1
                    if key in protected:
                        back[key] = walked
                        heappush(heap, (walked, key))
                    else:
                        parked[key] = walked << _TAG_BITS | tag
                        src._num_parked += 1
            else:
                for key in passed:
                    del order[key]
                    walked += 1
                    parked[key] = walked << _TAG_BITS | tag
                src._num_parked += len(passed)
            src._walked = walked

    def abort(self) -> None:
        heap = self._src._heap
        for entry in chain(self._chosen, self._kept):
            heappush(heap, entry)
