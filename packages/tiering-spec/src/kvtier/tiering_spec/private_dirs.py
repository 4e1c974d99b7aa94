"""Folders only this OS user can change: checked by path, made ``0700``.

Files under an fs tier's ``root_dir`` (and the folders kvtier makes for its host
regions) are loaded into the KV cache, so nobody but this OS user may be able to put a
file there, now or later: every parent is checked as ssh's ``StrictModes`` checks a
home directory (owned by root or this user, and writable by no one else unless it is
sticky and owned by root or this user), and every folder kvtier creates is made
``0700`` whatever the umask. :mod:`kvtier.tiering_spec.tiers.fs.dirs` then holds the
fs tier's folders open.

Units: none; every function here works on names.
"""

from __future__ import annotations

import os
import stat

from kvtier.tiering_spec.errors import ConfigError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
PRIVATE_MODE = 0o700


def _setting(key: str) -> str:
    """The setting a message's ``key`` names (``secondary_tiers[0].root_dir``: root_dir)."""
    return key.rsplit(".", 1)[-1]


def refuse_unless_private(path: str, key: str, st: os.stat_result) -> None:
    """ConfigError unless ``st`` is a directory of this user that neither group nor
    others can write."""
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"{key}: {path!r} is not a directory; kvtier follows no links for its files: "
            f"point {_setting(key)} at the real directory"
        )
    uid = os.geteuid()
    if st.st_uid != uid:
        raise ConfigError(
            f"{key}: directory {path!r} belongs to uid {st.st_uid}, not to this engine's user "
            f"(uid {uid}); another user could plant KV there. Fix: chown {uid} {path!r}, or "
            f"choose a {_setting(key)} of this user"
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
                f"(like /tmp). Fix: chmod go-w {current!r}, or choose another {_setting(key)}"
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
            f"point {_setting(key)} at the real directory"
        )
    refuse_unless_private(path, key, st)
