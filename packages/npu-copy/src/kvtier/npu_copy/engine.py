"""The transfer engine: the one place in kvtier that moves KV bytes between device and host."""

from __future__ import annotations

from typing import Any

import torch

from kvtier.npu_copy.backend import Backend, Dep
from kvtier.npu_copy.cpu_backend import CPUBackend
from kvtier.npu_copy.handle import TransferHandle, completed_handle
from kvtier.npu_copy.layout import KVCaches, KVLayout
from kvtier.npu_copy.plan import BlockIds, as_id_list, check_ids, check_unique
from kvtier.npu_copy.platform_dma import platform_batch_memcpy
from kvtier.npu_copy.stream_backend import BatchMemcpy, ImmediateStreamOps, StreamBackend

BACKENDS = ("cpu", "stream")


class TransferEngine:
    """Copies whole KV blocks between the registered device tensors and host blocks.

    ``kv_caches`` are the engine's KV tensors (see :meth:`KVLayout.from_kv_caches`) or a
    ready :class:`KVLayout`. ``host_blocks`` is a ``[num_host_blocks, host_block_bytes]``
    uint8 CPU tensor (pinned when the KV tensors are on an accelerator), for example
    kvtier-blockpool's ``HostRegion.blocks``; host block ``h`` holds every segment of one
    device block at the layout's offsets.

    ``backend`` is chosen from the KV tensors' device: ``"cpu"`` for host tensors (vLLM's
    CPU platform), ``"stream"`` for an accelerator. ``"stream"`` on CPU tensors runs the
    accelerator data path with immediate streams (for tests). ``cpu_threads`` (default
    ``torch.get_num_threads()``), ``asynchronous`` (worker threads, default False: see
    :class:`~kvtier.npu_copy.cpu_backend.CPUBackend`) and ``cpu_native`` (the compiled piece
    copier of :mod:`kvtier.npu_copy.native` when it builds, default True) tune the CPU
    backend. ``batch_memcpy`` plugs a platform batched copy into the stream backend
    (default: :func:`~kvtier.npu_copy.platform_dma.platform_batch_memcpy`, vllm-ascend's
    ``swap_blocks_batch`` on an NPU where it is loaded). ``staging_bytes`` (default 32 MiB)
    is the stream backend's device staging buffer per direction, allocated here once:
    larger transfers move through it in pieces, and issuing one allocates no device memory.
    """

    def __init__(
        self,
        kv_caches: KVCaches | KVLayout,
        host_blocks: torch.Tensor,
        *,
        num_blocks: int | None = None,
        backend: str | None = None,
        cpu_threads: int | None = None,
        cpu_native: bool = True,
        asynchronous: bool = False,
        batch_memcpy: BatchMemcpy | None = None,
        require_pinned: bool = True,
        staging_bytes: int | None = None,
    ) -> None:
        if isinstance(kv_caches, KVLayout):
            if num_blocks is not None and num_blocks != kv_caches.num_blocks:
                raise ValueError(
                    f"num_blocks={num_blocks} does not match the layout's {kv_caches.num_blocks}"
                )
            layout = kv_caches
        else:
            layout = KVLayout.from_kv_caches(kv_caches, num_blocks)
        layout.check_host_blocks(host_blocks)
        device = layout.device
        if backend is None:
            backend = "cpu" if device.type == "cpu" else "stream"
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "cpu" and device.type != "cpu":
            raise ValueError(f"the cpu backend needs KV tensors on the host, not on {device}")
        if device.type != "cpu" and require_pinned and not _is_pinned(host_blocks):
            raise ValueError(
                f"host blocks must be pinned memory for asynchronous copies to {device} "
                "(HostRegion pins by default; pass require_pinned=False to allow pageable)"
            )
        self.layout = layout
        self.host_blocks = host_blocks
        self.num_host_blocks = int(host_blocks.shape[0])
        self.host_block_bytes = int(host_blocks.shape[1])
        self._backend: Backend
        if backend == "cpu":
            self._backend = CPUBackend(
                layout,
                host_blocks,
                threads=cpu_threads,
                asynchronous=asynchronous,
                native_copy=cpu_native,
            )
        else:
            ops = ImmediateStreamOps() if device.type == "cpu" else None
            if batch_memcpy is None:
                batch_memcpy = platform_batch_memcpy(device.type)
            self._backend = StreamBackend(
                layout, host_blocks, ops=ops, batch_memcpy=batch_memcpy, staging_bytes=staging_bytes
            )
        self.backend = backend
        self._inflight: list[TransferHandle] = []

    @property
    def device(self) -> torch.device:
        """The device of the registered KV tensors."""
        return self.layout.device

    @property
    def num_blocks(self) -> int:
        """Device blocks in the registered KV tensors."""
        return self.layout.num_blocks

    def store(self, device_block_ids: BlockIds, host_block_ids: BlockIds) -> TransferHandle:
        """Copy device blocks to host blocks, pairwise (``device_block_ids[i]`` ->
        ``host_block_ids[i]``), after everything already enqueued on the current (compute)
        stream. Returns at once; raises ValueError before any byte moves when ids are out
        of range, a host block appears twice, or the lists differ in length."""
        dev, host = self._validate(device_block_ids, host_block_ids, dst_is_host=True)
        if not dev:
            return completed_handle("store", dev, host)
        handle = TransferHandle(self._backend, "store", dev, host)
        deps = self._dependencies(handle)
        self._backend.store(handle, dev, host, deps)
        self._inflight.append(handle)
        return handle

    def load(self, host_block_ids: BlockIds, device_block_ids: BlockIds) -> TransferHandle:
        """Copy host blocks to device blocks, pairwise (``host_block_ids[i]`` ->
        ``device_block_ids[i]``). Returns at once. Before the forward reads the blocks,
        call ``handle.wait_on_stream()`` (or :meth:`make_compute_wait`). Raises ValueError
        before any byte moves when ids are out of range, a device block appears twice, or
        the lists differ in length."""
        dev, host = self._validate(device_block_ids, host_block_ids, dst_is_host=False)
        if not dev:
            return completed_handle("load", dev, host)
        handle = TransferHandle(self._backend, "load", dev, host)
        deps = self._dependencies(handle)
        self._backend.load(handle, host, dev, deps)
        self._inflight.append(handle)
        return handle

    def make_compute_wait(self, handle: TransferHandle, stream: Any = None) -> None:
        """Make the compute stream (default: the current stream) wait for ``handle``."""
        handle.wait_on_stream(stream)

    def in_flight(self) -> list[TransferHandle]:
        """Transfers submitted and not finished yet, oldest first."""
        self._inflight = [h for h in self._inflight if not h.done()]
        return list(self._inflight)

    def wait_all(self) -> bool:
        """Block until every submitted transfer finished; True when all succeeded.
        Waits for this engine's transfers only, never for the whole device."""
        handles, self._inflight = self._inflight, []
        return all([h.wait() for h in handles])

    def close(self) -> None:
        """Finish every transfer and stop the worker threads."""
        self.wait_all()
        self._backend.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _validate(
        self, device_block_ids: BlockIds, host_block_ids: BlockIds, *, dst_is_host: bool
    ) -> tuple[list[int], list[int]]:
        dev = as_id_list(device_block_ids, "device block ids")
        host = as_id_list(host_block_ids, "host block ids")
        if len(dev) != len(host):
            raise ValueError(
                f"{len(dev)} device block ids but {len(host)} host block ids: "
                "a transfer pairs them one to one"
            )
        check_ids(dev, self.layout.num_blocks, "device block")
        check_ids(host, self.num_host_blocks, "host block")
        if dst_is_host:
            check_unique(host, "host block")
        else:
            check_unique(dev, "device block")
        return dev, host

    def _dependencies(self, handle: TransferHandle) -> list[Dep]:
        """Earlier transfers of the other direction that touch the same blocks.

        Transfers of one direction are already ordered (one stream or thread each). A
        store reads device blocks a load may be writing (must succeed) and writes host
        blocks a load may be reading; a load reads host blocks a store may be writing
        (must succeed) and overwrites device blocks a store may be reading.
        """
        self._inflight = [h for h in self._inflight if not h.done()]
        deps: list[Dep] = []
        for other in self._inflight:
            if other.direction == handle.direction:
                continue
            if handle.direction == "store":
                reads_its_output = not handle.device_set.isdisjoint(other.device_set)
                overwrites_its_input = not handle.host_set.isdisjoint(other.host_set)
            else:
                reads_its_output = not handle.host_set.isdisjoint(other.host_set)
                overwrites_its_input = not handle.device_set.isdisjoint(other.device_set)
            if reads_its_output or overwrites_its_input:
                deps.append((other, reads_its_output))
        return deps


def _is_pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:
        return False
