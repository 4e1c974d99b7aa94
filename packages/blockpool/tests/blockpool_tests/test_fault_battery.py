"""Fault battery of the host region: nothing planted in the shared-memory directory
hangs start-up or gets mapped, and a region larger than the machine's available memory
is refused before it is allocated (item 3 of the hardening issue)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvtier.blockpool import (
    HostRegion,
    InsufficientHostMemoryError,
    cleanup_stale_regions,
    mem_available_bytes,
)
from kvtier.blockpool import region as region_mod

PREFIX = region_mod.PREFIX


def unique(prefix: str) -> str:
    return f"test-{prefix}-{uuid.uuid4().hex[:12]}"


def test_a_fifo_under_a_region_name_neither_hangs_nor_is_mapped(tmp_path: Path) -> None:
    name = unique("fifo")
    fifo = tmp_path / f"{PREFIX}{name}"
    os.mkfifo(fifo)
    # Before: opening the FIFO to check for a stale region blocked start-up for ever.
    assert cleanup_stale_regions(str(tmp_path)) == []
    with pytest.raises(ValueError, match="not a regular file"):
        HostRegion.create_shared(name, 2, 4096, shm_dir=str(tmp_path))
    with pytest.raises(ValueError, match="not a regular file"):
        HostRegion.attach_shared(name, 2, 4096, pin=False, shm_dir=str(tmp_path))
    assert fifo.exists(), "another process's FIFO was removed"


def test_a_symlink_under_a_region_name_is_not_followed(tmp_path: Path) -> None:
    name = unique("link")
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes(2 * 4096))
    (tmp_path / f"{PREFIX}{name}").symlink_to(target)
    with pytest.raises(OSError):
        HostRegion.attach_shared(name, 2, 4096, pin=False, shm_dir=str(tmp_path))
    assert cleanup_stale_regions(str(tmp_path)) == []
    assert target.read_bytes() == bytes(2 * 4096)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_a_region_file_of_another_user_is_refused_and_kept(tmp_path: Path) -> None:
    name = unique("foreign")
    path = tmp_path / f"{PREFIX}{name}"
    path.write_bytes(bytes(2 * 4096))
    os.chown(path, 12345, 12345)
    with pytest.raises(PermissionError, match="belongs to uid 12345"):
        HostRegion.attach_shared(name, 2, 4096, pin=False, shm_dir=str(tmp_path))
    assert cleanup_stale_regions(str(tmp_path)) == []
    assert path.exists()


def test_the_cleanup_command_removes_regions_of_dead_processes(tmp_path: Path) -> None:
    stale = tmp_path / f"{PREFIX}{unique('dead')}"
    stale.write_bytes(bytes(4096))  # nobody holds its lock: its creator is gone
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from kvtier.blockpool.region import cleanup_main;"
         "sys.exit(cleanup_main(sys.argv[1:]))", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"removed {stale}" in out.stdout
    assert not stale.exists()


def test_mem_available_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    assert mem_available_bytes(str(meminfo)) == 2048 * 1024
    assert mem_available_bytes(str(tmp_path / "missing")) is None


def test_a_private_region_above_available_memory_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(region_mod, "mem_available_bytes", lambda: 3 * 4096)
    with pytest.raises(InsufficientHostMemoryError, match="cpu_bytes_to_use"):
        HostRegion.private(4, 4096)
    with HostRegion.private(3, 4096) as region:
        assert region.nbytes == 3 * 4096


def test_an_unpinned_private_region_is_allocated_at_start_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where nothing page-locks it (no accelerator), the region's memory is allocated
    when it is made, not page by page by the stores that first write it; a machine that
    cannot give it refuses it then, naming the keys."""
    import errno

    from kvtier.blockpool import host_memory

    reserved: list[int] = []
    real = os.posix_fallocate
    monkeypatch.setattr(
        host_memory.os, "posix_fallocate", lambda fd, off, n: (reserved.append(n), real(fd, off, n))
    )
    with HostRegion.private(3, 4096, pin=False) as region:
        assert region.nbytes == 3 * 4096
    assert reserved == [3 * 4096]

    def full(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(host_memory.os, "posix_fallocate", full)
    with pytest.raises(InsufficientHostMemoryError, match="cpu_bytes_to_use"):
        HostRegion.private(3, 4096, pin=False)
