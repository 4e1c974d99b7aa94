"""Platform batched copies for the stream backend: one call enqueues many DMAs.

On Ascend, vllm-ascend builds ``torch.ops._C_ascend.swap_blocks_batch``: given CPU int64
tensors of source pointers, destination pointers and byte sizes, and a direction (0 host
to device, 1 device to host), it enqueues every copy on the current NPU stream with one
``aclrtMemcpyBatchAsync`` (CANN 8.5 and later; one ``aclrtMemcpyAsync`` per copy before).
:func:`platform_batch_memcpy` finds such an op for a device type and wraps it as a
:data:`~kvtier.npu_copy.stream_backend.BatchMemcpy`; without one, the stream backend issues one
``copy_`` per run of host blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier.npu_copy.stream_backend import BatchMemcpy

logger = logging.getLogger("kvtier.npu_copy")

H2D, D2H = 0, 1  # the direction codes of vllm-ascend's swap_blocks_batch


def _find_ascend_op() -> Callable[..., Any] | None:
    namespace = getattr(torch.ops, "_C_ascend", None)
    if namespace is None:
        return None
    try:
        op: Callable[..., Any] = namespace.swap_blocks_batch
        return op
    except (AttributeError, RuntimeError):
        return None


def _takes_direction(op: Callable[..., Any]) -> bool:
    """Whether the op's schema has the direction argument (vllm-ascend's has 4 arguments;
    vLLM's CUDA ``swap_blocks_batch`` has 3 and infers the direction)."""
    overload = getattr(op, "default", None)
    schema = getattr(overload, "_schema", None)
    args = getattr(schema, "arguments", None)
    return args is None or len(args) >= 4


def pointer_batch_memcpy(op: Callable[..., Any], *, with_direction: bool = True) -> BatchMemcpy:
    """A :data:`BatchMemcpy` over an op taking ``(src_ptrs, dst_ptrs, sizes[, direction])``.

    Every pair must be contiguous and of equal byte size, one side on the host; the op
    enqueues the copies on the current stream, which the stream backend has set.
    """

    def batch(
        dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], stream: Any, to_host: bool
    ) -> None:
        if not dsts:
            return
        sizes = []
        for dst, src in zip(dsts, srcs, strict=True):
            n = dst.numel() * dst.element_size()
            if n != src.numel() * src.element_size():
                raise ValueError(f"batched copy of {src.nbytes} bytes into {n} bytes")
            if not (dst.is_contiguous() and src.is_contiguous()):
                raise ValueError("batched copies need contiguous runs of blocks")
            sizes.append(n)
        args: list[Any] = [
            torch.tensor([s.data_ptr() for s in srcs], dtype=torch.int64),
            torch.tensor([d.data_ptr() for d in dsts], dtype=torch.int64),
            torch.tensor(sizes, dtype=torch.int64),
        ]
        if with_direction:
            args.append(D2H if to_host else H2D)
        op(*args)

    return batch


def platform_batch_memcpy(device_type: str) -> BatchMemcpy | None:
    """The platform's batched copy for ``device_type``, or None (one ``copy_`` per run).

    ``"npu"``: vllm-ascend's ``torch.ops._C_ascend.swap_blocks_batch`` when it is loaded
    (vllm-ascend registers it when its custom ops are enabled).
    """
    if device_type != "npu":
        return None
    op = _find_ascend_op()
    if op is None:
        return None
    logger.info("kvtier: NPU block copies use torch.ops._C_ascend.swap_blocks_batch")
    return pointer_batch_memcpy(op, with_direction=_takes_direction(op))
