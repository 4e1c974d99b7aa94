"""Eviction policies for the keyed part of the host block pool.

A policy only orders keys; the pool owns blocks, pins and states. The pool tells
the policy when keys enter the cache (``insert``), are used again (``touch``) or
leave it other than by eviction (``remove``), and asks it for victims with
``evict``, passing a predicate that says whether a key may go now (pinned and
unfinished blocks may not). A policy must not evict a key the predicate refuses.

When a request finishes, the pool passes all of its keys, head first, to the
policy's optional ``touch_prefix`` (a policy without one gets ``touch``): the keys
it stored as well as those it reused, so that its prefix's tail goes first.

Policies are chosen by name (``lru``, ``arc``) or loaded from a module path
``"package.module:ClassName"`` (or ``"package.module.ClassName"``).
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Protocol, runtime_checkable

Key = Hashable


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the pool needs from an eviction policy.

    Methods take whole batches so that a call costs one Python call, not one per key.
    """

    def insert(self, keys: Sequence[Key]) -> None:
        """``keys`` were added to the cache, in this order (the last is the newest).
        Each is listed once and is not in the policy already (the pool makes sure)."""

    def touch(self, keys: Sequence[Key]) -> None:
        """``keys`` were used again. The *first* key ends up the most recently used
        (a prefix's head is shared by the most requests). Unknown keys are ignored."""

    def remove(self, key: Key) -> None:
        """``key`` left the cache other than by ``evict`` (a failed store, a clear)."""

    # Optional (the pool calls ``touch(keys)`` on policies without it):
    #
    # def touch_prefix(self, keys: Sequence[Key], reused: Collection[Key]) -> None:
    #     """A request finished with ``keys``, its keys in prefix order (head first):
    #     the head ends up the most recently used, the tail the least. Only the keys
    #     in ``reused`` were used again; the others the request stored, which is not
    #     a second use. Unknown keys are ignored."""

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


_NO_KEY = object()  # what ``next`` returns once a list has no evictable key left


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha, 2003), adapted to pinning.

    ``t1`` holds keys seen once since they entered the cache, ``t2`` keys seen at
    least twice; ``b1`` and ``b2`` remember keys recently evicted from ``t1`` and
    ``t2`` (ghosts: keys only, no blocks). Each list is an ``OrderedDict``, oldest
    first. ``p`` is the target size of ``t1`` in keys: a key inserted while a ghost in
    ``b1`` grows it, one in ``b2`` shrinks it, and both go straight to ``t2``.

    Eviction takes the oldest evictable key of ``t1`` while ``t1`` (less the keys
    already chosen from it) is larger than ``p``, else the oldest of ``t2``; if the
    chosen list has no evictable key left, the other list's. Ghost lists are bounded
    so that ``|t1| + |b1| <= capacity`` and all four lists hold ``<= 2 * capacity``.
    """

    __slots__ = ("b1", "b2", "capacity", "p", "t1", "t2")
    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def insert(self, keys: Sequence[Key]) -> None:
        """``keys`` entered the cache: each once, none already in ``t1`` or ``t2`` (the
        pool makes sure); the last is the newest."""
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        for key in keys:
            if key in b1:
                self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
                del b1[key]
                t2[key] = None
            elif key in b2:
                self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
                del b2[key]
                t2[key] = None
            else:
                t1[key] = None
        self._trim_ghosts()

    def touch(self, keys: Sequence[Key]) -> None:
        """``keys`` were used again: each moves to the new end of ``t2``, the *first*
        key last (it is the newest). Unknown keys are ignored."""
        t1, t2 = self.t1, self.t2
        for key in reversed(keys):
            if key in t2:
                t2.move_to_end(key)
            elif key in t1:
                del t1[key]
                t2[key] = None

    def touch_prefix(self, keys: Sequence[Key], reused: Collection[Key]) -> None:
        """A request finished with ``keys`` (head first): the keys in ``reused`` are
        touched; the others (stored by the request) move to the new end of the list
        they are in, as a store is not a second use. The head ends up the newest."""
        t1, t2 = self.t1, self.t2
        for key in reversed(keys):
            if key in t2:
                t2.move_to_end(key)
            elif key in t1:
                if key in reused:
                    del t1[key]
                    t2[key] = None
                else:
                    t1.move_to_end(key)

    def remove(self, key: Key) -> None:
        """``key`` left the cache other than by ``evict``; it leaves no ghost."""
        if self.t1.pop(key, _NO_KEY) is _NO_KEY:
            del self.t2[key]

    def evict(self, n: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        """Choose ``n`` evictable keys by the ARC rule and make them ghosts.

        Returns them in the order chosen, or ``None`` (changing nothing) when fewer
        than ``n`` keys are evictable. Each list is walked once, from its oldest key,
        and only as far as the victims taken from it.
        """
        if n <= 0:
            return []
        t1, t2 = self.t1, self.t2
        candidates1 = (key for key in t1 if evictable(key))
        candidates2 = (key for key in t2 if evictable(key))
        from1: list[Key] = []
        from2: list[Key] = []
        victims: list[Key] = []
        while len(victims) < n:
            if len(t1) - len(from1) > self.p:
                order = ((candidates1, from1), (candidates2, from2))
            else:
                order = ((candidates2, from2), (candidates1, from1))
            for candidates, taken in order:
                key = next(candidates, _NO_KEY)
                if key is not _NO_KEY:
                    taken.append(key)
                    victims.append(key)
                    break
            else:
                return None  # fewer than n evictable keys: nothing was changed
        # The walks are over: the lists may change now.
        for key in from1:
            del t1[key]
            self.b1[key] = None
        for key in from2:
            del t2[key]
            self.b2[key] = None
        self._trim_ghosts()
        return victims

    def _trim_ghosts(self) -> None:
        """Forget the oldest ghosts beyond the bounds of the class docstring."""
        c, b1, b2 = self.capacity, self.b1, self.b2
        while b1 and len(self.t1) + len(b1) > c:
            b1.popitem(last=False)
        while b2 and len(self.t1) + len(self.t2) + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)

    def keys_in_eviction_order(self) -> list[Key]:
        """``t1`` then ``t2``, each oldest first (the order while ``|t1| > p``)."""
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
