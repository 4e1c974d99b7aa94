"""Adversarial battery of the store tier (issue #25): a master that hangs, answers
slowly or dies mid-batch, objects planted by another client of the master, and
back-off after failures far apart.

A fake Mooncake client (no Mooncake needed) stands in for the master: it copies
bytes to and from the buffers the tier hands it, as the real one does, and can be
told to hang, to be slow or to fail. Every case checks: nothing foreign is loaded,
no lookup waits more than a bounded time, threads and queues stay bounded, and the
fault is counted. Deadlines are shrunk through ``StoreTierSettings``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.blockpool import HostBlockPool
from kvtier.tiering_spec import auth
from kvtier.tiering_spec.config import ConfigError, parse_fs_tier, parse_mooncake_tier
from kvtier.tiering_spec.manager import Lookup, TierManager
from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.fs.format import key_digest
from kvtier.tiering_spec.tiers.store.tier import (
    MAX_BATCH,
    MAX_PENDING_PROBES,
    MAX_STUCK_CALLS,
    StoreTier,
    StoreTierSettings,
)

from .tier_support import PAYLOAD, Region, layouts

# Deadlines of these tests (seconds); a lookup must be answered within BOUND.
CALL_S = 0.3
PROBE_S = 0.2
BACKOFF_S = 0.1
BOUND = 3.0
KEY = os.urandom(32)


class FakeMaster:
    """Objects by name, shared by the clients of one fake master."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()


class FakeClient:
    """A Mooncake store client against a :class:`FakeMaster`.

    ``gate``: ops ("put", "get", "exist", "remove") whose calls wait until
    ``release`` is set (a master that accepts and does not answer); ``delay``: seconds
    each call of those ops takes first; ``die``: ops that copy half the objects, then
    raise (the master died mid-batch); ``fail``: ops that raise at once.
    """

    def __init__(self, master: FakeMaster) -> None:
        self.master = master
        self.gate: set[str] = set()
        self.release = threading.Event()
        self.delay = 0.0
        self.die: set[str] = set()
        self.fail: set[str] = set()
        self.calls: dict[str, int] = {}
        self.returned_late = threading.Event()

    def _enter(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        if op in self.fail:
            raise ConnectionError(f"{op}: connection refused")
        if op in self.gate:
            if self.delay:
                time.sleep(self.delay)
            else:
                self.release.wait()
            self.returned_late.set()

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        return 0

    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]:
        self._enter("put")
        codes = []
        for n, (key, ptrs, sizes) in enumerate(zip(keys, all_buffer_ptrs, all_sizes)):
            if "put" in self.die and n >= len(keys) // 2:
                raise ConnectionError("master died")
            data = b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))
            with self.master.lock:
                self.master.objects[key] = data
            codes.append(0)
        return codes

    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]:
        self._enter("get")
        codes = []
        for n, (key, ptrs, sizes) in enumerate(zip(keys, all_buffer_ptrs, all_sizes)):
            with self.master.lock:
                data = self.master.objects.get(key)
            if data is None:
                codes.append(-704)
                continue
            if "get" in self.die and n >= len(keys) // 2:
                ctypes.memmove(ptrs[0], data, min(len(data), sizes[0]))
                raise ConnectionError("master died")
            off = 0
            for p, s in zip(ptrs, sizes):
                chunk = data[off : off + s]
                ctypes.memmove(p, chunk, len(chunk))
                off += s
            codes.append(len(data))
        return codes

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._enter("exist")
        with self.master.lock:
            return [1 if k in self.master.objects else 0 for k in keys]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        self._enter("remove")
        with self.master.lock:
            for k in keys:
                self.master.objects.pop(k, None)
        return [0] * len(keys)


@pytest.fixture
def make_tier() -> Iterator[Callable[..., tuple[StoreTier, FakeClient]]]:
    made: list[tuple[StoreTier, FakeClient]] = []

    def make(
        region: Region, master: FakeMaster | None = None, *, auth_key: bytes | None = None
    ) -> tuple[StoreTier, FakeClient]:
        client = FakeClient(master or FakeMaster())
        settings = StoreTierSettings(
            auth_key=auth_key,
            call_timeout_s=CALL_S,
            probe_timeout_s=PROBE_S,
            backoff_min_s=BACKOFF_S,
            backoff_max_s=30.0,
            shutdown_timeout_s=2.0,
        )
        tier = StoreTier(lambda: client, layouts(), PAYLOAD, region.views, settings)
        assert tier.wait_connected(5.0)
        made.append((tier, client))
        return tier, client

    yield make
    for tier, client in made:
        client.release.set()  # let hung calls return, so threads end
        tier.shutdown()


def plant(tier: StoreTier, key: bytes, payload: bytes, mac_key: bytes | None = None) -> None:
    """An object for ``key`` as anyone who reaches the master can write it: every
    header field is computable from public facts."""
    digest = key_digest(key)
    header = fs_format.encode_header(
        tier.fingerprints[0],
        digest,
        len(payload),
        fs_format.checksum(payload),
        auth_key=mac_key,
        payload=payload,
    )
    page = header + bytes(fs_format.HEADER_SIZE - len(header))
    client = tier._connect()
    assert isinstance(client, FakeClient)
    client.master.objects[tier.object_keys(digest)[0]] = page + payload


def lookup_until(
    mgr: TierManager, key: bytes, done: Callable[[Lookup], bool], bound: float = BOUND
) -> tuple[Lookup, float]:
    """Look ``key`` up each ms, as vLLM does each step, until ``done``; (answer, wait)."""
    t0 = time.monotonic()
    while True:
        got = mgr.lookup(key, "req")
        mgr.end_step()
        waited = time.monotonic() - t0
        if done(got) or waited > bound:
            return got, waited
        time.sleep(0.001)


def foreign(seed: int) -> bytes:
    return (seed.to_bytes(4, "little") * (PAYLOAD // 4))[:PAYLOAD]


def assert_bounded(tier: StoreTier) -> None:
    """Threads, probes and absent keys stay bounded while the master misbehaves."""
    assert len(tier._threads) <= 2 * (MAX_STUCK_CALLS + 1) + 1
    assert len(tier._probing) <= MAX_PENDING_PROBES
    assert tier.in_flight <= MAX_PENDING_PROBES + 2 * MAX_BATCH


# ----------------------------------------------------------------- a master that hangs


def test_hung_existence_check_is_a_miss_within_the_deadline(make_tier: Any) -> None:
    region = Region(4)
    tier, client = make_tier(region)
    client.gate = {"exist"}
    mgr = TierManager(HostBlockPool(4), [tier])
    got, waited = lookup_until(mgr, b"k" * 16, lambda g: g is not Lookup.HIT_PENDING)
    assert got is Lookup.MISS, f"still {got} after {waited:.1f} s"
    assert waited < PROBE_S + 1.0
    assert tier.faults()["timeout"] >= 1
    # The tier backs off: lookups miss at once, without asking the hung master.
    asked = client.calls["exist"]
    for i in range(50):
        assert mgr.lookup(bytes([i]) * 16, "r2") is Lookup.MISS
    assert client.calls["exist"] == asked
    assert_bounded(tier)


def test_hung_master_keeps_threads_and_queues_bounded(make_tier: Any) -> None:
    region = Region(4)
    tier, client = make_tier(region)
    client.gate = {"exist", "get", "put", "remove"}
    mgr = TierManager(HostBlockPool(4), [tier])
    deadline = time.monotonic() + 8 * (PROBE_S + BACKOFF_S)
    n = 0
    while time.monotonic() < deadline:
        for _ in range(20):
            n += 1
            got = mgr.lookup(n.to_bytes(16, "little"), f"r{n}")
            assert got in (Lookup.MISS, Lookup.HIT_PENDING)
        mgr.end_step()
        assert_bounded(tier)
        time.sleep(0.01)
    assert tier.faults()["timeout"] >= MAX_STUCK_CALLS
    # No more abandoned calls than allowed: the rest of the time the tier gives misses.
    assert client.calls["exist"] <= MAX_STUCK_CALLS + 1
    assert mgr.lookup(b"z" * 16, "last") is Lookup.MISS
    # The master answers again: the stuck threads come back, and so does the tier.
    client.gate = set()
    client.release.set()
    deadline = time.monotonic() + BOUND
    while tier._down() and time.monotonic() < deadline:
        mgr.end_step()
        time.sleep(0.005)
    assert not tier._down()
    assert mgr.lookup(b"y" * 16, "back") is Lookup.HIT_PENDING  # asks the master again
    got, _ = lookup_until(mgr, b"y" * 16, lambda g: g is not Lookup.HIT_PENDING)
    assert got is Lookup.MISS
    assert tier.shutdown()
    assert not any(t.is_alive() for t in tier._threads)


def test_hung_read_is_a_miss_and_its_block_is_not_reused_until_the_call_returns(
    make_tier: Any,
) -> None:
    region = Region(2)
    tier, client = make_tier(region)
    key = b"promoted-key-000"
    plant(tier, key, foreign(7))
    pool = HostBlockPool(2)
    mgr = TierManager(pool, [tier])
    client.gate = {"get"}
    got, waited = lookup_until(mgr, key, lambda g: g is not Lookup.HIT_PENDING)
    assert got is Lookup.MISS, f"still {got} after {waited:.1f} s"
    assert waited < PROBE_S + CALL_S + 1.0
    assert tier.faults()["timeout"] == 1
    assert mgr.counters.promotion_failures == 1
    # The block the hung get writes into stays reserved: never cached, never reused.
    block = pool.block_of(key)
    assert block is not None and pool.is_storing(key)
    plan = mgr.prepare_store([b"other-key-000001", b"other-key-000002"])
    assert plan is None or block not in plan[1]
    if plan is not None:
        mgr.complete_store(plan[0], success=False)
    # The late get lands; it is never reported as loaded, and the block is freed.
    client.release.set()
    assert client.returned_late.wait(2.0)
    deadline = time.monotonic() + BOUND
    while pool.is_storing(key) and time.monotonic() < deadline:
        mgr.end_step()
        time.sleep(0.002)
    assert not pool.is_storing(key) and not pool.contains(key)
    assert pool.num_free == 2
    assert tier.drain(1.0)


def test_hung_write_keeps_its_block_pinned_and_counts_a_timeout(make_tier: Any) -> None:
    region = Region(2)
    tier, client = make_tier(region)
    pool = HostBlockPool(2)
    mgr = TierManager(pool, [tier], max_write_backlog=8)
    client.gate = {"put"}
    key = b"written-key-0001"
    plan = mgr.prepare_store([key])
    assert plan is not None
    region.fill(0, plan[1][0], 3)
    mgr.complete_store(plan[0])
    assert mgr.write_pinned_blocks == 1
    deadline = time.monotonic() + CALL_S + 1.0
    while tier.faults()["timeout"] == 0 and time.monotonic() < deadline:
        mgr.end_step()
        time.sleep(0.005)
    assert tier.faults()["timeout"] == 1
    # The engine need not keep stepping for it, and the put may still read the block.
    assert not mgr.has_pending_work()
    assert mgr.write_pinned_blocks == 1
    assert not tier.drain(0.05)
    client.release.set()
    deadline = time.monotonic() + BOUND
    while mgr.write_pinned_blocks and time.monotonic() < deadline:
        mgr.end_step()
        time.sleep(0.002)
    assert mgr.write_pinned_blocks == 0
    assert mgr.counters.write_failures == 1
    assert not tier.has(key_digest(key))


# ----------------------------------------------------------------- slow, then dead


def test_slow_master_is_a_miss_and_the_late_answer_is_not_trusted(make_tier: Any) -> None:
    region = Region(2)
    tier, client = make_tier(region)
    key = b"slow-key-0000001"
    plant(tier, key, foreign(9))
    pool = HostBlockPool(2)
    mgr = TierManager(pool, [tier])
    client.gate = {"get"}
    client.delay = 3 * CALL_S  # answers, but after the deadline
    got, waited = lookup_until(mgr, key, lambda g: g is not Lookup.HIT_PENDING)
    assert got is Lookup.MISS and waited < PROBE_S + CALL_S + 1.0
    assert tier.faults()["timeout"] == 1
    deadline = time.monotonic() + BOUND
    while pool.is_storing(key) and time.monotonic() < deadline:
        mgr.end_step()
        time.sleep(0.005)
    assert not pool.contains(key) and pool.num_free == 2
    assert tier.stats.reads == 0


def test_master_dying_mid_batch_loads_nothing(make_tier: Any) -> None:
    region = Region(4)
    tier, client = make_tier(region)
    keys = [f"dying-key-{i:06d}".encode() for i in range(4)]
    for i, k in enumerate(keys):
        plant(tier, k, foreign(100 + i))
    pool = HostBlockPool(4)
    mgr = TierManager(pool, [tier])
    client.die = {"get"}
    t0 = time.monotonic()
    answers = {k: Lookup.HIT_PENDING for k in keys}
    while any(a is Lookup.HIT_PENDING for a in answers.values()):
        assert time.monotonic() - t0 < BOUND, answers
        for k in keys:
            if answers[k] is Lookup.HIT_PENDING:
                answers[k] = mgr.lookup(k, "req")
        mgr.end_step()
        time.sleep(0.002)
    assert all(a is Lookup.MISS for a in answers.values())
    assert not any(pool.contains(k) for k in keys)
    assert tier.faults()["unreachable"] >= 1
    assert pool.num_free == 4
    # Then the master is gone for good: calls fail fast, lookups miss.
    client.fail = {"exist", "get", "put", "remove"}
    got, waited = lookup_until(mgr, b"n" * 16, lambda g: g is not Lookup.HIT_PENDING)
    assert got is Lookup.MISS and waited < BOUND
    assert_bounded(tier)


# ----------------------------------------------------------------- back-off


def test_back_off_returns_to_its_minimum_after_a_success(make_tier: Any) -> None:
    region = Region(2)
    tier, client = make_tier(region)
    for blip in range(8):
        client.fail = {"exist"}
        before = tier.faults()["unreachable"]
        assert tier.contains(f"blip-{blip:010d}".encode()) is None
        tier.wait_probes(2.0)
        assert tier.faults()["unreachable"] > before
        down_for = tier._down_until - time.monotonic()
        assert down_for <= BACKOFF_S + 0.05, f"blip {blip}: down for {down_for:.2f} s"
        client.fail = set()
        time.sleep(max(0.0, down_for) + 0.01)
        # A call that succeeds (here: an existence check) resets the back-off.
        assert tier.contains(f"fine-{blip:010d}".encode()) is None
        tier.wait_probes(2.0)
        assert tier.contains(f"fine-{blip:010d}".encode()) is False


# ----------------------------------------------------------------- planted objects


def test_without_a_key_start_up_says_every_client_is_trusted(
    make_tier: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.tiering_spec"):
        make_tier(Region(1))
    assert "every client of the Mooncake master is trusted" in caplog.text


def test_with_a_key_a_planted_object_is_never_loaded(make_tier: Any) -> None:
    region = Region(4)
    master = FakeMaster()
    tier, _ = make_tier(region, master, auth_key=KEY)
    pool = HostBlockPool(4)
    mgr = TierManager(pool, [tier])
    cases = {
        b"planted-nomac-01": None,  # an object as an engine without a key writes it
        b"planted-wrong-01": os.urandom(32),  # a MAC with another key
    }
    for key, mac_key in cases.items():
        plant(tier, key, foreign(5), mac_key)
    # A MAC'd object whose payload was changed afterwards (checksum fixed up too).
    tampered = b"planted-tamper01"
    plant(tier, tampered, foreign(6), KEY)
    name = tier.object_keys(key_digest(tampered))[0]
    obj = bytearray(master.objects[name])
    obj[fs_format.HEADER_SIZE :] = foreign(66)
    head = fs_format.encode_header(
        tier.fingerprints[0],
        key_digest(tampered),
        PAYLOAD,
        fs_format.checksum(foreign(66)),
        auth_key=os.urandom(32),
        payload=foreign(66),
    )[: fs_format.MAC_OFFSET]
    obj[: len(head)] = head  # the MAC flag, a valid CRC and XXH3; the old MAC kept
    master.objects[name] = bytes(obj)
    for key in [*cases, tampered]:
        got, waited = lookup_until(mgr, key, lambda g: g is not Lookup.HIT_PENDING)
        assert got is Lookup.MISS and waited < BOUND
        assert not pool.contains(key)
    assert tier.faults()["unauthenticated"] == 3
    assert tier.stats.reads == 0
    # Removed, so that no engine tries them again.
    assert not any(
        n in master.objects for k in [*cases, tampered] for n in tier.object_keys(key_digest(k))
    )
    assert pool.num_free == 4


def test_with_a_key_objects_of_the_same_key_are_loaded(make_tier: Any) -> None:
    master = FakeMaster()
    writer_region, reader_region = Region(2), Region(2)
    writer, _ = make_tier(writer_region, master, auth_key=KEY)
    reader, _ = make_tier(reader_region, master, auth_key=KEY)
    key = b"shared-key-00001"
    wmgr = TierManager(HostBlockPool(2), [writer], max_write_backlog=8)
    plan = wmgr.prepare_store([key])
    assert plan is not None
    data = writer_region.fill(0, plan[1][0], 42)
    wmgr.complete_store(plan[0])
    assert wmgr.drain(2.0)  # the write-through goes out as a job, then finishes
    assert writer.stats.writes == 1
    name = writer.object_keys(key_digest(key))[0]
    flags = int.from_bytes(master.objects[name][14:16], "little")
    assert flags & fs_format.FLAG_MAC
    pool = HostBlockPool(2)
    rmgr = TierManager(pool, [reader])
    got, _ = lookup_until(rmgr, key, lambda g: g is not Lookup.HIT_PENDING)
    assert got is Lookup.HIT
    assert reader_region.block(0, pool.block_of(key)) == data
    assert reader.faults()["unauthenticated"] == 0


def test_without_a_key_a_planted_object_is_loaded_as_documented(make_tier: Any) -> None:
    """The trust the start-up line names: without a key a client of the master can
    plant KV (hence the key); a MAC'd object stays readable."""
    region = Region(2)
    tier, _ = make_tier(region)
    pool = HostBlockPool(2)
    mgr = TierManager(pool, [tier])
    plant(tier, b"planted-plain-01", foreign(1))
    plant(tier, b"planted-maced-01", foreign(2), KEY)
    for key in (b"planted-plain-01", b"planted-maced-01"):
        got, _ = lookup_until(mgr, key, lambda g: g is not Lookup.HIT_PENDING)
        assert got is Lookup.HIT


# ----------------------------------------------------------------- the key file


def write_key(path: Path, data: bytes, mode: int = 0o600) -> str:
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def test_key_file_is_checked_like_a_private_key(tmp_path: Path) -> None:
    good = write_key(tmp_path / "key", os.urandom(64))
    assert len(auth.load_auth_key(good, "k")) == auth.MAC_SIZE
    assert auth.load_auth_key(good, "k") == auth.load_auth_key(good, "k")
    bad = {
        "group readable": write_key(tmp_path / "g", os.urandom(64), 0o640),
        "world writable": write_key(tmp_path / "w", os.urandom(64), 0o602),
        "too short": write_key(tmp_path / "s", b"secret\n"),
        "missing": str(tmp_path / "none"),
        "a directory": str(tmp_path),
    }
    link = tmp_path / "link"
    link.symlink_to(good)
    bad["a symlink"] = str(link)
    for path in bad.values():
        with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.auth_key_file"):
            auth.load_auth_key(path, "secondary_tiers[0].auth_key_file")


def test_auth_key_file_in_both_tier_configs(tmp_path: Path) -> None:
    good = write_key(tmp_path / "key", os.urandom(64))
    loose = write_key(tmp_path / "loose", os.urandom(64), 0o644)
    mooncake = {
        "type": "mooncake",
        "master_server_address": "127.0.0.1:50051",
        "metadata_server": "P2PHANDSHAKE",
    }
    fs = {"type": "fs", "root_dir": str(tmp_path / "fs")}
    assert parse_mooncake_tier(mooncake, "t").auth_key_file is None
    assert parse_fs_tier(fs, "t").auth_key_file is None
    assert parse_mooncake_tier({**mooncake, "auth_key_file": good}, "t").auth_key_file == good
    assert parse_fs_tier({**fs, "auth_key_file": good}, "t").auth_key_file == good
    for value in (loose, "", 7):
        with pytest.raises(ConfigError, match=r"t\.auth_key_file"):
            parse_mooncake_tier({**mooncake, "auth_key_file": value}, "t")
        with pytest.raises(ConfigError, match=r"t\.auth_key_file"):
            parse_fs_tier({**fs, "auth_key_file": value}, "t")
    assert "key" not in repr(StoreTierSettings(auth_key=KEY)).replace("auth_key", "")


def test_header_mac_covers_header_and_payload() -> None:
    fp, dg, payload = b"f" * 16, b"d" * 16, foreign(3)
    header = fs_format.encode_header(
        fp, dg, PAYLOAD, fs_format.checksum(payload), auth_key=KEY, payload=payload
    )
    assert len(header) == fs_format.HEADER_USED_MAC
    page = header + bytes(fs_format.HEADER_SIZE - len(header))
    assert fs_format.decode_header(page, fingerprint=fp, digest=dg, payload_len=PAYLOAD)
    fs_format.check_mac(page, payload, KEY)
    changed = bytearray(payload)
    changed[-1] ^= 1
    for bad_page, bad_payload, key in (
        (page, bytes(changed), KEY),
        (page, payload, os.urandom(32)),
        (page[:40] + b"\x00" + page[41:], payload, KEY),  # a header field changed
    ):
        with pytest.raises(fs_format.FormatError) as err:
            fs_format.check_mac(bad_page, bad_payload, key)
        assert err.value.kind == "unauthenticated"
    plain = fs_format.encode_header(fp, dg, PAYLOAD, fs_format.checksum(payload))
    assert len(plain) == fs_format.HEADER_USED
    with pytest.raises(fs_format.FormatError, match="no MAC"):
        fs_format.check_mac(plain + bytes(4028), payload, KEY)
