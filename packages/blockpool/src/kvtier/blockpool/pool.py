"""The host block pool: a fixed set of host blocks, a keyed cache over them, and
blocks owned by requests, all drawn from one capacity.

Every block is in exactly one state:

* ``FREE``: in the allocator;
* ``STORING``: given out by ``prepare_store``, its bytes are being written;
  not findable by ``lookup`` and never evicted until ``complete_store``;
* ``CACHED``: holds the bytes of its key; evictable unless held;
* ``OWNED``: held by a request (``allocate_owned``), outside the keyed cache.

So ``free + storing + cached + owned == capacity`` at all times. A block is *held*
for a reason, a :class:`~kvtier.blockpool.holds.Hold` (a device load, a secondary
tier's write, a promotion waiting for its load, a lookup pass, a timed-out tier
read, a transfer of an owned block): by key (``hold(keys, kind)`` ..
``release(keys, kind)``; vLLM's ``prepare_load`` .. ``complete_load`` is the same
with no reason named) or by block id (``hold_blocks`` .. ``release_blocks``). A held
block is never evicted and never handed out again; the pool counts holds per kind
(``held``, ``PoolStats.holds``). :mod:`kvtier.blockpool.holds` keeps that
bookkeeping.

Keys are any hashable values (vLLM's block hashes are ``bytes``). Units: blocks.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from typing import Any

from kvtier.blockpool.allocator import RunAllocator
from kvtier.blockpool.budget import require_positive_int
from kvtier.blockpool.holds import Hold, PoolHolds
from kvtier.blockpool.policies import (
    ARCPolicy,
    EvictionPolicy,
    FrecencyPolicy,
    LRUPolicy,
    finish_request,
    make_policy,
)
from kvtier.blockpool.records import (
    ALLOCATION_BUCKETS,
    FREE,
    KEYED,
    OWNED,
    CacheEvent,
    PoolStats,
    StorePlan,
)

# Policies whose evictions park the keys they find unevictable (``evict(park=True)``,
# ``unpark``, ``parked``): exactly these classes, not subclasses, which may override
# eviction without parking.
PARKING_POLICIES = (FrecencyPolicy, LRUPolicy, ARCPolicy)

__all__ = [
    "ALLOCATION_BUCKETS",
    "CacheEvent",
    "Hold",
    "HostBlockPool",
    "PoolStats",
    "StorePlan",
]


class HostBlockPool(PoolHolds):
    """A fixed set of ``num_blocks`` host blocks with a keyed cache and request-owned blocks.

    Args:
        num_blocks: capacity in blocks (see ``resolve_budget``).
        eviction_policy: ``"frecency"`` (the default), ``"lru"`` or ``"arc"``.
        cache_policy_module_path: ``"pkg.module:Class"`` of a custom policy (overrides the name).
        policy: a policy built already (overrides both), for the capacity ``num_blocks``.
        enable_events: record ``CacheEvent``s for ``take_events``.

    To store only keys asked for often enough, wrap the pool in a ``StoreAdmissionFilter``.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        eviction_policy: str = "frecency",
        cache_policy_module_path: str | None = None,
        policy: EvictionPolicy | None = None,
        enable_events: bool = False,
    ) -> None:
        self.num_blocks = require_positive_int("num_blocks", num_blocks)
        self.policy: EvictionPolicy = (
            policy
            if policy is not None
            else make_policy(eviction_policy, self.num_blocks, cache_policy_module_path)
        )
        self._alloc = RunAllocator(self.num_blocks)
        # Every policy of the package parks the keys an eviction finds storing or pinned; they are
        # unparked as their store completes or their last pin ends (the policy's parked
        # dict, or an empty one that stays so: checked before any call).
        self._parking = self.policy if type(self.policy) in PARKING_POLICIES else None
        self._parked: dict[Any, Any] = {} if self._parking is None else self._parking.parked
        # key -> block for cached keys, ~block (< 0) for keys being stored: one map, so
        # finishing a store rewrites a value instead of moving a key between maps.
        self._keys: dict[Any, int] = {}
        self._num_storing = 0
        # Raised whenever a key is added, made readable or removed: equal counts mean
        # the same keys are cached and storing (for callers that look again each step).
        self.key_changes = 0
        self._block_key: list[Any] = [None] * self.num_blocks
        self._state = bytearray(self.num_blocks)
        self._init_holds()  # pins and holds, by key and by block (see PoolHolds)
        self._owned: dict[Hashable, list[int]] = {}
        self._num_owned = 0
        self._histogram = [0] * (len(ALLOCATION_BUCKETS) + 1)
        self._events_on = bool(enable_events)
        self._events: list[CacheEvent] = []

    @property
    def enable_events(self) -> bool:
        """Whether cache events are recorded (fixed at construction)."""
        return self._events_on

    # ------------------------------------------------------------------ keyed cache

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """Number of leading ``keys`` whose blocks are cached and readable now."""
        table = self._keys
        hits = 0
        for key in keys:
            if table.get(key, -1) < 0:  # absent, or being stored (< 0)
                break
            hits += 1
        return hits

    def contains(self, key: Hashable) -> bool:
        """Whether ``key`` is cached and readable (no side effect on eviction order)."""
        return self._keys.get(key, -1) >= 0

    def is_storing(self, key: Hashable) -> bool:
        return self._keys.get(key, 0) < 0

    def prepare_store(
        self, keys: Sequence[Hashable], keep: Collection[Hashable] = ()
    ) -> StorePlan | None:
        """Reserve blocks for the ``keys`` not yet present (cached or storing).

        Evicts unpinned cached keys (never one of ``keys`` or of ``keep``: the keys
        the storing request loaded or reused, whose recency it refreshes only when it
        finishes) when free blocks are short. Returns ``None``, changing nothing, when
        room cannot be made.
        """
        table = self._keys
        new_keys = [k for k in keys if k not in table]
        # Keys of the request already present must survive its eviction; none here.
        present = keys if len(new_keys) < len(keys) else ()
        if len(new_keys) > 1 and len(set(new_keys)) < len(new_keys):
            new_keys = list(dict.fromkeys(new_keys))  # a key listed twice is stored once
        n = len(new_keys)
        if not n:
            return StorePlan(new_keys, [], [])
        alloc = self._alloc
        evicted: list[Any] = []
        if n > alloc.num_free:
            victims = self._evict(n - alloc.num_free, [*present, *keep] if keep else present)
            if victims is None:
                return None
            evicted, reused = victims
            blocks = alloc.allocate(n - len(reused)) + reused if len(reused) < n else reused
        else:
            blocks = alloc.allocate(n)
        self._reserve(new_keys, blocks)
        return StorePlan(new_keys, blocks, evicted)

    def _reserve(self, new_keys: list[Hashable], blocks: list[int]) -> None:
        """``new_keys`` (at least one) are being stored in ``blocks``, one each: the key
        map, the blocks' owners, the policy and the counts say so."""
        table, state, block_key = self._keys, self._state, self._block_key
        for key, block in zip(new_keys, blocks):
            table[key] = ~block
            block_key[block] = key
            state[block] = KEYED
        n = len(new_keys)
        self._num_storing += n
        self.key_changes += 1
        self.policy.insert(new_keys)
        self._histogram[min(((n - 1).bit_length() + 1) >> 1, len(ALLOCATION_BUCKETS))] += 1

    def prepare_store_many(self, requests: Sequence[Sequence[Hashable]]) -> list[StorePlan] | None:
        """``prepare_store(keys)`` of each of ``requests`` in turn, in one call, when the
        free blocks hold the new keys of all of them (no eviction): the same plans,
        blocks, policy inserts and counts. Otherwise ``None``, changing nothing (the
        caller asks request by request)."""
        table = self._keys
        taken: dict[Hashable, None] = {}  # new keys of the requests before
        wanted: list[list[Hashable]] = []
        total = 0
        for keys in requests:
            new_keys = [k for k in keys if k not in table and k not in taken]
            if len(new_keys) > 1 and len(set(new_keys)) < len(new_keys):
                new_keys = list(dict.fromkeys(new_keys))  # a key listed twice is stored once
            if new_keys:
                taken.update(dict.fromkeys(new_keys))
                total += len(new_keys)
            wanted.append(new_keys)
        alloc = self._alloc
        if total > alloc.num_free:
            return None
        plans: list[StorePlan] = []
        for new_keys in wanted:
            if not new_keys:
                plans.append(StorePlan(new_keys, [], []))
                continue
            blocks = alloc.allocate(len(new_keys))  # (the blocks it would get alone)
            self._reserve(new_keys, blocks)
            plans.append(StorePlan(new_keys, blocks, []))
        return plans

    def _is_evictable(self, key: Hashable) -> bool:
        """Whether the policy may evict ``key`` now: cached (not storing) and not pinned."""
        return self._keys[key] >= 0 and key not in self._pins

    def _evict(
        self, n: int, request_keys: Collection[Hashable] = ()
    ) -> tuple[list[Any], list[int]] | None:
        """Evict ``n`` unpinned cached keys, never one of ``request_keys``.

        Returns the victims and their blocks (now FREE-to-reuse, not in the
        allocator), or ``None`` with nothing changed.
        """
        table = self._keys
        protected = {k for k in request_keys if table.get(k, -1) >= 0}
        # Cached keys no load pins (pins are on cached keys only), less the protected:
        # when too few, no walk of the policy can find n (a pool pinned full stays O(1)).
        pins = self._pins
        spared = sum(1 for k in protected if k not in pins) if protected else 0
        if self.num_evictable - spared < n:
            return None
        if self._parking is not None:
            victims = self._parking.evict(n, self._is_evictable, park=True, protected=protected)
        elif protected:

            def evictable(key: Hashable) -> bool:
                return table[key] >= 0 and key not in pins and key not in protected

            victims = self.policy.evict(n, evictable)
        else:
            victims = self.policy.evict(n, self._is_evictable)
        if victims is None:
            return None
        blocks = [table.pop(key) for key in victims]
        self.key_changes += 1
        block_key = self._block_key
        for block in blocks:
            block_key[block] = None
        if self._events_on:
            self._events.append(CacheEvent("removed", tuple(victims)))
        return victims, blocks

    def complete_store(self, keys: Sequence[Hashable], success: bool = True) -> None:
        """Finish a store: the blocks become readable, or on failure are freed.

        Keys that are not being stored (already finished, or never prepared) are
        skipped, and so are keys held while storing (``Hold.LATE_READ``): they stay
        storing until released.
        """
        table = self._keys
        held = self._storing_holds
        if success:
            stored = []
            for key in keys:
                block = table.get(key, 0)
                if block < 0:  # storing: ~block is its block
                    if held and key in held:
                        continue
                    table[key] = ~block
                    stored.append(key)
            self._num_storing -= len(stored)
            if stored:
                if self._parked:  # readable now: evictable unless pinned
                    self._parking.unpark(stored)
                self.key_changes += 1
            if stored and self._events_on:
                self._events.append(CacheEvent("stored", tuple(stored)))
            return
        failed = [k for k in dict.fromkeys(keys) if table.get(k, 0) < 0 and k not in held]
        self._num_storing -= len(failed)
        self._drop_keys(failed, [~table.pop(k) for k in failed])

    def _drop_keys(self, keys: Sequence[Hashable], blocks: list[int]) -> None:
        """Free the blocks of ``keys``, just taken out of the key map, and tell the policy."""
        self.key_changes += 1
        remove, block_key = self.policy.remove, self._block_key
        for key, block in zip(keys, blocks):
            remove(key)
            block_key[block] = None
        self._free_blocks(blocks)

    def _free_blocks(self, blocks: list[int]) -> None:
        """Return ``blocks`` (no key's and no owner's now) to the allocator."""
        state = self._state
        for block in blocks:
            state[block] = FREE
        self._alloc.free(blocks)

    def touch(self, keys: Sequence[Hashable]) -> None:
        """Mark ``keys`` used. The first key ends up the most recently used: a
        prefix's first blocks are shared by the most requests."""
        self.policy.touch(keys)

    def finish_request(self, keys: Sequence[Hashable], reused: Collection[Hashable]) -> None:
        """A request is done with ``keys``: every key it stored or reused, in prefix
        order (head first). Its head ends up the most recently used and its tail the
        least, stored keys included, so eviction takes a prefix from its tail. Only
        the keys in ``reused`` (found cached) count as a use; the policy's
        ``touch_prefix`` tells them apart, a policy without one gets ``touch``."""
        finish_request(self.policy, keys, reused)

    def evict(self, n: int, keep: Collection[Hashable] = ()) -> list[Hashable] | None:
        """Evict ``n`` unpinned cached keys now, by the policy's order, never one of
        ``keep``, and free their blocks. Returns the keys, or ``None`` (evicting
        nothing) when fewer than ``n`` may go."""
        victims = self._evict(n, keep)
        if victims is None:
            return None
        keys, blocks = victims
        self._free_blocks(blocks)
        return keys

    def evict_all(self) -> list[Hashable]:
        """Evict every unpinned cached key (for a reset); returns them."""
        pins = self._pins
        table = self._keys
        keys = [k for k, b in table.items() if b >= 0 and k not in pins]
        self._drop_keys(keys, [table.pop(k) for k in keys])
        if keys and self._events_on:
            self._events.append(CacheEvent("removed", tuple(keys)))
        return keys

    # ------------------------------------------------------------------ owned blocks

    def allocate_owned(self, owner: Hashable, n: int, *, evict: bool = True) -> list[int] | None:
        """Give ``owner`` ``n`` more blocks outside the keyed cache.

        Evicts unpinned cached keys if ``evict`` and blocks are short. Returns
        ``None``, changing nothing, when there is no room.
        """
        if n <= 0:
            return []
        free = self._alloc.num_free
        if n > free:
            if not evict:
                return None
            victims = self._evict(n - free)
            if victims is None:
                return None
            blocks = self._alloc.allocate(free) + victims[1]
        else:
            blocks = self._alloc.allocate(n)
        state = self._state
        for block in blocks:
            state[block] = OWNED
        self._owned.setdefault(owner, []).extend(blocks)
        self._num_owned += n
        return blocks

    def owned_blocks(self, owner: Hashable) -> list[int]:
        return list(self._owned.get(owner, ()))

    def owners(self) -> list[Hashable]:
        return list(self._owned)

    def free_owned(self, owner: Hashable) -> int:
        """Return all of ``owner``'s blocks to the free set. Returns how many.

        Raises ``RuntimeError`` if one is still held (``hold_blocks``, ``pin``).
        """
        blocks = self._owned.get(owner)
        if not blocks:
            self._owned.pop(owner, None)
            return 0
        if any(b in self._owned_read_pins or b in self._owned_write_pins for b in blocks):
            raise RuntimeError(f"owner {owner!r} has blocks held (by a transfer in flight)")
        del self._owned[owner]
        self._free_blocks(blocks)
        self._num_owned -= len(blocks)
        return len(blocks)

    # ------------------------------------------------------------------ introspection

    @property
    def num_free(self) -> int:
        return self._alloc.num_free

    @property
    def num_cached(self) -> int:
        return len(self._keys) - self._num_storing

    @property
    def num_evictable(self) -> int:
        """Cached keys no hold pins: what a store may evict (pins are on cached keys
        only)."""
        return len(self._keys) - self._num_storing - len(self._pins)

    @property
    def num_storing(self) -> int:
        """Blocks reserved by stores not yet complete (``PoolStats.storing``)."""
        return self._num_storing

    @property
    def num_read_pinned(self) -> int:
        """Blocks held for reading: cached keys held, owned blocks held by a reading
        kind (``PoolStats.read_pinned``)."""
        return len(self._pins) + len(self._owned_read_pins)

    def block_of(self, key: Hashable) -> int | None:
        """The block of a cached or storing key, else ``None``."""
        block = self._keys.get(key)
        return None if block is None else (~block if block < 0 else block)

    def state_of(self, block: int) -> str:
        """``"free"``, ``"storing"``, ``"cached"`` or ``"owned"``."""
        state = self._state[block]
        if state == KEYED:
            return "cached" if self._keys[self._block_key[block]] >= 0 else "storing"
        return "owned" if state == OWNED else "free"

    def is_pinned(self, block: int) -> bool:
        key = self._block_key[block]
        return (
            block in self._owned_read_pins
            or block in self._owned_write_pins
            or (key is not None and (key in self._pins or self._keys[key] < 0))
        )

    def free_runs(self) -> list[tuple[int, int]]:
        return self._alloc.runs()

    def take_events(self) -> list[CacheEvent]:
        """Cache events since the last call (empty unless ``enable_events``)."""
        events, self._events = self._events, []
        return events

    def stats(self) -> PoolStats:
        return PoolStats(
            capacity=self.num_blocks,
            free=self._alloc.num_free,
            storing=self._num_storing,
            cached=self.num_cached,
            owned=self._num_owned,
            read_pinned=len(self._pins) + len(self._owned_read_pins),
            write_pinned=self._num_storing + len(self._owned_write_pins),
            allocation_histogram=list(self._histogram),
            holds=self._hold_stats(),
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (for tests)."""
        counts = [0, 0, 0]
        for s in self._state:
            counts[s] += 1
        assert counts[FREE] == self._alloc.num_free, "free count differs from allocator"
        assert counts[KEYED] == len(self._keys), "keyed count drifted"
        assert self._num_storing == sum(1 for b in self._keys.values() if b < 0)
        assert counts[OWNED] == self._num_owned, "owned count drifted"
        assert sum(counts) == self.num_blocks
        free_ids = [b for s, e in self._alloc.runs() for b in range(s, e)]
        assert len(free_ids) == len(set(free_ids)) == counts[FREE], "free runs overlap"
        assert all(self._state[b] == FREE for b in free_ids), "a free-run block is in use"
        owned = [b for blocks in self._owned.values() for b in blocks]
        assert len(owned) == len(set(owned)) == counts[OWNED], "a block is owned twice"
        assert all(self._state[b] == OWNED for b in owned)
        seen: set[int] = set()
        for key, value in self._keys.items():
            block = ~value if value < 0 else value
            assert block not in seen, f"block {block} holds two keys"
            seen.add(block)
            assert self._block_key[block] == key
            assert self._state[block] == KEYED
        assert len(seen) == counts[KEYED]
        self._check_holds()
