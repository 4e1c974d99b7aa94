"""The two ways bytes move: a CPU backend (host memcpy on worker threads) and a stream
backend (torch's device-generic streams and events: CUDA, Ascend NPU, any accelerator).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.npu_copy import native
from kvtier.npu_copy.handle import TransferHandle
from kvtier.npu_copy.layout import KVLayout
from kvtier.npu_copy.plan import coalesce, consecutive_runs

# ctypes.memmove releases the GIL, so large copies on several threads run in parallel and
# overlap the caller's Python. Small pieces go through memoryview slice assignment instead:
# ~0.35 us per call against ~0.65 us for ctypes (measured here), and bounds-checked.
_memmove: Callable[[int, int, int], Any] = ctypes.memmove


def _span_view(rows: torch.Tensor) -> memoryview:
    """A byte memoryview over the memory of a ``[n, bytes]`` uint8 row view (rows contiguous).

    The view does not own the memory: whoever holds it must keep ``rows`` alive.
    """
    n, width = rows.shape
    nbytes = (n - 1) * rows.stride(0) + width if n else 0
    buf = (ctypes.c_ubyte * nbytes).from_address(rows.data_ptr())
    return memoryview(buf).cast("B")


class Backend(Protocol):
    """What the engine needs from a backend. Ids are validated before these are called."""

    name: str

    def store(
        self, handle: TransferHandle, device_ids: list[int], host_ids: list[int], deps: list[Dep]
    ) -> None: ...

    def load(
        self, handle: TransferHandle, host_ids: list[int], device_ids: list[int], deps: list[Dep]
    ) -> None: ...

    def poll(self, handle: TransferHandle) -> bool: ...

    def block(self, handle: TransferHandle) -> None: ...

    def stream_wait(self, handle: TransferHandle, stream: Any) -> None: ...

    def close(self) -> None: ...


Dep = tuple[TransferHandle, bool]
"""An earlier transfer to wait for, and whether its failure fails this one (it wrote
bytes this transfer reads) or only orders it (this transfer overwrites bytes it reads)."""


class DependencyFailed(RuntimeError):
    """A transfer this one reads the output of failed, so this one cannot be valid."""


# ---------------------------------------------------------------------------------------
# CPU backend
# ---------------------------------------------------------------------------------------

# Measured on a 2-core Xeon VM (torch 2.13, 32 layers, 64 blocks scattered on both sides,
# methods interleaved, best of 7): gathering through a staging buffer (index_select, then
# one memmove per host block, or index_copy_ to scatter) reached 2.6-3.5 GB/s at 4 KiB and
# 1-3.5 GB/s at 64 KiB, because every byte moves twice and torch's CPU row scatter is
# element-wise; one copy per (block, segment) reached 2.8-3.8 GB/s at 4 KiB (memoryview)
# and 7-12 GB/s at 64-512 KiB (memmove on 2 threads), with the contiguous limit at ~11.
# So the CPU backend never stages; runs of consecutive blocks are one strided torch copy.
RUN_MIN_BLOCKS = 8
"""A run of at least this many blocks (both sides consecutive) is one torch copy per segment."""
PARALLEL_MIN_PIECE_BYTES = 32 * 1024
"""Pieces at least this large are memmoved on all copy threads with the GIL released;
smaller ones are copied on one thread, where per-call overhead dominates."""
PARALLEL_MIN_BYTES = 2 * 1024 * 1024
"""Transfers smaller than this stay on one thread."""
STREAM_MIN_BYTES = 4 * 1024 * 1024
"""Transfers at least this large are written with non-temporal stores (native path):
they would not stay in cache anyway, and streaming skips reading each destination line
first. Measured here at 64 KiB pieces: 0.57x of a contiguous copy with memmove per
piece from Python, 1.0x with one native call per thread (cached stores), 1.0-1.4x
streamed; at 512 KiB 1.1x cached, 1.4x streamed."""


def _c_array(ctype: Any, values: Sequence[int]) -> Any:
    return (ctype * len(values))(*values)


class CPUBackend:
    """KV "device" tensors are host tensors (vLLM's CPU platform): copies are memcpy.

    By default (``asynchronous=False``) copies run in the caller's thread and handles
    are finished when ``store``/``load`` return. On vLLM's CPU platform the caller is
    the engine's own thread, the one that runs the forward, so a copy never overlaps the
    forward's OpenMP threads and no second OpenMP team is made. Both cost time there:
    a torch op on another thread gives that thread an OpenMP team of its own, and once
    libgomp manages more threads than there are cores it stops spin-waiting at barriers,
    so every parallel region of the forward sleeps and wakes its threads (measured: a
    decode step of a 16-layer model 26 -> 36 ms on 2 cores, for the rest of the run).

    With ``asynchronous=True`` one worker thread per direction plays the role of a
    stream: transfers of one direction run in submission order, and only the compiled
    copier or ``memmove`` runs on those threads (no torch op, so no OpenMP team).
    """

    name = "cpu"

    def __init__(
        self,
        layout: KVLayout,
        host_blocks: torch.Tensor,
        *,
        threads: int | None = None,
        asynchronous: bool = False,
        native_copy: bool = True,
    ) -> None:
        self.layout = layout
        self.host_blocks = host_blocks
        self.threads = max(1, threads if threads is not None else torch.get_num_threads())
        self.asynchronous = asynchronous
        segs = layout.segments
        self._seg_offsets = [s.host_offset for s in segs]
        self._seg_bases = [(s.rows.data_ptr(), s.rows.stride(0)) for s in segs]
        self._seg_sizes = [s.block_bytes for s in segs]
        self._block_bytes = sum(self._seg_sizes)  # bytes per block over all segments
        self._host_base = host_blocks.data_ptr()
        self._host_stride = host_blocks.stride(0)
        self._host_view = _span_view(host_blocks)
        self._seg_views = [
            (_span_view(s.rows), s.rows.stride(0), s.host_offset, s.block_bytes) for s in segs
        ]
        # One native call per copy thread moves all pieces of a transfer (no GIL per piece).
        self._native: Any = native.load() if native_copy else None
        n = len(segs)
        self._nat_host = (
            _c_array(ctypes.c_uint64, [self._host_base + s.host_offset for s in segs]),
            _c_array(ctypes.c_int64, [self._host_stride] * n),
        )
        self._nat_dev = (
            _c_array(ctypes.c_uint64, [s.rows.data_ptr() for s in segs]),
            _c_array(ctypes.c_int64, [s.rows.stride(0) for s in segs]),
        )
        self._nat_sizes = _c_array(ctypes.c_uint64, self._seg_sizes)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()  # the store and load workers may both want it
        self._queues: dict[str, queue.SimpleQueue[Any]] = {}
        self._workers: list[threading.Thread] = []
        self._closed = False
        if asynchronous:
            for direction in ("store", "load"):
                q: queue.SimpleQueue[Any] = queue.SimpleQueue()
                t = threading.Thread(
                    target=self._worker, args=(q,), name=f"kvtier-{direction}", daemon=True
                )
                t.start()
                self._queues[direction] = q
                self._workers.append(t)

    # -- engine interface --------------------------------------------------------------

    def store(
        self, handle: TransferHandle, device_ids: list[int], host_ids: list[int], deps: list[Dep]
    ) -> None:
        copy = self._copy  # bound now: the transfer runs what was current when submitted
        self._submit(handle, lambda: copy(device_ids, host_ids, to_host=True), deps)

    def load(
        self, handle: TransferHandle, host_ids: list[int], device_ids: list[int], deps: list[Dep]
    ) -> None:
        copy = self._copy
        self._submit(handle, lambda: copy(device_ids, host_ids, to_host=False), deps)

    def poll(self, handle: TransferHandle) -> bool:
        token: threading.Event = handle._token
        return token.is_set()

    def block(self, handle: TransferHandle) -> None:
        token: threading.Event = handle._token
        token.wait()

    def stream_wait(self, handle: TransferHandle, stream: Any) -> None:
        # CPU compute is synchronous with the caller: "the compute stream waits" = we wait.
        handle.wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for q in self._queues.values():
            q.put(None)
        for t in self._workers:
            t.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- execution ---------------------------------------------------------------------

    def _submit(self, handle: TransferHandle, copy: Callable[[], None], deps: list[Dep]) -> None:
        token = threading.Event()
        handle._token = token
        if self.asynchronous:
            self._queues[handle.direction].put((handle, copy, deps))
        else:
            self._run(handle, copy, deps)

    def _worker(self, q: queue.SimpleQueue[Any]) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            self._run(*job)

    @staticmethod
    def _run(handle: TransferHandle, copy: Callable[[], None], deps: list[Dep]) -> None:
        try:
            for dep, must_succeed in deps:
                dep.wait()
                if must_succeed and not dep.ok:
                    raise DependencyFailed(f"{handle.direction} reads blocks that {dep!r} wrote")
            copy()
        except BaseException as e:  # reported on the handle, never raised into a thread
            handle._fail(e)
        finally:
            handle._token.set()

    def _copy(self, device_ids: list[int], host_ids: list[int], *, to_host: bool) -> None:
        host = self.host_blocks
        single_dev: list[int] = []
        single_host: list[int] = []
        # A strided torch copy runs OpenMP: only on the caller's thread (see the class).
        strided_ok = not self.asynchronous
        for run in coalesce(device_ids, host_ids):
            if strided_ok and run.length >= RUN_MIN_BLOCKS:
                # One strided copy per segment: device rows are contiguous, host rows strided.
                d, h, k = run.src, run.dst, run.length
                for seg in self.layout.segments:
                    dev_rows = seg.rows[d : d + k]
                    host_rows = host[h : h + k, seg.host_offset : seg.host_end]
                    if to_host:
                        host_rows.copy_(dev_rows)
                    else:
                        dev_rows.copy_(host_rows)
            else:
                for i in range(run.length):
                    single_dev.append(run.src + i)
                    single_host.append(run.dst + i)
        if not single_dev:
            return
        if self._native is not None:
            self._copy_native(single_dev, single_host, to_host=to_host)
            return
        if self._block_bytes // len(self._seg_sizes) < PARALLEL_MIN_PIECE_BYTES:
            self._copy_small(single_dev, single_host, to_host=to_host)
        else:
            self._copy_large(single_dev, single_host, to_host=to_host)

    def _copy_pool(self) -> ThreadPoolExecutor:
        """The extra copy threads, started on first use (one pool, whichever worker asks)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvtier-copy")
            return self._pool

    def _on_copy_threads(self, n: int, total: int, run: Callable[[int, int], object]) -> None:
        """``run(start, end)`` over pieces ``[0, n)`` of a ``total``-byte transfer: on this
        thread below ``PARALLEL_MIN_BYTES``, else in equal ranges over the copy threads
        (this one included), returning when all are done."""
        threads = min(self.threads, n) if total >= PARALLEL_MIN_BYTES else 1
        if threads <= 1:
            run(0, n)
            return
        pool = self._copy_pool()
        step = -(-n // threads)
        futures: list[Future[Any]] = [
            pool.submit(run, i, min(i + step, n)) for i in range(step, n, step)
        ]
        run(0, step)
        for f in futures:
            f.result()

    def _copy_native(self, device_ids: list[int], host_ids: list[int], *, to_host: bool) -> None:
        """All (block, segment) pieces in one native call per copy thread, GIL released."""
        nb = len(device_ids)
        n = nb * len(self._seg_sizes)
        dev = (*self._nat_dev, _c_array(ctypes.c_int64, device_ids))
        host = (*self._nat_host, _c_array(ctypes.c_int64, host_ids))
        dst, src = (host, dev) if to_host else (dev, host)
        total = self._block_bytes * nb
        stream = int(total >= STREAM_MIN_BYTES)
        fn: Callable[..., None] = self._native
        sizes = self._nat_sizes
        self._on_copy_threads(n, total, lambda a, b: fn(*dst, *src, sizes, nb, a, b, stream))

    def _copy_small(self, device_ids: list[int], host_ids: list[int], *, to_host: bool) -> None:
        """One memoryview slice assignment per (block, segment), on this thread."""
        hv, hs = self._host_view, self._host_stride
        segs = self._seg_views
        for d, h in zip(device_ids, host_ids):
            hbase = h * hs
            for sv, stride, off, nb in segs:
                s = d * stride
                o = hbase + off
                if to_host:
                    hv[o : o + nb] = sv[s : s + nb]
                else:
                    sv[s : s + nb] = hv[o : o + nb]

    def _copy_large(self, device_ids: list[int], host_ids: list[int], *, to_host: bool) -> None:
        """One memmove per (block, segment), split over the copy threads (GIL released)."""
        # Segment-major order: each thread streams through few tensors at a time, which
        # measured 5-10% faster for stores than block-major order at 64 KiB.
        hb, hs = self._host_base, self._host_stride
        host_rows = [hb + h * hs for h in host_ids]
        host_ptrs = [row + off for off in self._seg_offsets for row in host_rows]
        dev_ptrs = [base + d * stride for base, stride in self._seg_bases for d in device_ids]
        sizes = [size for size in self._seg_sizes for _ in device_ids]
        dsts, srcs = (host_ptrs, dev_ptrs) if to_host else (dev_ptrs, host_ptrs)
        self._on_copy_threads(
            len(sizes),
            self._block_bytes * len(device_ids),
            lambda a, b: _memmove_many(dsts[a:b], srcs[a:b], sizes[a:b]),
        )


def _memmove_many(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int]) -> None:
    deque(map(_memmove, dsts, srcs, sizes), maxlen=0)


# ---------------------------------------------------------------------------------------
# Stream backend
# ---------------------------------------------------------------------------------------


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
    scratch: torch.Tensor  # blocks * largest segment bytes: gathers and scatters by index
    index: torch.Tensor  # [blocks] int64: device block ids of a scattered piece


class StreamBackend:
    """Transfers on an accelerator: one stream per direction, ordered by events.

    A store gathers the blocks' segments on the device into a staging buffer laid out as
    host blocks (device memory is far faster than the link), then copies each run of
    consecutive host blocks with one DMA. A load is the mirror image. Host blocks must be
    pinned so DMAs are asynchronous.

    The staging buffers are allocated once, ``staging_bytes`` per direction (stores and
    loads run on different streams), with room for the index and gather scratch of one
    piece; a larger transfer moves through them in pieces, one after another on its
    stream. Preemption copies happen when device memory is exhausted, so issuing a
    transfer allocates nothing on the device.
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
        seg_bytes = max(seg.block_bytes for seg in layout.segments)
        self._staging = {
            direction: _Staging(
                blocks,
                torch.empty((blocks, row_bytes), dtype=torch.uint8, device=self.device),
                torch.empty(blocks * seg_bytes, dtype=torch.uint8, device=self.device),
                torch.empty(blocks, dtype=torch.int64, device=self.device),
            )
            for direction in ("store", "load")
        }
        if self.device.type != "cpu":
            logger.info(
                "kvtier: transfers stage through %.1f MiB of %s memory per direction, "
                "%d blocks a piece",
                (blocks * (row_bytes + seg_bytes + 8)) / 2**20,
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
                        gathered = buf.scratch[: n * seg.block_bytes].view(n, seg.block_bytes)
                        torch.index_select(seg.rows, 0, rows, out=gathered)
                        part.copy_(gathered)
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
                        scattered = buf.scratch[: n * seg.block_bytes].view(n, seg.block_bytes)
                        scattered.copy_(part)
                        seg.rows.index_copy_(0, rows, scattered)

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
