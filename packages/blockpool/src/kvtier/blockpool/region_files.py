"""The files of shared host regions in ``/dev/shm``: their names, opening one safely,
liveness, the rendezvous of creator and attachers, and removing stale ones.

Liveness is tracked with ``flock``: every process that maps a region holds a shared
lock on its file. A file nobody holds a lock on was left by a killed process;
``cleanup_stale_regions`` (run before every create, and by ``kvtier-cleanup-regions``)
unlinks it, and every attach refuses it. A region file is opened without following a
link or blocking on a FIFO, must be a regular file of this user, and is checked
through the fd it was opened with, which is the fd then mapped.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
import time
from pathlib import Path

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


def region_path(name: str, shm_dir: str) -> str:
    """The file of the shared region ``name`` in ``shm_dir``; ``ValueError`` for a bad name."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or _TMP_MARK in name:
        raise ValueError(
            f"shared region name must be 1-200 characters of letters, digits, '_', '.', '-'; "
            f"got {name!r}"
        )
    return os.path.join(shm_dir, PREFIX + name)


def create_region_file(path: str, size: int, shm_dir: str) -> int:
    """Create the region file ``path`` of ``size`` bytes (replacing a stale one), its
    pages reserved, shared-locked from the moment it has the name; its fd.

    Raises ``InsufficientSharedMemoryError`` naming the budget and the free space
    when ``shm_dir`` cannot hold it, and ``FileExistsError`` when a live process
    already maps a region of that name.
    """
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
    return fd


def attach_region_file(path: str, num_blocks: int, block_bytes: int, wait_s: float | None) -> int:
    """An fd of the region file ``path`` that a live process created, shared-locked
    and checked through that fd (this user's regular file, no access for group or
    others, ``num_blocks x block_bytes`` bytes). See ``HostRegion.attach_shared``."""
    size = num_blocks * block_bytes
    fd = _open_live(path, wait_s)
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
    return fd


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


def _shm_message(size: int, free: int, shm_dir: str) -> str:
    return (
        f"the shared host region needs {size} bytes ({size / 2**30:.2f} GiB: the per-rank host "
        f"budget cpu_bytes_to_use_per_rank / cpu_bytes_to_use), but {shm_dir} has only {free} "
        f"bytes ({free / 2**30:.2f} GiB) free. Lower the budget or enlarge {shm_dir} "
        "(for containers: docker run --shm-size, or a memory-backed emptyDir in Kubernetes)."
    )


def list_regions(shm_dir: str = SHM_DIR) -> list[Path]:
    return sorted(Path(shm_dir).glob(PREFIX + "*"))
