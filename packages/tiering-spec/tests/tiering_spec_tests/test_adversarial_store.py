"""Adversarial battery of the store tier (issue #25): objects planted by another
client of the master, the key that authenticates them, and back-off after failures
far apart.

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
from kvtier.tiering_spec import auth, fsformat
from kvtier.tiering_spec.config import ConfigError, parse_fs_tier, parse_mooncake_tier
from kvtier.tiering_spec.fsformat import key_digest
from kvtier.tiering_spec.manager import Lookup, TierManager
from kvtier.tiering_spec.storetier import (
    StoreTier,
    StoreTierSettings,
)

from .tier_support import PAYLOAD, Region, layouts

# The shortest back-off of these tests; a lookup must be answered within BOUND
# (seconds).
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
        settings = StoreTierSettings(auth_key=auth_key, backoff_min_s=BACKOFF_S, backoff_max_s=30.0)
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
    header = fsformat.encode_header(
        tier.fingerprints[0],
        digest,
        len(payload),
        fsformat.checksum(payload),
        auth_key=mac_key,
        payload=payload,
    )
    page = header + bytes(fsformat.HEADER_SIZE - len(header))
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
    obj[fsformat.HEADER_SIZE :] = foreign(66)
    head = fsformat.encode_header(
        tier.fingerprints[0],
        key_digest(tampered),
        PAYLOAD,
        fsformat.checksum(foreign(66)),
        auth_key=os.urandom(32),
        payload=foreign(66),
    )[: fsformat.MAC_OFFSET]
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
    assert writer.drain(2.0)
    wmgr.poll()
    assert writer.stats.writes == 1
    name = writer.object_keys(key_digest(key))[0]
    flags = int.from_bytes(master.objects[name][14:16], "little")
    assert flags & fsformat.FLAG_MAC
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
    header = fsformat.encode_header(
        fp, dg, PAYLOAD, fsformat.checksum(payload), auth_key=KEY, payload=payload
    )
    assert len(header) == fsformat.HEADER_USED_MAC
    page = header + bytes(fsformat.HEADER_SIZE - len(header))
    assert fsformat.decode_header(page, fingerprint=fp, digest=dg, payload_len=PAYLOAD)
    fsformat.check_mac(page, payload, KEY)
    changed = bytearray(payload)
    changed[-1] ^= 1
    for bad_page, bad_payload, key in (
        (page, bytes(changed), KEY),
        (page, payload, os.urandom(32)),
        (page[:40] + b"\x00" + page[41:], payload, KEY),  # a header field changed
    ):
        with pytest.raises(fsformat.FormatError) as err:
            fsformat.check_mac(bad_page, bad_payload, key)
        assert err.value.kind == "unauthenticated"
    plain = fsformat.encode_header(fp, dg, PAYLOAD, fsformat.checksum(payload))
    assert len(plain) == fsformat.HEADER_USED
    with pytest.raises(fsformat.FormatError, match="no MAC"):
        fsformat.check_mac(plain + bytes(4028), payload, KEY)
