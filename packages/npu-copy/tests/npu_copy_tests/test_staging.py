"""The stream backend's staging: allocated once, bounded, and a transfer larger than it
moves through it in pieces. Preemption copies happen when device memory is exhausted, so
issuing a transfer must allocate nothing where the KV lives."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvtier.npu_copy import KVLayout, TransferEngine

from .copy_support import host_for, round_trip
from .layouts import NUM_BLOCKS, make_layout


def block_bytes(case: Any) -> int:
    return KVLayout.from_kv_caches(case.kv, NUM_BLOCKS).block_bytes


class NewKVBytes(TorchDispatchMode):
    """Records every op whose result is a new uint8 tensor (KV bytes): a staging
    buffer or a gathered copy made while a transfer is issued."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in [*args, *(kwargs or {}).values()]
            if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(t, torch.Tensor)
                and t.dtype == torch.uint8
                and t.untyped_storage().data_ptr() not in inputs
                and not func._schema.name.endswith(("view", "slice", "select", "as_strided"))
                and "alias" not in str(func._schema)
            ):
                self.made.append(str(func))
        return out


@pytest.mark.parametrize("layout", ["per_layer", "kv_tuple", "multiple_first"])
def test_a_transfer_larger_than_the_staging_buffer_goes_in_pieces(layout: str) -> None:
    case = make_layout(layout)
    two_blocks = 2 * block_bytes(case)
    engine = TransferEngine(
        case.kv, host_for(case), num_blocks=NUM_BLOCKS, backend="stream", staging_bytes=two_blocks
    )
    assert engine._backend.piece_blocks == 2
    # Five scattered blocks: three pieces, two of them gathered by index.
    round_trip(case, engine, [3, 7, 1, 9, 10], [0, 1, 2, 5, 6], [11, 0, 4, 2, 8])
    # One run of device blocks split across pieces.
    round_trip(case, engine, [4, 5, 6, 7, 8], [9, 8, 7, 6, 5], [0, 1, 2, 3, 11])


@pytest.mark.parametrize("layout", ["per_layer", "multiple_first"])
def test_issuing_transfers_allocates_no_kv_bytes(layout: str) -> None:
    case = make_layout(layout)
    engine = TransferEngine(
        case.kv,
        host_for(case),
        num_blocks=NUM_BLOCKS,
        backend="stream",
        staging_bytes=3 * block_bytes(case),
    )
    with NewKVBytes() as mode:
        stored = engine.store([3, 7, 1, 9, 10], [0, 1, 2, 5, 6])  # scattered, 2 pieces
        loaded = engine.load([0, 1, 2, 5, 6], [11, 0, 4, 2, 8])
        runs = engine.store([4, 5, 6, 7], [9, 8, 7, 6])  # consecutive device blocks
    assert stored.wait() and loaded.wait() and runs.wait()
    assert mode.made == [], f"transfers allocated KV-sized tensors: {mode.made}"


def test_the_detector_sees_an_allocation() -> None:
    with NewKVBytes() as mode:
        torch.empty(16, dtype=torch.uint8)
        x = torch.zeros(8, 4, dtype=torch.uint8)
        x[torch.tensor([0, 2])]  # advanced indexing makes a new tensor
    assert len(mode.made) >= 2, mode.made


def test_staging_smaller_than_a_block_is_refused() -> None:
    case = make_layout("per_layer")
    with pytest.raises(ValueError, match="staging_bytes"):
        TransferEngine(
            case.kv,
            host_for(case),
            num_blocks=NUM_BLOCKS,
            backend="stream",
            staging_bytes=block_bytes(case) - 1,
        )
