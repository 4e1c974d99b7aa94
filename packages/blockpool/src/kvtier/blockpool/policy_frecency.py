"""The frecency eviction policy: frequency with aging at the pace of reuse (the
pool's default; the package README says why)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from heapq import heapify, heappop, heappush
from math import ldexp
from typing import Any, NamedTuple

from kvtier.blockpool.policy_base import NO_KEY, Key

_GHOST_ITEM: tuple[float, int, Key] = (0.0, -1, NO_KEY)
"""An evicted key's item: in no queue."""


class FrecencyEntry(NamedTuple):
    """What frecency knows of a cached key or a ghost (:meth:`FrecencyPolicy.entry`)."""

    uses: float  # uses so far (halved as tuned)
    halvings: int  # the policy's halvings so far, all applied to ``uses``
    clock: float  # the virtual clock at the last use
    stored_at: int  # blocks stored before the last use (-1: never used)
    restored: bool  # stored again since: its next use was a miss
    order: int  # order of the last use
    # Its item in the queue while cached: (scaled score when queued, order, key; see
    # FrecencyPolicy), _GHOST_ITEM while a ghost.
    item: tuple[float, int, Key]


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

    A halving writes no key's uses: each use adds ``2 ** e`` to a key's scaled uses,
    ``e`` being the halvings so far, and keys are ordered by the scaled score, ``scaled
    uses + 2 ** e * clock``, which is the score times ``2 ** e``: the same order and,
    scaling by a power of two being exact, the same floating-point comparisons. A
    halving raises ``e``, so a use counts twice as much as every earlier one, which is
    what halving the earlier ones does; ghosts need nothing, and no use checks for
    halvings it missed. The cached keys are then queued anew with their scaled scores
    (left to evictions, each stale key would be popped and pushed again, at several
    times the cost). Every ``RESCALE_HALVINGS`` halvings every entry's scaled uses are
    scaled back and ``e`` starts from 0 again.

    Below ``INCREMENTAL_KEYS`` of capacity the halving's call queues them anew in one
    pass. From there on that pass would be one call of milliseconds (0.05-0.2 s at
    100,000 keys), so the queues of the next scale (``2 ** (e + 1)``) are built ahead,
    a few rows per stored block and per reuse between tunings: a *spare* heap, FIFO and
    item per row, kept as the main ones are (a key inserted or stored again is queued
    in both, one evicted or forgotten leaves both, and the items of evicted keys are
    dropped from the spare queues' heads as evictions go). A halving swaps the spare
    queues in; a spare item older than its key's last use is a lower bound of its score
    there too, and is queued anew when popped, as any item is. The walk over the rows
    starts again after each halving (and after a tuning that did not halve, once the
    spare queues hold twice the cached keys); tunings are ``capacity`` stored blocks or
    reuses apart, and the walk takes ``ceil(rows / capacity)`` rows a block or reuse,
    so it has gone over every row by the next one (a halving called sooner ends it).
    The queues swapped out are freed as calls store or reuse, by the next tuning too.
    The halving that scales the uses back (every ``RESCALE_HALVINGS``) is one pass.

    A use writes its key's entry and nothing else: each cached key is queued once, with
    the scaled score it had when queued (a lower bound, as scores only grow between
    halvings). Eviction takes the lowest; a key used since it was queued is queued
    again with its score, any other goes. A key never seen before
    enters at the clock with no uses, so such keys arrive in score order: they wait in a
    FIFO (an append, not a heap push), and eviction takes the lower of its head and the
    heap's.

    Each key's entry is a row of seven lists (a row number per key, rows of forgotten
    keys used again), not an object: the garbage collector tracks no object per key,
    so a full collection in a process holding millions of keys (an fs tier's index,
    its ghosts) does not go over each of them, as it would go over an object each.
    """

    __slots__ = (
        "_clocks",
        "_distances",
        "_exponent",
        "_free",
        "_fresh",
        "_ghosts",
        "_grave_step",
        "_graves",
        "_halvings",
        "_heap",
        "_items",
        "_lead",
        "_next_tune",
        "_order",
        "_orders",
        "_restored",
        "_reuses",
        "_scale",
        "_seen",
        "_spare_fresh",
        "_spare_heap",
        "_spare_items",
        "_stored_at",
        "_uses",
        "_walk",
        "_walk_end",
        "_walk_step",
        "capacity",
        "clock",
        "max_ghosts",
        "parked",
        "stored",
        "tau",
    )
    name = "frecency"
    GHOST_KEYS = 64_000
    """Ghosts remembered at least (as many keys as vLLM's admission tracker counts)."""
    RESCALE_HALVINGS = 512
    """Halvings after which the scaled uses and scores are scaled back (``2 ** 512``
    times a clock of ``2 ** 400`` stays far from the largest float)."""
    GRAVE_SLICE = 4096
    """Items of the queues swapped out freed at least per call that stores or reuses
    (freeing 100,000 at once takes about a millisecond); more where the call stores
    or reuses more, so that all are freed by the next tuning."""
    INCREMENTAL_KEYS = 4096
    """Capacity from which the queues of a halving are built ahead (see the class):
    below it, queueing every cached key anew takes a few milliseconds at most."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.max_ghosts = max(self.GHOST_KEYS, 4 * self.capacity)
        self.tau = float(self.capacity)
        self.clock = 0.0  # the virtual clock: + 1 / tau per stored block
        self.stored = 0  # blocks stored so far: reuse distances are counted in them
        self._order = 0  # uses so far, to order equal scores
        self._next_tune = self.capacity
        self._seen: dict[Key, int] = {}  # cached keys and ghosts -> their entry's row
        # The entries, a list per field, by row (uses scaled by 2 ** exponent, see the
        # class); rows to use again.
        self._uses: list[float] = []
        self._clocks: list[float] = []
        self._stored_at: list[int] = []
        self._restored: list[bool] = []
        self._orders: list[int] = []
        self._items: list[tuple[float, int, Key]] = []
        self._free: list[int] = []
        self._ghosts: OrderedDict[Key, None] = OrderedDict()  # first evicted first
        self._heap: list[tuple[float, int, Key]] = []
        # Keys never seen before, queued in insertion order, which is their score order.
        self._fresh: deque[tuple[float, int, Key]] = deque()
        self._distances = [0] * 64  # reuse distances by bit length, halved as tuned
        # Since the last tuning: reuses seen as requests finished, and how many more of
        # them hit than LRU would have hit.
        self._reuses = self._lead = 0
        # Queued keys an eviction with ``park`` found unevictable (storing or pinned),
        # with their items: out of the heap until the caller unparks them. (The same
        # dict for the policy's life: a pool checks it before calling unpark.)
        self.parked: dict[Key, tuple[float, int, Key]] = {}
        self._halvings = 0  # halvings of the uses so far
        self._exponent = 0  # halvings since the entries were last scaled back
        self._scale = 1.0  # 2 ** exponent: what a use adds to the scaled uses
        # The queues of the next scale, built ahead (capacities of INCREMENTAL_KEYS on,
        # see the class): each row's item in them (_GHOST_ITEM: none), the heap and the
        # FIFO; the walk over the rows that builds them (rows below _walk_end not
        # walked yet from _walk on, _walk_step a stored block or reuse). Unused below.
        self._spare_items: list[tuple[float, int, Key]] | None = (
            [] if self.capacity >= self.INCREMENTAL_KEYS else None
        )
        self._spare_heap: list[tuple[float, int, Key]] = []
        self._spare_fresh: deque[tuple[float, int, Key]] = deque()
        self._walk = self._walk_end = 0
        self._walk_step = 1
        self._graves: list[list[Any] | deque[Any]] = []  # queues swapped out, to free
        self._grave_step = 1  # their items to free per stored block or reuse

    def _new(self, clock: float, order: int, item: tuple[float, int, Key]) -> int:
        """A new entry's row: no uses, last used now (``clock``, ``order``), queued as
        ``item`` (and in the spare FIFO at the next scale)."""
        spare_items = self._spare_items
        spare = _GHOST_ITEM
        free = self._free
        if spare_items is not None and (
            not free or not self._walk <= free[-1] < self._walk_end  # (else walked)
        ):
            spare = (2.0 * item[0], order, item[2])
            self._spare_fresh.append(spare)
        if free:
            row = free.pop()
            self._uses[row] = 0
            self._clocks[row] = clock
            self._stored_at[row] = -1
            self._restored[row] = False
            self._orders[row] = order
            self._items[row] = item
            if spare_items is not None:
                spare_items[row] = spare
            return row
        self._uses.append(0)
        self._clocks.append(clock)
        self._stored_at.append(-1)
        self._restored.append(False)
        self._orders.append(order)
        self._items.append(item)
        if spare_items is not None:
            spare_items.append(spare)
        return len(self._items) - 1

    def _add_rows(self, added: list[tuple[float, int, Key]], clocks: list[float]) -> None:
        """The entries of new keys queued as ``added`` (their items, in order), last
        used at ``clocks`` (one each), in the next rows: what :meth:`_new` does for each
        with no free row, together."""
        n = len(added)
        self._uses += [0] * n
        self._clocks += clocks
        self._stored_at += [-1] * n
        self._restored += [False] * n
        self._orders += [item[1] for item in added]
        self._items += added
        self._fresh += added
        spare_items = self._spare_items
        if spare_items is not None:  # (no free row: none was walked)
            spares = [(2.0 * item[0], item[1], item[2]) for item in added]
            self._spare_fresh += spares
            spare_items += spares

    def _spare(self, row: int, key: Key) -> None:
        """Queue ``key`` (row ``row``, cached again) in the spare heap with its score at
        the next scale, unless the walk has its row still to go over."""
        if self._walk <= row < self._walk_end:
            return
        spare = (self._uses[row] + 2.0 * self._scale * self._clocks[row], self._orders[row], key)
        heappush(self._spare_heap, spare)
        self._spare_items[row] = spare  # type: ignore[index]

    def _walk_rows(self, n: int) -> None:
        """Walk ``n`` rows more (see the class): each cached key's row queues it in the
        spare heap. (A row of a ghost or of no key has no spare item already: a key
        leaves both queues' rows as it becomes a ghost or is forgotten.)"""
        start = self._walk
        end = min(self._walk_end, start + n)
        self._walk = end
        items, spare_items = self._items, self._spare_items
        assert spare_items is not None
        uses, clocks, orders = self._uses, self._clocks, self._orders
        heap, next_scale = self._spare_heap, 2.0 * self._scale
        for row in range(start, end):
            item = items[row]
            if item is not _GHOST_ITEM:
                spare = (uses[row] + next_scale * clocks[row], orders[row], item[2])
                heappush(heap, spare)
                spare_items[row] = spare

    def _drop_dead_spares(self, most: int) -> None:
        """Drop up to ``most`` items of keys evicted (or queued again) from the heads of
        the spare queues: evictions take the lowest scores, so such items gather there,
        and swapped in, one eviction would pop them all."""
        seen, spare_items = self._seen, self._spare_items
        assert spare_items is not None
        heap, fresh = self._spare_heap, self._spare_fresh
        while most > 0 and heap:
            row = seen.get(heap[0][2])
            if row is not None and spare_items[row] is heap[0]:
                break
            heappop(heap)
            most -= 1
        while most > 0 and fresh:
            row = seen.get(fresh[0][2])
            if row is not None and spare_items[row] is fresh[0]:
                break
            fresh.popleft()
            most -= 1

    def _start_walk(self, *, bury: bool) -> None:
        """Build the spare queues anew, from the next stored block or reuse on; with
        ``bury``, the spare queues left are freed a slice at a time."""
        if bury:
            self._bury(self._spare_heap, self._spare_fresh)
        self._spare_heap = []
        self._spare_fresh = deque()
        self._walk = 0
        self._walk_end = len(self._items)
        self._walk_step = -(-self._walk_end // self.capacity)

    def _bury(self, *queues: list[Any] | deque[Any]) -> None:
        """Free ``queues`` as calls store or reuse (:meth:`_free_graves`)."""
        graves = self._graves
        graves += [q for q in queues if q]
        self._grave_step = -(-sum(map(len, graves)) // self.capacity)

    def _free_graves(self, units: int) -> None:
        """Free items of the queues swapped out: ``GRAVE_SLICE``, or as many per stored
        block or reuse of the call (``units``) as free them all within ``capacity``."""
        graves, most = self._graves, max(self.GRAVE_SLICE, units * self._grave_step)
        while graves and most > 0:
            queue = graves[-1]
            n = min(most, len(queue))
            if isinstance(queue, list):
                del queue[len(queue) - n :]
            else:
                pop = queue.pop
                for _ in range(n):
                    pop()
            most -= n
            if not queue:
                graves.pop()

    def _forget(self, key: Key) -> None:
        """Drop ``key``'s entry (KeyError if it has none); its row is used again."""
        row = self._seen.pop(key)
        self._items[row] = _GHOST_ITEM  # (holds no key)
        if self._spare_items is not None:
            self._spare_items[row] = _GHOST_ITEM
        self._free.append(row)

    def entry(self, key: Key) -> FrecencyEntry | None:
        """``key``'s entry as it is now, or None: a copy, for tests and inspection."""
        row = self._seen.get(key)
        if row is None:
            return None
        return FrecencyEntry(
            ldexp(self._uses[row], -self._exponent),
            self._halvings,
            self._clocks[row],
            self._stored_at[row],
            self._restored[row],
            self._orders[row],
            self._items[row],
        )

    def insert(self, keys: Sequence[Key]) -> None:
        """``keys`` entered the cache; a ghost gets its uses back."""
        seen, ghosts, heap, fresh = self._seen, self._ghosts, self._heap, self._fresh
        uses, clocks, orders, items = self._uses, self._clocks, self._orders, self._items
        stored_at, scale, free = self._stored_at, self._scale, self._free
        clock, order = self.clock, self._order
        at_clock = scale * clock  # a new key's scaled score
        # New keys once no free row is left take the next rows in turn: their entries
        # are added together (a list extend per field, not an append per key and field).
        added: list[tuple[float, int, Key]] = []
        base = len(items)  # the first row of ``added``
        for key in reversed(keys):  # the tail first: it goes first among equals
            row = seen.get(key)
            order += 1
            if row is None:
                item = (at_clock, order, key)
                if free:
                    seen[key] = self._new(clock, order, item)
                    fresh.append(item)
                else:
                    seen[key] = base + len(added)
                    added.append(item)
                continue
            if row >= base:  # a key given twice, added above: its entry must exist now
                self._add_rows(added, [clock] * len(added))
                base, added = len(items), []
            if ghosts.pop(key, NO_KEY) is not NO_KEY and stored_at[row] >= 0:
                self._restored[row] = True  # stored again: its next use was a miss
            item = items[row] = (uses[row] + scale * clocks[row], orders[row], key)
            heappush(heap, item)
            if self._spare_items is not None:
                self._spare(row, key)
        if added:
            self._add_rows(added, [clock] * len(added))
        self._order = order
        self.stored += len(keys)
        self.clock += len(keys) / self.tau
        if self._walk < self._walk_end:
            self._walk_rows(len(keys) * self._walk_step)
        if self._graves:
            self._free_graves(len(keys))
        if self.stored >= self._next_tune:
            self._tune()

    def insert_each(self, keys: Sequence[Key]) -> None:
        """``insert([key])`` for each of ``keys`` in turn, in one call: the same
        scores, order, clock and tunings (a tier indexes the files a poll found written
        so, in the order they landed)."""
        seen, ghosts = self._seen, self._ghosts
        n = len(keys)
        if (
            n > 1
            and not self._free
            and self._walk >= self._walk_end
            and self.stored + n < self._next_tune
            and seen.keys().isdisjoint(keys)
            and len(set(keys)) == n
        ):
            # (Most calls: new keys, no free row, no walk and no tuning before the last
            # key: their entries are added together, each with its own clock.)
            self._add_new_each(keys)
            if self._graves:
                self._free_graves(n)
            return
        uses, clocks, orders = self._uses, self._clocks, self._orders
        for key in keys:
            row = seen.get(key)
            order = self._order = self._order + 1
            clock = self.clock
            # (A tuning may halve: read the scale, and the items swapped in, each key.)
            scale, items = self._scale, self._items
            if row is None:
                item = (scale * clock, order, key)
                seen[key] = self._new(clock, order, item)
                self._fresh.append(item)
            else:
                if ghosts.pop(key, NO_KEY) is not NO_KEY and self._stored_at[row] >= 0:
                    self._restored[row] = True  # stored again: its next use was a miss
                item = items[row] = (uses[row] + scale * clocks[row], orders[row], key)
                heappush(self._heap, item)
                if self._spare_items is not None:
                    self._spare(row, key)
            self.stored += 1
            self.clock = clock + 1 / self.tau
            if self._walk < self._walk_end:
                self._walk_rows(self._walk_step)
            if self.stored >= self._next_tune:
                self._tune()
        if self._graves:
            self._free_graves(len(keys))

    def _add_new_each(self, keys: Sequence[Key]) -> None:
        """:meth:`insert_each` of ``keys``, all new and distinct, where no row is free,
        no walk goes on and no tuning comes before the last one: each key queued at the
        clock it is stored at (the clock moves by ``1 / tau`` a key, added in turn as one
        at a time adds it), in the next rows, together."""
        seen, scale, tau = self._seen, self._scale, self.tau
        clock, order = self.clock, self._order
        base = len(self._items)
        at: list[float] = []
        added: list[tuple[float, int, Key]] = []
        for row, key in enumerate(keys, base):
            order += 1
            at.append(clock)
            added.append((scale * clock, order, key))
            seen[key] = row
            clock = clock + 1 / tau
        self._add_rows(added, at)
        self._order = order
        self.clock = clock
        self.stored += len(keys)

    def touch(self, keys: Sequence[Key]) -> None:
        """``keys`` were used, head first: each counts one use. vLLM before 0.32 calls
        this for a request's keys at every store, so it is kept lean: it feeds neither
        the reuse distances nor the comparison with LRU. Unknown keys are ignored."""
        clock, order, scale = self.clock, self._order, self._scale
        uses, clocks, orders = self._uses, self._clocks, self._orders
        for row in map(self._seen.get, reversed(keys)):
            if row is not None:
                order += 1
                uses[row] += scale
                clocks[row] = clock
                orders[row] = order
        self._order = order

    def touch_prefix(self, keys: Sequence[Key], reused: Collection[Key]) -> None:
        """A request finished with ``keys`` (head first): each counts one use, whether
        the request stored it or reused it; a reuse records its distance and whether
        it hit where LRU would have. Unknown keys are ignored."""
        distances = self._distances
        clock, now, capacity, order = self.clock, self.stored, self.capacity, self._order
        scale = self._scale
        uses, clocks, orders = self._uses, self._clocks, self._orders
        stored_at, restored = self._stored_at, self._restored
        reuses = lead = 0  # lead: reuses that hit, less those LRU would have hit
        for row in map(self._seen.get, reversed(keys)):
            if row is None:
                continue
            last = stored_at[row]
            if last >= 0:  # used before: a reuse
                distance = now - last
                distances[distance.bit_length()] += 1
                reuses += 1
                lead += (not restored[row]) - (distance <= capacity)
                restored[row] = False
            order += 1
            uses[row] += scale
            clocks[row] = clock
            stored_at[row] = now
            orders[row] = order
        self._order = order
        self._lead += lead
        self._reuses += reuses
        if reuses and self._walk < self._walk_end:
            self._walk_rows(reuses * self._walk_step)
        if self._graves:
            self._free_graves(reuses)
        if self._reuses >= capacity:
            self._tune()

    def remove(self, key: Key) -> None:
        """``key`` left the cache other than by ``evict``; it leaves no ghost."""
        self._forget(key)
        if self.parked:
            self.parked.pop(key, None)

    def unpark(self, keys: Iterable[Key]) -> None:
        """``keys`` may be evictable now (stored, or their last pin ended): those an
        eviction parked are queued again."""
        parked = self.parked
        if parked:
            heap = self._heap
            for key in keys:
                item = parked.pop(key, None)
                if item is not None:
                    heappush(heap, item)

    def evict(
        self,
        n: int,
        evictable: Callable[[Key], bool],
        *,
        park: bool = False,
        protected: Collection[Key] = (),
    ) -> list[Key] | None:
        """Take the ``n`` evictable keys of lowest score, none of ``protected``; they
        become ghosts.

        Returns them lowest first, or ``None`` (changing nothing but the heap's
        queued scores) when fewer than ``n`` keys are evictable.

        With ``park``, keys found unevictable are parked out of the heap until the
        caller names them to :meth:`unpark`, which it must do for every key that may
        have become evictable: evictions while many keys are storing or pinned (a slow
        tier's writes pin up to three quarters of a pool) do not go over them each
        time. The keys chosen are the same either way.
        """
        if n <= 0:
            return []
        heap, fresh, seen = self._heap, self._fresh, self._seen
        uses, clocks, orders, items = self._uses, self._clocks, self._orders, self._items
        parked, scale = self.parked, self._scale
        if parked and not park:  # a caller that does not unpark: queue them again
            for item in parked.values():
                heappush(heap, item)
            parked.clear()
        victims: list[int] = []  # their rows
        refused: list[tuple[float, int, Key]] = []
        while len(victims) < n and (heap or fresh):
            from_fresh = fresh and (not heap or fresh[0] < heap[0])
            item = fresh.popleft() if from_fresh else heappop(heap)
            key = item[2]
            row = seen.get(key)
            if row is None or items[row] is not item:
                continue  # the key left the cache
            if orders[row] != item[1]:  # used since it was queued: queue it anew
                item = items[row] = (uses[row] + scale * clocks[row], orders[row], key)
                heappush(heap, item)
            elif key in protected:
                refused.append(item)
            elif evictable(key):
                victims.append(row)
            elif park:
                parked[key] = item
            else:
                refused.append(item)
        for item in refused:
            heappush(heap, item)
        if len(victims) < n:
            for row in victims:
                heappush(heap, items[row])
            return None
        ghosts = self._ghosts
        spare_items = self._spare_items
        keys = []
        for row in victims:
            key = items[row][2]
            items[row] = _GHOST_ITEM
            if spare_items is not None:
                spare_items[row] = _GHOST_ITEM
            ghosts[key] = None
            keys.append(key)
        if spare_items is not None:
            self._drop_dead_spares(2 * n + 2)
        while len(ghosts) > self.max_ghosts:
            self._forget(ghosts.popitem(last=False)[0])
        return keys

    def _tune(self) -> None:
        """Halve the uses if LRU would have hit more reuses since the last tuning; set
        ``tau`` to the median reuse distance (at least the capacity), then halve the
        distance counts, so that older distances weigh less."""
        self._next_tune = self.stored + self.capacity
        if self._lead < 0:
            self._halve_uses()
        elif (
            self._spare_items is not None
            and len(self._spare_heap) + len(self._spare_fresh)
            > 2 * (len(self._seen) - len(self._ghosts))  # twice the cached keys
        ):
            self._start_walk(bury=True)  # drop the spare items of keys long gone
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
        """Halve every key's uses: from now on a use counts twice as much as any before
        (see the class). Every ``RESCALE_HALVINGS`` halvings, the entries are scaled
        back (:meth:`_requeue`)."""
        self._halvings += 1
        self._exponent += 1
        spare_items = self._spare_items
        if self._exponent >= self.RESCALE_HALVINGS:
            exponent, uses = self._exponent, self._uses
            for row in self._seen.values():
                uses[row] = ldexp(uses[row], -exponent)
            self._exponent = 0
        elif spare_items is not None:
            # The spare queues are those of this scale: swapped in (the walk is done
            # unless tunings came closer than the class says; then it ends here).
            self._walk_rows(self._walk_end - self._walk)
            self._scale = ldexp(1.0, self._exponent)
            self._items, self._spare_items = spare_items, self._items
            self._bury(self._heap, self._fresh)
            self._heap, self._fresh = self._spare_heap, self._spare_fresh
            self.parked.clear()  # every cached key is queued in the spare heap
            self._start_walk(bury=False)
            return
        self._scale = ldexp(1.0, self._exponent)
        self._requeue()
        if spare_items is not None:
            self._start_walk(bury=True)

    def _requeue(self) -> None:
        """Queue every cached key anew with its scaled score, in one heap: after a
        halving each queued score is stale, and re-queueing them one by one as
        evictions pop them costs several times this pass. The cached keys are those
        with a queued item that is still theirs (in the heap, the FIFO or parked)."""
        seen, scale = self._seen, self._scale
        uses, clocks, orders, items = self._uses, self._clocks, self._orders, self._items
        heap: list[tuple[float, int, Key]] = []
        append = heap.append
        for queue in (self._heap, self._fresh, self.parked.values()):
            for item in queue:
                key = item[2]
                row = seen.get(key)
                if row is not None and items[row] is item:
                    item = items[row] = (uses[row] + scale * clocks[row], orders[row], key)
                    append(item)
        heapify(heap)
        self._heap = heap
        self._fresh.clear()
        self.parked.clear()  # every cached key is queued anew above

    def score(self, key: Key) -> float:
        """``key``'s score now (cached keys and ghosts)."""
        row = self._seen[key]
        return ldexp(self._uses[row] + self._scale * self._clocks[row], -self._exponent)

    def keys_in_eviction_order(self) -> list[Key]:
        """Cached keys, lowest score first, ties in the order of their last use."""
        uses, clocks, orders, items = self._uses, self._clocks, self._orders, self._items
        scale = self._scale
        return [
            key
            for _, _, key in sorted(
                (uses[row] + scale * clocks[row], orders[row], key)
                for key, row in self._seen.items()
                if items[row] is not _GHOST_ITEM
            )
        ]
