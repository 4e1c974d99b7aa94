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
from collections.abc import Callable, Hashable, Sequence
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


DEAD_ENTRIES_TO_COMPACT = 16
"""Gone entries one eviction walk may pass behind a live key before it compacts them."""

MIN_LOG_TO_COMPACT = 1024
"""A recency log is compacted when it reaches this many entries, or twice its live ones."""


def _value_or_none(get: Callable[[Key], int | None], key: Key) -> int | None:
    try:
        return get(key)
    except Exception:  # not hashable or not comparable: never cached
        return None


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha, 2003), adapted to pinning.

    ``T1`` holds keys seen once since they entered, ``T2`` keys seen at least twice.
    ``B1``/``B2`` remember keys recently evicted from ``T1``/``T2`` (ghosts, no
    blocks). A key inserted while a ghost in ``B1`` grows the target size ``p`` of
    ``T1``; one in ``B2`` shrinks it; both go straight to ``T2``. Eviction takes the
    least recently used evictable key of ``T1`` when ``|T1| > p`` (or ``T2`` has none),
    else of ``T2``; if the chosen list has no evictable key, the other list is used.
    Ghost lists are bounded so that ``|T1|+|B1| <= c`` and the total is ``<= 2c``.

    Layout, for a cheap hit. Every cached key is in one dict, ``_where``, and each
    list's recency order is an append-only log of keys (oldest first). A hit
    rewrites the key's value in place and appends the key to T2's log: one probe
    of one table, where moving the key between two tables (or unlinking list
    nodes) is two or more. A key's value says its list and where its current log
    entry can be: the log position at the start of the call that put it there,
    ``s`` for T1 and ``~s`` (negative) for T2. Positions count every entry ever
    appended (a log keeps its end; its first position is the end minus its
    length), so an entry at position ``i`` is the key's current one exactly when
    the value is of that list and its ``s <= i``; entries of earlier visits are
    skipped. A walk remembers where its log's gone prefix ends, and a log is
    compacted (current entries kept, in order, at the end of their old span, so
    positions only grow) once it is twice as long as its current entries.
    Eviction is amortised O(1) per key, pinned keys aside (they are rescanned,
    as in any LRU walk).
    """

    name = "arc"
    _table_type: type[dict[Key, int]] = dict  # the key table's type (a test counts lookups)

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        # key -> s (T1) or ~s (T2): s is the log position when the key was put there
        self._where: dict[Key, int] = self._table_type()
        where = self._where
        self._logs: tuple[list[Key], list[Key]] = ([], [])  # T1's and T2's recency logs
        # T1's log end (the position its next entry gets); per log, the index its gone
        # prefix ends at and the length at which compaction is next considered; the
        # keys put into T1. A log's first position is its end minus its length.
        st = self._st = [0, 0, 0, MIN_LOG_TO_COMPACT, MIN_LOG_TO_COMPACT, 0]
        # What hits change lives in this closure, where the hit path reaches it
        # fastest: the value of T2's next entry (~ its log's end), and the keys
        # moved from T1 to T2 (so |T1| = st[5] - promoted).
        next2 = -1
        promoted = 0
        log2 = self._logs[1]
        get, append, extend = where.get, log2.append, log2.extend
        compact = self._compact

        def touch(keys: Sequence[Key]) -> None:
            nonlocal next2, promoted
            if len(keys) == 1:  # the common case, without the loop
                key = keys[0]
                v = get(key)
                if v is None:
                    return  # not cached
                where[key] = next2
                next2 -= 1
                append(key)
                if v >= 0:  # from T1
                    promoted += 1
                elif len(log2) > st[4]:  # (from T1: see remove)
                    compact(1)
                return
            cur = next2
            moved = 0
            dup = False
            try:
                for key in keys:
                    v = get(key)
                    if v is None:
                        continue
                    if v >= 0:
                        moved += 1
                    elif v == cur:  # listed twice in this call
                        dup = True
                    where[key] = cur
            except BaseException:  # a key that cannot be hashed, say: log those done
                promoted += moved
                done = [k for k in keys if _value_or_none(get, k) == cur]
                keys = list(dict.fromkeys(done))
                extend(reversed(keys))
                next2 = cur - len(keys)
                raise
            promoted += moved
            if dup:
                keys = list(dict.fromkeys(keys))
            # The first key ends up the newest. Keys not cached are logged too (their
            # entries are never current): cheaper than leaving them out.
            extend(reversed(keys))
            next2 = cur - len(keys)
            if len(log2) > st[4]:
                compact(1)

        def put2(keys: Sequence[Key]) -> None:
            """Put keys that are not cached into T2, the last one newest (insert's
            ghost hits)."""
            nonlocal next2
            cur = next2
            for key in keys:
                where[key] = cur
            extend(keys)
            next2 = cur - len(keys)
            if len(log2) > st[4]:
                compact(1)

        def len1() -> int:
            return st[5] - promoted

        def end2() -> int:
            return ~next2

        touch.__doc__ = ARCPolicy.touch.__doc__
        self.touch = touch  # type: ignore[method-assign]
        self._put2, self._len1, self._end2 = put2, len1, end2

    def __copy__(self) -> ARCPolicy:
        raise TypeError("an ARCPolicy cannot be copied: its hit path is bound to it")

    def __deepcopy__(self, memo: dict[int, object]) -> ARCPolicy:
        return self.__copy__()

    def insert(self, keys: Sequence[Key]) -> None:
        """``keys`` entered the cache: each once, none already in the policy (the pool
        makes sure); the last is the newest."""
        where, st, log1 = self._where, self._st, self._logs[0]
        b1, b2 = self.b1, self.b2
        s = st[0]
        to1: Sequence[Key]
        if (not b1 or b1.keys().isdisjoint(keys)) and (not b2 or b2.keys().isdisjoint(keys)):
            # No key is a ghost: every one is new to T1.
            for key in keys:
                where[key] = s
            to1 = keys
        else:
            new1: list[Key] = []
            to2: list[Key] = []
            for key in keys:
                if b1 and key in b1:
                    self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
                    del b1[key]
                    to2.append(key)
                elif b2 and key in b2:
                    self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
                    del b2[key]
                    to2.append(key)
                else:
                    where[key] = s
                    new1.append(key)
            to1 = new1
            if to2:
                self._put2(to2)
        log1.extend(to1)
        st[0] += len(to1)
        st[5] += len(to1)
        if b1 or b2:
            self._trim_ghosts()
        if len(log1) > st[3]:
            self._compact(0)

    def touch(self, keys: Sequence[Key]) -> None:
        """``keys`` were used again. The *first* key ends up the most recently used.
        Unknown keys are ignored."""
        self.touch(keys)  # the closure __init__ binds on the instance

    def remove(self, key: Key) -> None:
        st = self._st
        if self._where.pop(key) >= 0:
            st[5] -= 1
        elif len(self._logs[1]) > st[4]:
            # Keys promoted by one-key hits (which skip this check, being the hottest
            # call) and then removed, never walked past: keep T2's log bounded here.
            self._compact(1)

    def _first(self, lane: int) -> int:
        """The position of ``log[0]`` of T1 (``lane`` 0) or T2 (1)."""
        end = self._st[0] if lane == 0 else self._end2()
        return end - len(self._logs[lane])

    def _current_entries(self, lane: int, start: int, stop: int | None = None) -> list[Key]:
        """The keys whose current entry is in ``log[start:stop]`` of T1 (``lane`` 0) or
        T2 (1), in log order. ``start`` must not be before the log's gone prefix ends:
        a walk's compaction leaves copies of the keys it moved there, which would pass."""
        get, log = self._where.get, self._logs[lane]
        first = self._first(lane) + start  # the position of log[start]
        if lane == 0:
            return [k for i, k in enumerate(log[start:stop], first) if 0 <= get(k, -1) <= i]
        return [k for i, k in enumerate(log[start:stop], first) if ~i <= get(k, 0) < 0]

    def _compact(self, lane: int) -> None:
        """Drop the log's entries that are no longer current, keeping its order, once
        they are at least as many as the current ones; else check again later."""
        st, log = self._st, self._logs[lane]
        head = st[1 + lane]
        live = self._len1() if lane == 0 else len(self._where) - self._len1()
        if len(log) - head < 2 * live + MIN_LOG_TO_COMPACT:
            st[3 + lane] = head + 2 * live + MIN_LOG_TO_COMPACT
            return
        # From the gone prefix's end. The kept entries end where the log ended, so
        # positions only grow.
        log[:] = self._current_entries(lane, head)
        st[1 + lane] = 0
        st[3 + lane] = 2 * len(log) + MIN_LOG_TO_COMPACT

    def _walk(self, lane: int, n: int, evictable: Callable[[Key], bool]) -> tuple[list[Key], int]:
        """Up to ``n`` evictable keys of T1 (``lane`` 0) or T2 (1), oldest first, and
        the log index after the last entry walked if every current entry walked was
        returned (so all are gone once those keys are), else -1."""
        get, st, log = self._where.get, self._st, self._logs[lane]
        base, head, t1 = self._first(lane), st[1 + lane], lane == 0
        missing = -1 if t1 else 0
        found: list[Key] = []
        valid = dead = 0
        i = head - 1
        for i in range(head, len(log)):
            key = log[i]
            v = get(key, missing)
            pos = base + i
            if (0 <= v <= pos) if t1 else (~pos <= v < 0):
                valid += 1
                if evictable(key):
                    found.append(key)
                    if len(found) == n:
                        break
            elif valid == 0:
                head = i + 1
            else:
                dead += 1
        stop = i + 1
        if dead >= DEAD_ENTRIES_TO_COMPACT:
            # A key that may not go yet (pinned, storing) holds the front: move the
            # current entries of the walked stretch to its end, in order, so the next
            # walk does not pass the gone ones again. Costs what the walk did.
            keep = self._current_entries(lane, head, stop)
            log[stop - len(keep) : stop] = keep
            head = stop - len(keep)
        if head > MIN_LOG_TO_COMPACT and 2 * head > len(log):
            del log[:head]  # drop the gone prefix (the log's end stays)
            stop -= head
            head = 0
        st[1 + lane] = head
        return found, stop if valid == len(found) else -1

    def evict(self, n: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        if n <= 0:
            return []
        len1 = self._len1()
        len2 = len(self._where) - len1
        p = self.p
        # The first evictable keys of each list, up to n (the most either could give),
        # then each victim by the ARC rule on the sizes the lists would have after
        # the victims chosen so far. A list the rule would not reach is not walked.
        t1_first = len1 - n + 1 > p  # T1 for every victim, while it has evictable keys
        t2_first = len1 <= p  # T2 for every victim, while it has evictable keys
        free1: list[Key] = []
        free2: list[Key] = []
        end1 = end2 = -1
        if len1 and not t2_first:
            free1, end1 = self._walk(0, n, evictable)
        if len2 and not (t1_first and len(free1) == n):
            free2, end2 = self._walk(1, n - len(free1) if t1_first else n, evictable)
        if t2_first and len1 and len(free2) < n:
            free1, end1 = self._walk(0, n - len(free2), evictable)
        if len(free1) + len(free2) < n:
            return None
        if not free2:
            from1, from2, victims = free1, free2, free1
        elif not free1:
            from1, from2, victims = free1, free2, free2
        else:
            k1 = k2 = 0
            victims = []
            while k1 + k2 < n:
                if k2 == len(free2) or (k1 < len(free1) and len1 - k1 > p):
                    victims.append(free1[k1])
                    k1 += 1
                else:
                    victims.append(free2[k2])
                    k2 += 1
            from1, from2 = free1[:k1], free2[:k2]
        where, b1, b2, st = self._where, self.b1, self.b2, self._st
        for key in from1:
            del where[key]
            b1[key] = None
        for key in from2:
            del where[key]
            b2[key] = None
        st[5] -= len(from1)
        # A walk whose every current entry went: the next one starts after it.
        if end1 >= 0 and len(from1) == len(free1):
            st[1] = end1
        if end2 >= 0 and len(from2) == len(free2):
            st[2] = end2
        self._trim_ghosts()
        return victims

    def _trim_ghosts(self) -> None:
        c, b1, b2 = self.capacity, self.b1, self.b2
        len1, total = self._len1(), len(self._where)
        while b1 and len1 + len(b1) > c:
            b1.popitem(last=False)
        while b2 and total + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)

    @property
    def t1(self) -> list[Key]:
        """The keys of T1, oldest first (a copy)."""
        return self._current_entries(0, self._st[1])

    @property
    def t2(self) -> list[Key]:
        """The keys of T2, oldest first (a copy)."""
        return self._current_entries(1, self._st[2])

    def keys_in_eviction_order(self) -> list[Key]:
        """T1 then T2, each oldest first (the order when |T1| > p throughout)."""
        return self.t1 + self.t2


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
