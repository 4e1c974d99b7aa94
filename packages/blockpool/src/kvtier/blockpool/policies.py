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
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Hashable, Sequence
from heapq import heapify, heappop, heappush
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
        # (Walked through items(), which a caller's ordered dict may count.)
        candidates1 = (key for key, _ in t1.items() if evictable(key))
        candidates2 = (key for key, _ in t2.items() if evictable(key))
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


_GHOST_ITEM: tuple[float, int, Key] = (0.0, -1, _NO_KEY)
"""An evicted key's item: in no queue."""


class _Entry:
    """What frecency knows of a cached key or a ghost. A touch writes three fields in
    place: an object with slots holds them inline, one memory read away."""

    __slots__ = ("clock", "item", "order", "restored", "stored_at", "uses")

    def __init__(self, clock: float, order: int, item: tuple[float, int, Key]) -> None:
        self.uses: float = 0  # uses so far (halved as tuned)
        self.clock = clock  # the virtual clock at the last use
        self.stored_at = -1  # blocks stored before the last use (-1: never used)
        self.restored = False  # stored again since: its next use was a miss
        self.order = order  # order of the last use
        # Its item in the queue while cached: (score when queued, order, key);
        # _GHOST_ITEM while a ghost.
        self.item = item


class FrecencyPolicy:
    """Frequency with aging at the pace of reuse: keeps what many requests share and
    what comes back, and forgets both once they stop being used.

    A key's *score* is its *uses* (requests that used it, counted also while it was
    out of the cache) plus the value of a virtual *clock* at its last use; the lowest
    score goes first, ties in the order of last use. The clock advances by ``1 / tau``
    for each block stored, so one more use keeps a block as long as ``tau`` more
    stored blocks would. Two rules tune it, every ``capacity`` stored blocks or
    reuses seen as requests finish (``touch_prefix``):

    * ``tau`` is the median reuse distance (blocks stored between two uses of a key)
      seen lately, and at least the capacity (where the policy is LRU with frequency
      deciding between blocks of about the same age);
    * when fewer reuses hit than LRU would have served (reuses within ``capacity``
      stored blocks of the last use), every use count is halved: old frequency was
      keeping blocks that recency would have replaced.

    A request's keys are used tail first, so its head is never scored below its tail
    (it is used whenever the tail is) and eviction takes a prefix from its tail.
    Keys that left the cache keep their uses as *ghosts*, at most
    ``max(GHOST_KEYS, 4 * capacity)``, the first evicted forgotten first: a
    conversation that comes back after its blocks were evicted is known again.

    A use writes its key's entry and nothing else: each cached key is queued once, with
    the score it had when queued (a lower bound, as scores only grow between halvings).
    Eviction takes the lowest; a key used since it was queued is queued again with its
    score, any other goes. A key never seen before enters at the clock with no uses, so
    such keys arrive in score order: they wait in a FIFO (an append, not a heap push),
    and eviction takes the lower of its head and the heap's.
    """

    __slots__ = (
        "_distances",
        "_fresh",
        "_ghosts",
        "_heap",
        "_lead",
        "_next_tune",
        "_order",
        "_parked",
        "_parked_gen",
        "_reuses",
        "_seen",
        "capacity",
        "clock",
        "max_ghosts",
        "stored",
        "tau",
    )
    name = "frecency"
    GHOST_KEYS = 64_000
    """Ghosts remembered at least (as many keys as vLLM's admission tracker counts)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.max_ghosts = max(self.GHOST_KEYS, 4 * self.capacity)
        self.tau = float(self.capacity)
        self.clock = 0.0  # the virtual clock: + 1 / tau per stored block
        self.stored = 0  # blocks stored so far: reuse distances are counted in them
        self._order = 0  # uses so far, to order equal scores
        self._next_tune = self.capacity
        self._seen: dict[Key, _Entry] = {}  # cached keys and ghosts -> entry
        self._ghosts: OrderedDict[Key, None] = OrderedDict()  # first evicted first
        self._heap: list[tuple[float, int, Key]] = []
        # Keys never seen before, queued in insertion order, which is their score order.
        self._fresh: deque[tuple[float, int, Key]] = deque()
        self._distances = [0] * 64  # reuse distances by bit length, halved as tuned
        # Since the last tuning: reuses seen as requests finished, and how many more of
        # them hit than LRU would have hit.
        self._reuses = self._lead = 0
        # Queued keys an eviction found unevictable (storing or pinned), kept out of the
        # heap while the pool's generation says no key became evictable since.
        self._parked: list[tuple[float, int, Key]] = []
        self._parked_gen: int | None = None

    def insert(self, keys: Sequence[Key]) -> None:
        """``keys`` entered the cache; a ghost gets its uses back."""
        seen, ghosts, heap, fresh = self._seen, self._ghosts, self._heap, self._fresh
        clock, order = self.clock, self._order
        for key in reversed(keys):  # the tail first: it goes first among equals
            entry = seen.get(key)
            order += 1
            if entry is None:
                item = (clock, order, key)
                seen[key] = _Entry(clock, order, item)
                fresh.append(item)
                continue
            if ghosts.pop(key, _NO_KEY) is not _NO_KEY and entry.stored_at >= 0:
                entry.restored = True  # stored again: its next use was a miss
            item = entry.item = (entry.uses + entry.clock, entry.order, key)
            heappush(heap, item)
        self._order = order
        self.stored += len(keys)
        self.clock += len(keys) / self.tau
        if self.stored >= self._next_tune:
            self._tune()

    def touch(self, keys: Sequence[Key]) -> None:
        """``keys`` were used, head first: each counts one use. vLLM before 0.32 calls
        this for a request's keys at every store, so it is kept lean: it feeds neither
        the reuse distances nor the comparison with LRU. Unknown keys are ignored."""
        clock, order = self.clock, self._order
        for entry in map(self._seen.get, reversed(keys)):
            if entry is not None:
                order += 1
                entry.uses += 1
                entry.clock = clock
                entry.order = order
        self._order = order

    def touch_prefix(self, keys: Sequence[Key], reused: Collection[Key]) -> None:
        """A request finished with ``keys`` (head first): each counts one use, whether
        the request stored it or reused it; a reuse records its distance and whether
        it hit where LRU would have. Unknown keys are ignored."""
        distances = self._distances
        clock, now, capacity, order = self.clock, self.stored, self.capacity, self._order
        reuses = lead = 0  # lead: reuses that hit, less those LRU would have hit
        for entry in map(self._seen.get, reversed(keys)):
            if entry is None:
                continue
            if entry.stored_at >= 0:  # used before: a reuse
                distance = now - entry.stored_at
                distances[distance.bit_length()] += 1
                reuses += 1
                lead += (not entry.restored) - (distance <= capacity)
                entry.restored = False
            order += 1
            entry.uses += 1
            entry.clock = clock
            entry.stored_at = now
            entry.order = order
        self._order = order
        self._lead += lead
        self._reuses += reuses
        if self._reuses >= capacity:
            self._tune()

    def remove(self, key: Key) -> None:
        """``key`` left the cache other than by ``evict``; it leaves no ghost."""
        del self._seen[key]

    def evict(
        self,
        n: int,
        evictable: Callable[[Key], bool],
        *,
        generation: int | None = None,
        protected: Collection[Key] = (),
    ) -> list[Key] | None:
        """Take the ``n`` evictable keys of lowest score, none of ``protected``; they
        become ghosts.

        Returns them lowest first, or ``None`` (changing nothing but the heap's
        queued scores) when fewer than ``n`` keys are evictable.

        With ``generation`` (a count the caller raises whenever a key may have become
        evictable), keys found unevictable are parked out of the heap until the count
        changes, so a run of evictions while many keys are storing or pinned does not
        go over them each time. The keys chosen are the same either way.
        """
        if n <= 0:
            return []
        heap, fresh, seen = self._heap, self._fresh, self._seen
        parked = self._parked
        if parked and (generation is None or generation != self._parked_gen):
            for item in parked:  # some may be evictable now: queue them again
                heappush(heap, item)
            parked.clear()
        self._parked_gen = generation
        park = parked.append if generation is not None else None
        victims: list[_Entry] = []
        refused: list[tuple[float, int, Key]] = []
        while len(victims) < n and (heap or fresh):
            from_fresh = fresh and (not heap or fresh[0] < heap[0])
            item = fresh.popleft() if from_fresh else heappop(heap)
            key = item[2]
            entry = seen.get(key)
            if entry is None or entry.item is not item:
                continue  # the key left the cache
            if entry.order != item[1]:  # used since it was queued: queue it anew
                item = entry.item = (entry.uses + entry.clock, entry.order, key)
                heappush(heap, item)
            elif key in protected:
                refused.append(item)
            elif evictable(key):
                victims.append(entry)
            elif park is not None:
                park(item)
            else:
                refused.append(item)
        for item in refused:
            heappush(heap, item)
        if len(victims) < n:
            for entry in victims:
                heappush(heap, entry.item)
            return None
        ghosts = self._ghosts
        keys = []
        for entry in victims:
            key = entry.item[2]
            entry.item = _GHOST_ITEM
            ghosts[key] = None
            keys.append(key)
        while len(ghosts) > self.max_ghosts:
            del seen[ghosts.popitem(last=False)[0]]
        return keys

    def _tune(self) -> None:
        """Halve the uses if LRU would have hit more reuses since the last tuning; set
        ``tau`` to the median reuse distance (at least the capacity), then halve the
        distance counts, so that older distances weigh less."""
        self._next_tune = self.stored + self.capacity
        if self._lead < 0:
            self._halve_uses()
        self._reuses = self._lead = 0
        distances = self._distances
        half = sum(distances) / 2
        median = below = 0.0
        for bits, count in enumerate(distances):
            if count and below + count >= half:
                low = 1 << bits >> 1  # distances of this bit length: [low, 2 * low)
                median = low + max(1, low) * (half - below) / count
                break
            below += count
        self.tau = max(float(self.capacity), median)
        self._distances = [count // 2 for count in distances]

    def _halve_uses(self) -> None:
        """Halve every key's uses and queue the cached keys anew with their scores."""
        heap: list[tuple[float, int, Key]] = []
        for entry in self._seen.values():
            entry.uses /= 2
            if entry.item is not _GHOST_ITEM:
                entry.item = (entry.uses + entry.clock, entry.order, entry.item[2])
                heap.append(entry.item)
        heapify(heap)
        self._heap = heap
        self._fresh.clear()
        self._parked.clear()  # every cached key is queued anew above

    def score(self, key: Key) -> float:
        """``key``'s score now (cached keys and ghosts)."""
        entry = self._seen[key]
        return float(entry.uses + entry.clock)

    def keys_in_eviction_order(self) -> list[Key]:
        """Cached keys, lowest score first, ties in the order of their last use."""
        return [
            key
            for _, _, key in sorted(
                (entry.uses + entry.clock, entry.order, key)
                for key, entry in self._seen.items()
                if entry.item is not _GHOST_ITEM
            )
        ]


POLICIES: dict[str, type] = {"lru": LRUPolicy, "arc": ARCPolicy, "frecency": FrecencyPolicy}


def finish_request(policy: EvictionPolicy, keys: Sequence[Key], reused: Collection[Key]) -> None:
    """Tell ``policy`` a request finished with ``keys`` (head first), having reused the
    keys in ``reused``: its ``touch_prefix`` where it has one, else ``touch``."""
    touch_prefix = getattr(policy, "touch_prefix", None)
    if touch_prefix is None:
        policy.touch(keys)
    else:
        touch_prefix(keys, reused)


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
