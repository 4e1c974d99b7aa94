"""The fs tier's directories: checked once by path, then held open.

Files under ``root_dir`` are loaded into the KV cache, so nobody but this OS user may
be able to put a file there, now or later:

* every parent of ``root_dir`` is checked as ssh's ``StrictModes`` checks a home
  directory: owned by root or this user, and writable by no one else unless it is
  sticky (``/tmp``) and owned by root or this user;
* every folder kvtier creates is made ``0700`` whatever the umask;
* from start-up on, the tier holds a descriptor of ``root_dir``'s parent, of
  ``root_dir`` and of every folder below, and reaches files only relative to them
  (``openat``, ``renameat``, ``unlinkat``, ``scandir`` on a descriptor). A folder
  renamed, removed or replaced by a symlink after the check is never walked into by
  name: a removed folder is made again from its held parent, and checked again.

Units: none; every function here works on names and descriptors.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Sequence

from kvtier.tiering_spec.config import ConfigError
from kvtier.tiering_spec.tiers.fs_format import FORMAT_DIR, NUM_SHARDS

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
PRIVATE_MODE = 0o700


def _refuse_mode(path: str, key: str, st: os.stat_result) -> None:
    """ConfigError unless ``st`` is a directory of this user that neither group nor
    others can write."""
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"{key}: {path!r} is not a directory; kvtier follows no links for its files: "
            "point root_dir at the real directory"
        )
    uid = os.geteuid()
    if st.st_uid != uid:
        raise ConfigError(
            f"{key}: directory {path!r} belongs to uid {st.st_uid}, not to this engine's user "
            f"(uid {uid}); another user could plant KV there. Fix: chown {uid} {path!r}, or "
            "choose a root_dir of this user"
        )
    if st.st_mode & 0o022:
        raise ConfigError(
            f"{key}: directory {path!r} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}); another user could plant KV there. Fix: "
            f"chmod go-w {path!r}"
        )


def check_parents(path: str, key: str) -> None:
    """Refuse ``path`` when another user could replace or add a folder on its way:
    each existing parent (symlinks resolved) must be owned by root or this user and
    writable by no one else, unless sticky and owned by root or this user."""
    uid = os.geteuid()
    parent = os.path.dirname(os.path.abspath(path))
    real = os.path.realpath(parent)
    parts = [p for p in real.split(os.sep) if p]
    current = os.sep
    for part in [None, *parts]:
        if part is not None:
            current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return  # made later by make_private_dirs, 0700
        except OSError as exc:
            raise ConfigError(f"{key}: {current!r} cannot be checked: {exc.strerror}") from None
        owner_ok = st.st_uid in (0, uid)
        writable = bool(st.st_mode & 0o022)
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if not owner_ok or (writable and not sticky):
            who = f"uid {st.st_uid}" if not owner_ok else f"mode {stat.S_IMODE(st.st_mode):o}"
            raise ConfigError(
                f"{key}: parent folder {current!r} of {path!r} ({who}) can be changed by "
                f"another user, who could then swap in a folder of their own KV. Allowed: "
                f"parents owned by root or uid {uid} and writable by no one else, or sticky "
                f"(like /tmp). Fix: chmod go-w {current!r}, or choose another root_dir"
            )


def make_private_dirs(path: str, key: str) -> None:
    """Create ``path`` and its missing parents, each ``0700`` whatever the umask, then
    check ``path`` (see :func:`check_private_dir`). Parents are checked by
    :func:`check_parents` first."""
    check_parents(path, key)
    missing: list[str] = []
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        missing.append(current)
        up = os.path.dirname(current)
        if up == current:
            break
        current = up
    for folder in reversed(missing):
        try:
            os.mkdir(folder, PRIVATE_MODE)
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(
                f"{key}={path!r} cannot be created: {exc.strerror or exc} ({folder!r})"
            ) from None
        os.chmod(folder, PRIVATE_MODE, follow_symlinks=False)
    check_private_dir(path, key)


def check_private_dir(path: str, key: str) -> None:
    """Refuse ``path`` unless it is a real directory (no symlink) of this user that
    neither group nor others can write."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(
            f"{key}: {path!r} is a symlink; kvtier follows no links for its files: "
            "point root_dir at the real directory"
        )
    _refuse_mode(path, key, st)


def open_private_dir(name: str, dir_fd: int, path: str, key: str) -> int:
    """Descriptor of folder ``name`` under ``dir_fd`` (made ``0700`` if missing),
    checked through that descriptor: a real directory of this user that no one else
    can write. ``path`` names it in errors."""
    created = False
    try:
        os.mkdir(name, PRIVATE_MODE, dir_fd=dir_fd)
        created = True
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"{key}: {path!r} cannot be created: {exc.strerror or exc}") from None
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ConfigError(
                f"{key}: {path!r} is a symlink or not a directory; kvtier follows no links "
                "for its files"
            ) from None
        raise ConfigError(f"{key}: {path!r} cannot be opened: {exc.strerror or exc}") from None
    try:
        if created:
            os.fchmod(fd, PRIVATE_MODE)
        _refuse_mode(path, key, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _removed(fd: int) -> bool:
    """Whether the folder held by ``fd`` was removed (no name links to it any more)."""
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


class TierDirs:
    """The folders of one fs tier, held open from start-up::

        parent of root_dir / root_dir / kvtier-kv-v1 / <fingerprint> / <shard>

    one fingerprint folder per rank. ``shard(rank, n)`` is the descriptor that every
    block file of that rank and shard is opened, renamed and removed through.
    """

    def __init__(self, root_dir: str, fingerprints: Sequence[str], key: str) -> None:
        self.key = key
        self.root_dir = root_dir
        make_private_dirs(root_dir, key)
        real_root = os.path.realpath(root_dir)
        self._parent = os.open(os.path.dirname(real_root) or os.sep, DIR_FLAGS)
        self._retired: list[int] = []
        self._lock = threading.Lock()
        root_name = os.path.basename(real_root)
        # (name, parent index) per held folder: 0 = root_dir, 1 = base, then per rank
        # its fingerprint folder and its shards.
        self._names: list[str] = [root_name, FORMAT_DIR]
        self._up: list[int] = [-1, 0]
        self.paths: list[str] = [root_dir, os.path.join(root_dir, FORMAT_DIR)]
        self._fp_index: list[int] = []
        self._shard_index: list[list[int]] = []
        for fp in fingerprints:
            fp_i = len(self._names)
            self._names.append(fp)
            self._up.append(1)
            self.paths.append(os.path.join(self.paths[1], fp))
            self._fp_index.append(fp_i)
            shards = []
            for n in range(NUM_SHARDS):
                shards.append(len(self._names))
                self._names.append(f"{n:x}")
                self._up.append(fp_i)
                self.paths.append(os.path.join(self.paths[fp_i], f"{n:x}"))
            self._shard_index.append(shards)
        self._fds: list[int] = []
        try:
            for i, name in enumerate(self._names):
                up = self._parent if self._up[i] < 0 else self._fds[self._up[i]]
                self._fds.append(open_private_dir(name, up, self.paths[i], key))
        except BaseException:
            self.close()
            raise

    @property
    def root(self) -> int:
        return self._fds[0]

    @property
    def base(self) -> int:
        return self._fds[1]

    def fingerprint(self, rank: int) -> int:
        return self._fds[self._fp_index[rank]]

    def shard(self, rank: int, n: int) -> int:
        return self._fds[self._shard_index[rank][n]]

    def fingerprint_path(self, rank: int) -> str:
        return self.paths[self._fp_index[rank]]

    def revive(self, rank: int, n: int) -> bool:
        """Make again the folders on the way to shard ``n`` of ``rank`` that were
        removed while the engine ran, each from its held parent and checked again.
        True when any was made again; raises ConfigError when a folder now there is not
        this user's private folder (someone else made it)."""
        chain: list[int] = []
        i = self._shard_index[rank][n]
        while i >= 0:
            chain.append(i)
            i = self._up[i]
        chain.reverse()
        with self._lock:
            start = next((j for j, i in enumerate(chain) if _removed(self._fds[i])), None)
            if start is None:
                return False
            for i in chain[start:]:
                up = self._parent if self._up[i] < 0 else self._fds[self._up[i]]
                fd = open_private_dir(self._names[i], up, self.paths[i], self.key)
                # Another thread may be inside a call on the old descriptor: it is closed
                # at shutdown, never reused for another folder while the tier runs.
                self._retired.append(self._fds[i])
                self._fds[i] = fd
            # Folders below a made-again one that this chain does not cover (other
            # shards) are found removed, and made again, by their own next write.
            return True

    def close(self) -> None:
        for fd in [*self._fds, *self._retired, self._parent]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        self._retired = []
