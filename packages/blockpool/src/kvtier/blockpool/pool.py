"""The host block pool: a fixed set of host blocks, a keyed cache over them, and
blocks owned by requests, all drawn from one capacity.

Every block is in exactly one state:

* ``FREE``: in the allocator;
* ``STORING``: given out by ``prepare_store``, its bytes are being written;
  not findable by ``lookup`` and never evicted until ``complete_store``;
* ``CACHED``: holds the bytes of its key; evictable unless pinned;
* ``OWNED``: held by a request (``allocate_owned``), outside the keyed cache.

So ``free + storing + cached + owned == capacity`` at all times. A block is
*pinned* while a transfer reads it (``prepare_load`` .. ``complete_load``, or
``pin(..., write=False)``) or writes it (``STORING``, or ``pin(..., write=True)``);
a pinned block is never evicted and never handed out again.

A cached block can also be *held* for a named reason (``hold(keys, kind)`` ..
``release(keys, kind)``, a :class:`Hold`): a device load, a secondary tier's write, a
promotion waiting for its load, a lookup pass. A hold pins the block as a load does,
and the pool counts holds per kind, so each reason's share of the pins can be told.

Keys are any hashable values (vLLM's block hashes are ``bytes``). Units: blocks.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvtier.blockpool.allocator import RunAllocator
from kvtier.blockpool.budget import require_positive_int
from kvtier.blockpool.policies import (
    EvictionPolicy,
    FrecencyPolicy,
    finish_request,
    make_policy,
)

FREE, KEYED, OWNED = 0, 1, 2  # KEYED: storing or cached, told apart by the key maps

# Upper bounds of the blocks-per-store histogram (powers of 4), then +Inf. A store of n
# blocks falls in bucket ceil(log4(n)).
ALLOCATION_BUCKETS: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class Hold(str, enum.Enum):
    """Why a cached block is held (pinned: never evicted, never handed out again)."""

    DEVICE_LOAD = "device_load"  # a device load reads it
    TIER_WRITE = "tier_write"  # a secondary tier writes it out
    PROMOTION = "promotion"  # read in from a secondary tier, kept until a device load
    LOOKUP_PASS = "lookup_pass"  # found by a request's lookup, kept while it goes on

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str(self.value)


class StorePlan(NamedTuple):
    """What ``prepare_store`` decided.

    Attributes:
        keys: the keys to write, in request order (keys already present dropped).
        block_ids: host block for each of ``keys``; write them, then ``complete_store(keys)``.
        evicted: keys evicted to make room (their blocks are reused).
    """

    keys: list[Any]
    block_ids: list[int]
    evicted: list[Any]


@dataclass(frozen=True)
class CacheEvent:
    """Keys that entered (``stored``) or left (``removed``) the keyed cache."""

    kind: str  # "stored" | "removed"
    keys: tuple[Any, ...]


@dataclass
class PoolStats:
    """A snapshot of the pool. Fractions are of the pool's capacity in blocks."""

    capacity: int
    free: int
    storing: int
    cached: int
    owned: int
    read_pinned: int
    write_pinned: int
    allocation_histogram: list[int] = field(default_factory=list)
    holds: dict[str, int] = field(default_factory=dict)  # holds by kind (Hold's value)

    @property
    def usage(self) -> float:
        return (self.capacity - self.free) / self.capacity if self.capacity else 0.0

    @property
    def read_usage(self) -> float:
        return self.read_pinned / self.capacity if self.capacity else 0.0

    @property
    def write_usage(self) -> float:
        return self.write_pinned / self.capacity if self.capacity else 0.0


class HostBlockPool:
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
        # Frecency parks the keys an eviction finds storing or pinned until this count
        # (raised whenever a key may have become evictable) changes.
        self._frecency = self.policy if type(self.policy) is FrecencyPolicy else None
        self._released = 0
        # key -> block for cached keys, ~block (< 0) for keys being stored: one map, so
        # finishing a store rewrites a value instead of moving a key between maps.
        self._keys: dict[Any, int] = {}
        self._num_storing = 0
        self._block_key: list[Any] = [None] * self.num_blocks
        self._state = bytearray(self.num_blocks)
        # Pins: cached keys being read by loads (key -> count; absent = unpinned), and
        # owned blocks pinned by transfers (block -> count). Only pinned entries are
        # stored, so a pin count's size is the number of pinned blocks.
        self._load_pins: dict[Any, int] = {}
        self._owned_read_pins: dict[int, int] = {}
        self._owned_write_pins: dict[int, int] = {}
        self._owned: dict[Hashable, list[int]] = {}
        self._num_owned = 0
        # Holds by kind: key -> count, and each kind's total.
        self._holds: dict[Hold, dict[Any, int]] = {kind: {} for kind in Hold}
        self._hold_counts: dict[Hold, int] = dict.fromkeys(Hold, 0)
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

    def prepare_store(self, keys: Sequence[Hashable]) -> StorePlan | None:
        """Reserve blocks for the ``keys`` not yet present (cached or storing).

        Evicts unpinned cached keys (never one of ``keys``) when free blocks are
        short. Returns ``None``, changing nothing, when room cannot be made.
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
            victims = self._evict(n - alloc.num_free, present)
            if victims is None:
                return None
            evicted, reused = victims
            blocks = alloc.allocate(n - len(reused)) + reused if len(reused) < n else reused
        else:
            blocks = alloc.allocate(n)
        state, block_key = self._state, self._block_key
        for key, block in zip(new_keys, blocks):
            table[key] = ~block
            block_key[block] = key
            state[block] = KEYED
        self._num_storing += n
        self.policy.insert(new_keys)
        self._histogram[min(((n - 1).bit_length() + 1) >> 1, len(ALLOCATION_BUCKETS))] += 1
        return StorePlan(new_keys, blocks, evicted)

    def _is_evictable(self, key: Hashable) -> bool:
        """Whether the policy may evict ``key`` now: cached (not storing) and not pinned."""
        return self._keys[key] >= 0 and key not in self._load_pins

    def _evict(
        self, n: int, request_keys: Sequence[Hashable] = ()
    ) -> tuple[list[Any], list[int]] | None:
        """Evict ``n`` unpinned cached keys, never one of ``request_keys``.

        Returns the victims and their blocks (now FREE-to-reuse, not in the
        allocator), or ``None`` with nothing changed.
        """
        table = self._keys
        protected = {k for k in request_keys if table.get(k, -1) >= 0}
        # Cached keys no load pins (pins are on cached keys only), less the protected:
        # when too few, no walk of the policy can find n (a pool pinned full stays O(1)).
        pins = self._load_pins
        spared = sum(1 for k in protected if k not in pins) if protected else 0
        if len(table) - self._num_storing - len(pins) - spared < n:
            return None
        if self._frecency is not None:
            victims = self._frecency.evict(
                n, self._is_evictable, generation=self._released, protected=protected
            )
        elif protected:

            def evictable(key: Hashable) -> bool:
                return table[key] >= 0 and key not in pins and key not in protected

            victims = self.policy.evict(n, evictable)
        else:
            victims = self.policy.evict(n, self._is_evictable)
        if victims is None:
            return None
        blocks = [table.pop(key) for key in victims]
        block_key = self._block_key
        for block in blocks:
            block_key[block] = None
        if self._events_on:
            self._events.append(CacheEvent("removed", tuple(victims)))
        return victims, blocks

    def complete_store(self, keys: Sequence[Hashable], success: bool = True) -> None:
        """Finish a store: the blocks become readable, or on failure are freed.

        Keys that are not being stored (already finished, or never prepared) are skipped.
        """
        table = self._keys
        if success:
            stored = []
            for key in keys:
                block = table.get(key, 0)
                if block < 0:  # storing: ~block is its block
                    table[key] = ~block
                    stored.append(key)
            self._num_storing -= len(stored)
            if stored:
                self._released += 1  # readable now: evictable unless pinned
            if stored and self._events_on:
                self._events.append(CacheEvent("stored", tuple(stored)))
            return
        freed: list[int] = []
        for key in keys:
            block = table.get(key, 0)
            if block < 0:
                del table[key]
                block = ~block
                self._block_key[block] = None
                self._state[block] = FREE
                self.policy.remove(key)
                freed.append(block)
        self._num_storing -= len(freed)
        self._alloc.free(freed)

    def prepare_load(self, keys: Sequence[Hashable]) -> list[int]:
        """Pin the blocks of cached ``keys`` for reading and return them, in order.

        Raises ``KeyError`` (pinning nothing) if a key is not cached and readable.
        """
        table = self._keys
        try:
            if len(keys) == 1:  # the common case, without the list comprehension's frame
                key = keys[0]
                block = table[key]
                if block >= 0:
                    pins = self._load_pins
                    pins[key] = pins.get(key, 0) + 1
                    return [block]
                blocks = [block]
            else:
                blocks = [table[k] for k in keys]
        except KeyError as exc:
            raise KeyError(f"cannot load key {exc.args[0]!r}: it is not cached") from None
        if min(blocks, default=0) < 0:
            key = next(k for k, b in zip(keys, blocks) if b < 0)
            raise KeyError(f"cannot load key {key!r}: it is being stored")
        pins = self._load_pins
        get = pins.get
        for key in keys:
            pins[key] = get(key, 0) + 1
        return blocks

    def complete_load(self, keys: Sequence[Hashable]) -> None:
        """Unpin the blocks that ``prepare_load`` pinned for ``keys``."""
        pins = self._load_pins
        if len(keys) == 1:  # the common case, without loop bookkeeping
            count = pins.get(keys[0], 0)
            if count == 1:
                del pins[keys[0]]
                self._released += 1  # unpinned: evictable again
                return
            if count > 1:
                pins[keys[0]] = count - 1
                return
        done = 0
        try:
            for key in keys:
                count = pins[key]
                if count == 1:
                    del pins[key]
                    self._released += 1  # unpinned: evictable again
                else:
                    pins[key] = count - 1
                done += 1
        except KeyError:
            for key in keys[:done]:  # leave the pins as they were
                pins[key] = pins.get(key, 0) + 1
            raise RuntimeError(
                f"complete_load for key {keys[done]!r} without prepare_load"
            ) from None

    def hold(self, keys: Sequence[Hashable], kind: Hold) -> list[int]:
        """Hold the blocks of cached ``keys`` for ``kind`` and return them, in order:
        pinned as by ``prepare_load``, and counted for ``kind`` until ``release``.

        Raises ``KeyError`` (holding nothing) if a key is not cached and readable.
        """
        blocks = self.prepare_load(keys)
        held = self._holds[kind]
        get = held.get
        for key in keys:
            held[key] = get(key, 0) + 1
        self._hold_counts[kind] += len(keys)
        return blocks

    def release(self, keys: Sequence[Hashable], kind: Hold) -> None:
        """End holds of ``kind`` on ``keys``. Raises ``RuntimeError`` (releasing nothing)
        for a key ``kind`` does not hold as often as it is named."""
        held = self._holds[kind]
        wanted: dict[Any, int] = {}
        for key in keys:
            wanted[key] = wanted.get(key, 0) + 1
        for key, n in wanted.items():
            if held.get(key, 0) < n:
                raise RuntimeError(f"release of a {kind.value} hold on {key!r}, which it lacks")
        self.complete_load(keys)
        for key, n in wanted.items():
            left = held[key] - n
            if left:
                held[key] = left
            else:
                del held[key]
        self._hold_counts[kind] -= len(keys)

    def pins(self, key: Hashable) -> int:
        """How many loads (holds included) pin ``key`` now."""
        return self._load_pins.get(key, 0)

    def holds(self, key: Hashable, kind: Hold) -> int:
        """How many holds of ``kind`` ``key`` has."""
        return self._holds[kind].get(key, 0)

    def held(self, kind: Hold) -> int:
        """Holds of ``kind`` on all keys together (a key held twice counts twice)."""
        return self._hold_counts[kind]

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
        victims = self._evict(n, list(keep))
        if victims is None:
            return None
        keys, blocks = victims
        for block in blocks:
            self._state[block] = FREE
        self._alloc.free(blocks)
        return keys

    def evict_all(self) -> list[Hashable]:
        """Evict every unpinned cached key (for a reset); returns them."""
        pins = self._load_pins
        table = self._keys
        keys = [k for k, b in table.items() if b >= 0 and k not in pins]
        blocks = [table.pop(k) for k in keys]
        for key, block in zip(keys, blocks):
            self.policy.remove(key)
            self._block_key[block] = None
            self._state[block] = FREE
        self._alloc.free(blocks)
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

        Raises ``RuntimeError`` if one is still pinned by a transfer.
        """
        blocks = self._owned.get(owner)
        if not blocks:
            self._owned.pop(owner, None)
            return 0
        if any(b in self._owned_read_pins or b in self._owned_write_pins for b in blocks):
            raise RuntimeError(f"owner {owner!r} has blocks pinned by a transfer in flight")
        del self._owned[owner]
        for block in blocks:
            self._state[block] = FREE
        self._alloc.free(blocks)
        self._num_owned -= len(blocks)
        return len(blocks)

    def pin(self, block_ids: Sequence[int], *, write: bool) -> None:
        """Pin owned blocks for a transfer (``write``: the transfer fills them).

        Cached blocks are pinned with ``prepare_load`` instead.
        """
        state = self._state
        for block in block_ids:
            if state[block] != OWNED:
                raise ValueError(
                    f"block {block} is {self.state_of(block)}; pin() is for owned blocks "
                    "(cached ones are pinned by prepare_load)"
                )
        pins = self._owned_write_pins if write else self._owned_read_pins
        for block in block_ids:
            pins[block] = pins.get(block, 0) + 1

    def unpin(self, block_ids: Sequence[int], *, write: bool) -> None:
        pins = self._owned_write_pins if write else self._owned_read_pins
        missing = [b for b in block_ids if b not in pins]
        if missing:
            raise RuntimeError(f"blocks {missing} unpinned more often than pinned")
        for block in block_ids:
            count = pins[block]
            if count == 1:
                del pins[block]
            else:
                pins[block] = count - 1

    # ------------------------------------------------------------------ introspection

    @property
    def num_free(self) -> int:
        return self._alloc.num_free

    @property
    def num_cached(self) -> int:
        return len(self._keys) - self._num_storing

    @property
    def num_storing(self) -> int:
        """Blocks reserved by stores not yet complete (``PoolStats.storing``)."""
        return self._num_storing

    @property
    def num_read_pinned(self) -> int:
        """Blocks pinned by loads in flight (``PoolStats.read_pinned``)."""
        return len(self._load_pins) + len(self._owned_read_pins)

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
            or (key is not None and (key in self._load_pins or self._keys[key] < 0))
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
            read_pinned=len(self._load_pins) + len(self._owned_read_pins),
            write_pinned=self._num_storing + len(self._owned_write_pins),
            allocation_histogram=list(self._histogram),
            holds={kind.value: n for kind, n in self._hold_counts.items()},
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
        assert all(self._keys[key] >= 0 and n > 0 for key, n in self._load_pins.items())
        for pins in (self._owned_read_pins, self._owned_write_pins):
            assert all(self._state[b] == OWNED and n > 0 for b, n in pins.items())
        for kind, held in self._holds.items():
            assert self._hold_counts[kind] == sum(held.values()), f"{kind.value} count drifted"
            for key, n in held.items():
                assert n > 0 and self._load_pins.get(key, 0) >= n, f"{kind.value} hold unpinned"
        for key, n in self._load_pins.items():
            assert sum(h.get(key, 0) for h in self._holds.values()) <= n, "holds exceed pins"
