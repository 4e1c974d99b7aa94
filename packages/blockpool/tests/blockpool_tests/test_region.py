"""The host region: exact size, views, shared across processes, stale-file cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid

import pytest
import torch

from kvtier.blockpool import (
    HostRegion,
    InsufficientSharedMemoryError,
    cleanup_stale_regions,
    shm_free_bytes,
)

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


def unique(prefix: str) -> str:
    return f"test-{prefix}-{uuid.uuid4().hex[:12]}"


def run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_private_region_has_exact_size_and_block_views() -> None:
    region = HostRegion.private(7, 3000)
    assert region.tensor.numel() == 21000 and region.tensor.dtype == torch.uint8
    assert region.blocks.shape == (7, 3000)
    region.block(3).fill_(9)
    assert int(region.tensor[3 * 3000 : 4 * 3000].sum()) == 9 * 3000
    assert region.nbytes == 21000 and not region.shared


def _mappings_named(name: str) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if name in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                out.append((start, end))
    return out


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create")
def test_a_private_region_maps_exactly_its_budget() -> None:
    """No power-of-two rounding: 12 GiB per rank must pin 12 GiB, not 16. The region is
    a mapping of its own, so the kernel's view of it is its exact size."""
    from kvtier.blockpool.region import MEMFD_NAME

    page = os.sysconf("SC_PAGE_SIZE")
    size = 3 * (16 * page + 123)  # far from a power of two, not a multiple of a page
    before = set(_mappings_named(MEMFD_NAME))
    region = HostRegion.private(3, 16 * page + 123)
    assert region.nbytes == size and region.tensor.untyped_storage().nbytes() == size
    new = [m for m in _mappings_named(MEMFD_NAME) if m not in before]
    ptr = region.tensor.data_ptr()
    assert [m for m in new if m[0] <= ptr < m[1]] == [(ptr, ptr + -(-size // page) * page)], new
    region.close()
    del region
    import gc

    gc.collect()
    assert [m for m in _mappings_named(MEMFD_NAME) if m not in before] == [], "not unmapped"


def test_layer_views_address_each_layer_inside_each_block() -> None:
    region = HostRegion.private(4, 100)
    region.tensor.zero_()
    views = region.layer_views([10, 30, 50])
    assert [tuple(v.shape) for v in views] == [(4, 10), (4, 30), (4, 50)]
    views[1][2].fill_(1)
    assert torch.equal(region.block(2)[10:40], torch.ones(30, dtype=torch.uint8))
    assert int(region.tensor.sum()) == 30


def test_layer_views_must_fit_in_a_block() -> None:
    region = HostRegion.private(2, 64)
    with pytest.raises(ValueError, match="64"):
        region.layer_views([40, 40])


def test_unpinned_without_accelerator_says_why() -> None:
    region = HostRegion.private(2, 64)
    if not torch.accelerator.is_available():
        assert not region.pinned and "no accelerator" in region.pin_method


def test_shared_region_is_seen_by_another_process() -> None:
    name = unique("share")
    with HostRegion.create_shared(name, 8, 4096) as region:
        region.tensor.zero_()
        region.block(5).fill_(7)
        child = run_child(
            """
            import sys
            from kvtier.blockpool import HostRegion
            r = HostRegion.attach_shared(sys.argv[1], 8, 4096)
            assert int(r.block(5)[0]) == 7, "child does not see the parent's bytes"
            r.block(2).fill_(3)
            r.close()
            """,
            name,
        )
        assert child.returncode == 0, child.stderr
        assert torch.equal(region.block(2), torch.full((4096,), 3, dtype=torch.uint8))
        assert region.path is not None and os.path.exists(region.path), (
            "an attacher must not unlink the creator's region"
        )
    assert not os.path.exists(region.path), "the creator unlinks on close"


def test_attach_with_a_different_size_is_refused() -> None:
    name = unique("size")
    with HostRegion.create_shared(name, 4, 1024), pytest.raises(ValueError, match="disagree"):
        HostRegion.attach_shared(name, 5, 1024)


def test_second_live_creator_of_the_same_name_is_refused() -> None:
    name = unique("dup")
    with HostRegion.create_shared(name, 2, 1024), pytest.raises(FileExistsError):
        HostRegion.create_shared(name, 2, 1024)


def test_region_left_by_a_killed_process_is_cleaned_up_on_next_start() -> None:
    name = unique("killed")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from kvtier.blockpool import HostRegion\n"
            "r = HostRegion.create_shared(sys.argv[1], 4, 4096)\n"
            "print(r.path, flush=True)\n"
            "time.sleep(600)\n",
            name,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    path = proc.stdout.readline().strip()
    assert os.path.exists(path)
    assert path not in cleanup_stale_regions(), "a live process's region was removed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert os.path.exists(path), "SIGKILL leaves the file behind (what we clean up)"
    # The next start of a region with the same name finds and replaces it.
    with HostRegion.create_shared(name, 4, 4096) as region:
        assert region.path == path
    assert not os.path.exists(path)


def test_region_is_unlinked_at_interpreter_exit() -> None:
    name = unique("exit")
    child = run_child(
        """
        import sys
        from kvtier.blockpool import HostRegion
        r = HostRegion.create_shared(sys.argv[1], 2, 4096)
        print(r.path)
        """,
        name,
    )
    assert child.returncode == 0, child.stderr
    assert not os.path.exists(child.stdout.strip())


def test_too_small_shm_fails_before_mapping_and_names_budget_and_free_space() -> None:
    free = shm_free_bytes()
    blocks = free // (1 << 20) + 16  # more 1 MiB blocks than /dev/shm holds
    with pytest.raises(InsufficientSharedMemoryError) as info:
        HostRegion.create_shared(unique("big"), blocks, 1 << 20)
    text = str(info.value)
    assert "cpu_bytes_to_use" in text and str(blocks << 20) in text and "free" in text
    assert not [p for p in os.listdir("/dev/shm") if "big" in p], "a file was left behind"


@pytest.mark.parametrize("name", ["", "a/b", "../x", "x" * 201, "sp ace"])
def test_bad_region_name_is_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="name"):
        HostRegion.create_shared(name, 2, 64)


@pytest.mark.parametrize(
    ("blocks", "nbytes", "key"), [(0, 64, "num_blocks"), (2, -1, "block_bytes")]
)
def test_bad_sizes_are_named(blocks: int, nbytes: int, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        HostRegion.private(blocks, nbytes)


def test_attach_with_wait_s_waits_for_a_creator_that_comes_later() -> None:
    import threading

    name = unique("late")
    made: list[HostRegion] = []
    timer = threading.Timer(0.3, lambda: made.append(HostRegion.create_shared(name, 2, 4096)))
    timer.start()
    try:
        with HostRegion.attach_shared(name, 2, 4096, wait_s=30) as region:
            assert not region.owner
            assert made and region.path == made[0].path
    finally:
        timer.join()
        for r in made:
            r.close()


def test_attach_with_wait_s_gives_up_with_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match=r"no live process created .* within 0\.2 s"):
        HostRegion.attach_shared(unique("never"), 2, 4096, wait_s=0.2)


def test_attach_with_wait_s_does_not_map_a_dead_processs_region() -> None:
    name = unique("stale")
    # A folder of its own: any region created meanwhile (a test beside this one, on
    # another worker) sweeps /dev/shm of stale regions and would take this file away.
    shm_dir = tempfile.mkdtemp(prefix="test-stale-", dir="/dev/shm")
    path = os.path.join(shm_dir, "kvtier-" + name)
    with open(path, "wb") as fh:  # what a killed creator leaves: the file, no lock
        fh.truncate(2 * 4096)
    try:
        with pytest.raises(FileNotFoundError, match="no live process"):
            HostRegion.attach_shared(name, 2, 4096, shm_dir=shm_dir, wait_s=0.2)
        # Without wait_s (the scheduler's lazy attach) it is refused at once, too.
        with pytest.raises(FileNotFoundError, match="no live process holds"):
            HostRegion.attach_shared(name, 2, 4096, shm_dir=shm_dir)
    finally:
        os.unlink(path)
        os.rmdir(shm_dir)
