"""Ordering rules on the CPU backend, where each direction is its own worker thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvtier.npu_copy import KVLayout, TransferEngine

from .layouts import make_layout


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    case = make_layout("per_layer")
    layout = KVLayout.from_kv_caches(case.kv)
    host = torch.zeros((8, layout.block_bytes), dtype=torch.uint8)
    with TransferEngine(layout, host, asynchronous=True) as eng:
        yield eng


@contextmanager
def gated(engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Transfers submitted inside the block start copying only once the gate opens."""
    gate = threading.Event()
    real = engine._backend._copy  # type: ignore[attr-defined]

    def held(*args: object, **kwargs: object) -> None:
        assert gate.wait(10), "test gate never opened"
        real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(engine._backend, "_copy", held)
        yield gate


def rows(engine: TransferEngine, block: int) -> list[torch.Tensor]:
    return [s.rows[block].clone() for s in engine.layout.segments]


def host_block(engine: TransferEngine, h: int) -> list[torch.Tensor]:
    return [
        engine.host_blocks[h, s.host_offset : s.host_end].clone() for s in engine.layout.segments
    ]


def set_block(engine: TransferEngine, block: int, value: int) -> None:
    for s in engine.layout.segments:
        s.rows[block].fill_(value)


def test_load_waits_for_a_store_still_reading_its_device_blocks(
    engine: TransferEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = rows(engine, 3)
    engine.host_blocks[5].fill_(0xAB)
    with gated(engine, monkeypatch) as gate:
        store = engine.store([3], [0])
    load = engine.load([5], [3])  # overwrites device block 3, which the store still reads
    assert not load.done(), "the load ran before the store that reads its blocks"
    gate.set()
    assert store.wait() and load.wait()
    assert all(torch.equal(a, b) for a, b in zip(host_block(engine, 0), original)), (
        "the store saw bytes of the later load"
    )
    assert all(bool((r == 0xAB).all()) for r in rows(engine, 3))


def test_store_waits_for_a_load_still_writing_its_device_blocks(
    engine: TransferEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.host_blocks[2].fill_(0x5A)
    with gated(engine, monkeypatch) as gate:
        load = engine.load([2], [7])
    store = engine.store([7], [4])  # must read what the load writes
    assert not store.done()
    gate.set()
    assert load.wait() and store.wait()
    assert bool((engine.host_blocks[4, : engine.layout.block_bytes] == 0x5A).all())


def test_store_waits_for_a_load_still_reading_its_host_blocks(
    engine: TransferEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.host_blocks[1].fill_(0x11)
    set_block(engine, 6, 0x22)
    with gated(engine, monkeypatch) as gate:
        load = engine.load([1], [0])
    store = engine.store([6], [1])  # overwrites host block 1, which the load still reads
    gate.set()
    assert load.wait() and store.wait()
    assert all(bool((r == 0x11).all()) for r in rows(engine, 0)), "the load read the new bytes"


def test_unrelated_transfers_do_not_wait(
    engine: TransferEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with gated(engine, monkeypatch) as gate:
        store = engine.store([0], [0])
    load = engine.load([3], [5])
    assert load.wait(), "an unrelated load waited for a store"
    assert not store.done()
    gate.set()
    assert store.wait()


def test_wait_on_stream_on_cpu_waits_for_the_load(
    engine: TransferEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.host_blocks[3].fill_(0x33)
    with gated(engine, monkeypatch) as gate:
        load = engine.load([3], [2])
    threading.Timer(0.05, gate.set).start()
    engine.make_compute_wait(load)
    assert load.done() and load.ok
    assert all(bool((r == 0x33).all()) for r in rows(engine, 2))


def test_buffers_are_released_when_done() -> None:
    case = make_layout("per_layer")
    layout = KVLayout.from_kv_caches(case.kv)
    host = torch.zeros((4, layout.block_bytes), dtype=torch.uint8)
    with TransferEngine(layout, host, backend="stream") as eng:
        handle = eng.store([3, 1], [0, 2])
        assert handle._keep, "the staging buffer and index are not held by the handle"
        assert handle.wait()
        assert handle._keep == [], "buffers still held after the transfer finished"


def test_wait_all_and_in_flight(engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    with gated(engine, monkeypatch) as gate:
        a = engine.store([0], [0])
        b = engine.store([1], [1])
    assert engine.in_flight() == [a, b]
    gate.set()
    assert engine.wait_all()
    assert engine.in_flight() == []
