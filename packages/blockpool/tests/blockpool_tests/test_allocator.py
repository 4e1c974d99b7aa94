"""The run allocator hands out contiguous runs and merges freed neighbours."""

import random

import pytest

from kvtier.blockpool import RunAllocator


def test_fresh_allocator_gives_contiguous_ascending_runs() -> None:
    alloc = RunAllocator(100)
    first = alloc.allocate(10)
    second = alloc.allocate(5)
    for got, n in ((first, 10), (second, 5)):
        assert got == list(range(got[0], got[0] + n)), f"not one ascending run: {got}"
    assert not set(first) & set(second)
    assert alloc.num_free == 85 and alloc.runs() == [(0, 85)]


def test_freed_blocks_merge_with_neighbours() -> None:
    alloc = RunAllocator(10)
    blocks = alloc.allocate(10)
    alloc.free(blocks[2:4])
    alloc.free([4])
    alloc.free([1])
    assert alloc.runs() == [(1, 5)]
    alloc.free([0, 5, 6, 7, 8, 9])
    assert alloc.runs() == [(0, 10)]


def test_request_is_served_from_a_run_long_enough_when_one_exists() -> None:
    alloc = RunAllocator(64)
    alloc.allocate(64)
    alloc.free([1, 3, 5])  # three single holes
    alloc.free(range(20, 30))  # one run of 10
    got = alloc.allocate(6)
    assert got == list(range(got[0], got[0] + 6)), f"not contiguous: {got}"
    assert 20 <= got[0] <= 24


def test_request_larger_than_any_run_spans_several_runs() -> None:
    alloc = RunAllocator(20)
    alloc.allocate(20)
    alloc.free([0, 1, 2, 10, 11, 12, 13])
    got = alloc.allocate(7)
    assert sorted(got) == [0, 1, 2, 10, 11, 12, 13]
    assert alloc.num_free == 0


def test_over_allocation_raises() -> None:
    alloc = RunAllocator(4)
    with pytest.raises(ValueError):
        alloc.allocate(5)


def test_random_alloc_free_never_duplicates() -> None:
    rng = random.Random(7)
    alloc = RunAllocator(257)
    held: list[list[int]] = []
    for _ in range(3000):
        if held and (rng.random() < 0.5 or alloc.num_free == 0):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, max(1, min(alloc.num_free, 40)))
            if n <= alloc.num_free:
                held.append(alloc.allocate(n))
        owned = [b for blocks in held for b in blocks]
        free = [b for s, e in alloc.runs() for b in range(s, e)]
        assert len(set(owned)) == len(owned)
        assert sorted(owned + free) == list(range(257))
        runs = alloc.runs()
        assert all(runs[i][1] < runs[i + 1][0] for i in range(len(runs) - 1)), "unmerged runs"
