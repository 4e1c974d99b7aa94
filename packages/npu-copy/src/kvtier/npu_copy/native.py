"""The CPU backend's native piece copier: ``_native/copy_pieces.c``, built on first use.

The C source ships with the package and is compiled with the system C compiler (``$CC``,
else ``cc`` or ``gcc``) into a per-user cache the first time an engine needs it, as
torch's inductor and Triton compile their helpers. Where no compiler works, or with
``KVTIER_NATIVE_COPY=0``, :func:`load` returns ``None`` and the CPU backend keeps its
pure-Python path (memmove per piece): the same bytes, more slowly for small pieces.

Cache directory: ``$KVTIER_CACHE_DIR/native``, else ``$XDG_CACHE_HOME/kvtier/native``,
else ``~/.cache/kvtier/native``. The library's name carries a hash of the source, the
compiler and the machine, so an upgrade or another host never loads a stale build.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ABI_VERSION = 1
SOURCE = Path(__file__).with_name("_native") / "copy_pieces.c"
ENV_SWITCH = "KVTIER_NATIVE_COPY"

_lock = threading.Lock()
_loaded: Any = None
_tried = False

U64P = ctypes.POINTER(ctypes.c_uint64)
I64P = ctypes.POINTER(ctypes.c_int64)


def cache_dir() -> Path:
    if os.environ.get("KVTIER_CACHE_DIR"):
        return Path(os.environ["KVTIER_CACHE_DIR"]) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / "native"


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return cc
    return shutil.which("cc") or shutil.which("gcc")


def library_path(cc: str) -> Path:
    """Where the library built from ``SOURCE`` by ``cc`` on this machine is cached."""
    tag = hashlib.sha256(SOURCE.read_bytes() + cc.encode() + platform.machine().encode())
    return cache_dir() / f"copy_pieces-{tag.hexdigest()[:16]}.so"


def _private_dir(directory: Path) -> bool:
    """Whether only this user can write ``directory`` (so nobody else can plant a library)."""
    st = directory.stat()
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _build_and_open(cc: str, out: Path) -> Any:
    """Compile ``SOURCE``, load it, and leave it at ``out`` for later processes.

    The library is loaded from its temporary name, which no earlier load in this process
    can have used (a process that loaded a bad file at ``out`` would otherwise get that
    handle back), then renamed into place: a reader never sees a half-written file.
    """
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [*cc.split(), "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[:500]}")
        fn = _open(Path(tmp))
        os.replace(tmp, out)
        return fn
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(path: Path) -> Any:
    lib = ctypes.CDLL(str(path))  # CDLL calls release the GIL
    if lib.kvtier_copy_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI version mismatch")
    fn = lib.kvtier_copy_pieces
    fn.restype = None
    fn.argtypes = [
        U64P, I64P, I64P,  # destination: base per segment, stride per segment, block ids
        U64P, I64P, I64P,  # source: the same
        U64P,  # bytes per segment
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # blocks, first piece, end piece
        ctypes.c_int,  # non-temporal stores
    ]  # fmt: skip
    return fn


def load() -> Any:
    """The compiled ``kvtier_copy_pieces`` function, or ``None`` (logged once) if unavailable."""
    global _loaded, _tried
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
            log.info("kvtier native copy disabled by %s; using memmove per piece", ENV_SWITCH)
            return None
        cc = _compiler()
        if cc is None:
            log.info("kvtier native copy: no C compiler (set CC); using memmove per piece")
            return None
        try:
            path = library_path(cc)
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _private_dir(path.parent):
                raise RuntimeError(
                    f"{path.parent} is not private to this user (owner or group/other "
                    "write permission); set KVTIER_CACHE_DIR to a directory of your own"
                )
            if path.exists():
                try:
                    _loaded = _open(path)
                except (OSError, AttributeError, RuntimeError):  # damaged: build it again
                    path.unlink(missing_ok=True)
            if _loaded is None:
                _loaded = _build_and_open(cc, path)
            log.debug("kvtier native copy loaded from %s", path)
        except Exception as exc:  # any failure keeps the portable path
            log.warning("kvtier native copy unavailable (%s); using memmove per piece", exc)
            _loaded = None
        return _loaded


def reset_for_tests() -> None:
    """Forget the loaded library so the next :func:`load` looks again (tests only)."""
    global _loaded, _tried
    with _lock:
        _loaded, _tried = None, False
