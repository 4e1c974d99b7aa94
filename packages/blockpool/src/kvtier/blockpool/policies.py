"""Eviction policies for the keyed part of the host block pool.

A policy only orders keys; the pool owns blocks, pins and states. The pool tells
the policy when a key enters the cache (``insert``), is used again (``access``) or
leaves it other than by eviction (``remove``), and asks it for victims with
``evict``, passing a predicate that says whether a key may go now (pinned and
unfinished blocks may not). A policy must not evict a key the predicate refuses.

Policies are chosen by name (``lru``, ``arc``) or loaded from a module path
``"package.module:ClassName"`` (or ``"package.module.ClassName"``).
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol, runtime_checkable

Key = Hashable


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the pool needs from an eviction policy."""

    def insert(self, key: Key) -> None:
        """``key`` was added to the cache (it is the most recently used now)."""

    def access(self, key: Key) -> None:
        """``key`` was used again: a hit, a load or a touch."""

    def remove(self, key: Key) -> None:
        """``key`` left the cache other than by ``evict`` (a failed store, a clear)."""

    def evict(self, n: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        """Choose and forget ``n`` keys for which ``evictable`` is true.

        Returns the keys in eviction order, or ``None`` (forgetting nothing) when
        fewer than ``n`` keys may be evicted.
        """


class LRUPolicy:
    """Least recently used first. Inserts and accesses make a key the newest."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._order[key] = None

    def access(self, key: Key) -> None:
        self._order.move_to_end(key)

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


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha, 2003), adapted to pinning.

    ``T1`` holds keys seen once since they entered, ``T2`` keys seen at least twice.
    ``B1``/``B2`` remember keys recently evicted from ``T1``/``T2`` (ghosts, no
    blocks). A key inserted while a ghost in ``B1`` grows the target size ``p`` of
    ``T1``; one in ``B2`` shrinks it; both go straight to ``T2``. Eviction takes the
    least recently used evictable key of ``T1`` when ``|T1| > p`` (or ``T2`` has none),
    else of ``T2``; if the chosen list has no evictable key, the other list is used.
    Ghost lists are bounded so that ``|T1|+|B1| <= c`` and the total is ``<= 2c``.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        c = self.capacity
        if key in self.b1:
            self.p = min(float(c), self.p + max(1.0, len(self.b2) / len(self.b1)))
            del self.b1[key]
            self.t2[key] = None
            return
        if key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            del self.b2[key]
            self.t2[key] = None
            return
        self.t1[key] = None
        self._trim_ghosts()

    def access(self, key: Key) -> None:
        t1 = self.t1
        if key in t1:
            del t1[key]
            self.t2[key] = None
        else:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if self.t1.pop(key, 0) is None:
            return
        del self.t2[key]

    def evict(self, n: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        victims: list[Key] = []
        if n <= 0:
            return victims
        # Walk both lists lazily; decide each victim by the ARC rule on the sizes
        # the lists would have after the victims chosen so far.
        it1 = (k for k in self.t1 if evictable(k))
        it2 = (k for k in self.t2 if evictable(k))
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
    policy = cls(capacity)
    missing = [m for m in ("insert", "access", "remove", "evict") if not callable(getattr(policy, m, None))]
    if missing:
        raise ValueError(
            f"cache_policy_module_path={module_path!r}: class lacks method(s) {missing}"
        )
    return policy  # type: ignore[no-any-return]


def iter_keys(keys: Iterable[Key]) -> list[Key]:
    return keys if isinstance(keys, list) else list(keys)
