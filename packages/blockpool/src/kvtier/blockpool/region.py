"""The host region: one exact-size host allocation that the pool's blocks live in.

Private mode allocates a (pinned where an accelerator exists) torch tensor. Shared
mode maps a file in ``/dev/shm`` so a scheduler process and worker processes see
the same bytes; it checks free shared memory first and reserves the pages up front,
so a too-small ``/dev/shm`` fails at start-up with a clear message instead of a
``SIGBUS`` or "Bad address" later.

Liveness of shared regions is tracked with ``flock``: every process that maps a
region holds a shared lock on its file. A file nobody holds a lock on was left by a
killed process; ``cleanup_stale_regions`` (run before every create) unlinks it, and
every attach refuses it. A region is checked through the fd it was opened with and
mapped from that fd.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from kvtier.blockpool.budget import require_positive_int

logger = logging.getLogger("kvtier.blockpool")

SHM_DIR = "/dev/shm"
PREFIX = "kvtier-"
_TMP_MARK = ".creating-"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
# A file being created is left alone this long before it may be called stale.
_CREATE_GRACE_S = 60.0


class InsufficientSharedMemoryError(MemoryError):
    """The shared-memory filesystem has less free space than the region needs."""


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


class InsufficientHostMemoryError(MemoryError):
    """The machine has less available memory than a private region needs."""


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None where it cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _open_region_file(path: str, flags: int) -> int:
    """Open a region file without following a link or blocking on a FIFO, and refuse
    anything but a regular file of this process's user."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(
                f"{path} is not a regular file; a shared host region is one. Remove it "
                f"(rm {path}) and start again"
            )
        if st.st_uid != os.geteuid():
            raise PermissionError(
                f"{path} belongs to uid {st.st_uid}, not to this process's user "
                f"(uid {os.geteuid()}); kvtier maps only its own regions. Remove it as its "
                "owner, or run every process of the engine as one user"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_locked(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    return False


def cleanup_stale_regions(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink kvtier region files that no live process maps. Returns their paths."""
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(shm_dir, name)
        try:
            if _TMP_MARK in name and now - os.lstat(path).st_mtime < _CREATE_GRACE_S:
                continue
            fd = _open_region_file(path, os.O_RDONLY)
        except (OSError, ValueError):
            continue  # not ours or not a region: never unlinked here
        try:
            if not _is_locked(fd):
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    for path in removed:
        logger.warning("kvtier: removed stale shared host region %s left by a dead process", path)
    return removed


def cleanup_main(argv: list[str] | None = None) -> int:
    """``kvtier-cleanup-regions [SHM_DIR]``: remove the shared host regions that no live
    process maps (left by killed engines); print each one removed."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    shm_dir = args[0] if args else SHM_DIR
    removed = cleanup_stale_regions(shm_dir)
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} stale kvtier region(s) removed from {shm_dir}")
    return 0


MEMFD_NAME = "kvtier-region"


def _pin_description() -> str:
    if not torch.accelerator.is_available():
        return "none"
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None else "none"


def _cuda_host_register(tensor: torch.Tensor) -> bool:
    """Page-lock ``tensor``'s memory for CUDA DMA. False where registration is not offered."""
    if not (torch.cuda.is_available() and hasattr(torch.cuda, "cudart")):
        return False
    try:
        rc = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    except Exception:
        return False
    return int(rc) == 0


def _cuda_host_unregister(tensor: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    except Exception:
        pass


def _close_shared(path: str | None, fd: int, owner: bool, registered: torch.Tensor | None) -> None:
    if registered is not None:
        _cuda_host_unregister(registered)
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


def _exact_mapping(size: int) -> torch.Tensor:
    """``size`` bytes of host memory mapped for this region alone: an anonymous memory
    file (``memfd``) of exactly ``size`` bytes, which ``/proc/<pid>/maps`` names
    ``kvtier-region``. Plain anonymous memory where memfd is missing."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is None:
        return torch.empty(size, dtype=torch.uint8)
    fd = memfd_create(MEMFD_NAME, getattr(os, "MFD_CLOEXEC", 0))
    try:
        os.ftruncate(fd, size)
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
    finally:
        os.close(fd)  # the mapping keeps the memory


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


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
        accel = _pin_description()
        # An exactly sized mapping of its own (named in /proc/<pid>/maps), never a
        # caching allocator's block: torch's pinned host allocator rounds a request up
        # to a power of two, so 12 GiB would pin 16 GiB.
        tensor = _exact_mapping(size)
        registered = False
        if pin and accel != "none":
            registered = _cuda_host_register(tensor)
            if registered:
                pinned, method = True, f"{accel} host registration of exactly {size} bytes"
            else:
                try:
                    tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                    pinned = True
                    method = (
                        f"{accel} pinned host allocator (it may reserve up to "
                        f"{_power_of_two_at_least(size)} bytes for these {size})"
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
        path = cls._path(name, shm_dir)
        cleanup_stale_regions(shm_dir)
        if os.path.lexists(path):
            # Refuses a link, a FIFO or another user's file by name; else it is live.
            os.close(_open_region_file(path, os.O_RDONLY))
            raise FileExistsError(f"shared host region {path} is in use by a live process")
        free = shm_free_bytes(shm_dir)
        if size > free:
            raise InsufficientSharedMemoryError(_shm_message(size, free, shm_dir))
        tmp = f"{path}{_TMP_MARK}{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise InsufficientSharedMemoryError(
                        _shm_message(size, shm_free_bytes(shm_dir), shm_dir)
                    ) from exc
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)
            # link() fails if the name exists, so two creators racing cannot both win.
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise FileExistsError(
                    f"shared host region {path} is in use by a live process"
                ) from None
            os.unlink(tmp)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            os.close(fd)
            raise
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
        size = cls._sizes(num_blocks, block_bytes)
        path = cls._path(name, shm_dir)
        fd = cls._open_live(path, wait_s)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise PermissionError(
                    f"shared host region {path} has mode {stat.S_IMODE(st.st_mode):o}; kvtier "
                    "creates its regions 600 and maps no region that another user may open. "
                    f"Remove it (rm {path}) and start again"
                )
            if st.st_size != size:
                raise ValueError(
                    f"shared host region {path} holds {st.st_size} bytes, expected "
                    f"{num_blocks} blocks x {block_bytes} bytes = {size}: the processes "
                    "disagree on the budget"
                )
        except BaseException:
            os.close(fd)
            raise
        return cls._map(path, fd, num_blocks, block_bytes, owner=False, pin=pin)

    @staticmethod
    def _open_live(path: str, wait_s: float | None) -> int:
        """An fd of ``path`` once a live process holds it (its creator locks it from the
        moment it has the name). Checks once when ``wait_s`` is None, else polls until
        ``wait_s`` seconds have passed."""
        deadline = time.monotonic() + max(0.0, wait_s or 0.0)
        while True:
            try:
                fd = _open_region_file(path, os.O_RDWR)
            except FileNotFoundError:
                pass
            else:
                try:
                    live = _is_locked(fd)
                    if not live:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                except BaseException:
                    os.close(fd)
                    raise
                if live:
                    return fd
                os.close(fd)  # stale: its creator's replacement is on the way
            if time.monotonic() >= deadline:
                if wait_s is None:
                    raise FileNotFoundError(
                        errno.ENOENT,
                        "no live process holds the shared host region (it is missing, or "
                        "was left by a dead process)",
                        path,
                    )
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"no live process created the shared host region within {wait_s:g} s",
                    path,
                )
            time.sleep(0.05)

    @staticmethod
    def _path(name: str, shm_dir: str) -> str:
        if not isinstance(name, str) or not _NAME_RE.match(name) or _TMP_MARK in name:
            raise ValueError(
                f"shared region name must be 1-200 characters of letters, digits, '_', '.', '-'; "
                f"got {name!r}"
            )
        return os.path.join(shm_dir, PREFIX + name)

    @classmethod
    def _map(
        cls, path: str, fd: int, num_blocks: int, block_bytes: int, *, owner: bool, pin: bool
    ) -> HostRegion:
        size = num_blocks * block_bytes
        # From the fd that was checked: opening the name again could map whatever file
        # was renamed onto it since. The tensor keeps the mapping alive.
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        registered = pin and _cuda_host_register(tensor)
        if registered:
            method = "cuda host registration"
        elif pin and _pin_description() != "none":
            method = (
                f"unpinned: {_pin_description()} offers no registration of mapped host "
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


def _shm_message(size: int, free: int, shm_dir: str) -> str:
    return (
        f"the shared host region needs {size} bytes ({size / 2**30:.2f} GiB: the per-rank host "
        f"budget cpu_bytes_to_use_per_rank / cpu_bytes_to_use), but {shm_dir} has only {free} "
        f"bytes ({free / 2**30:.2f} GiB) free. Lower the budget or enlarge {shm_dir} "
        "(for containers: docker run --shm-size, or a memory-backed emptyDir in Kubernetes)."
    )


def list_regions(shm_dir: str = SHM_DIR) -> list[Path]:
    return sorted(Path(shm_dir).glob(PREFIX + "*"))
