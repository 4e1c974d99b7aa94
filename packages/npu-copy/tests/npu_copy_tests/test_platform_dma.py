"""The platform batched copy: vllm-ascend's ``swap_blocks_batch`` contract, checked with a
stand-in op on the CPU that copies what the pointers say."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvtier.npu_copy import TransferEngine
from kvtier.npu_copy.platform_dma import (
    D2H,
    H2D,
    _takes_direction,
    platform_batch_memcpy,
    pointer_batch_memcpy,
)

from .copy_support import host_for, round_trip
from .layouts import NUM_BLOCKS, make_layout

CALLS: list[tuple[int, int]] = []  # (number of copies, direction) per call

_LIB = torch.library.Library("kvtier_dma_test", "DEF")
_LIB.define(
    "swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, int direction) -> ()"
)
_LIB.define("swap_blocks_batch3(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes) -> ()")


def _copy_pointers(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor) -> None:
    for s, d, n in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)


def _stand_in(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor, direction: int):
    assert src_ptrs.dtype == dst_ptrs.dtype == sizes.dtype == torch.int64
    assert src_ptrs.device.type == "cpu", "vllm-ascend's op reads the pointers on the host"
    CALLS.append((int(src_ptrs.numel()), int(direction)))
    _copy_pointers(src_ptrs, dst_ptrs, sizes)


def _stand_in3(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor):
    CALLS.append((int(src_ptrs.numel()), -1))
    _copy_pointers(src_ptrs, dst_ptrs, sizes)


_LIB.impl("swap_blocks_batch", _stand_in, "CPU")
_LIB.impl("swap_blocks_batch3", _stand_in3, "CPU")


@pytest.fixture(autouse=True)
def _clear_calls() -> None:
    CALLS.clear()


@pytest.mark.parametrize("layout", ["per_layer", "kv_tuple", "multiple_first"])
def test_round_trip_through_a_batched_op_is_byte_exact(layout: str) -> None:
    case = make_layout(layout)
    dma = pointer_batch_memcpy(torch.ops.kvtier_dma_test.swap_blocks_batch)
    engine = TransferEngine(
        case.kv, host_for(case), num_blocks=NUM_BLOCKS, backend="stream", batch_memcpy=dma
    )
    # Host blocks 0, 1, 2 and 5, 6: two runs, so one call carries two copies.
    round_trip(case, engine, [3, 7, 1, 9, 10], [0, 1, 2, 5, 6], [11, 0, 4, 2, 8])
    assert CALLS == [(2, D2H), (2, H2D)], "one call per transfer, with the right direction"


def test_op_without_direction_argument_is_called_with_three() -> None:
    op = torch.ops.kvtier_dma_test.swap_blocks_batch3
    assert not _takes_direction(op)
    assert _takes_direction(torch.ops.kvtier_dma_test.swap_blocks_batch)
    case = make_layout("per_layer")
    dma = pointer_batch_memcpy(op, with_direction=_takes_direction(op))
    engine = TransferEngine(
        case.kv, host_for(case), num_blocks=NUM_BLOCKS, backend="stream", batch_memcpy=dma
    )
    round_trip(case, engine, [0, 5], [3, 4], [6, 7])
    assert CALLS == [(1, -1), (1, -1)]


def test_unequal_sizes_are_refused_before_any_copy() -> None:
    dma = pointer_batch_memcpy(torch.ops.kvtier_dma_test.swap_blocks_batch)
    with pytest.raises(ValueError, match="bytes"):
        dma([torch.zeros(8, dtype=torch.uint8)], [torch.zeros(4, dtype=torch.uint8)], None, True)
    assert CALLS == []


def test_only_an_npu_looks_for_the_ascend_op() -> None:
    assert platform_batch_memcpy("cpu") is None
    assert platform_batch_memcpy("cuda") is None
    # No vllm-ascend here: the op is absent and the portable path stays.
    if not hasattr(torch.ops, "_C_ascend") or not hasattr(torch.ops._C_ascend, "swap_blocks_batch"):
        assert platform_batch_memcpy("npu") is None


def test_engine_on_cpu_tensors_keeps_the_portable_path() -> None:
    case = make_layout("per_layer")
    engine = TransferEngine(case.kv, host_for(case), backend="stream")
    round_trip(case, engine, [1, 2], [0, 1], [NUM_BLOCKS - 1, 0])
    assert CALLS == []
