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
import threading
from collections.abc import Sequence

from kvtier.tiering_spec.errors import ConfigError
from kvtier.tiering_spec.private_dirs import (
    DIR_FLAGS,
    PRIVATE_MODE,
    make_private_dirs,
    refuse_unless_private,
)
from kvtier.tiering_spec.tiers.fs.format import FORMAT_DIR, NUM_SHARDS


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
        refuse_unless_private(path, key, os.fstat(fd))
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
