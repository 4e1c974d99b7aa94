"""The stream backend: transfers on an accelerator through torch's device-generic streams
and events (CUDA, Ascend NPU through torch_npu, ...), staged through device buffers."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.npu_copy.backend import Dep, DependencyFailed
from kvtier.npu_copy.handle import TransferHandle
from kvtier.npu_copy.layout import KVLayout
from kvtier.npu_copy.plan import consecutive_runs


class StreamOps(Protocol):
    """Streams and events of one device."""

    def new_stream(self) -> Any: ...

    def current_stream(self) -> Any: ...

    def record(self, stream: Any) -> Any: ...

    def wait(self, stream: Any, event: Any) -> None: ...

    def query(self, event: Any) -> bool: ...

    def synchronize(self, event: Any) -> None: ...

    def use(self, stream: Any) -> contextlib.AbstractContextManager[None]: ...


class TorchStreamOps:
    """torch's device-generic streams and events (CUDA, NPU through torch_npu, ...)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        return torch.Stream(device=self.device)

    def current_stream(self) -> Any:
        return torch.accelerator.current_stream(self.device)

    def record(self, stream: Any) -> Any:
        event = torch.Event(device=self.device)
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        previous = torch.accelerator.current_stream(self.device)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)


class ImmediateStreamOps:
    """Streams for a device without them (CPU): every operation has already happened.

    Lets the stream backend's data path run, and be tested, on host tensors.
    """

    def new_stream(self) -> Any:
        return None

    def current_stream(self) -> Any:
        return None

    def record(self, stream: Any) -> Any:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        return None

    def query(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        return None

    def use(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


BatchMemcpy = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Any, bool], None]
"""Extension point for a platform batched copy (CUDA ``cudaMemcpyBatchAsync``, ACL
``aclrtMemcpyBatchAsync``): ``(dsts, srcs, stream, to_host)`` enqueues ``dst.copy_(src)``
for every pair (contiguous, equal byte sizes, one side pinned host memory) on ``stream``;
``to_host`` is True when the destinations are the host blocks (a store)."""


def copy_each(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], stream: Any, to_host: bool
) -> None:
    """The portable path: one asynchronous ``copy_`` per pair on the current stream."""
    for dst, src in zip(dsts, srcs):
        dst.copy_(src, non_blocking=True)


DEFAULT_STAGING_BYTES = 32 << 20  # device bytes per direction for staged transfers

logger = logging.getLogger("kvtier.npu_copy")


@dataclass
class _Staging:
    """One direction's device buffers, allocated once: a transfer moves through them in
    pieces of at most ``blocks`` blocks, so issuing one allocates no device memory."""

    blocks: int
    staging: torch.Tensor  # [blocks, host_block_bytes] uint8: a piece laid out as host blocks
    index: torch.Tensor  # [blocks] int64: device block ids of a scattered piece


class StreamBackend:
    """Transfers on an accelerator: one stream per direction, ordered by events.

    A store gathers the blocks' segments on the device into a staging buffer laid out as
    host blocks (device memory is far faster than the link), then copies each run of
    consecutive host blocks with one DMA. A load is the mirror image. Host blocks must be
    pinned so DMAs are asynchronous.

    The staging buffers are allocated once, ``staging_bytes`` per direction (stores and
    loads run on different streams), with room for the block index of one piece; a
    larger transfer moves through them in pieces, one after another on its stream.
    Preemption copies happen when device memory is exhausted, so issuing a transfer
    allocates nothing on the device. A scattered piece costs one index kernel per segment
    and direction, writing (or reading) the strided staging rows directly.
    """

    name = "stream"

    def __init__(
        self,
        layout: KVLayout,
        host_blocks: torch.Tensor,
        *,
        ops: StreamOps | None = None,
        batch_memcpy: BatchMemcpy | None = None,
        staging_bytes: int | None = None,
    ) -> None:
        self.layout = layout
        self.host_blocks = host_blocks
        self.device = layout.device
        self.ops: StreamOps = ops if ops is not None else TorchStreamOps(self.device)
        self.dma: BatchMemcpy = batch_memcpy if batch_memcpy is not None else copy_each
        self._streams = {"store": self.ops.new_stream(), "load": self.ops.new_stream()}
        self._pin_index = self.device.type != "cpu"
        row_bytes = int(host_blocks.shape[1])
        staging_bytes = DEFAULT_STAGING_BYTES if staging_bytes is None else int(staging_bytes)
        if staging_bytes < row_bytes:
            raise ValueError(
                f"staging_bytes must hold at least one host block ({row_bytes} bytes), "
                f"got {staging_bytes}"
            )
        blocks = min(staging_bytes // row_bytes, max(1, int(host_blocks.shape[0])))
        self._staging = {
            direction: _Staging(
                blocks,
                torch.empty((blocks, row_bytes), dtype=torch.uint8, device=self.device),
                torch.empty(blocks, dtype=torch.int64, device=self.device),
            )
            for direction in ("store", "load")
        }
        if self.device.type != "cpu":
            logger.info(
                "kvtier: transfers stage through %.1f MiB of %s memory per direction, "
                "%d blocks a piece",
                (blocks * (row_bytes + 8)) / 2**20,
                self.device,
                blocks,
            )

    @property
    def piece_blocks(self) -> int:
        """Blocks one piece of a transfer moves through the staging buffer."""
        return self._staging["store"].blocks

    def _device_index(self, ids: list[int], buf: _Staging, keep: list[Any]) -> torch.Tensor | slice:
        """Rows to gather or scatter on the device: a slice for one run, else the
        preallocated index buffer, filled from a (pinned) host list."""
        if len(ids) == 1 or all(b - a == 1 for a, b in itertools.pairwise(ids)):
            return slice(ids[0], ids[0] + len(ids))
        host_index = torch.tensor(ids, dtype=torch.int64, pin_memory=self._pin_index)
        keep.append(host_index)  # the copy below reads it asynchronously
        index = buf.index[: len(ids)]
        index.copy_(host_index, non_blocking=True)
        return index

    def _host_dmas(self, host_ids: list[int], staging: torch.Tensor, *, to_host: bool) -> None:
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for pos, first, length in consecutive_runs(host_ids):
            host_rows = self.host_blocks[first : first + length]
            stage_rows = staging[pos : pos + length]
            dsts.append(host_rows if to_host else stage_rows)
            srcs.append(stage_rows if to_host else host_rows)
        self.dma(dsts, srcs, self.ops.current_stream(), to_host)

    def _pieces(
        self, device_ids: list[int], host_ids: list[int]
    ) -> Iterator[tuple[list[int], list[int]]]:
        step = self.piece_blocks
        for start in range(0, len(device_ids), step):
            yield device_ids[start : start + step], host_ids[start : start + step]

    def _enqueue(
        self, handle: TransferHandle, deps: list[Dep], body: Callable[[list[Any]], None]
    ) -> None:
        ops = self.ops
        stream = self._streams[handle.direction]
        # Store: read after the forward wrote. Load: overwrite after the forward (of this or
        # an earlier step) stopped reading blocks that were freed and handed out again.
        compute_done = ops.record(ops.current_stream())
        keep: list[Any] = []
        with ops.use(stream):
            try:
                ops.wait(stream, compute_done)
                for dep, must_succeed in deps:
                    if must_succeed and dep.done() and not dep.ok:
                        raise DependencyFailed(
                            f"{handle.direction} reads blocks that {dep!r} wrote"
                        )
                    if dep._token is not None:
                        ops.wait(stream, dep._token)
                body(keep)
            except BaseException as e:  # reported on the handle
                handle._fail(e)
            finally:
                handle._token = ops.record(stream)
                handle._keep = keep

    def store(
        self, handle: TransferHandle, device_ids: list[int], host_ids: list[int], deps: list[Dep]
    ) -> None:
        buf = self._staging["store"]

        def body(keep: list[Any]) -> None:
            for dev, host in self._pieces(device_ids, host_ids):
                n = len(dev)
                stage = buf.staging[:n]
                rows = self._device_index(dev, buf, keep)
                for seg in self.layout.segments:
                    part = stage[:, seg.host_offset : seg.host_end]
                    if isinstance(rows, slice):
                        part.copy_(seg.rows[rows])
                    else:
                        # One kernel a segment: the gather writes the strided part itself.
                        torch.index_select(seg.rows, 0, rows, out=part)
                self._host_dmas(host, stage, to_host=True)

        self._enqueue(handle, deps, body)

    def load(
        self, handle: TransferHandle, host_ids: list[int], device_ids: list[int], deps: list[Dep]
    ) -> None:
        buf = self._staging["load"]

        def body(keep: list[Any]) -> None:
            for dev, host in self._pieces(device_ids, host_ids):
                n = len(dev)
                stage = buf.staging[:n]
                self._host_dmas(host, stage, to_host=False)
                rows = self._device_index(dev, buf, keep)
                for seg in self.layout.segments:
                    part = stage[:, seg.host_offset : seg.host_end]
                    if isinstance(rows, slice):
                        seg.rows[rows].copy_(part)
                    else:
                        seg.rows.index_copy_(0, rows, part)

        self._enqueue(handle, deps, body)

    def poll(self, handle: TransferHandle) -> bool:
        return handle._token is None or self.ops.query(handle._token)

    def block(self, handle: TransferHandle) -> None:
        if handle._token is not None:
            self.ops.synchronize(handle._token)

    def stream_wait(self, handle: TransferHandle, stream: Any) -> None:
        if handle._token is not None:
            target = stream if stream is not None else self.ops.current_stream()
            self.ops.wait(target, handle._token)

    def close(self) -> None:
        return None
