"""Ordering rules against real streams: CUDA (``-m gpu``) and Ascend NPU (``-m npu``).

Each test makes the race it guards against likely (long work queued ahead of the
transfer or of the reader), so a missing event wait shows up as wrong bytes. The device
is ``$KVTIER_DEVICE`` when set, else the first device of the kind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from kvtier.npu_copy import TransferEngine, import_npu_backend

DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    pytest.param("npu", marks=pytest.mark.npu, id="npu"),
]
LAYERS = 8
BLOCKS = 128
SEGMENT_BYTES = 1 << 20  # 1 MiB per block per layer: a 100-block transfer is 800 MiB


def _device(kind: str) -> torch.device:
    wanted = os.environ.get("KVTIER_DEVICE", "")
    if kind == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA GPU")
    elif not import_npu_backend():
        pytest.skip("no Ascend NPU (torch_npu missing or no device visible)")
    return torch.device(wanted if wanted.startswith(kind) else kind)


@pytest.fixture(params=DEVICES)
def engine(request: pytest.FixtureRequest) -> Iterator[TransferEngine]:
    device = _device(request.param)
    torch.accelerator.set_device_index(device.index or 0)
    kv = [
        torch.zeros((BLOCKS, SEGMENT_BYTES // 2), dtype=torch.float16, device=device)
        for _ in range(LAYERS)
    ]
    host = torch.zeros((BLOCKS, LAYERS * SEGMENT_BYTES), dtype=torch.uint8, pin_memory=True)
    with TransferEngine(kv, host) as eng:
        assert eng.backend == "stream"
        yield eng


def busy(device: torch.device, iterations: int = 400) -> None:
    """Queue roughly 100 ms of work on the current stream."""
    x = torch.randn(2048, 2048, device=device)
    for _ in range(iterations):
        x = torch.tanh(x @ x)


def fill_block(engine: TransferEngine, block: int, value: int) -> None:
    """On the current (compute) stream: every byte of ``block`` = ``value``."""
    for seg in engine.layout.segments:
        seg.rows[block].fill_(value)


def host_bytes(engine: TransferEngine, h: int) -> torch.Tensor:
    return engine.host_blocks[h, : engine.layout.block_bytes]


def test_store_reads_after_the_compute_stream_wrote(engine: TransferEngine) -> None:
    busy(engine.device)
    fill_block(engine, 9, 0x7E)  # queued behind ~100 ms of compute
    store = engine.store([9], [0])
    assert store.wait(), store.error
    assert bool((host_bytes(engine, 0) == 0x7E).all()), "store read KV before compute wrote it"


def test_load_waits_for_a_store_still_reading_its_device_blocks(engine: TransferEngine) -> None:
    fill_block(engine, 5, 0x11)
    engine.host_blocks[120].fill_(0x22)
    torch.accelerator.synchronize()
    slow = list(range(10, 110))
    engine.store(slow, slow)  # ~800 MiB ahead on the store stream
    store = engine.store([5], [111])  # reads device block 5 only after that
    load = engine.load([120], [5])  # overwrites device block 5
    assert store.wait() and load.wait()
    assert bool((host_bytes(engine, 111) == 0x11).all()), "load overwrote a block being stored"


def test_store_waits_for_a_load_still_writing_its_device_blocks(engine: TransferEngine) -> None:
    engine.host_blocks[:].fill_(0x33)
    fill_block(engine, 4, 0)
    torch.accelerator.synchronize()
    slow = list(range(10, 110))
    engine.load(slow, slow)  # ~800 MiB ahead on the load stream
    load = engine.load([120], [4])
    store = engine.store([4], [0])
    assert load.wait() and store.wait()
    assert bool((host_bytes(engine, 0) == 0x33).all()), "store read a block before its load"


def test_compute_stream_waits_for_a_load(engine: TransferEngine) -> None:
    engine.host_blocks[:].fill_(0x44)
    torch.accelerator.synchronize()
    ids = list(range(0, 100))
    load = engine.load(ids, ids)  # ~800 MiB
    load.wait_on_stream()
    seen = engine.layout.segments[-1].rows[99].clone()  # on the compute stream
    torch.accelerator.synchronize()
    assert load.ok
    assert bool((seen == 0x44).all()), "compute read a block before the load finished"


def test_round_trip_on_device(engine: TransferEngine) -> None:
    for b in range(12):
        fill_block(engine, b, b + 1)
    store = engine.store([3, 7, 1, 2], [40, 41, 60, 13])
    assert store.wait()
    load = engine.load([40, 41, 60, 13], [100, 101, 102, 110])
    load.wait_on_stream()
    for src, dst in [(3, 100), (7, 101), (1, 102), (2, 110)]:
        for seg in engine.layout.segments:
            assert bool((seg.rows[dst] == src + 1).all()), f"block {src} -> {dst} differs"
