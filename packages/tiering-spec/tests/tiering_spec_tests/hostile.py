"""Another OS user, for the adversarial tests: code run in a child process whose user
and group are an unused id. Only root can become another user; without root the
tests that need one skip with the reason."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.tiering_spec.tiers.fs import format as fs_format

OTHER_UID = 54321  # no account: an id no file of the host belongs to


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("becoming another OS user needs root (CI runs as root)")


def as_other_user(action: Callable[[], None]) -> None:
    """Run ``action`` as uid/gid ``OTHER_UID`` in a forked child, with the umask of a
    careless account (000); re-raise its failure here."""
    need_root()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        status = 0
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            os.umask(0)
            action()
        except BaseException:
            os.write(write, traceback.format_exc().encode())
            status = 1
        os.close(write)
        os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        report = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the other user's action failed:\n{report}"


def forged_block(fingerprint: bytes, key: bytes, payload: bytes) -> bytes:
    """A block file for ``key`` with any payload, made from public facts alone (the
    fingerprint is a folder's name, keys are vLLM's block hashes): valid header and
    checksum."""
    digest = fs_format.key_digest(key)
    head = fs_format.encode_header(fingerprint, digest, len(payload), fs_format.checksum(payload))
    return head + bytes(fs_format.HEADER_SIZE - len(head)) + payload


def plant(path: Path, data: bytes) -> None:
    """Write ``data`` at ``path`` (folders made as needed, world-writable as a careless
    account leaves them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
