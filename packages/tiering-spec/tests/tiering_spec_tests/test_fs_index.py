"""The fs tier's index alone, driven by random operations: its bytes always add up,
its change count moves whenever its digests do, it never evicts an entry in use, a
refused ``make_room`` changes nothing, and with
``lru`` it evicts in the order a plain model of LRU gives."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvtier.tiering_spec.tiers.fs.index import FsCapacity, FsIndex

ENTRY = 10
DIGEST = st.integers(0, 11).map(lambda i: b"d%02d" % i)


class IndexMachine(RuleBasedStateMachine):
    policy = "lru"
    capacity = 5 * ENTRY

    def __init__(self) -> None:
        super().__init__()
        self.index = FsIndex(ENTRY, self.policy, self.capacity // ENTRY)
        self.model: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self.busy: set[bytes] = set()
        self.last: tuple[int, set[bytes]] = (self.index.changes, set())

    @rule(digest=DIGEST)
    def write(self, digest: bytes) -> None:
        """A write: room is made for it, then it lands."""
        if digest in self.index:
            return
        evicted = self.index.make_room(ENTRY, self.capacity, self.busy.__contains__)
        if evicted is None:
            return
        for victim, _ in evicted:
            self.model.pop(victim)
        self.index.add(digest, digest)
        self.model[digest] = None

    @rule(digest=DIGEST)
    def use(self, digest: bytes) -> None:
        self.index.touch([digest])
        if digest in self.model:
            self.model.move_to_end(digest)

    @rule(digest=DIGEST)
    def forget(self, digest: bytes) -> None:
        entry = self.index.remove(digest)
        assert (entry is not None) == (digest in self.model)
        self.model.pop(digest, None)

    @rule(digest=DIGEST)
    def start_reading(self, digest: bytes) -> None:
        self.busy.add(digest)

    @precondition(lambda self: self.busy)
    @rule(data=st.data())
    def stop_reading(self, data: st.DataObject) -> None:
        self.busy.discard(data.draw(st.sampled_from(sorted(self.busy))))

    @rule(n=st.integers(0, 3))
    def make_room(self, n: int) -> None:
        """Room for ``n`` entries, as a full disk or a lowered capacity asks."""
        before = (self.index.used, set(self.index))
        evicted = self.index.make_room(n * ENTRY, self.capacity, self.busy.__contains__)
        if evicted is None:
            assert (self.index.used, set(self.index)) == before, "a refusal changed the index"
            idle = [d for d in self.model if d not in self.busy]
            assert (len(self.model) - len(idle) + n) * ENTRY > self.capacity, "room was there"
            return
        victims = [d for d, _ in evicted]
        assert not set(victims) & self.busy, "an entry in use was evicted"
        assert self.index.used + n * ENTRY <= self.capacity
        if self.policy == "lru":
            expected = [d for d in self.model if d not in self.busy][: len(victims)]
            assert victims == expected, "not the least recently used"
        for victim in victims:
            self.model.pop(victim)

    @invariant()
    def equal_change_counts_hold_the_same_digests(self) -> None:
        changes, digests = self.last
        if self.index.changes == changes:
            assert set(self.index) == digests, "the digests changed, the count did not"
        self.last = (self.index.changes, set(self.index))

    @invariant()
    def bytes_add_up(self) -> None:
        assert set(self.index) == set(self.model)
        assert self.index.used == ENTRY * len(self.model)
        assert self.index.used <= self.capacity


@pytest.mark.parametrize("policy", ["lru", "arc", "frecency"])
def test_the_index_keeps_its_bytes_and_spares_what_is_in_use(policy: str) -> None:
    machine = type(f"IndexMachine_{policy}", (IndexMachine,), {"policy": policy})
    run_state_machine_as_test(
        machine, settings=settings(max_examples=150, stateful_step_count=40, deadline=None)
    )


def test_no_capacity_needs_no_room() -> None:
    index = FsIndex(ENTRY, "frecency", 1)
    index.add(b"a", None)
    assert index.make_room(100 * ENTRY, None, lambda d: False) == []
    assert index.make_room(ENTRY + 1, ENTRY, lambda d: False) is None, "larger than the tier"


class CapacityMachine(RuleBasedStateMachine):
    """A full disk lowers the bound, room on the disk raises it back: never below the
    floor, never above the target, and back at the target once the disk has room."""

    def __init__(self) -> None:
        super().__init__()
        self.writers = 3
        self.cap = FsCapacity(20 * ENTRY, ENTRY, self.writers)

    @rule(used=st.integers(0, 30 * ENTRY), free=st.integers(0, 30 * ENTRY))
    def disk_full(self, used: int, free: int) -> None:
        before = self.cap.current
        assert before is not None
        went_down = self.cap.lower_for_full_disk(used, free)
        assert went_down == (self.cap.current != before)
        if went_down:
            assert self.cap.current == max(self.cap.floor, used + free) < before
        else:
            assert before <= max(self.cap.floor, used + free)

    @rule(
        used=st.integers(0, 30 * ENTRY),
        reserved=st.integers(0, 5 * ENTRY),
        free=st.integers(0, 30 * ENTRY),
    )
    def room_again(self, used: int, reserved: int, free: int) -> None:
        before = self.cap.current
        assert before is not None
        went_up = self.cap.regrow(used, reserved, free)
        assert went_up == (self.cap.current != before)
        if went_up:
            assert self.cap.current == min(20 * ENTRY, used + reserved + free) > before
        if used + reserved + free >= 20 * ENTRY:
            assert not self.cap.lowered, "room for the target, and not back at it"

    @invariant()
    def bound_between_floor_and_target(self) -> None:
        assert self.cap.floor == self.writers * ENTRY
        assert self.cap.current is not None
        assert self.cap.floor <= self.cap.current <= 20 * ENTRY
        assert self.cap.lowered == (self.cap.current != 20 * ENTRY)


def test_capacity_moves_between_floor_and_target() -> None:
    run_state_machine_as_test(CapacityMachine, settings=settings(max_examples=200))


def test_capacity_edges() -> None:
    unbounded = FsCapacity(None, ENTRY, 4)
    assert unbounded.lower_for_full_disk(used=3 * ENTRY, free=0), "a full disk bounds it"
    assert unbounded.current == 3 * ENTRY  # its files plus what is free
    assert not unbounded.regrow(100 * ENTRY, 0, 100 * ENTRY), "no target to grow back to"
    small = FsCapacity(2 * ENTRY, ENTRY, 8)
    assert small.floor == 2 * ENTRY, "the floor never exceeds the target"
    small.lower_for_full_disk(used=0, free=0)
    assert small.current == 2 * ENTRY and not small.lowered
    small.reset(5 * ENTRY)
    assert small.current == small.target == 5 * ENTRY


@pytest.mark.parametrize("policy", ["lru", "arc", "frecency"])
def test_the_index_keeps_no_object_per_file_for_the_garbage_collector(policy: str) -> None:
    """A full collection visits every tracked object while the engine's thread
    waits: an fs tier indexes millions of files, so an entry must not be one."""
    import gc

    n = 2000
    index = FsIndex(1 << 20, policy, n)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(0, n, 16):
        index.add_all(
            [(i.to_bytes(4, "little") + j.to_bytes(28, "little"), b"k") for j in range(16)]
        )
    evicted = index.make_room(index.used // 2, index.used, lambda _digest: False)
    assert evicted and evicted[0][1].nbytes == 1 << 20  # entries still read by name
    del evicted  # (what it hands out is the caller's to keep)
    gc.collect()  # (a plain tuple of numbers and bytes is untracked when collected)
    gc.collect()
    added = len(gc.get_objects()) - before
    assert added < n // 20, f"{added} tracked objects for {n} files"
