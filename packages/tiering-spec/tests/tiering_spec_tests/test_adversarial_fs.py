"""Adversarial battery of the fs tier: KV this engine never wrote, a restart, a full
disk, a file taken over while another engine starts.

Each case is played as the hostile user or the unlucky operator would play it, against
the tier's own classes (and one real engine), and asserts that nothing foreign is
loaded, that the fault is counted, and that memory stays bounded. "Another user" is a
child process with another uid (root only; skipped otherwise, with the reason).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.blockpool import HostBlockPool
from kvtier.tiering_spec.config import ConfigError, FsTierConfig, parse_config
from kvtier.tiering_spec.manager import Lookup, TierManager
from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.fs import io as fs_io
from kvtier.tiering_spec.tiers.fs import tier as fs_tier
from kvtier.tiering_spec.tiers.fs.format import key_digest
from kvtier.tiering_spec.tiers.fs.tier import FileSystemTier

from .hostile import OTHER_UID, as_other_user, forged_block, need_root, plant
from .tier_support import PAYLOAD, Region, layouts, wait_results

FORGED = b"\x66" * PAYLOAD  # what the hostile user wants served


@pytest.fixture(autouse=True)
def quick_discovery(monkeypatch: pytest.MonkeyPatch) -> None:
    """The background look for other engines' files every 20 ms instead of 1 s."""
    monkeypatch.setattr(fs_tier, "DISCOVER_INTERVAL_S", 0.02)


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A folder another user can reach (pytest's own is 0700 at the top): 0755, in the
    system's temporary folder, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvtier-adversarial-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tiers() -> Iterator[list[FileSystemTier]]:
    made: list[FileSystemTier] = []
    yield made
    for t in made:
        t.shutdown()


def start(
    made: list[FileSystemTier], root: Path, region: Region, capacity: int | None = None
) -> FileSystemTier:
    cfg = FsTierConfig(
        root_dir=str(root), n_read_threads=1, n_write_threads=1, capacity_bytes=capacity
    )
    tier = FileSystemTier(cfg, layouts(), region.payload, region.views, enable_events=True)
    made.append(tier)
    assert tier.wait_scan(30)
    return tier


def fs_config(root: Path) -> dict[str, object]:
    return {"cpu_bytes_to_use": 1 << 24, "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}


def write(tier: FileSystemTier, region: Region, key: bytes, block: int) -> None:
    region.fill(0, block, block + 1)
    assert tier.submit_write(key, key_digest(key), block)
    [res] = wait_results(tier)
    assert res.ok, res


def settle_discovery(tier: FileSystemTier, rounds: int = 10) -> None:
    """Let the background thread look several times, then take in what it found."""
    time.sleep(rounds * fs_tier.DISCOVER_INTERVAL_S + 0.1)
    tier.poll()


def block_path(tier: FileSystemTier, key: bytes, root: Path | None = None) -> Path:
    """Where ``key``'s file lives under ``root`` (default: the tier's own root)."""
    [path] = tier.paths(key_digest(key))
    if root is None:
        return Path(path)
    return root / Path(path).relative_to(tier.cfg.root_dir)


def assert_not_loaded(tier: FileSystemTier, region: Region, key: bytes, block: int) -> None:
    """``key`` is a miss, or a read of it fails (the manager then frees the host block
    unused: nothing reaches the device)."""
    region.fill(0, block, 7)
    digest = key_digest(key)
    if tier.contains(digest) and tier.submit_read(key, digest, block):
        [res] = wait_results(tier)
        assert not res.ok, f"a file this engine never wrote was loaded: {res}"
    else:
        assert region.block(0, block) != FORGED


# ------------------------------------------------------------------ another user's files


def test_a_file_another_user_plants_in_root_dir_is_never_loaded(
    tmp_path: Path, tiers: list[FileSystemTier]
) -> None:
    """An operator opened the tree to everyone (chmod -R a+rwx): another user replaces
    this engine's file and adds one of their own, both with valid headers."""
    need_root()
    region = Region(4)
    root = tmp_path / "fs"
    tier = start(tiers, root, region)
    write(tier, region, b"mine", 0)
    mine, theirs = block_path(tier, b"mine"), block_path(tier, b"theirs")
    for folder in (root, *root.rglob("*")):
        if folder.is_dir():
            folder.chmod(0o777)
    fp = tier.fingerprints[0]

    def replant() -> None:
        mine.unlink()
        plant(mine, forged_block(fp, b"mine", FORGED))
        plant(theirs, forged_block(fp, b"theirs", FORGED))

    as_other_user(replant)
    assert mine.stat().st_uid == OTHER_UID
    settle_discovery(tier)
    assert not tier.contains(key_digest(b"theirs")), "another user's file was indexed"
    assert_not_loaded(tier, region, b"mine", 1)
    assert_not_loaded(tier, region, b"theirs", 2)
    assert tier.faults()["foreign"] >= 1, "the refusal was not counted"
    # A restart indexes neither (its folders opened again: 0777 is refused, so close them).
    tier.shutdown()
    for folder in (root, *root.rglob("*")):
        if folder.is_dir():
            folder.chmod(0o700)
    again = start(tiers, root, region)
    assert again.stats.files_indexed_at_start == 0
    assert_not_loaded(again, region, b"theirs", 2)


def test_a_root_dir_removed_and_made_again_by_another_user_is_never_used(
    tmp_path: Path, tiers: list[FileSystemTier]
) -> None:
    """root_dir lives in a sticky world-writable folder (/tmp); a cleaner removes it
    while the engine runs and another user makes it again, full of forged files."""
    need_root()
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    root = shared / "kv"
    region = Region(4)
    tier = start(tiers, root, region)
    write(tier, region, b"mine", 0)
    fp = tier.fingerprints[0]
    names = {k: block_path(tier, k) for k in (b"mine", b"theirs", b"later")}
    shutil.rmtree(root)

    def remake() -> None:
        for key, path in names.items():
            plant(path, forged_block(fp, key, FORGED))

    as_other_user(remake)
    assert root.stat().st_uid == OTHER_UID
    settle_discovery(tier)
    assert not tier.contains(key_digest(b"theirs")), "a file of the new root_dir was indexed"
    assert_not_loaded(tier, region, b"mine", 1)
    assert_not_loaded(tier, region, b"theirs", 2)
    # A write never goes into the other user's folder: it fails and is counted.
    region.fill(0, 3, 3)
    assert tier.submit_write(b"new", key_digest(b"new"), 3)
    [res] = wait_results(tier)
    assert not res.ok and tier.faults()["write_failed"] == 1
    assert not block_path(tier, b"new").exists()


@pytest.mark.parametrize("how", ["world-writable", "another-owner", "symlink-to-such"])
def test_a_parent_another_user_can_change_is_refused_at_start(tmp_path: Path, how: str) -> None:
    need_root()
    parent = tmp_path / "parent"
    parent.mkdir()
    if how == "world-writable":
        parent.chmod(0o777)
    elif how == "another-owner":
        os.chown(parent, OTHER_UID, OTHER_UID)
    else:
        evil = tmp_path / "evil"
        evil.mkdir()
        evil.chmod(0o777)
        parent.rmdir()
        parent.symlink_to(evil)
    root = parent / "kv"
    with pytest.raises(ConfigError, match="parent folder") as err:
        parse_config(fs_config(root), tiering=True)
    assert "root_dir" in str(err.value)
    with pytest.raises(ConfigError, match="parent folder"):
        FileSystemTier(FsTierConfig(root_dir=str(root)), layouts(), PAYLOAD, lambda: None)


def test_a_sticky_parent_of_root_is_accepted(tmp_path: Path, tiers: list) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    start(tiers, shared / "kv", Region(1))


def test_every_folder_is_made_0700_whatever_the_umask(tmp_path: Path, tiers: list) -> None:
    root = tmp_path / "a" / "b" / "kv"
    old = os.umask(0o002)
    try:
        raw = {
            "cpu_bytes_to_use": 1 << 24,
            "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
        }
        parse_config(raw, tiering=True)
        tier = start(tiers, root, Region(1))
    finally:
        os.umask(old)
    made = [tmp_path / "a", tmp_path / "a" / "b", *[p for p in root.rglob("*") if p.is_dir()]]
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in made}
    assert set(modes.values()) == {"0o700"}, modes
    assert len(modes) >= 2 + 2 + fs_format.NUM_SHARDS and tier.dirs


def test_a_hard_link_under_a_block_name_is_never_loaded(
    tmp_path: Path, tiers: list[FileSystemTier]
) -> None:
    """A forged file of this user's (made elsewhere on the same filesystem) linked
    under a block's name: one link too many, refused."""
    region = Region(2)
    root = tmp_path / "fs"
    tier = start(tiers, root, region)
    outside = tmp_path / "outside.kv"
    outside.write_bytes(forged_block(tier.fingerprints[0], b"linked", FORGED))
    os.link(outside, block_path(tier, b"linked"))
    settle_discovery(tier)
    assert not tier.contains(key_digest(b"linked")), "a hard link was indexed"
    tier.shutdown()
    again = start(tiers, root, region)
    assert again.stats.files_indexed_at_start == 0
    assert_not_loaded(again, region, b"linked", 1)


@pytest.mark.parametrize("component", ["root_dir", "fingerprint", "shard"])
def test_a_folder_swapped_for_a_symlink_is_never_followed(
    tmp_path: Path, tiers: list[FileSystemTier], component: str
) -> None:
    """After start-up a folder on the way to the block files is renamed away and a
    symlink to a folder of forged files takes its name: the running tier never walks
    into it, and a restart refuses it."""
    region = Region(4)
    root = tmp_path / "fs"
    tier = start(tiers, root, region)
    write(tier, region, b"mine", 0)
    expected_mine = region.block(0, 0)
    theirs = block_path(tier, b"theirs")
    folder = {
        "root_dir": root,
        "fingerprint": Path(tier.dirs[0]),
        "shard": theirs.parent,
    }[component]
    evil = tmp_path / "evil"
    shutil.copytree(folder, evil, symlinks=True)
    forged_theirs = evil / theirs.relative_to(folder)
    forged_theirs.parent.mkdir(parents=True, exist_ok=True)
    forged_theirs.write_bytes(forged_block(tier.fingerprints[0], b"theirs", FORGED))
    mine = block_path(tier, b"mine")
    if mine.is_relative_to(folder):  # the copy of this engine's own file: forged too
        (evil / mine.relative_to(folder)).write_bytes(
            forged_block(tier.fingerprints[0], b"mine", FORGED)
        )
    folder.rename(tmp_path / "moved")
    folder.symlink_to(evil, target_is_directory=True)
    settle_discovery(tier)
    assert not tier.contains(key_digest(b"theirs")), "a file behind a symlink was indexed"
    assert_not_loaded(tier, region, b"theirs", 2)
    # This engine's own file is still read from the folder it holds.
    assert tier.submit_read(b"mine", key_digest(b"mine"), 1)
    [res] = wait_results(tier)
    assert res.ok and region.block(0, 1) == expected_mine
    tier.shutdown()
    with pytest.raises(ConfigError, match="symlink"):
        start(tiers, root, region)


# ------------------------------------------------------------------ a restart, idle


def test_after_a_restart_files_on_disk_are_served_without_any_write(
    tmp_path: Path, tiers: list[FileSystemTier]
) -> None:
    """The engine restarts and only looks up: the start-up scan's index is taken in
    by the manager's poll although no fs job is in flight."""
    region = Region(4)
    first = start(tiers, tmp_path / "fs", region)
    keys = [b"a", b"b", b"c"]
    for i, k in enumerate(keys):
        write(first, region, k, i)
    first.shutdown()
    cfg = FsTierConfig(root_dir=str(tmp_path / "fs"), n_read_threads=1, n_write_threads=1)
    tier = FileSystemTier(cfg, layouts(), region.payload, region.views)
    tiers.append(tier)
    assert tier.scan_done.wait(30)  # found, not yet taken in
    mgr = TierManager(HostBlockPool(4), [tier], max_write_backlog=64)
    deadline = time.monotonic() + 10
    states: list[Lookup] = []
    while time.monotonic() < deadline:
        states = [mgr.lookup(k, "r") for k in keys]
        if all(s is Lookup.HIT for s in states):
            break
        mgr.end_step()
        time.sleep(0.01)
    assert states == [Lookup.HIT] * 3, f"files on disk missed after a restart: {states}"
    assert tier.stats.writes == 0 and mgr.counters.promotions == 3


def _pending(tier: FileSystemTier) -> int:
    """Digests the background thread found and the scheduler has not taken in."""
    return tier._disk.waiting


def test_discovery_holds_at_most_the_new_files_while_nobody_polls(
    tmp_path: Path, tiers: list[FileSystemTier]
) -> None:
    """Another engine writes into the shared root_dir while this one idles (no poll):
    what waits for this engine is at most the files on disk, reported once."""
    region = Region(64)
    idle = start(tiers, tmp_path / "fs", region)
    other = start(tiers, tmp_path / "fs", region)
    for i in range(48):
        other.submit_write(b"k%d" % i, key_digest(b"k%d" % i), i)
    wait_results(other, 48)
    files = 48
    for i in range(16):  # keep changing the shard folders for 16 discovery rounds
        time.sleep(fs_tier.DISCOVER_INTERVAL_S)
        key = b"more-%d" % i
        other.submit_write(key, key_digest(key), 48 + i)
        wait_results(other, 1)
        files += 1
        assert _pending(idle) <= files, f"{_pending(idle)} digests held for {files} files"
    settle_discovery(idle)
    assert all(idle.contains(key_digest(b"k%d" % i)) for i in range(48))
    assert _pending(idle) == 0


# ------------------------------------------------------------------ a full disk


def test_a_full_disk_once_then_room_again_brings_the_capacity_back(
    tmp_path: Path, tiers: list[FileSystemTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    region = Region(24)
    entry = fs_format.HEADER_SIZE + PAYLOAD
    tier = start(tiers, tmp_path / "fs", region, capacity=20 * entry)
    for i in range(10):
        write(tier, region, b"old-%d" % i, i)
    free = {"bytes": 0}
    monkeypatch.setattr(
        fs_io,
        "_fstatvfs",
        lambda fd: SimpleNamespace(f_bavail=free["bytes"] // 4096, f_frsize=4096),
        raising=False,
    )
    real = fs_io._pwritev
    calls = {"n": 0}

    def full_once(*a: Any, **k: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(fs_io, "_pwritev", full_once)
    write(tier, region, b"new", 10)
    assert tier.faults()["disk_full"] == 1
    assert tier.capacity_bytes == 10 * entry, "lowered to what it holds plus 0 bytes free"
    assert sum(tier.has(key_digest(b"old-%d" % i)) for i in range(10)) == 9, "one evicted"
    free["bytes"] = 1 << 30  # room again
    deadline = time.monotonic() + 5
    while tier.capacity_bytes != 20 * entry and time.monotonic() < deadline:
        time.sleep(fs_tier.DISCOVER_INTERVAL_S)
        tier.poll()
    assert tier.capacity_bytes == 20 * entry, "the capacity never grew back"
    for i in range(11, 20):
        write(tier, region, b"fresh-%d" % i, i)
    assert tier.used_bytes == 19 * entry and tier.stats.evictions == 1


# ------------------------------------------------------------------ a take-over


def test_a_taken_over_file_looks_fresh_to_another_engines_start_up_scan(
    tmp_path: Path, tiers: list[FileSystemTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full tier overwrites an evicted file in place under a temporary name; another
    engine starting meanwhile must not remove it as a stale temporary file."""
    entry = fs_format.HEADER_SIZE + PAYLOAD
    region = Region(4)
    tier = start(tiers, tmp_path / "fs", region, capacity=2 * entry)
    write(tier, region, b"a", 0)
    write(tier, region, b"b", 1)
    two_hours_ago = time.time() - 7200
    for key in (b"a", b"b"):
        os.utime(block_path(tier, key), (two_hours_ago, two_hours_ago))
    real = fs_io._pwritev
    seen: dict[str, Any] = {}
    gate = threading.Event()

    def during_write(fd: int, *a: Any, **k: Any) -> int:
        if "mtime" not in seen:
            seen["mtime"] = os.fstat(fd).st_mtime
            seen["reused"] = tier.stats.files_reused
            # Another engine starts now and scans the shared folder.
            other = start(tiers, tmp_path / "fs", Region(1))
            seen["removed_tmp"] = other.stats.files_indexed_at_start
            gate.set()
        return real(fd, *a, **k)

    monkeypatch.setattr(fs_io, "_pwritev", during_write)
    region.fill(0, 2, 9)
    assert tier.submit_write(b"c", key_digest(b"c"), 2)
    [res] = wait_results(tier)
    assert gate.is_set() and seen["reused"] == 1, "no file was taken over"
    assert seen["mtime"] > time.time() - 600, "the taken-over file kept its old times"
    assert res.ok, f"the write failed: another engine's scan removed it ({res})"
    assert tier.submit_read(b"c", key_digest(b"c"), 3)
    [back] = wait_results(tier)
    assert back.ok and region.block(0, 3) == region.block(0, 2)


# ------------------------------------------------------------------ one real engine


@pytest.mark.e2e
@pytest.mark.slow
def test_forged_files_of_another_user_never_reach_the_engine(tmp_path: Path) -> None:
    """A first engine fills the fs tier. Every block file is then replaced by a forgery
    of the same key (valid header and checksum, other bytes) owned by another user, as
    through a folder someone left open. The second engine's outputs are those of vLLM
    alone, and every forgery is refused."""
    need_root()
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvtier.testkit import (
        Workload,
        compare_outputs,
        kv_transfer_config,
        make_tiny_llama,
        run_with,
    )
    from kvtier.testkit.engine import kv_connector_of

    from .e2e_support import ENGINE, ROOMY, offload_config, prefix_prompts

    model = make_tiny_llama()
    workload = Workload(prefix_prompts(), 8)
    cfg = offload_config("TieringOffloadingSpec", host_chunks=10, root_dir=str(tmp_path / "fs"))

    def fs_tier(llm: Any) -> Any:
        tier = kv_connector_of(llm).connector_scheduler.manager.core.secondary_tiers[0]
        return SimpleNamespace(stats=tier.stats, faults=tier.faults())

    reference, _ = run_with(model, workload, **ROOMY)
    _, first = run_with(
        model, workload, inspect=fs_tier, kv_transfer_config=kv_transfer_config(cfg), **ENGINE
    )
    assert first.stats.writes > 0
    forged = 0
    for path in (tmp_path / "fs").rglob("*.kv"):
        data = path.read_bytes()
        fp, digest = data[16:32], data[32:48]
        payload = os.urandom(len(data) - fs_format.HEADER_SIZE)
        head = fs_format.encode_header(fp, digest, len(payload), fs_format.checksum(payload))
        path.write_bytes(head + bytes(fs_format.HEADER_SIZE - len(head)) + payload)
        os.chown(path, OTHER_UID, OTHER_UID)
        forged += 1
    assert forged == first.stats.writes
    got, second = run_with(
        model, workload, inspect=fs_tier, kv_transfer_config=kv_transfer_config(cfg), **ENGINE
    )
    cmp = compare_outputs(reference.outputs, got.outputs)
    assert cmp.identical, cmp.report()
    # Not one forgery indexed: the second engine read only the files it wrote itself.
    assert second.stats.files_indexed_at_start == 0
    assert second.stats.reads <= second.stats.writes


# ------------------------------------------------------------------ a shared filesystem


def key_file(tmp_path: Path, name: str = "key", secret: bytes | None = None) -> str:
    path = tmp_path / name
    path.write_bytes(secret if secret is not None else os.urandom(64))
    path.chmod(0o600)
    return str(path)


def start_keyed(
    made: list[FileSystemTier], root: Path, region: Region, auth_key_file: str | None
) -> FileSystemTier:
    cfg = FsTierConfig(
        root_dir=str(root), n_read_threads=1, n_write_threads=1, auth_key_file=auth_key_file
    )
    tier = FileSystemTier(cfg, layouts(), region.payload, region.views)
    made.append(tier)
    assert tier.wait_scan(30)
    return tier


def test_with_auth_key_file_a_file_forged_under_this_uid_is_never_loaded(
    tmp_path: Path, tiers: list[FileSystemTier]
) -> None:
    """On a shared filesystem the uid does not prove authorship (NFS trusts the uid a
    client asserts): with a key, a file with a valid header and checksum but no valid
    MAC is refused, counted and removed; the engine's own files load."""
    region = Region(4)
    root = tmp_path / "fs"
    key = key_file(tmp_path)
    tier = start_keyed(tiers, root, region, key)
    write(tier, region, b"mine", 0)
    expected = region.block(0, 0)
    forged = block_path(tier, b"theirs")
    forged.write_bytes(forged_block(tier.fingerprints[0], b"theirs", FORGED))
    forged.chmod(0o600)
    settle_discovery(tier)
    assert tier.contains(key_digest(b"theirs")), "this user's file is indexed (then checked)"
    assert_not_loaded(tier, region, b"theirs", 2)
    assert tier.faults()["unauthenticated"] == 1
    deadline = time.monotonic() + 5
    while forged.exists() and time.monotonic() < deadline:  # removed by an I/O thread
        time.sleep(0.01)
        tier.poll()
    assert not forged.exists(), "the forgery was not removed"
    assert tier.submit_read(b"mine", key_digest(b"mine"), 1)
    [res] = wait_results(tier)
    assert res.ok and region.block(0, 1) == expected
    # An engine with another key refuses this one's files; one without a key reads them.
    tier.shutdown()
    other = start_keyed(tiers, root, region, key_file(tmp_path, "other"))
    assert_not_loaded(other, region, b"mine", 2)
    assert other.faults()["unauthenticated"] == 1


def test_an_auth_key_file_others_can_read_is_refused_at_start(tmp_path: Path) -> None:
    key = key_file(tmp_path)
    os.chmod(key, 0o644)
    raw = fs_config(tmp_path / "fs")
    raw["secondary_tiers"][0]["auth_key_file"] = key  # type: ignore[index]
    with pytest.raises(ConfigError, match="auth_key_file"):
        parse_config(raw, tiering=True)
    with pytest.raises(ConfigError, match="auth_key_file"):
        start_keyed([], tmp_path / "fs", Region(1), key)
