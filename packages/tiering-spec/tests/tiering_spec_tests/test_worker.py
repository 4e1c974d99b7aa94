"""Worker side: device blocks to host rows, and copies through kvtier-npu-copy."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.blockpool import HostRegion
from kvtier.tiering_spec.worker import OffloadTransferWorker, host_rows


def test_one_block_per_chunk_maps_chunk_to_row() -> None:
    assert host_rows([3], [0], [7, 2, 5], 1) == [7, 2, 5]


def test_chunks_of_several_blocks_skip_into_the_first_chunk() -> None:
    # logical blocks 2..6 of a request, 4 blocks per chunk: chunk 9 from its 3rd slot
    assert host_rows([5], [2], [9, 4], 4) == [38, 39, 16, 17, 18]


def test_groups_take_their_chunks_in_order() -> None:
    assert host_rows([2, 1], [0, 1], [1, 3], 2) == [2, 3, 7]


def test_a_chunk_count_mismatch_is_refused() -> None:
    with pytest.raises(ValueError):
        host_rows([2], [0], [1, 2], 2)


def wait(worker: OffloadTransferWorker, n: int) -> list:
    out: list = []
    deadline = time.monotonic() + 10
    while len(out) < n and time.monotonic() < deadline:
        out += worker.get_finished()
        time.sleep(0.001)
    return out


@pytest.mark.parametrize("bpc", [1, 2])
def test_store_then_load_round_trips_kv(bpc: int) -> None:
    kv = [torch.randn(8, 2, 16, 8) for _ in range(2)]  # two layers, 8 device blocks
    block_bytes = sum(t[0].numel() * t.element_size() for t in kv)
    chunks = 3
    region = HostRegion.private(chunks, bpc * block_bytes)
    worker = OffloadTransferWorker(
        kv, region, num_chunks=chunks, blocks_per_chunk=bpc, sub_block_bytes=block_bytes
    )
    before = [t.clone() for t in kv]
    worker.submit_store(1, [1, 2], [2], [0], list(range(2 // bpc)))
    done = wait(worker, 1)
    assert done and done[0].ok and done[0].nbytes == 2 * block_bytes
    for t in kv:
        t[5:7].zero_()
    worker.submit_load(2, list(range(2 // bpc)), [5, 6], [2], [0])
    assert wait(worker, 1)[0].ok
    for t, b in zip(kv, before):
        assert torch.equal(t[5], b[1]) and torch.equal(t[6], b[2])
    worker.shutdown()


def test_a_host_tier_sized_for_smaller_blocks_is_refused() -> None:
    kv = [torch.zeros(4, 1024)]
    region = HostRegion.private(2, 1024)
    with pytest.raises(ValueError, match="disagree"):
        OffloadTransferWorker(kv, region, num_chunks=2, blocks_per_chunk=1, sub_block_bytes=1024)
