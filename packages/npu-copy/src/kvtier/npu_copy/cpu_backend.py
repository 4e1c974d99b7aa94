"""The CPU backend: KV "device" tensors on the host (vLLM's CPU platform), copied with memcpy
in the caller's thread or on one worker thread per direction."""

from __future__ import annotations

import ctypes
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvtier.npu_copy import native
from kvtier.npu_copy.backend import Dep, DependencyFailed
from kvtier.npu_copy.handle import TransferHandle
from kvtier.npu_copy.layout import KVLayout
from kvtier.npu_copy.plan import coalesce

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
