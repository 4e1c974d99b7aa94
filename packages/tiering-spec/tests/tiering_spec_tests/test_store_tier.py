"""The store tier against a real Mooncake Store: a ``mooncake_master`` on loopback.

Needs ``mooncake-transfer-engine-non-cuda`` (and Debian's libibverbs1); without it the
tests skip, unless ``KVTIER_REQUIRE_MOONCAKE=1`` (the nox session that installs it),
where they fail instead.
"""

from __future__ import annotations

import mmap
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.fs.format import key_digest
from kvtier.tiering_spec.tiers.store.tier import StoreTier, StoreTierSettings

from .mooncake_env import Master, _mooncake

PAYLOAD = 65536


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    _mooncake()
    m = Master(tmp_path_factory.mktemp("mooncake"))
    yield m
    m.stop()


class Region:
    def __init__(self, blocks: int, copies: int = 1) -> None:
        self.maps = [mmap.mmap(-1, blocks * PAYLOAD) for _ in range(copies)]

    def views(self) -> list[memoryview]:
        return [memoryview(m) for m in self.maps]

    def fill(self, copy: int, block: int, seed: int) -> bytes:
        data = (seed.to_bytes(4, "little") * (PAYLOAD // 4))[:PAYLOAD]
        self.maps[copy][block * PAYLOAD : (block + 1) * PAYLOAD] = data
        return data

    def block(self, copy: int, block: int) -> bytes:
        return bytes(self.maps[copy][block * PAYLOAD : (block + 1) * PAYLOAD])


@pytest.fixture
def make_tier(master: Master) -> Iterator[Any]:
    made: list[StoreTier] = []
    model = uuid.uuid4().hex  # each test its own fingerprint: objects never collide

    def make(region: Region, *, client: Any = None, copies: int = 1) -> StoreTier:
        layouts = [{"model": model, "rank": r, "world_size": copies} for r in range(copies)]
        client = client or master.client()
        tier = StoreTier(lambda: client, layouts, PAYLOAD, region.views, StoreTierSettings())
        made.append(tier)
        assert tier.wait_connected(), "the store tier did not connect"
        return tier

    yield make
    for t in made:
        t.shutdown()


def settle(tier: StoreTier, n: int = 1, timeout: float = 10.0) -> list[Any]:
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        tier.drain(timeout)
        out += tier.poll()
    return out


def written(tier: StoreTier, key: bytes) -> bytes:
    """Put host block 0 as ``key`` and wait for it; the key's digest."""
    digest = key_digest(key)
    assert tier.submit_write(key, digest, 0)
    assert settle(tier)[0].ok
    return digest


def test_a_put_block_gets_back_byte_for_byte_in_every_copy(make_tier) -> None:
    region = Region(4, copies=2)
    tier = make_tier(region, copies=2)
    d0, d1 = region.fill(0, 1, 5), region.fill(1, 1, 6)
    assert tier.submit_write(b"k", key_digest(b"k"), 1)
    [res] = settle(tier)
    assert res.ok, res
    for m in region.maps:
        m[:] = bytes(len(m))
    assert tier.contains(key_digest(b"k")) is True
    assert tier.submit_read(b"k", key_digest(b"k"), 3)
    [res] = settle(tier)
    assert res.ok and region.block(0, 3) == d0 and region.block(1, 3) == d1


def test_another_engines_object_is_found_by_a_background_check(make_tier, master) -> None:
    region_a, region_b = Region(2), Region(2)
    a = make_tier(region_a)
    b = make_tier(region_b)  # another client: another engine
    digest = key_digest(b"shared")
    assert b.contains(digest) is None, "an unknown key must not be answered on the spot"
    b.wait_probes()
    assert b.contains(digest) is False, "the store lacks it"
    data = region_a.fill(0, 0, 9)
    assert a.submit_write(b"shared", digest, 0)
    assert settle(a)[0].ok
    b._probe_cache._absent.clear()  # past the negative-cache time
    assert b.contains(digest) is None
    b.wait_probes()
    assert b.contains(digest) is True
    assert b.submit_read(b"shared", digest, 1)
    assert settle(b)[0].ok and region_b.block(0, 1) == data


def test_a_corrupt_object_is_a_counted_miss_and_removed(make_tier, master) -> None:
    tier = make_tier(Region(2))
    digest = written(tier, b"k")
    # Another writer replaces the object with bytes whose checksum does not match.
    raw = master.client()
    [name] = tier.object_keys(digest)
    bad = bytearray(fs_format.HEADER_SIZE + PAYLOAD)
    bad[: fs_format.HEADER_USED] = fs_format.encode_header(tier.fingerprints[0], digest, PAYLOAD, 1)
    assert raw.remove(name, True) == 0 and raw.put(name, bytes(bad)) == 0
    assert tier.submit_read(b"k", digest, 1)
    [res] = settle(tier)
    assert not res.ok and res.fault == "corrupt" and tier.faults()["corrupt"] == 1
    assert tier.contains(digest) is None, "a corrupt object stays indexed"
    tier.wait_probes()
    assert tier.contains(digest) is False, "a corrupt object was not removed"


def test_an_object_the_store_evicted_is_a_counted_miss(make_tier, master) -> None:
    tier = make_tier(Region(2))
    digest = written(tier, b"k")
    [name] = tier.object_keys(digest)
    assert master.client().remove(name, True) == 0  # as the store's own eviction does
    assert tier.submit_read(b"k", digest, 1)
    [res] = settle(tier)
    assert not res.ok and res.fault == "vanished" and tier.faults()["vanished"] == 1
    assert not tier.has(digest)


def test_a_dead_master_gives_misses_and_back_off_never_a_hang(make_tier, tmp_path) -> None:
    own = Master(tmp_path)
    try:
        region = Region(2)
        tier = make_tier(region, client=own.client())
        region.fill(0, 0, 1)
        assert tier.submit_write(b"a", key_digest(b"a"), 0)
        assert settle(tier)[0].ok
    finally:
        own.stop(kill=True)  # as a crash
    t0 = time.monotonic()
    assert tier.submit_write(b"b", key_digest(b"b"), 1)
    [res] = settle(tier, timeout=60)
    assert not res.ok
    tier.poll()
    assert tier.faults()["unreachable"] >= 1
    assert tier.contains(key_digest(b"c")) is False, "lookups must miss during back-off"
    assert not tier.submit_write(b"d", key_digest(b"d"), 1), "writes must be dropped"
    assert time.monotonic() - t0 < 60


def test_a_store_down_at_start_gives_misses_until_it_is_up(tmp_path) -> None:
    _mooncake()
    attempts = {"n": 0}
    late = {"master": None}

    def connect() -> Any:
        attempts["n"] += 1
        if late["master"] is None:
            raise ConnectionError("master not up yet")
        return late["master"].client()

    region = Region(2)
    tier = StoreTier(connect, [{"model": uuid.uuid4().hex}], PAYLOAD, region.views)
    try:
        time.sleep(0.2)
        tier.poll()
        assert tier.contains(key_digest(b"k")) is False, "a lookup waited for the store"
        assert not tier.submit_write(b"k", key_digest(b"k"), 0)
        assert tier.faults()["unreachable"] >= 1
        late["master"] = Master(tmp_path)
        assert tier.wait_connected(30), "the tier did not connect once the master was up"
        tier._down_until = 0.0  # past the back-off
        region.fill(0, 0, 4)
        assert tier.submit_write(b"k", key_digest(b"k"), 0)
        assert settle(tier)[0].ok and attempts["n"] >= 2
    finally:
        tier.shutdown()
        if late["master"] is not None:
            late["master"].stop()


class RecordingClient:
    """A store client that records which thread registers memory, and can refuse it."""

    def __init__(self, refuse: int = 0) -> None:
        self.registered: list[tuple[int, str]] = []
        self.refuse = refuse

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        if self.refuse:
            self.refuse -= 1
            return -1
        self.registered.append((size, threading.current_thread().name))
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [0] * len(keys)


def test_the_host_region_is_registered_off_the_scheduler_thread_once_mapped() -> None:
    # Registering pins the region for RDMA, seconds for tens of GiB: the scheduler
    # thread must never do it, and the tier must wait for the region to be mapped.
    region = Region(4, copies=2)
    mapped: dict[str, bool] = {"yes": False}
    client = RecordingClient()
    tier = StoreTier(
        lambda: client,
        [{"model": uuid.uuid4().hex, "rank": r} for r in range(2)],
        PAYLOAD,
        lambda: region.views() if mapped["yes"] else None,
    )
    try:
        assert not tier.wait_connected(0.3), "ready before the host regions were mapped"
        assert not tier.submit_write(b"k", key_digest(b"k"), 0), "a write without a region"
        mapped["yes"] = True
        assert tier.wait_connected(10), "the regions were not registered once mapped"
        # the header pages first, then each copy's region
        assert [size for size, _ in client.registered][1:] == [4 * PAYLOAD] * 2

        me = threading.current_thread().name
        assert all(name != me for _, name in client.registered), client.registered
    finally:
        tier.shutdown()


def test_a_refused_registration_backs_off_and_is_tried_again() -> None:
    region = Region(2)
    client = RecordingClient(refuse=2)  # the header pages, then the region
    tier = StoreTier(lambda: client, [{"model": uuid.uuid4().hex}], PAYLOAD, region.views)
    try:
        assert tier.wait_connected(10), "registration was not tried again"
        tier.poll()
        assert tier.faults()["unreachable"] >= 2
        assert [size for size, _ in client.registered][-1] == 2 * PAYLOAD
    finally:
        tier.shutdown()
