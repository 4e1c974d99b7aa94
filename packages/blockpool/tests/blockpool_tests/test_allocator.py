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


class _FirstAllocator(RunAllocator):
    """The allocator as first written: where no run holds what is still wanted, the
    longest run of the longest bucket is searched for again for each run taken."""

    __slots__ = ()

    def allocate(self, n: int) -> list[int]:
        self.num_free -= n
        out: list[int] = []
        while n > 0:
            start = self._fit(n)
            if start is None:
                bucket = self._buckets[self._mask.bit_length() - 1]
                start = max(bucket, key=lambda s: self._by_start[s] - s)
            end = self._by_start[start]
            if end - start <= n:
                self._drop_run(start, end)
                out += range(start, end)
                n -= end - start
                continue
            self._drop_run(start, end)
            self._add_run(start, end - n)
            out += range(end - n, end)
            break
        return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_runs_taken_are_those_the_first_allocator_took(seed: int) -> None:
    """Ranking the longest bucket once per call takes the same blocks, in the same
    order, as searching it once per run taken."""
    rng = random.Random(seed)
    new, first = RunAllocator(300), _FirstAllocator(300)
    held: list[list[int]] = []
    for step in range(2000):
        if held and (rng.random() < 0.55 or new.num_free == 0):
            blocks = held.pop(rng.randrange(len(held)))
            scattered = [b for b in blocks if rng.random() < 0.7]  # partly, to scatter
            if len(scattered) < len(blocks):
                held.append([b for b in blocks if b not in scattered])
            new.free(scattered)
            first.free(scattered)
        else:
            n = rng.randint(1, max(1, min(new.num_free, 60)))
            got = new.allocate(n)
            assert got == first.allocate(n), step
            held.append(got)
        assert new.runs() == first.runs(), step


class _CountingDict(dict):  # type: ignore[type-arg]
    reads = 0

    def __getitem__(self, key: object) -> object:
        _CountingDict.reads += 1
        return super().__getitem__(key)


def test_scattered_free_blocks_are_not_searched_once_per_block() -> None:
    """Taking 16 blocks out of 2,000 scattered ones reads a few dozen runs, not 2,000
    for each block taken (0.02 s a call at 10,000 scattered blocks, 1.2 s for 1,000 of
    them)."""
    alloc = RunAllocator(4000)
    alloc.allocate(4000)
    alloc.free(range(0, 4000, 2))
    alloc._by_start = _CountingDict(alloc._by_start)
    for _ in range(10):
        _CountingDict.reads = 0
        got = alloc.allocate(16)
        assert len(got) == 16 and all(b % 2 == 0 for b in got)
        assert _CountingDict.reads <= 64, _CountingDict.reads
    # Runs of two and three blocks (bucket 1): the longest ranked once, not per run.
    alloc = RunAllocator(3000)
    alloc.allocate(3000)
    for i in range(0, 3000, 5):
        alloc.free(range(i, i + 2 + (i // 5) % 2))
    alloc._by_start = _CountingDict(alloc._by_start)
    _CountingDict.reads = 0
    got = alloc.allocate(600)
    assert len(got) == 600 and len(set(got)) == 600
    assert _CountingDict.reads <= 600 + 3 * 200, _CountingDict.reads  # (600 runs)
