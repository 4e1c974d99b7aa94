"""Round trips through a copy engine, shared by the tests of every backend path."""

from __future__ import annotations

import torch

from kvtier.npu_copy import KVLayout, TransferEngine

from .layouts import NUM_BLOCKS, LayoutCase

NUM_HOST_BLOCKS = 10


def host_for(case: LayoutCase, pad: int = 0) -> torch.Tensor:
    layout = KVLayout.from_kv_caches(case.kv, NUM_BLOCKS)
    return torch.zeros((NUM_HOST_BLOCKS, layout.block_bytes + pad), dtype=torch.uint8)


def round_trip(
    case: LayoutCase, engine: TransferEngine, src: list[int], host: list[int], dst: list[int]
) -> None:
    """Store ``src`` -> ``host``, clobber the device, load ``host`` -> ``dst``; check bytes."""
    before = {b: case.snapshot(b) for b in range(NUM_BLOCKS)}
    stored = engine.store(src, host)
    assert stored.wait(), f"store failed: {stored.error!r}"
    zero_blocks(case, dst)
    loaded = engine.load(host, dst)
    assert loaded.wait(), f"load failed: {loaded.error!r}"
    expected = dict(before)
    for s, d in zip(src, dst):
        expected[d] = before[s]
    for b in range(NUM_BLOCKS):
        got = case.snapshot(b)
        for i, (g, e) in enumerate(zip(got, expected[b])):
            assert torch.equal(g.view(torch.uint8), e.view(torch.uint8)), (
                f"{case.name}: tensor {i} block {b} differs after store {src}->{host}, "
                f"load {host}->{dst}"
            )


def zero_blocks(case: LayoutCase, blocks: list[int]) -> None:
    for t in case.tensors:
        for b in blocks:
            if case.name == "multiple_first":
                t[b].zero_()
                t[NUM_BLOCKS + b].zero_()
            elif case.name == "leading_kv":
                t[:, b].zero_()
            else:
                t[b].zero_()
