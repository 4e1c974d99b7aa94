"""The CPU backend's native piece copier, ``_native/copy_pieces.c``: shipped compiled in the
platform wheels, built on first use for a source install.

:func:`load` takes the first of these that works:

1. ``prebuilt``: the library a platform wheel ships, ``_native/copy_pieces.so``, compiled
   when the wheel was built (``hatch_build.py`` beside the package's pyproject.toml).
2. ``built``: a library compiled from the shipped C source with the system C compiler
   (``$CC``, else ``cc`` or ``gcc``) into a per-user cache the first time an engine needs
   it, as torch's inductor and Triton compile their helpers. Processes that start together
   (the workers of one tensor-parallel engine) take a file lock, so one compiles and the
   others load its result.
3. ``none``: no library (no compiler, a failed build, or ``KVTIER_NATIVE_COPY=0``): the CPU
   backend keeps its pure-Python path (memmove per piece), the same bytes more slowly.

:func:`source` says which one this process uses, :func:`library_file` where it came from.

Cache directory: ``$KVTIER_CACHE_DIR/native``, else ``$XDG_CACHE_HOME/kvtier/native``,
else ``~/.cache/kvtier/native``. A built library's name carries a hash of the source, the
compiler flags, :data:`ABI_VERSION`, the compiler command and its ``--version`` output and
the machine, so an upgrade, another compiler or another host never loads a stale build.

This module imports only the standard library: the wheel build hook loads it by path to
compile with the same command.
"""

from __future__ import annotations

import ctypes
import fcntl
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
C_SOURCE = Path(__file__).with_name("_native") / "copy_pieces.c"
PREBUILT = Path(__file__).with_name("_native") / "copy_pieces.so"
"""Where a platform wheel puts the library it ships (absent in a source or editable install)."""
CFLAGS = ("-O2", "-shared", "-fPIC")
"""Flags for both builds, the wheel's and the run-time one."""
ENV_SWITCH = "KVTIER_NATIVE_COPY"
SOURCES = ("prebuilt", "built", "none")

_lock = threading.Lock()
_loaded: Any = None
_tried = False
_source = "none"
_library: Path | None = None

U64P = ctypes.POINTER(ctypes.c_uint64)
I64P = ctypes.POINTER(ctypes.c_int64)


def cache_dir() -> Path:
    """The directory run-time builds are cached in (see the module docstring)."""
    if os.environ.get("KVTIER_CACHE_DIR"):
        return Path(os.environ["KVTIER_CACHE_DIR"]) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / "native"


def compiler() -> str | None:
    """The C compiler command: ``$CC`` (may hold arguments), else ``cc`` or ``gcc`` on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return cc
    return shutil.which("cc") or shutil.which("gcc")


def _run(cmd: list[str], timeout_s: float) -> str:
    """Run ``cmd``; its stdout and stderr, or ``RuntimeError`` saying why it failed."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{' '.join(cmd)} failed: {exc}") from exc
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[:500]}")
    return res.stdout + res.stderr


def compiler_version(cc: str) -> str:
    """``cc --version``'s output; a compiler that cannot say raises ``RuntimeError``."""
    return _run([*cc.split(), "--version"], timeout_s=30)


def build_key(cc: str) -> str:
    """Hex digest of everything a built library depends on: source, flags, ABI, compiler."""
    parts = [
        C_SOURCE.read_bytes(),
        " ".join(CFLAGS).encode(),
        str(ABI_VERSION).encode(),
        cc.encode(),
        compiler_version(cc).encode(),
        platform.machine().encode(),
    ]
    digest = hashlib.sha256()
    for part in parts:  # length-prefixed, so no two lists of parts hash alike
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()


def library_path(cc: str) -> Path:
    """Where the library built from ``C_SOURCE`` by ``cc`` on this machine is cached."""
    return cache_dir() / f"copy_pieces-{build_key(cc)[:16]}.so"


def compile_library(cc: str, out: Path) -> None:
    """Compile ``C_SOURCE`` into the shared library ``out`` with :data:`CFLAGS`."""
    _run([*cc.split(), *CFLAGS, "-o", str(out), str(C_SOURCE)], timeout_s=120)


def _private_dir(directory: Path) -> bool:
    """Whether only this user can write ``directory`` (so nobody else can plant a library)."""
    st = directory.stat()
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _build_and_open(cc: str, out: Path) -> Any:
    """Compile ``C_SOURCE``, load it, and leave it at ``out`` for later processes.

    The library is loaded from its temporary name, which no earlier load in this process
    can have used (a process that loaded a bad file at ``out`` would otherwise get that
    handle back), then renamed into place: a reader never sees a half-written file.
    """
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        compile_library(cc, Path(tmp))
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


def _load_prebuilt() -> Any:
    """The shipped library, or ``None`` if there is none or it cannot be used (logged)."""
    if not PREBUILT.exists():
        log.debug("kvtier native copy: no shipped library at %s (a source install)", PREBUILT)
        return None
    try:
        return _open(PREBUILT)
    except (OSError, AttributeError, RuntimeError) as exc:
        log.warning("kvtier native copy: the shipped %s cannot be used (%s)", PREBUILT, exc)
        return None


def _load_built(cc: str) -> tuple[Any, Path]:
    """The cached run-time build for ``cc``, compiled first if missing or damaged.

    Under an exclusive lock on a file beside the library, so of the processes that start
    together one compiles and the others wait and load its result.
    """
    path = library_path(cc)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private_dir(path.parent):
        raise RuntimeError(
            f"{path.parent} is not private to this user (owner or group/other "
            "write permission); set KVTIER_CACHE_DIR to a directory of your own"
        )
    fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed
        if path.exists():
            try:
                fn = _open(path)
                log.info("kvtier native copy: the run-time build cached at %s", path)
                return fn, path
            except (OSError, AttributeError, RuntimeError):  # damaged: build it again
                path.unlink(missing_ok=True)
        fn = _build_and_open(cc, path)
        log.info("kvtier native copy: compiled with %s into %s", cc, path)
        return fn, path
    finally:
        os.close(fd)


def load() -> Any:
    """The compiled ``kvtier_copy_pieces`` function, or ``None`` (logged once) if unavailable.

    Tries the shipped library, then a run-time build (see the module docstring); the
    result is kept for the life of the process.
    """
    global _loaded, _tried, _source, _library
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
            log.info("kvtier native copy disabled by %s; using memmove per piece", ENV_SWITCH)
            return None
        _loaded = _load_prebuilt()
        if _loaded is not None:
            _source, _library = "prebuilt", PREBUILT
            log.info("kvtier native copy: the library shipped with the package, %s", PREBUILT)
            return _loaded
        cc = compiler()
        if cc is None:
            log.info("kvtier native copy: no C compiler (set CC); using memmove per piece")
            return None
        try:
            _loaded, _library = _load_built(cc)
            _source = "built"
        except Exception as exc:  # any failure keeps the portable path
            log.warning("kvtier native copy unavailable (%s); using memmove per piece", exc)
            _loaded = None
        return _loaded


def source() -> str:
    """Which copier this process uses: ``"prebuilt"`` (shipped in the wheel), ``"built"``
    (compiled at run time) or ``"none"`` (the pure-Python path). Loads it if not yet done."""
    load()
    return _source


def library_file() -> Path | None:
    """The path of the loaded library, or ``None`` on the pure-Python path."""
    load()
    return _library


def reset_for_tests() -> None:
    """Forget the loaded library so the next :func:`load` looks again (tests only)."""
    global _loaded, _tried, _source, _library
    with _lock:
        _loaded, _tried, _source, _library = None, False, "none", None
