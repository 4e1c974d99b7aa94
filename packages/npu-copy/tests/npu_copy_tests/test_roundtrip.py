"""Byte-exact store/load round trips for every layout, backend and kind of block set."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.npu_copy import TransferEngine

from .copy_support import NUM_HOST_BLOCKS, host_for, round_trip
from .layouts import LAYOUTS, NUM_BLOCKS, make_layout

# (engine keyword arguments) for every way the CPU build moves bytes.
ENGINES = {
    "cpu-async": {"backend": "cpu", "asynchronous": True},
    "cpu-sync": {"backend": "cpu", "asynchronous": False},
    "cpu-1thread": {"backend": "cpu", "cpu_threads": 1},
    "cpu-portable": {"backend": "cpu", "cpu_native": False},  # memmove per piece
    "stream-path-on-cpu": {"backend": "stream"},
}


@pytest.fixture(params=list(ENGINES))
def engine_kwargs(request: pytest.FixtureRequest) -> dict:
    return ENGINES[request.param]


@st.composite
def transfers(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """(source device blocks, host blocks, destination device blocks) of equal length:
    runs, scattered, single and empty sets all occur."""
    kind = draw(st.sampled_from(["run", "scattered", "single", "empty", "mixed"]))
    if kind == "empty":
        return [], [], []
    n = 1 if kind == "single" else draw(st.integers(2, min(NUM_BLOCKS, NUM_HOST_BLOCKS)))
    if kind == "run":
        s0 = draw(st.integers(0, NUM_BLOCKS - n))
        h0 = draw(st.integers(0, NUM_HOST_BLOCKS - n))
        d0 = draw(st.integers(0, NUM_BLOCKS - n))
        return list(range(s0, s0 + n)), list(range(h0, h0 + n)), list(range(d0, d0 + n))
    src = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n))
    host = draw(st.permutations(range(NUM_HOST_BLOCKS)))[:n]
    dst = draw(st.permutations(range(NUM_BLOCKS)))[:n]
    if kind == "mixed":  # a run in the middle of scattered ids
        host = sorted(host)
        dst = sorted(dst)
    return src, host, dst


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(blocks=transfers())
def test_round_trip_is_byte_exact(
    layout: str, engine_kwargs: dict, blocks: tuple[list[int], list[int], list[int]]
) -> None:
    case = make_layout(layout)
    with TransferEngine(case.kv, host_for(case), num_blocks=NUM_BLOCKS, **engine_kwargs) as eng:
        round_trip(case, eng, *blocks)


@pytest.mark.parametrize("layout", ["per_layer", "kv_tuple", "mixed_sizes"])
@pytest.mark.parametrize("kwargs", list(ENGINES.values()), ids=list(ENGINES))
def test_round_trip_large_segments_uses_every_path(layout: str, kwargs: dict) -> None:
    """64 KiB segments take the threaded memmove path; long runs take strided copies."""
    case = make_layout(layout, large=True, seed=3)
    with TransferEngine(case.kv, host_for(case), num_blocks=NUM_BLOCKS, **kwargs) as eng:
        scattered_dst = [11, 3, 2, 5, 0, 1, 6, 7, 8]
        round_trip(case, eng, [0, 1, 2, 3, 4, 5, 6, 7, 9], list(range(9)), scattered_dst)
        round_trip(case, eng, [2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8], list(range(8)))


def test_host_block_holds_layers_back_to_back() -> None:
    """Host block h = every layer's bytes of one device block, in registration order."""
    case = make_layout("per_layer")
    host = host_for(case, pad=64)
    with TransferEngine(case.kv, host) as eng:
        assert eng.store([7], [4]).wait()
    want = torch.cat([t[7].reshape(-1).view(torch.uint8) for t in case.tensors])
    assert torch.equal(host[4, : want.numel()], want)
    assert int(host[4, want.numel() :].count_nonzero()) == 0, "padding bytes were written"
    assert int(host[[0, 1, 2, 3, 5]].count_nonzero()) == 0, "other host blocks were written"


def test_ids_may_be_tensors() -> None:
    case = make_layout("per_layer")
    host = host_for(case)
    with TransferEngine(case.kv, host) as eng:
        assert eng.store(torch.tensor([1, 5]), torch.tensor([0, 9])).wait()
        assert eng.load(torch.tensor([9]), torch.tensor([2])).wait()
    t = case.tensors[0].view(torch.uint8)
    assert torch.equal(t[2], t[5])


def test_empty_transfer_is_done_at_once() -> None:
    case = make_layout("per_layer")
    with TransferEngine(case.kv, host_for(case)) as eng:
        handle = eng.store([], [])
        assert handle.done() and handle.ok and handle.error is None
