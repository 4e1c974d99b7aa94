"""The host region: one exact-size host allocation that the pool's blocks live in.

Private mode maps host memory of its own (page-locked where an accelerator exists:
:mod:`kvtier.blockpool.host_memory`). Shared mode maps a file in ``/dev/shm`` so a
scheduler process and worker processes see the same bytes; it checks free shared
memory first and reserves the pages up front, so a too-small ``/dev/shm`` fails at
start-up with a clear message instead of a ``SIGBUS`` or "Bad address" later. The
files, their liveness (``flock``) and the rendezvous of creator and attachers are in
:mod:`kvtier.blockpool.region_files`.
"""

from __future__ import annotations

import logging
import mmap
import os
import weakref
from collections.abc import Sequence

import torch

from kvtier.blockpool.budget import require_positive_int
from kvtier.blockpool.host_memory import (
    MEMFD_NAME,
    InsufficientHostMemoryError,
    cuda_host_register,
    cuda_host_unregister,
    exact_mapping,
    mem_available_bytes,
    pin_description,
    power_of_two_at_least,
)
from kvtier.blockpool.region_files import (
    PREFIX,
    SHM_DIR,
    InsufficientSharedMemoryError,
    attach_region_file,
    cleanup_main,
    cleanup_stale_regions,
    create_region_file,
    list_regions,
    region_path,
    shm_free_bytes,
)

__all__ = [
    "MEMFD_NAME",
    "PREFIX",
    "SHM_DIR",
    "HostRegion",
    "InsufficientHostMemoryError",
    "InsufficientSharedMemoryError",
    "cleanup_main",
    "cleanup_stale_regions",
    "list_regions",
    "mem_available_bytes",
    "shm_free_bytes",
]

logger = logging.getLogger("kvtier.blockpool")


def _close_shared(path: str | None, fd: int, owner: bool, registered: torch.Tensor | None) -> None:
    if registered is not None:
        cuda_host_unregister(registered)
    if owner and path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


class HostRegion:
    """``num_blocks`` host blocks of ``block_bytes`` bytes each, in one allocation.

    Use ``HostRegion.private(...)``, ``HostRegion.create_shared(...)`` or
    ``HostRegion.attach_shared(...)``. ``tensor`` is the whole region as a 1-D
    ``uint8`` tensor of exactly ``num_blocks * block_bytes`` bytes; ``blocks`` is the
    same memory as ``[num_blocks, block_bytes]``.
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        num_blocks: int,
        block_bytes: int,
        *,
        pinned: bool,
        pin_method: str,
        path: str | None = None,
        fd: int = -1,
        owner: bool = False,
        registered: bool = False,
    ) -> None:
        self.tensor = tensor
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.pinned = pinned
        self.pin_method = pin_method
        self.path = path
        self.owner = owner
        self._closed = False
        self._finalizer = (
            weakref.finalize(self, _close_shared, path, fd, owner, tensor if registered else None)
            if fd >= 0 or registered
            else None
        )

    # ----------------------------------------------------------------- constructors

    @staticmethod
    def _sizes(num_blocks: int, block_bytes: int) -> int:
        num_blocks = require_positive_int("num_blocks", num_blocks)
        block_bytes = require_positive_int("block_bytes", block_bytes)
        return num_blocks * block_bytes

    @classmethod
    def private(cls, num_blocks: int, block_bytes: int, *, pin: bool = True) -> HostRegion:
        """A region private to this process, page-locked when an accelerator exists."""
        size = cls._sizes(num_blocks, block_bytes)
        available = mem_available_bytes()
        if available is not None and size > available:
            raise InsufficientHostMemoryError(
                f"a private host region of {size} bytes ({num_blocks} blocks x {block_bytes} "
                f"bytes) is more than this machine's available memory ({available} bytes, "
                "MemAvailable in /proc/meminfo); lower cpu_bytes_to_use or "
                "cpu_bytes_to_use_per_rank"
            )
        accel = pin_description()
        # An exactly sized mapping of its own (named in /proc/<pid>/maps), never a
        # caching allocator's block: torch's pinned host allocator rounds a request up
        # to a power of two, so 12 GiB would pin 16 GiB. Allocated now where it will
        # not be page-locked (which allocates it), not by the stores' first writes.
        lock = pin and accel != "none"
        tensor = exact_mapping(size, reserve=not lock)
        registered = False
        if lock:
            registered = cuda_host_register(tensor)
            if registered:
                pinned, method = True, f"{accel} host registration of exactly {size} bytes"
            else:
                try:
                    tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                    pinned = True
                    method = (
                        f"{accel} pinned host allocator (it may reserve up to "
                        f"{power_of_two_at_least(size)} bytes for these {size})"
                    )
                except RuntimeError as exc:
                    logger.warning(
                        "kvtier: pinned allocation of %d bytes failed (%s); unpinned", size, exc
                    )
                    pinned, method = False, "unpinned (pinned allocation failed)"
        else:
            pinned = False
            method = "unpinned (no accelerator: host-to-host copies)" if pin else "unpinned"
        logger.info(
            "kvtier: private host region of %d blocks x %d bytes = %d bytes, %s",
            num_blocks,
            block_bytes,
            size,
            method,
        )
        return cls(
            tensor, num_blocks, block_bytes, pinned=pinned, pin_method=method, registered=registered
        )

    @classmethod
    def create_shared(
        cls,
        name: str,
        num_blocks: int,
        block_bytes: int,
        *,
        pin: bool = True,
        shm_dir: str = SHM_DIR,
    ) -> HostRegion:
        """Create the shared region ``name`` in ``shm_dir`` (replacing a stale one).

        Raises ``InsufficientSharedMemoryError`` naming the budget and the free space
        when ``shm_dir`` cannot hold it, and ``FileExistsError`` when a live process
        already maps a region of that name.
        """
        size = cls._sizes(num_blocks, block_bytes)
        path = region_path(name, shm_dir)
        fd = create_region_file(path, size, shm_dir)
        return cls._map(path, fd, num_blocks, block_bytes, owner=True, pin=pin)

    @classmethod
    def attach_shared(
        cls,
        name: str,
        num_blocks: int,
        block_bytes: int,
        *,
        pin: bool = True,
        shm_dir: str = SHM_DIR,
        wait_s: float | None = None,
    ) -> HostRegion:
        """Map the shared region ``name`` that a live process created.

        Every attach checks liveness once on the file it opens: a missing file, or one
        no process holds (left by a dead one, to be replaced), raises
        ``FileNotFoundError``. With ``wait_s``, such a file is waited out for up to that
        many seconds first. The file is then checked through its fd (this user's regular
        file, no access for group or others, the expected size) and mapped from that
        same fd, never opened again by name.
        """
        cls._sizes(num_blocks, block_bytes)
        path = region_path(name, shm_dir)
        fd = attach_region_file(path, num_blocks, block_bytes, wait_s)
        return cls._map(path, fd, num_blocks, block_bytes, owner=False, pin=pin)

    @classmethod
    def _map(
        cls, path: str, fd: int, num_blocks: int, block_bytes: int, *, owner: bool, pin: bool
    ) -> HostRegion:
        size = num_blocks * block_bytes
        # From the fd that was checked: opening the name again could map whatever file
        # was renamed onto it since. The tensor keeps the mapping alive.
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        registered = pin and cuda_host_register(tensor)
        if registered:
            method = "cuda host registration"
        elif pin and pin_description() != "none":
            method = (
                f"unpinned: {pin_description()} offers no registration of mapped host "
                "memory; transfers from it are staged by the driver"
            )
        else:
            method = "unpinned (no accelerator: host-to-host copies)"
        logger.info(
            "kvtier: %s shared host region %s of %d blocks x %d bytes = %d bytes, %s",
            "created" if owner else "attached",
            path,
            num_blocks,
            block_bytes,
            size,
            method,
        )
        return cls(
            tensor,
            num_blocks,
            block_bytes,
            pinned=registered,
            pin_method=method,
            path=path,
            fd=fd,
            owner=owner,
            registered=registered,
        )

    # ----------------------------------------------------------------- views

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def shared(self) -> bool:
        return self.path is not None

    @property
    def blocks(self) -> torch.Tensor:
        """The region as ``[num_blocks, block_bytes]`` uint8."""
        return self.tensor.view(self.num_blocks, self.block_bytes)

    def block(self, block_id: int) -> torch.Tensor:
        """The bytes of one host block (a view)."""
        return self.blocks[block_id]

    def layer_views(self, layer_bytes: Sequence[int]) -> list[torch.Tensor]:
        """One ``[num_blocks, layer_bytes[i]]`` view per layer.

        A host block holds layer 0's bytes, then layer 1's, and so on, so one host
        block is one contiguous DMA; the views let a copy engine address a layer.
        """
        total = sum(layer_bytes)
        if total > self.block_bytes:
            raise ValueError(
                f"layers need {total} bytes per block; a host block has {self.block_bytes}"
            )
        views: list[torch.Tensor] = []
        offset = 0
        for nbytes in layer_bytes:
            views.append(self.blocks[:, offset : offset + nbytes])
            offset += nbytes
        return views

    def close(self) -> None:
        """Release the region; a shared region's creator also unlinks its file."""
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> HostRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
