"""Holds: why a block of the host block pool may be neither evicted nor handed out
again, taken and released by key or by block id and counted per kind.

Every reason is a :class:`Hold`. One pair of methods takes and ends them:
``hold(keys, kind)`` .. ``release(keys, kind)`` for blocks named by key (cached keys,
and storing keys for a kind that fills its block), ``hold_blocks(block_ids, kind)`` ..
``release_blocks(block_ids, kind)`` for blocks named by id (owned blocks). A hold of a
cached key *pins* it (never evicted); a storing or owned block is never evicted
anyway, and a hold keeps it from being finished, freed or reused. vLLM's load verbs
are the same pair with no reason named: ``prepare_load`` is ``hold(keys)``,
``complete_load`` is ``release(keys)``; such a load pins the key like any hold but
is counted by ``pins(key)`` only. ``pin``/``unpin`` are ``hold_blocks`` with the
transfer kinds.

:class:`PoolHolds` keeps this bookkeeping; ``HostBlockPool`` is built on it.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

from kvtier.blockpool.records import OWNED


class Hold(str, enum.Enum):
    """Why a block is held (never evicted, never handed out again, while held)."""

    DEVICE_LOAD = "device_load"  # a device load reads a cached block
    TIER_WRITE = "tier_write"  # a secondary tier writes a cached block out
    PROMOTION = "promotion"  # read in from a secondary tier, kept until a device load
    LOOKUP_PASS = "lookup_pass"  # found by a request's lookup, kept while it goes on
    # A secondary tier's read into a storing block timed out: its late call may still
    # write the block, which stays storing until the tier says the call is over.
    LATE_READ = "late_read"
    TRANSFER_READ = "transfer_read"  # a transfer reads an owned block
    TRANSFER_WRITE = "transfer_write"  # a transfer fills an owned block

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str(self.value)

    @property
    def fills(self) -> bool:
        """Whether the holder may write the block (it is then storing or owned)."""
        return self is Hold.LATE_READ or self is Hold.TRANSFER_WRITE


# The kinds a cached block is held for: PoolStats.holds always lists them.
CACHE_HOLDS: tuple[Hold, ...] = (
    Hold.DEVICE_LOAD,
    Hold.TIER_WRITE,
    Hold.PROMOTION,
    Hold.LOOKUP_PASS,
)


class PoolHolds:
    """The hold bookkeeping of ``HostBlockPool`` (its base class; see the module).

    Counts are kept only for what is held, so a count's size is the number of held
    blocks: ``_pins`` (cached key -> holds of every kind, unnamed loads included; the
    eviction's test), ``_storing_holds`` (storing key -> holds), ``_owned_read_pins``
    and ``_owned_write_pins`` (owned block -> holds that read it, or fill it), and per
    kind ``_holds`` (key -> count), ``_block_holds`` (block -> count) and
    ``_hold_counts`` (the kind's total).
    """

    # The pool's key map (key -> block, ~block while storing), block states, and its
    # policy's parked keys (unparked as their last pin ends).
    _keys: dict[Any, int]
    _state: bytearray
    _parked: dict[Any, Any]
    _parking: Any

    def _init_holds(self) -> None:
        self._pins: dict[Any, int] = {}
        self._storing_holds: dict[Any, int] = {}
        self._owned_read_pins: dict[int, int] = {}
        self._owned_write_pins: dict[int, int] = {}
        self._holds: dict[Hold, dict[Any, int]] = {kind: {} for kind in Hold}
        self._block_holds: dict[Hold, dict[int, int]] = {kind: {} for kind in Hold}
        self._hold_counts: dict[Hold, int] = dict.fromkeys(Hold, 0)

    # ------------------------------------------------------------------ by key

    def hold(self, keys: Sequence[Hashable], kind: Hold | None = None) -> list[int]:
        """Hold the blocks of ``keys`` for ``kind`` and return them, in order, until
        ``release(keys, kind)``. A cached key is pinned (never evicted); a storing key
        may be held only for a kind that ``fills`` its block, and then stays storing.
        Without ``kind`` (``prepare_load``): a load, counted by ``pins`` only.

        Raises ``KeyError`` (holding nothing) for a key that cannot be held so.
        """
        table = self._keys
        try:
            if len(keys) == 1:  # the common case, without the list comprehension's frame
                key = keys[0]
                block = table[key]
                if block >= 0:
                    pins = self._pins
                    pins[key] = pins.get(key, 0) + 1
                    if kind is not None:
                        held = self._holds[kind]
                        held[key] = held.get(key, 0) + 1
                        self._hold_counts[kind] += 1
                    return [block]
                blocks = [block]
            else:
                blocks = [table[k] for k in keys]
        except KeyError as exc:
            raise KeyError(f"cannot hold key {exc.args[0]!r}: it is not cached") from None
        pins = self._pins
        get = pins.get
        if kind is None:  # a load: pins only
            if min(blocks, default=0) < 0:
                key = next(k for k, b in zip(keys, blocks) if b < 0)
                raise KeyError(f"cannot hold key {key!r} to read it: it is being stored")
            for key in keys:
                pins[key] = get(key, 0) + 1
            return blocks
        held = self._holds[kind]
        held_get = held.get
        if min(blocks, default=0) < 0:
            if not kind.fills:
                key = next(k for k, b in zip(keys, blocks) if b < 0)
                raise KeyError(f"cannot hold key {key!r} to read it: it is being stored")
            storing = self._storing_holds
            for key, block in zip(keys, blocks):
                if block < 0:
                    storing[key] = storing.get(key, 0) + 1
                else:
                    pins[key] = get(key, 0) + 1
                held[key] = held_get(key, 0) + 1
            blocks = [~b if b < 0 else b for b in blocks]
        else:  # (most calls: every key cached) pin and hold in one pass
            for key in keys:
                pins[key] = get(key, 0) + 1
                held[key] = held_get(key, 0) + 1
        self._hold_counts[kind] += len(keys)
        return blocks

    def release(self, keys: Sequence[Hashable], kind: Hold | None = None) -> None:
        """End holds of ``kind`` on ``keys`` (without ``kind``: ``complete_load``).

        Raises ``RuntimeError`` (releasing nothing) for a key not held as often as
        it is named.
        """
        if kind is None:
            self._unpin(keys)
            return
        held = self._holds[kind]
        storing = self._storing_holds
        # The common case (a load's or a write's keys, each named once and held, none
        # of them storing): checked at C speed, then each hold dropped.
        unique = set(keys)
        if (
            len(unique) == len(keys)
            and held.keys() >= unique
            and (not storing or storing.keys().isdisjoint(unique))
        ):
            self._unpin(keys)  # (a hold pins its key)
            for key in keys:  # (_drop's work inline: this is every load's completion)
                count = held[key]
                if count == 1:
                    del held[key]
                else:
                    held[key] = count - 1
            self._hold_counts[kind] -= len(keys)
            return
        wanted: dict[Any, int] = {}
        for key in keys:
            wanted[key] = wanted.get(key, 0) + 1
        for key, n in wanted.items():
            if held.get(key, 0) < n:
                raise RuntimeError(f"release of a {kind.value} hold on {key!r}, which it lacks")
        if storing and any(key in storing for key in wanted):
            table = self._keys  # a held key stays in it (pinned, or storing)
            for key, n in wanted.items():
                if table[key] < 0:
                    _drop(storing, key, n)
            self._unpin([key for key in keys if table[key] >= 0])
        else:
            self._unpin(keys)
        for key, n in wanted.items():
            _drop(held, key, n)
        self._hold_counts[kind] -= len(keys)

    def _unpin(self, keys: Sequence[Hashable]) -> None:
        """End one pin of each of ``keys`` (cached keys); ``RuntimeError``, changing
        nothing, for a key not pinned as often as it is named."""
        pins = self._pins
        if len(keys) == 1:  # the common case, without loop bookkeeping
            count = pins.get(keys[0], 0)
            if count == 1:
                del pins[keys[0]]
                if self._parked:  # unpinned: evictable again
                    self._parking.unpark(keys)
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
                    if self._parked:  # unpinned: evictable again
                        self._parking.unpark((key,))
                else:
                    pins[key] = count - 1
                done += 1
        except KeyError:
            for key in keys[:done]:  # leave the pins as they were
                pins[key] = pins.get(key, 0) + 1
            raise RuntimeError(
                f"complete_load for key {keys[done]!r} without prepare_load"
            ) from None

    def prepare_load(self, keys: Sequence[Hashable]) -> list[int]:
        """vLLM's verb: ``hold(keys)``, a load's hold with no reason named."""
        return self.hold(keys)

    def complete_load(self, keys: Sequence[Hashable]) -> None:
        """vLLM's verb: ``release(keys)``, the end of ``prepare_load``'s hold."""
        self._unpin(keys)

    # ------------------------------------------------------------------ by block id

    def hold_blocks(self, block_ids: Sequence[int], kind: Hold) -> None:
        """Hold owned blocks for ``kind`` until ``release_blocks(block_ids, kind)``:
        a kind that ``fills`` them is a write pin, any other a read pin.

        Raises ``ValueError`` (holding nothing) for a block not owned: cached blocks
        are held by key.
        """
        state = self._state
        for block in block_ids:
            if state[block] != OWNED:
                raise ValueError(
                    f"block {block} is not owned; blocks are held by id only when owned "
                    "(cached ones are held by key: hold, prepare_load)"
                )
        pins = self._owned_write_pins if kind.fills else self._owned_read_pins
        held = self._block_holds[kind]
        for block in block_ids:
            pins[block] = pins.get(block, 0) + 1
            held[block] = held.get(block, 0) + 1
        self._hold_counts[kind] += len(block_ids)

    def release_blocks(self, block_ids: Sequence[int], kind: Hold) -> None:
        """End holds of ``kind`` on owned blocks. Raises ``RuntimeError`` (releasing
        nothing) for a block not held as often as it is named."""
        held = self._block_holds[kind]
        wanted: dict[int, int] = {}
        for block in block_ids:
            wanted[block] = wanted.get(block, 0) + 1
        missing = [b for b, n in wanted.items() if held.get(b, 0) < n]
        if missing:
            raise RuntimeError(f"blocks {missing} released of {kind.value} more often than held")
        pins = self._owned_write_pins if kind.fills else self._owned_read_pins
        for block, n in wanted.items():
            _drop(held, block, n)
            _drop(pins, block, n)
        self._hold_counts[kind] -= len(block_ids)

    def pin(self, block_ids: Sequence[int], *, write: bool) -> None:
        """Hold owned blocks for a transfer (``write``: the transfer fills them)."""
        self.hold_blocks(block_ids, Hold.TRANSFER_WRITE if write else Hold.TRANSFER_READ)

    def unpin(self, block_ids: Sequence[int], *, write: bool) -> None:
        """End ``pin``'s hold."""
        self.release_blocks(block_ids, Hold.TRANSFER_WRITE if write else Hold.TRANSFER_READ)

    # ------------------------------------------------------------------ counts

    def pins(self, key: Hashable) -> int:
        """How many holds (loads included) pin the cached ``key`` now."""
        return self._pins.get(key, 0)

    def holds(self, key: Hashable, kind: Hold) -> int:
        """How many holds of ``kind`` ``key`` has."""
        return self._holds[kind].get(key, 0)

    def holds_each(self, keys: Sequence[Hashable], kind: Hold) -> list[int]:
        """:meth:`holds` of each of ``keys``, in order (one call for a batch)."""
        table = self._holds[kind]
        return [table.get(key, 0) for key in keys]

    def held(self, kind: Hold) -> int:
        """Holds of ``kind`` on all keys and blocks together (one held twice counts
        twice)."""
        return self._hold_counts[kind]

    def _hold_stats(self) -> dict[str, int]:
        """``PoolStats.holds``: the kinds of cached blocks always, others while taken;
        a kind not listed reads 0."""
        counts = self._hold_counts
        stats: Counter[str] = Counter({kind.value: counts[kind] for kind in CACHE_HOLDS})
        for kind, n in counts.items():
            if n:
                stats[kind.value] = n
        return stats

    def _check_holds(self) -> None:
        """Raise ``AssertionError`` if the hold bookkeeping is inconsistent."""
        table = self._keys
        assert all(table[key] >= 0 and n > 0 for key, n in self._pins.items())
        assert all(table[key] < 0 and n > 0 for key, n in self._storing_holds.items())
        for pins in (self._owned_read_pins, self._owned_write_pins):
            assert all(self._state[b] == OWNED and n > 0 for b, n in pins.items())
        storing: Counter[Any] = Counter()
        cached: Counter[Any] = Counter()
        read: Counter[int] = Counter()
        write: Counter[int] = Counter()
        for kind in Hold:
            held, blocks = self._holds[kind], self._block_holds[kind]
            total = sum(held.values()) + sum(blocks.values())
            assert self._hold_counts[kind] == total, f"{kind.value} count drifted"
            for key, n in held.items():
                assert n > 0, f"{kind.value} hold count not positive"
                (storing if table[key] < 0 else cached)[key] += n
            for block, n in blocks.items():
                assert n > 0, f"{kind.value} hold count not positive"
                (write if kind.fills else read)[block] += n
        assert storing == self._storing_holds, "storing holds drifted"
        assert all(self._pins.get(key, 0) >= n for key, n in cached.items()), "holds exceed pins"
        assert read == self._owned_read_pins and write == self._owned_write_pins


def _drop(counts: dict[Any, int], item: Any, n: int) -> None:
    """Take ``n`` from ``item``'s count, forgetting it at 0."""
    left = counts[item] - n
    if left:
        counts[item] = left
    else:
        del counts[item]
