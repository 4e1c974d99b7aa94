"""The fs tier: round trips, restart, capacity, permissions, and every fault."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.tiering_spec.tiers.fs import capacity as fs_capacity
from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.fs import io as fs_io
from kvtier.tiering_spec.tiers.fs import scan as fs_scan
from kvtier.tiering_spec.tiers.fs import tier as fs_tier
from kvtier.tiering_spec.tiers.fs.format import key_digest

from .tier_support import PAYLOAD, Region, wait_results


def write(tier, region: Region, key: bytes, block: int, seed: int) -> bytes:
    data = region.fill(0, block, seed)
    assert tier.submit_write(key, key_digest(key), block)
    [res] = wait_results(tier)
    assert res.ok, res
    return data


def read(tier, key: bytes, block: int):
    assert tier.submit_read(key, key_digest(key), block)
    [res] = wait_results(tier)
    return res


def test_a_written_block_reads_back_byte_for_byte(make_tier) -> None:
    region = Region(4)
    tier = make_tier(region)
    data = write(tier, region, b"k1", 0, 7)
    res = read(tier, b"k1", 3)
    assert res.ok and region.block(0, 3) == data
    assert tier.stats.reads == 1 and tier.stats.writes == 1


def test_file_layout_header_and_permissions(make_tier, tmp_path: Path) -> None:
    region = Region(2)
    tier = make_tier(region)
    write(tier, region, b"key", 0, 1)
    [path] = tier.paths(key_digest(b"key"))
    raw = Path(path).read_bytes()
    assert raw[:8] == fs_format.MAGIC
    assert len(raw) == fs_format.HEADER_SIZE + PAYLOAD
    assert Path(path).name == key_digest(b"key").hex() + ".kv"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for d in (tier.dirs[0], os.path.dirname(path), str(tmp_path / "fs")):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".tmp")]
    assert (Path(tier.dirs[0]) / "layout.json").is_file()


def test_o_direct_is_used_where_the_filesystem_accepts_it(make_tier) -> None:
    tier = make_tier(Region(1))
    assert tier.direct == fs_io.probe_o_direct(tier.dirs[0])


def test_files_of_an_earlier_run_are_served_after_a_restart(make_tier, tmp_path: Path) -> None:
    region = Region(4)
    first = make_tier(region)
    data = write(first, region, b"old", 1, 5)
    first.shutdown()
    again = make_tier(region)
    assert again.stats.files_indexed_at_start == 1
    assert again.contains(key_digest(b"old"))
    assert read(again, b"old", 2).ok and region.block(0, 2) == data


def test_a_large_start_up_scan_is_indexed_a_slice_per_poll(
    make_tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan's findings are indexed on the scheduler thread for at most
    SCAN_TAKE_SECONDS a poll (at least a slice), the rest at the next polls; until
    then an entry reads as a miss. wait_scan indexes them all."""
    region = Region(8)
    first = make_tier(region)
    keys = [b"old-%d" % i for i in range(5)]
    for i, key in enumerate(keys):
        write(first, region, key, i, i + 1)
    first.shutdown()
    monkeypatch.setattr(fs_tier, "SCAN_TAKE_SECONDS", 0.0)
    monkeypatch.setattr(fs_tier, "SCAN_TAKE_SLICE", 2)
    again = make_tier(region, take_scan=False)
    assert again.scan_done.wait(30)
    indexed = []
    for _ in range(3):
        again.poll()
        indexed.append(sum(key_digest(k) in again._index for k in keys))
    assert indexed == [2, 4, 5], "a slice of two entries a poll, oldest first"
    assert again.stats.files_indexed_at_start == 5
    assert all(again.contains(key_digest(k)) for k in keys)
    assert read(again, keys[0], 7).ok
    third = make_tier(region, take_scan=False)
    assert third.wait_scan(30) and third.stats.files_indexed_at_start == 5, "all at once"


def found_by_discovery(make_tier, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """A tier whose discovery found 5 files another engine wrote into its root_dir, not
    taken yet, and their keys; the scan's take set to one slice of 2 a poll."""
    region = Region(8)
    mine = make_tier(region)
    other = make_tier(region)
    keys = [b"theirs-%d" % i for i in range(5)]
    for i, key in enumerate(keys):
        write(other, region, key, i, i + 1)
    monkeypatch.setattr(fs_tier, "SCAN_TAKE_SECONDS", 0.0)
    monkeypatch.setattr(fs_tier, "SCAN_TAKE_SLICE", 2)
    deadline = time.monotonic() + 30
    while mine._disk.waiting < len(keys) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mine._disk.waiting == len(keys)
    return mine, keys


def test_files_another_engine_wrote_are_indexed_a_slice_per_poll(
    make_tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What discovery finds on disk (everything, where the start-up scan failed) is
    indexed as the scan's findings: SCAN_TAKE_SECONDS a poll, at least a slice."""
    mine, keys = found_by_discovery(make_tier, monkeypatch)
    indexed = []
    for _ in range(3):
        assert mine.has_news
        mine.poll()
        indexed.append(sum(key_digest(k) in mine._index for k in keys))
    assert indexed == [2, 4, 5], "a slice of two entries a poll"
    assert mine._disk.waiting == 0
    assert read(mine, keys[3], 7).ok


def test_a_found_file_this_tier_removed_before_its_turn_is_never_indexed(
    make_tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Discovery's findings wait in the scanner until their slice comes; a file this tier
    removes meanwhile (its unlink tells the scanner) is not indexed: it is gone."""
    mine, keys = found_by_discovery(make_tier, monkeypatch)
    mine.poll()
    pending = [key_digest(k) for k in keys if key_digest(k) not in mine._index]
    assert len(pending) == 3
    gone = pending[0]
    shard, name = mine._where(gone)
    os.unlink(name, dir_fd=mine.fsdirs.shard(0, shard))  # (as the tier's unlink task does)
    mine._disk.note_own_change(shard, gone, False)
    while mine._disk.waiting:
        mine.poll()
    assert gone not in mine._index
    assert all(d in mine._index for d in pending[1:])


def test_earlier_files_indexed_while_a_full_disk_holds_the_capacity_down_are_kept(
    make_tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk lowers the capacity to the tier's indexed files plus the free space;
    the start-up scan's files, on disk before, raise it as they are indexed instead of
    being evicted for it."""
    region = Region(8)
    entry = fs_format.HEADER_SIZE + PAYLOAD
    first = make_tier(region)
    old = [b"old-%d" % i for i in range(6)]
    for i, key in enumerate(old):
        write(first, region, key, i, i + 1)
    first.shutdown()
    monkeypatch.setattr(fs_tier, "SCAN_TAKE_SECONDS", 0.0)
    monkeypatch.setattr(fs_tier, "SCAN_TAKE_SLICE", 2)
    tier = make_tier(region, capacity=10 * entry, take_scan=False)
    assert tier.scan_done.wait(30)
    assert tier._capacity.lower_for_full_disk(0, entry)  # a write found the disk full
    assert tier.capacity_bytes == 2 * entry  # (one entry per write thread)
    while tier._scan_result or tier._scan_taking is not None:
        tier.poll()
    assert tier.stats.evictions == 0
    assert all(tier.has(key_digest(k)) for k in old)
    assert tier.capacity_bytes == 8 * entry, "raised by the files found, below its target"


def test_a_capacity_gone_far_below_the_files_is_trimmed_a_slice_per_poll(
    make_tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files beyond a capacity (lowered for a full disk, recomputed after the scan) are
    evicted TRIM_ENTRIES a poll, never in one call; writes wait until the excess is
    within that much."""
    monkeypatch.setattr(fs_capacity, "TRIM_ENTRIES", 3)
    region = Region(12)
    tier = make_tier(region)
    for i in range(10):
        write(tier, region, b"k%d" % i, i, i)
    entry = tier.entry_bytes
    tier._capacity.reset(2 * entry)  # (as a recomputed capacity would)
    assert tier.has_news
    assert not tier.submit_write(b"new", key_digest(b"new"), 11), "8 over: the write waits"
    held = []
    while tier.used_bytes > 2 * entry:
        tier.poll()
        held.append(tier.used_bytes // entry)
    assert held == [7, 4, 2]
    assert not tier.has_news
    assert tier.stats.evictions == 8
    assert [i for i in range(10) if tier.has(key_digest(b"k%d" % i))] == [8, 9]
    write(tier, region, b"new", 11, 5)
    assert tier.has(key_digest(b"new")) and tier.used_bytes == 2 * entry


def test_a_default_capacity_counts_the_earlier_files_as_they_are_indexed(
    make_tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without capacity_bytes the tier may hold half of the free space plus its files of
    earlier runs. While the scan's findings are indexed a slice per poll, writes make
    room against the files indexed so far: none of the earlier files is evicted that
    the capacity computed from the whole scan keeps."""
    region = Region(12)
    first = make_tier(region)
    old = [b"old-%d" % i for i in range(8)]
    for i, key in enumerate(old):
        write(first, region, key, i, i + 1)
    first.shutdown()
    entry = first.entry_bytes
    # The disk shows 4 entries free: 2 before the scan, (4 + 8) / 2 = 6 after it.
    monkeypatch.setattr(
        fs_io, "_fstatvfs", lambda fd: SimpleNamespace(f_bavail=4 * entry // 4096, f_frsize=4096)
    )
    monkeypatch.setattr(fs_tier, "SCAN_TAKE_SECONDS", 0.0)
    monkeypatch.setattr(fs_tier, "SCAN_TAKE_SLICE", 2)
    tier = make_tier(region, take_scan=False)
    assert tier.scan_done.wait(30)
    assert tier.capacity_bytes == 2 * entry
    written = 0
    while tier._scan_result or tier._scan_taking is not None:
        tier.poll()  # two more files of earlier runs indexed
        if written < 2:  # (its polls index some more)
            write(tier, region, b"new-%d" % written, 8 + written, written)
            written += 1
    assert tier.capacity_bytes == 6 * entry
    assert tier.used_bytes == 6 * entry, "as many files as the capacity holds"
    assert tier.stats.evictions == 8 + written - 6


def test_the_start_up_scan_orders_its_entries_oldest_first_a_slice_at_a_time(
    make_tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan sorts its entries by age in slices merged in order (a sort of every
    file at once held the interpreter's lock, and the scheduler's thread, 1.4 s for a
    million files): the same order as one sort."""
    region = Region(8)
    first = make_tier(region)
    keys = [b"aged-%d" % i for i in range(7)]
    ages = [5, 1, 6, 0, 3, 2, 4]  # written in one order, aged in another
    for i, key in enumerate(keys):
        write(first, region, key, i, i + 1)
        os.utime(first.paths(key_digest(key))[0], (1000 + ages[i], 1000 + ages[i]))
    first.shutdown()
    monkeypatch.setattr(fs_scan, "SORT_SLICE", 2)
    again = make_tier(region, take_scan=False)
    assert again.scan_done.wait(30)
    report = again._disk.scan()
    assert report.entries == [key_digest(k) for _, k in sorted(zip(ages, keys))]


def test_another_fingerprint_does_not_see_the_files(make_tier) -> None:
    region = Region(2)
    a = make_tier(region)
    write(a, region, b"k", 0, 1)
    b = make_tier(region, dtype="bfloat16")
    assert b.dirs != a.dirs
    assert not b.contains(key_digest(b"k"))


def test_ranks_are_kept_apart_by_the_fingerprint(make_tier) -> None:
    region = Region(2, world_size=2)
    tier = make_tier(region, world_size=2)
    d0 = region.fill(0, 0, 1)
    d1 = region.fill(1, 0, 2)
    assert tier.submit_write(b"k", key_digest(b"k"), 0)
    assert wait_results(tier)[0].ok
    p0, p1 = tier.paths(key_digest(b"k"))
    assert os.path.dirname(os.path.dirname(p0)) != os.path.dirname(os.path.dirname(p1))
    region.ranks[0][:] = bytes(len(region.ranks[0]))
    region.ranks[1][:] = bytes(len(region.ranks[1]))
    assert read(tier, b"k", 1).ok
    assert region.block(0, 1) == d0 and region.block(1, 1) == d1
    # rank 1's file read as rank 0 fails the fingerprint check
    os.replace(p1, p0)
    res = read(tier, b"k", 1)
    assert not res.ok and res.fault == "corrupt"


def test_capacity_evicts_least_recently_used_first(make_tier) -> None:
    region = Region(4)
    entry = fs_format.HEADER_SIZE + PAYLOAD
    tier = make_tier(region, capacity=3 * entry)
    for i, k in enumerate([b"a", b"b", b"c"]):
        write(tier, region, k, i % 4, i)
    tier.touch([key_digest(b"a")])
    write(tier, region, b"d", 3, 9)
    wait_for_unlinks(tier)
    assert tier.used_bytes <= 3 * entry
    assert not tier.has(key_digest(b"b")), "b was least recently used"
    assert all(tier.has(key_digest(k)) for k in (b"a", b"c", b"d"))
    assert not any(os.path.exists(p) for p in tier.paths(key_digest(b"b")))
    assert tier.stats.evictions == 1


@pytest.mark.parametrize(("policy", "evicted"), [("lru", b"a"), ("arc", b"b"), ("frecency", b"b")])
def test_the_tiers_policy_picks_what_a_full_tier_evicts(make_tier, policy, evicted) -> None:
    """a is written, then reused by three requests, then b and c are written: LRU
    evicts a (used longest ago) for d; ARC and frecency keep it (used again) and evict
    b, the oldest block nobody reused."""
    region = Region(4)
    entry = fs_format.HEADER_SIZE + PAYLOAD
    tier = make_tier(region, capacity=3 * entry, eviction_policy=policy)
    write(tier, region, b"a", 0, 0)
    for _ in range(3):
        tier.finish_request([key_digest(b"a")], {key_digest(b"a")})
    for i, k in enumerate([b"b", b"c", b"d"], start=1):
        write(tier, region, k, i, i)
    wait_for_unlinks(tier)
    kept = {k for k in (b"a", b"b", b"c", b"d") if tier.has(key_digest(k))}
    assert kept == {b"a", b"b", b"c", b"d"} - {evicted}
    assert not any(os.path.exists(p) for p in tier.paths(key_digest(evicted)))


def wait_for_unlinks(tier) -> None:
    tier.drain()
    tier.poll()


def test_a_write_at_capacity_takes_over_the_evicted_file(make_tier) -> None:
    region = Region(4, world_size=2)
    tier = make_tier(region, world_size=2, capacity=2 * 2 * (fs_format.HEADER_SIZE + PAYLOAD))
    for i, k in enumerate([b"a", b"b"]):
        region.fill(1, i, 50 + i)
        write(tier, region, k, i, i)
    inodes = {os.stat(p).st_ino for p in tier.paths(key_digest(b"a"))}
    d0 = region.fill(0, 2, 9)
    d1 = region.fill(1, 2, 10)
    write(tier, region, b"c", 2, 9)
    wait_for_unlinks(tier)
    assert tier.stats.files_reused == 2, "both ranks' files of the evicted entry"
    assert {os.stat(p).st_ino for p in tier.paths(key_digest(b"c"))} == inodes
    assert not any(os.path.exists(p) for p in tier.paths(key_digest(b"a")))
    assert not tier.has(key_digest(b"a")) and tier.has(key_digest(b"c"))
    region.ranks[0][:] = bytes(len(region.ranks[0]))
    region.ranks[1][:] = bytes(len(region.ranks[1]))
    assert read(tier, b"c", 3).ok
    assert region.block(0, 3) == d0 and region.block(1, 3) == d1
    files = [n for d in tier.dirs for _, _, ns in os.walk(d) for n in ns if n.endswith(".kv")]
    assert len(files) == 4, files


def test_an_evicted_file_with_another_link_is_not_overwritten(make_tier, tmp_path) -> None:
    region = Region(4)
    tier = make_tier(region, capacity=fs_format.HEADER_SIZE + PAYLOAD)
    write(tier, region, b"a", 0, 1)
    [path] = tier.paths(key_digest(b"a"))
    outside = tmp_path / "linked"
    os.link(path, outside)
    before = outside.read_bytes()
    write(tier, region, b"b", 1, 2)
    wait_for_unlinks(tier)
    assert tier.stats.files_reused == 0
    assert outside.read_bytes() == before, "a file linked elsewhere was overwritten"
    assert read(tier, b"b", 2).ok and tier.faults() == dict.fromkeys(fs_tier.FAULT_KINDS, 0)


def test_restart_over_capacity_drops_the_oldest(make_tier) -> None:
    region = Region(4)
    entry = fs_format.HEADER_SIZE + PAYLOAD
    first = make_tier(region)
    for i, k in enumerate([b"a", b"b", b"c"]):
        write(first, region, k, i, i)
        os.utime(first.paths(key_digest(k))[0], (1000 + i, 1000 + i))
    first.shutdown()
    small = make_tier(region, capacity=2 * entry)
    assert small.used_bytes == 2 * entry
    assert not small.has(key_digest(b"a"))


# ------------------------------------------------------------------ faults


def faulty(make_tier, damage, caplog) -> tuple:
    region = Region(2)
    tier = make_tier(region)
    write(tier, region, b"k", 0, 3)
    [path] = tier.paths(key_digest(b"k"))
    damage(path)
    region.ranks[0][PAYLOAD:] = b"\xee" * PAYLOAD
    with caplog.at_level(logging.WARNING, logger="kvtier.tiering_spec"):
        res = read(tier, b"k", 1)
    return tier, res, region, path


def flip_payload_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(fs_format.HEADER_SIZE + 100)
        b = f.read(1)
        f.seek(fs_format.HEADER_SIZE + 100)
        f.write(bytes([b[0] ^ 0xFF]))


def flip_header_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"\x00\x01")


def truncate(path: str) -> None:
    os.truncate(path, fs_format.HEADER_SIZE + PAYLOAD // 2)


def replace_by_directory(path: str) -> None:
    os.unlink(path)
    os.mkdir(path)


def append_a_page(path: str) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)


def replace_by_fifo(path: str) -> None:
    os.unlink(path)
    os.mkfifo(path, 0o600)  # opening it for reading must not wait for a writer


@pytest.mark.parametrize(
    ("damage", "kind"),
    [
        (flip_payload_byte, "corrupt"),
        (flip_header_byte, "corrupt"),
        (truncate, "truncated"),
        (os.unlink, "vanished"),
        (replace_by_directory, "foreign"),
        (append_a_page, "corrupt"),
        (replace_by_fifo, "foreign"),
    ],
)
def test_a_bad_file_is_a_counted_miss_and_never_loaded(make_tier, caplog, damage, kind) -> None:
    tier, res, _region, path = faulty(make_tier, damage, caplog)
    assert not res.ok and res.fault == kind
    assert tier.faults()[kind] == 1
    assert tier.fault_count == sum(tier.faults().values()) == 1
    assert not tier.has(key_digest(b"k")), "a faulty entry must be forgotten"
    assert any(kind in r.getMessage() for r in caplog.records), "the fault must be logged"
    if kind in ("corrupt", "truncated"):
        wait_for_unlinks(tier)
        assert not os.path.exists(path), "a corrupt file is removed"


def test_each_fault_kind_is_logged_once(make_tier, caplog) -> None:
    region = Region(4)
    tier = make_tier(region)
    for i in range(3):
        write(tier, region, b"k%d" % i, i, i)
        flip_payload_byte(tier.paths(key_digest(b"k%d" % i))[0])
    with caplog.at_level(logging.WARNING, logger="kvtier.tiering_spec"):
        for i in range(3):
            assert not read(tier, b"k%d" % i, 3).ok
    assert tier.faults()["corrupt"] == 3 and tier.fault_count == 3
    assert sum("corrupt" in r.getMessage() for r in caplog.records) == 1


def test_full_disk_drops_the_write_and_leaves_no_file(make_tier, monkeypatch, caplog) -> None:
    region = Region(2)
    tier = make_tier(region)

    def enospc(*a: object, **k: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs_io, "_pwritev", enospc)
    region.fill(0, 0, 1)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiering_spec"):
        assert tier.submit_write(b"k", key_digest(b"k"), 0)
        [res] = wait_results(tier)
    assert not res.ok and res.fault == "disk_full"
    # Retried once after evicting, then dropped.
    assert tier.faults()["disk_full"] == 2 and not tier.has(key_digest(b"k"))
    shard = os.path.dirname(tier.paths(key_digest(b"k"))[0])
    assert os.listdir(shard) == [], "no temporary or partial file may stay"
    assert any("disk_full" in r.getMessage() for r in caplog.records)


def test_a_full_disk_evicts_the_oldest_files_and_retries_the_write(
    make_tier, monkeypatch, caplog
) -> None:
    region = Region(12)
    tier = make_tier(region)
    keys = [b"old-%d" % i for i in range(10)]
    for i, k in enumerate(keys):  # one at a time: the index's LRU order is write order
        write(tier, region, k, i, i)
    assert tier.used_bytes == 10 * tier.entry_bytes
    calls = {"n": 0}
    real = fs_io._pwritev

    def full_once(*a: object, **k: object) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(fs_io, "_pwritev", full_once)
    # The disk shows no room: the tier holds what it has, and makes room for the write.
    monkeypatch.setattr(fs_io, "_fstatvfs", lambda fd: SimpleNamespace(f_bavail=0, f_frsize=4096))
    region.fill(0, 11, 99)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiering_spec"):
        assert tier.submit_write(b"new", key_digest(b"new"), 11)
        [res] = [r for r in wait_results(tier, 1) if r.op == "write"]
    assert res.ok, "the retry after evicting must succeed"
    assert tier.faults()["disk_full"] == 1 and tier.has(key_digest(b"new"))
    evicted = [k for k in keys if not tier.has(key_digest(k))]
    assert evicted == keys[:1], "only the oldest entry makes room"
    assert tier.capacity_bytes == 10 * tier.entry_bytes, "what the tier held plus 0 free"
    assert any("capacity lowered" in r.getMessage() for r in caplog.records)


def test_a_full_disk_retries_the_write_with_other_writes_in_flight(make_tier, monkeypatch) -> None:
    """After a full disk the capacity is the tier's files plus the free space, so the
    writes in flight are over it; the failed write still makes its room and is retried,
    however many are in flight (TRIM_ENTRIES 0: any excess is more than a poll trims)."""
    monkeypatch.setattr(fs_capacity, "TRIM_ENTRIES", 0)
    region = Region(12)
    tier = make_tier(region)
    for i in range(4):
        write(tier, region, b"old-%d" % i, i, i)
    calls = {"n": 0}
    real = fs_io._pwritev
    release = threading.Event()

    def full_then_slow(*a: object, **k: object) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        if calls["n"] == 2:
            release.wait(30)  # a write in flight while the first is retried
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(fs_io, "_pwritev", full_then_slow)
    monkeypatch.setattr(fs_io, "_fstatvfs", lambda fd: SimpleNamespace(f_bavail=0, f_frsize=4096))
    assert tier.submit_write(b"new", key_digest(b"new"), 10)
    deadline = time.monotonic() + 30
    while not tier._results and time.monotonic() < deadline:
        time.sleep(0.01)  # its failure is back, not yet polled
    assert tier.submit_write(b"slow", key_digest(b"slow"), 11)
    while calls["n"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        [res] = [r for r in wait_results(tier, 1) if r.op == "write"]
        assert res.ok and res.key == b"new", "retried beside the write in flight"
    finally:
        release.set()
    wait_results(tier, 1)
    assert tier.has(key_digest(b"new")) and tier.has(key_digest(b"slow"))


def test_failed_rename_is_a_failed_write(make_tier, monkeypatch) -> None:
    region = Region(2)
    tier = make_tier(region)

    def eio(*a: object) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(fs_io, "_rename", eio)
    assert tier.submit_write(b"k", key_digest(b"k"), 0)
    [res] = wait_results(tier)
    assert res.fault == "write_failed" and tier.faults()["write_failed"] == 1
    assert os.listdir(os.path.dirname(tier.paths(key_digest(b"k"))[0])) == []


def test_short_reads_and_writes_are_completed(make_tier, monkeypatch) -> None:
    region = Region(2)
    tier = make_tier(region)
    real_w, real_r = os.pwritev, os.preadv

    def short_w(fd: int, bufs: list, off: int) -> int:
        if off == 0:
            return real_w(fd, [bufs[0], memoryview(bufs[1])[:4096]], 0)
        return real_w(fd, bufs, off)

    def short_r(fd: int, bufs: list, off: int) -> int:
        if off == 0:
            return real_r(fd, [bufs[0], memoryview(bufs[1])[:4096]], 0)
        return real_r(fd, bufs, off)

    monkeypatch.setattr(fs_io, "_pwritev", short_w)
    monkeypatch.setattr(fs_io, "_preadv", short_r)
    data = write(tier, region, b"k", 0, 11)
    assert read(tier, b"k", 1).ok and region.block(0, 1) == data


def test_stale_temporary_files_are_removed_at_start(make_tier) -> None:
    region = Region(1)
    tier = make_tier(region)
    shard = os.path.join(tier.dirs[0], "0")
    stale = os.path.join(shard, ".tmp-1-2-3")
    fresh = os.path.join(shard, ".tmp-1-2-4")
    for p in (stale, fresh):
        Path(p).write_bytes(b"partial")
    os.utime(stale, (1, 1))
    tier.shutdown()
    make_tier(region)
    assert not os.path.exists(stale) and os.path.exists(fresh)


def test_a_file_written_by_another_engine_is_found_on_lookup(make_tier, tmp_path) -> None:
    region = Region(2)
    reader = make_tier(region)
    writer = make_tier(region)
    data = write(writer, region, b"new", 0, 4)
    region.ranks[0][:] = bytes(len(region.ranks[0]))
    # Found by the reader's background look for new files, not by its lookup.
    deadline = time.monotonic() + 10 * fs_tier.DISCOVER_INTERVAL_S
    while not reader.contains(key_digest(b"new")) and time.monotonic() < deadline:
        time.sleep(0.05)
        reader.poll()
    assert reader.contains(key_digest(b"new"))
    assert read(reader, b"new", 1).ok and region.block(0, 1) == data


def test_names_come_only_from_hex_digests() -> None:
    shard, name = fs_format.file_name(key_digest(b"../../etc/passwd"))
    assert set(shard + name[:-3]) <= set("0123456789abcdef") and name.endswith(".kv")
    assert fs_format.parse_file_name("zz" * 16 + ".kv") is None
    assert fs_format.parse_file_name(name) == key_digest(b"../../etc/passwd")


def _job_of_writes(keys: list[bytes], blocks: list[int]):
    from kvtier.tiering_spec.tiers.base import TierJob

    return TierJob(1, "write", "r", [(k, key_digest(k), b) for k, b in zip(keys, blocks)])


@pytest.mark.parametrize("policy", ["lru", "arc", "frecency"])
def test_a_jobs_writes_evict_and_take_over_as_item_by_item(
    make_tier, tmp_path: Path, policy: str
) -> None:
    """A job's writes make their room in one call: the same entries are evicted and
    the same number of files taken over as when each write makes its own, every write
    lands and reads back, and a duplicate key in the job starts once."""
    from kvtier.tiering_spec.tiers.base import SecondaryTier

    entry = fs_format.HEADER_SIZE + PAYLOAD
    outcomes = []
    for batched in (False, True):
        region = Region(12)
        tier = make_tier(
            region, root=tmp_path / f"fs-{batched}", capacity=6 * entry, eviction_policy=policy
        )
        for i in range(5):  # five entries, one of them used again
            write(tier, region, b"old%d" % i, i, i)
        tier.finish_request([key_digest(b"old1")], {key_digest(b"old1")})
        keys = [b"new0", b"new1", b"old3", b"new2", b"new1", b"new3"]
        blocks = [5, 6, 3, 7, 6, 8]
        data = {k: region.fill(0, b, 40 + b) for k, b in zip(keys, blocks) if k.startswith(b"new")}
        job = _job_of_writes(keys, blocks)
        started = tier.submit(job) if batched else SecondaryTier.submit(tier, job)
        assert started == [True, True, False, True, False, True]
        results: list = []
        deadline = time.monotonic() + 20
        while len(results) < 4 and time.monotonic() < deadline:
            results += [r for r in tier.results() if r.op == "write"]
            time.sleep(0.002)
        assert len(results) == 4 and all(r.ok for r in results)
        assert {r.job for r in results} == {1}, "each result is labelled with its job"
        wait_for_unlinks(tier)
        assert tier.jobs_in_flight == 0 and tier.in_flight == 0
        kept = sorted(
            k for k in [*(b"old%d" % i for i in range(5)), *data] if tier.has(key_digest(k))
        )
        for n, (k, expected) in enumerate(data.items()):
            assert read(tier, k, 9 + n % 3).ok and region.block(0, 9 + n % 3) == expected
        on_disk = sorted(n for _, _, ns in os.walk(tier.dirs[0]) for n in ns if n.endswith(".kv"))
        outcomes.append((kept, tier.stats.evictions, tier.stats.files_reused, on_disk))
    assert outcomes[0] == outcomes[1]
    assert outcomes[1][1] == 3 and outcomes[1][2] == 3


def test_a_job_whose_writes_do_not_all_fit_starts_the_first_ones(make_tier) -> None:
    """Room for two of three new entries, everything else being read: the job starts
    its first two writes and drops the third, as item by item."""
    entry = fs_format.HEADER_SIZE + PAYLOAD
    region = Region(6)
    tier = make_tier(region, capacity=3 * entry)
    write(tier, region, b"a", 0, 1)
    tier._reading[key_digest(b"a")] = 1  # a read in flight: never evicted
    started = tier.submit(_job_of_writes([b"x", b"y", b"z"], [1, 2, 3]))
    assert started == [True, True, False]
    assert tier.stats.writes_dropped == 1
    assert all(r.ok for r in wait_results(tier, 2))
    assert tier.has(key_digest(b"x")) and tier.has(key_digest(b"y"))
    assert not tier.has(key_digest(b"z"))


def test_a_tier_with_nothing_to_take_in_says_so(make_tier) -> None:
    """The manager skips a poll that would find nothing (asked every step): the tier
    says it has news from the moment a result waits until a poll takes it."""
    region = Region(2)
    tier = make_tier(region)
    tier.poll()
    assert not tier.has_news
    region.fill(0, 0, 3)
    assert tier.submit_write(b"k", key_digest(b"k"), 0)
    deadline = time.monotonic() + 20
    while not tier.has_news and time.monotonic() < deadline:
        time.sleep(0.002)
    assert tier.has_news, "a finished write is news"
    assert [r.op for r in tier.poll()] == ["write"]
    assert not tier.has_news


def test_a_timeout_counts_among_the_faults(make_tier, caplog) -> None:
    tier = make_tier(Region(2))
    tier._timed_out("a job still running")
    assert tier.faults()["timeout"] == 1 and tier.fault_count == 1
    assert any("time limit" in r.getMessage() for r in caplog.records)
