"""Adversarial battery of the shared host region: a region file that no live process
holds, one swapped under its name between the checks and the mapping, one another
user made, and one others may open are never mapped (item 8 of the trust issue).

The scheduler side attaches the workers' regions lazily, without ``wait_s`` and with
``pin=False``; these tests attach the same way unless they say otherwise.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvtier.blockpool import HostRegion, cleanup_stale_regions
from kvtier.blockpool import region_files as region_mod

PREFIX = region_mod.PREFIX
OTHER_UID = 54321  # no account of this system uses it; the test makes "another user"
BLOCKS, BLOCK_BYTES = 2, 4096
SIZE = BLOCKS * BLOCK_BYTES


def unique(prefix: str) -> str:
    return f"test-{prefix}-{uuid.uuid4().hex[:12]}"


def in_child(body: Callable[[], None]) -> int:
    """Fork, run ``body`` in the child and leave with its status; returns the child's pid.
    The child touches only the os module (no torch, no threads)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            body()
            code = 0
        finally:
            os._exit(code)
    return pid


def reap(pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the helper process failed"


def write_region_file(path: Path, fill: int, mode: int = 0o600) -> int:
    """A region-shaped file of ``SIZE`` bytes of ``fill``; returns an fd holding it open."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.fchmod(fd, mode)  # whatever the umask
    os.write(fd, bytes([fill]) * SIZE)
    return fd


def test_the_schedulers_attach_refuses_a_region_whose_creator_died(tmp_path: Path) -> None:
    name = unique("dead")
    path = tmp_path / f"{PREFIX}{name}"

    def creator_then_killed() -> None:
        fd = write_region_file(path, 0x5A)
        fcntl.flock(fd, fcntl.LOCK_SH)  # as create_shared does; it ends with the process

    reap(in_child(creator_then_killed))
    assert path.exists(), "a dead creator leaves its file behind"
    # Before the fix the scheduler's attach (no wait_s) mapped this file as it was.
    with pytest.raises(FileNotFoundError, match="no live process holds"):
        HostRegion.attach_shared(name, BLOCKS, BLOCK_BYTES, pin=False, shm_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no live process"):
        HostRegion.attach_shared(
            name, BLOCKS, BLOCK_BYTES, pin=False, shm_dir=str(tmp_path), wait_s=0.1
        )
    assert cleanup_stale_regions(str(tmp_path)) == [str(path)]


def test_the_schedulers_attach_maps_a_region_whose_creator_lives(tmp_path: Path) -> None:
    name = unique("live")
    with HostRegion.create_shared(name, BLOCKS, BLOCK_BYTES, pin=False, shm_dir=str(tmp_path)) as r:
        r.tensor.fill_(0x11)
        with HostRegion.attach_shared(
            name, BLOCKS, BLOCK_BYTES, pin=False, shm_dir=str(tmp_path)
        ) as attached:
            assert torch.equal(attached.tensor, r.tensor)


@pytest.fixture
def swap_after_liveness_check(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Rename ``pending[0]`` onto ``pending[1]`` right after the first liveness check: the
    window between checking the opened file and mapping it."""
    pending: list[Path] = []
    real = region_mod._is_locked

    def checked_then_swapped(fd: int) -> bool:
        live = real(fd)
        if pending:
            decoy, path = pending
            os.rename(decoy, path)
            pending.clear()
        return live

    monkeypatch.setattr(region_mod, "_is_locked", checked_then_swapped)
    yield pending


def test_a_region_swapped_after_the_checks_is_not_what_gets_mapped(
    tmp_path: Path, swap_after_liveness_check: list[Path]
) -> None:
    name = unique("swap")
    with HostRegion.create_shared(name, BLOCKS, BLOCK_BYTES, pin=False, shm_dir=str(tmp_path)) as r:
        r.tensor.fill_(0xAA)
        assert r.path is not None
        decoy = tmp_path / "decoy"
        os.close(write_region_file(decoy, 0xBB))  # same size, this user's, mode 600
        swap_after_liveness_check[:] = [decoy, Path(r.path)]
        with HostRegion.attach_shared(
            name, BLOCKS, BLOCK_BYTES, pin=False, shm_dir=str(tmp_path), wait_s=1.0
        ) as attached:
            assert not swap_after_liveness_check, "the swap did not happen"
            seen = set(attached.tensor.unique().tolist())
            assert seen == {0xAA}, (
                f"mapped bytes {seen}: the file renamed onto the name after the checks was "
                "mapped, not the creator's region that was checked"
            )
            attached.block(1).fill_(0x33)
            assert int(r.block(1)[0]) == 0x33, "the attach does not share the creator's bytes"


def test_a_live_region_that_others_may_open_is_refused(tmp_path: Path) -> None:
    name = unique("mode")
    path = tmp_path / f"{PREFIX}{name}"
    fd = write_region_file(path, 0x44, mode=0o666)
    fcntl.flock(fd, fcntl.LOCK_SH)  # live: a creator holds it
    try:
        with pytest.raises(PermissionError, match="mode 666"):
            HostRegion.attach_shared(name, BLOCKS, BLOCK_BYTES, pin=False, shm_dir=str(tmp_path))
    finally:
        os.close(fd)
        path.unlink()


@pytest.mark.skipif(
    os.geteuid() != 0, reason="making a region of another user needs root (setuid in a child)"
)
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_live_region_of_another_user_is_refused_and_kept() -> None:
    # /dev/shm is the one folder here that every user may create files in (sticky, 1777).
    shm_dir = "/dev/shm"
    name = unique("foreign")
    path = os.path.join(shm_dir, PREFIX + name)
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()

    def another_user_holds_a_region() -> None:
        os.close(ready_r)
        os.close(hold_w)
        os.setgroups([])
        os.setgid(OTHER_UID)
        os.setuid(OTHER_UID)
        fd = write_region_file(Path(path), 0x66)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.write(ready_w, b"1")
        os.read(hold_r, 1)  # hold it live until the parent is done

    pid = in_child(another_user_holds_a_region)
    os.close(ready_w)
    os.close(hold_r)
    try:
        assert os.read(ready_r, 1) == b"1", "the other user's process did not start"
        assert os.stat(path).st_uid == OTHER_UID
        with pytest.raises(PermissionError, match=f"belongs to uid {OTHER_UID}"):
            HostRegion.attach_shared(name, BLOCKS, BLOCK_BYTES, pin=False)
        with pytest.raises(PermissionError, match=f"belongs to uid {OTHER_UID}"):
            HostRegion.attach_shared(name, BLOCKS, BLOCK_BYTES, pin=False, wait_s=0.1)
        assert path not in cleanup_stale_regions(shm_dir)
        assert os.path.exists(path), "another user's file was removed"
    finally:
        os.close(hold_w)
        os.close(ready_r)
        reap(pid)
        if os.path.exists(path):
            os.unlink(path)
