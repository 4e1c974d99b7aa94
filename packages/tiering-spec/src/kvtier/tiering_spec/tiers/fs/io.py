"""The fs tier's file I/O, as functions of what they are given: no tier state.

A block file is written whole to a temporary name and renamed, and read with checks in
this order: this user's regular file with one link (:func:`kvtier.tiering_spec.tiers.
fs.scan.foreign`), exactly ``file_bytes`` long, the header (format, fingerprint, key,
length), the payload's checksum, then the MAC where a key is configured. Any mismatch
raises :class:`kvtier.tiering_spec.tiers.fs.format.FormatError` with its fault kind; an I/O
error raises ``OSError``. Each function takes the folder as a held file descriptor, so
no path is resolved twice, and the scratch buffers from its caller (page aligned, for
``O_DIRECT``).

Units: bytes.
"""

from __future__ import annotations

import errno
import mmap
import os

from kvtier.tiering_spec.tiers.base import TierFault
from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.fs.scan import foreign, own_block_file

O_DIRECT = getattr(os, "O_DIRECT", 0)

# The system calls, as names fault-injection tests can replace.
_pwritev = os.pwritev
_preadv = os.preadv
_rename = os.rename
_fstatvfs = os.fstatvfs


def probe_o_direct(directory: str, dir_fd: int | None = None) -> bool:
    """Whether O_DIRECT writes and reads of an aligned 4096-byte block work in
    ``directory`` (the folder held by ``dir_fd`` when given)."""
    if not O_DIRECT:
        return False
    name = f"{fs_format.TMP_PREFIX}odirect-probe-{os.getpid()}"
    path = name if dir_fd is not None else os.path.join(directory, name)
    buf = mmap.mmap(-1, fs_format.ALIGNMENT)
    try:
        buf[:8] = b"kvtier!!"
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | O_DIRECT
        fd = os.open(path, flags, 0o600, dir_fd=dir_fd)
        try:
            if os.pwritev(fd, [buf], 0) != fs_format.ALIGNMENT:
                return False
            back = mmap.mmap(-1, fs_format.ALIGNMENT)
            try:
                ok = os.preadv(fd, [back], 0) == fs_format.ALIGNMENT and back[:8] == b"kvtier!!"
            finally:
                back.close()
            return ok
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        buf.close()
        try:
            os.unlink(path, dir_fd=dir_fd)
        except OSError:
            pass


def free_bytes(dir_fd: int) -> int:
    """Bytes an unprivileged writer may still put on the filesystem of the folder
    held by ``dir_fd`` (0 if it cannot be told)."""
    try:
        st = _fstatvfs(dir_fd)
    except OSError:
        return 0
    return int(st.f_bavail) * int(st.f_frsize)


def write_small_file(dir_fd: int, name: str, text: str) -> None:
    """Write ``text`` as file ``name`` of folder ``dir_fd``, through a temporary name
    (this process's) and a rename."""
    tmp = f"{name}{fs_format.TMP_PREFIX}{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def write_and_rename(
    folder: int,
    tmp: str,
    name: str,
    fd: int,
    hdr: mmap.mmap,
    fingerprint: bytes,
    digest: bytes,
    payload: memoryview,
    auth_key: bytes | None,
    direct: bool,
) -> None:
    """Write the block file open as ``fd`` (named ``tmp`` in ``folder``): its header,
    built in ``hdr``, and ``payload``; then rename it to ``name``. If O_DIRECT refuses the
    buffer (EINVAL), the same file is written again buffered. ``fd`` is closed, and on any
    failure ``tmp`` is removed."""
    crc = fs_format.checksum(payload)
    head = fs_format.encode_header(
        fingerprint, digest, len(payload), crc, auth_key=auth_key, payload=payload
    )
    hdr[: len(head)] = head
    try:
        try:
            _write_all(fd, hdr, payload)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            os.close(fd)
            fd = -1
            fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
            _write_all(fd, hdr, payload)
        _rename(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=folder)
        except OSError:
            pass
        raise
    finally:
        if fd >= 0:
            os.close(fd)


def _write_all(fd: int, hdr: mmap.mmap, payload: memoryview) -> None:
    """Write ``hdr`` then ``payload`` to ``fd`` from offset 0, continuing after short
    writes."""
    total = fs_format.HEADER_SIZE + len(payload)
    written = _pwritev(fd, [hdr, payload], 0)
    while written < total:  # short writes: continue where it stopped
        if written < fs_format.HEADER_SIZE:
            raise OSError(errno.EIO, "short header write")
        n = _pwritev(fd, [payload[written - fs_format.HEADER_SIZE :]], written)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        written += n


def take_over(
    src: int, old_name: str, dst: int, tmp: str, file_bytes: int, direct: bool
) -> int | None:
    """Open the block file ``old_name`` in folder ``src`` for writing and rename it to
    ``tmp`` in folder ``dst``: an evicted file overwritten in place (on some filesystems
    making a file costs more CPU than writing a MiB into one). Its times are refreshed
    first, so that no other engine's start-up scan takes it for a stale temporary file
    while it is written. None (nothing taken) unless it is a plain block file of this
    user with no other link; a reader still holding it open then fails its checksum."""
    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | (O_DIRECT if direct else 0)
    try:
        fd = os.open(old_name, flags, dir_fd=src)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not own_block_file(st, file_bytes):
            raise OSError(errno.EPERM, "not this tier's block file")
        os.utime(fd)
        os.rename(old_name, tmp, src_dir_fd=src, dst_dir_fd=dst)
    except OSError:
        os.close(fd)
        return None
    return fd


def read_block(
    folder: int,
    name: str,
    hdr: mmap.mmap,
    tail: mmap.mmap,
    fingerprint: bytes,
    digest: bytes,
    payload: memoryview,
    auth_key: bytes | None,
    direct: bool,
) -> None:
    """Read block file ``name`` of ``folder`` into ``payload``, checked (see the module
    docstring). With ``direct``, O_DIRECT; retried buffered if it refuses the buffer
    (EINVAL: not aligned). ``tail`` (one page) catches a file longer than a block file."""
    for o_direct in (O_DIRECT, 0) if direct and O_DIRECT else (0,):
        # O_NONBLOCK: a FIFO planted under that name fails the read instead of hanging;
        # O_NOFOLLOW: a symlink planted there fails it instead of reading its target.
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | o_direct
        try:
            _read_into(os.open(name, flags, dir_fd=folder), hdr, tail, payload)
            break
        except OSError as exc:
            if not (o_direct and exc.errno == errno.EINVAL):
                raise
    crc = fs_format.decode_header(
        hdr, fingerprint=fingerprint, digest=digest, payload_len=len(payload)
    )
    if fs_format.checksum(payload) != crc:
        raise fs_format.FormatError(TierFault.CORRUPT, "payload checksum mismatch")
    if auth_key is not None:
        fs_format.check_mac(hdr, payload, auth_key)


def _read_into(fd: int, hdr: mmap.mmap, tail: mmap.mmap, payload: memoryview) -> None:
    """Read the file open as ``fd`` (closed here) into ``hdr`` and ``payload``: only this
    tier's own files (this user's, a regular file with no other link), of exactly the
    block file's length."""
    try:
        why = foreign(os.fstat(fd))
        if why is not None:
            raise fs_format.FormatError(TierFault.FOREIGN, why)
        want = fs_format.HEADER_SIZE + len(payload)
        got = _preadv(fd, [hdr, payload, tail], 0)
        while got < want:
            if got < fs_format.HEADER_SIZE:
                raise fs_format.FormatError(TierFault.TRUNCATED, "short header read")
            n = _preadv(fd, [payload[got - fs_format.HEADER_SIZE :], tail], got)
            if n <= 0:
                raise fs_format.FormatError(TierFault.TRUNCATED, f"{got} of {want} bytes")
            got += n
        if got > want:
            raise fs_format.FormatError(TierFault.CORRUPT, f"longer than {want} bytes")
    finally:
        os.close(fd)
