"""Keyed authentication of block objects and files (``auth_key_file``).

A tier that shares its storage with other clients (a Mooncake master, a shared
filesystem) can be written by anyone who reaches it, and every other header field
(names, fingerprint, CRC-32, XXH3-64) is computable from public facts. With a secret
key, each object carries a BLAKE2b MAC over its header and its whole payload; a reader
with the same key accepts only objects whose MAC checks.

* :func:`load_auth_key` reads the secret from a file only this user can read and
  derives the MAC key from its bytes (BLAKE2b-256 of the content, so a key file of any
  length and format works; it must hold at least ``MIN_KEY_FILE_BYTES`` bytes).
* :func:`mac` computes the 32-byte tag; :func:`mac_matches` compares in constant time.

Every engine that shares the store (or folder) must use a file with the same bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from typing import Any

from kvtier.tiering_spec.errors import ConfigError

MAC_SIZE = 32
"""Bytes of a MAC (BLAKE2b-256)."""
MIN_KEY_FILE_BYTES = 32
"""The shortest key file accepted: 32 random bytes give a 256-bit secret."""
MAX_KEY_FILE_BYTES = 1 << 20
_PERSON_KEY = b"kvtier-key-v1"
_PERSON_MAC = b"kvtier-mac-v1"


def load_auth_key(path: str, key_name: str) -> bytes:
    """The 32-byte MAC key derived from the file at ``path``.

    Raises ``ConfigError`` naming ``key_name`` when the file is missing, a symlink or
    not a regular file, not owned by this process's user, readable or writable by
    group or others, shorter than ``MIN_KEY_FILE_BYTES`` or longer than 1 MiB.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(
            f"{key_name}={path!r} cannot be opened ({exc.strerror or exc}): it must name a "
            "regular file (no symlink) of this user, mode 0600, holding at least "
            f"{MIN_KEY_FILE_BYTES} secret bytes, e.g. made with 'head -c 64 /dev/urandom'"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{key_name}={path!r} is not a regular file")
        uid = os.geteuid()
        if st.st_uid != uid:
            raise ConfigError(
                f"{key_name}={path!r} belongs to uid {st.st_uid}, not to this engine's user "
                f"(uid {uid}); whoever owns it knows the key. Fix: a key file of this user"
            )
        if st.st_mode & 0o077:
            raise ConfigError(
                f"{key_name}={path!r} is open to group or others (mode "
                f"{stat.S_IMODE(st.st_mode):o}); another user could read or change the key. "
                f"Fix: chmod 600 {path!r}"
            )
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise ConfigError(f"{key_name}={path!r} is larger than 1 MiB: not a key file")
        chunks = []
        while True:
            chunk = os.read(fd, MAX_KEY_FILE_BYTES + 1)
            if not chunk:
                break
            chunks.append(chunk)
        content = b"".join(chunks)
    finally:
        os.close(fd)
    if len(content) < MIN_KEY_FILE_BYTES:
        raise ConfigError(
            f"{key_name}={path!r} holds {len(content)} bytes; at least {MIN_KEY_FILE_BYTES} "
            "secret bytes are needed (e.g. 'head -c 64 /dev/urandom > FILE')"
        )
    return hashlib.blake2b(content, digest_size=MAC_SIZE, person=_PERSON_KEY).digest()


def mac(key: bytes, header_prefix: Any, payload: Any) -> bytes:
    """The ``MAC_SIZE``-byte BLAKE2b MAC, keyed with ``key``, of the header bytes
    ``header_prefix`` followed by the whole ``payload`` (bytes-like objects)."""
    h = hashlib.blake2b(key=key, digest_size=MAC_SIZE, person=_PERSON_MAC)
    h.update(header_prefix)
    h.update(payload)
    return h.digest()


def mac_matches(key: bytes, header_prefix: Any, payload: Any, tag: Any) -> bool:
    """Whether ``tag`` is the MAC of ``header_prefix`` and ``payload`` (constant time)."""
    return hmac.compare_digest(mac(key, header_prefix, payload), bytes(tag))
