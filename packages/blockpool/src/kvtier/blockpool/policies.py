"""Eviction policies for the keyed part of the host block pool.

A policy only orders keys; the pool owns blocks, pins and states. The pool tells
the policy when keys enter the cache (``insert``), are used again (``touch``) or
leave it other than by eviction (``remove``), and asks it for victims with
``evict``, passing a predicate that says whether a key may go now (pinned and
unfinished blocks may not). A policy must not evict a key the predicate refuses.

Policies are chosen by name (``lru``, ``arc``) or loaded from a module path
``"package.module:ClassName"`` (or ``"package.module.ClassName"``).
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Protocol, runtime_checkable

Key = Hashable


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the pool needs from an eviction policy.

    Methods take whole batches so that a call costs one Python call, not one per key.
    """

    def insert(self, keys: Sequence[Key]) -> None:
        """``keys`` were added to the cache, in this order (the last is the newest)."""

    def touch(self, keys: Sequence[Key]) -> None:
        """``keys`` were used again. The *first* key ends up the most recently used
        (a prefix's head is shared by the most requests). Unknown keys are ignored."""

    def remove(self, key: Key) -> None:
        """``key`` left the cache other than by ``evict`` (a failed store, a clear)."""

    def evict(self, n: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        """Choose and forget ``n`` keys for which ``evictable`` is true.

        Returns the keys in eviction order, or ``None`` (forgetting nothing) when
        fewer than ``n`` keys may be evicted.
        """


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


DEAD_ENTRIES_TO_COMPACT = 32
"""Gone entries one eviction walk may pass behind a live key before it compacts them."""


class _Lane:
    """One ARC list's eviction scan over a plain dict (see ``ARCPolicy``)."""

    __slots__ = ("pos", "snap")

    def __init__(self) -> None:
        self.snap: list[Key] = []  # the dict's keys, oldest first, when last copied
        self.pos = 0  # snap[:pos] are all gone or stamped again since the copy


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha, 2003), adapted to pinning.

    ``T1`` holds keys seen once since they entered, ``T2`` keys seen at least twice.
    ``B1``/``B2`` remember keys recently evicted from ``T1``/``T2`` (ghosts, no
    blocks). A key inserted while a ghost in ``B1`` grows the target size ``p`` of
    ``T1``; one in ``B2`` shrinks it; both go straight to ``T2``. Eviction takes the
    least recently used evictable key of ``T1`` when ``|T1| > p`` (or ``T2`` has none),
    else of ``T2``; if the chosen list has no evictable key, the other list is used.
    Ghost lists are bounded so that ``|T1|+|B1| <= c`` and the total is ``<= 2c``.

    ``T1`` and ``T2`` are plain dicts in recency order (oldest first): a hit is a
    delete and an insert, with no linked-list nodes to allocate or unlink, which
    is what makes a touch cheap. A plain dict cannot be scanned from its oldest
    end cheaply after many deletions, so eviction scans a copy of its keys
    (``_Lane.snap``) and remembers how far the copy is used up. Each value is
    the *stamp* of the copy that was current when the key was (re)inserted; a
    copied key is still at its copied position exactly when its stamp is older
    than the copy, so keys touched or re-inserted since are skipped there and
    met again in a later copy. Each key is passed over once per copy it is in, and
    a walk that passes many gone entries behind a key that may not be evicted yet
    moves the live ones forward over them, so eviction is amortised O(1) per key,
    pinned keys aside (they are rescanned, as in any LRU walk).
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0
        self.t1: dict[Key, int] = {}
        self.t2: dict[Key, int] = {}
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self._stamp1 = self._stamp2 = 0  # stamps of keys (re)inserted from now on
        self._lane1, self._lane2 = _Lane(), _Lane()

    def insert(self, keys: Sequence[Key]) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        s1, s2 = self._stamp1, self._stamp2
        if not (b1 or b2):  # no ghosts: every key is new to T1
            for key in keys:
                t1[key] = s1
            return
        for key in keys:
            if b1 and key in b1:
                self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
                del b1[key]
                t2[key] = s2
            elif b2 and key in b2:
                self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
                del b2[key]
                t2[key] = s2
            else:
                t1[key] = s1
        self._trim_ghosts()

    def touch(self, keys: Sequence[Key]) -> None:
        t1, t2, s2 = self.t1, self.t2, self._stamp2
        # dict.pop with a default is one probe, where "in" then "del" are two.
        if len(keys) == 1:  # the common case, without the iterator
            key = keys[0]
            if t1.pop(key, None) is None and t2.pop(key, None) is None:
                return  # not cached
            t2[key] = s2
            return
        pop1, pop2 = t1.pop, t2.pop
        for key in reversed(keys):
            if pop1(key, None) is None and pop2(key, None) is None:
                continue
            t2[key] = s2

    def remove(self, key: Key) -> None:
        if self.t1.pop(key, None) is None:
            del self.t2[key]

    def _scan(self, which: int, evictable: Callable[[Key], bool]) -> Iterator[Key]:
        """The evictable keys of T1 (``which`` 1) or T2 (2), oldest first, lazily."""
        table = self.t1 if which == 1 else self.t2
        lane = self._lane1 if which == 1 else self._lane2
        get = table.get
        given: set[Key] | None = None  # keys yielded from an earlier copy
        while True:
            snap = lane.snap
            stamp = self._stamp1 if which == 1 else self._stamp2
            valid = dead = 0
            i = lane.pos - 1
            try:
                for i in range(lane.pos, len(snap)):
                    key = snap[i]
                    if get(key, stamp) < stamp:  # present, not re-stamped since the copy
                        valid += 1
                        if (given is None or key not in given) and evictable(key):
                            yield key
                    elif valid == 0:
                        lane.pos = i + 1
                    else:
                        dead += 1
            finally:  # also when the caller stops early
                if dead >= DEAD_ENTRIES_TO_COMPACT:
                    # A key that may not go yet (pinned, storing) holds the front: move
                    # the live keys of the walked stretch to its end, in order, so the
                    # next walk does not pass the gone ones again. Costs what the walk did.
                    stop = i + 1
                    keep = [k for k in snap[lane.pos : stop] if get(k, stamp) < stamp]
                    snap[stop - len(keep) : stop] = keep
                    lane.pos = stop - len(keep)
            if len(table) == valid:  # every key was in this copy: done
                return
            # Keys (re)inserted since the copy follow it: copy again, under a new
            # stamp, and skip what was already given from the old copy.
            old = {k for k in snap[lane.pos :] if get(k, stamp) < stamp}
            given = old if given is None else given | old
            lane.snap = list(table)
            lane.pos = 0
            if which == 1:
                self._stamp1 += 1
            else:
                self._stamp2 += 1

    def evict(self, n: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        victims: list[Key] = []
        if n <= 0:
            return victims
        # Walk both lists lazily; decide each victim by the ARC rule on the sizes
        # the lists would have after the victims chosen so far.
        it1 = self._scan(1, evictable)
        it2 = self._scan(2, evictable)
        head1 = next(it1, None)
        head2 = next(it2, None)
        from1: list[Key] = []
        from2: list[Key] = []
        len1 = len(self.t1)
        while len(victims) < n:
            if head1 is None and head2 is None:
                return None
            take_t1 = head2 is None or (head1 is not None and len1 - len(from1) > self.p)
            if take_t1:
                assert head1 is not None
                from1.append(head1)
                victims.append(head1)
                head1 = next(it1, None)
            else:
                from2.append(head2)
                victims.append(head2)
                head2 = next(it2, None)
        for key in from1:
            del self.t1[key]
            self.b1[key] = None
        for key in from2:
            del self.t2[key]
            self.b2[key] = None
        self._trim_ghosts()
        return victims

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def keys_in_eviction_order(self) -> list[Key]:
        """T1 then T2, each oldest first (the order when |T1| > p throughout)."""
        return [*self.t1, *self.t2]


POLICIES: dict[str, type] = {"lru": LRUPolicy, "arc": ARCPolicy}


def _load_class(path: str) -> type:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"cache_policy_module_path must look like 'package.module:ClassName', got {path!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"cache_policy_module_path={path!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"cache_policy_module_path={path!r}: {attr!r} is not a class")
    return cls


def make_policy(name: str, capacity: int, module_path: str | None = None) -> EvictionPolicy:
    """Build an eviction policy by name, or from ``module_path`` when one is given.

    Raises ``ValueError`` naming ``eviction_policy`` or ``cache_policy_module_path``.
    """
    if module_path:
        cls = _load_class(module_path)
    else:
        if not isinstance(name, str) or name.lower() not in POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {sorted(POLICIES)} "
                f"(or set cache_policy_module_path), got {name!r}"
            )
        cls = POLICIES[name.lower()]
    try:
        policy = cls(capacity)
    except Exception as exc:
        raise ValueError(
            f"cache_policy_module_path={module_path!r}: {cls.__name__}(capacity) failed: {exc}"
        ) from exc
    missing = [
        m for m in ("insert", "touch", "remove", "evict") if not callable(getattr(policy, m, None))
    ]
    if missing:
        raise ValueError(
            f"cache_policy_module_path={module_path!r}: class lacks method(s) {missing}"
        )
    return policy  # type: ignore[no-any-return,unused-ignore]
