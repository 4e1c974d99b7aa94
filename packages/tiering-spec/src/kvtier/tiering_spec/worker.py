"""The worker side: device <-> host block copies for offload jobs, on kvtier-npu-copy.

No vLLM import. A host block (one offloaded chunk) holds ``blocks_per_chunk``
sub-blocks of ``sub_block_bytes`` bytes each; sub-block ``j`` of chunk ``c`` holds
every KV segment of one device block. So the transfer engine sees host *rows*
``c * blocks_per_chunk + j`` of ``sub_block_bytes`` bytes and copies whole rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.blockpool import HostRegion
from kvtier.npu_copy import KVLayout, TransferEngine, TransferHandle

logger = logging.getLogger("kvtier.tiering_spec")


def host_rows(
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    chunk_ids: Sequence[int],
    blocks_per_chunk: int,
) -> list[int]:
    """Host rows for the device blocks of a transfer, in the device blocks' order.

    Device blocks come grouped by KV cache group (``group_sizes[g]`` of them);
    ``block_indices[g]`` is the logical index of the group's first device block in
    its request, so the first chunk of a group may be entered part-way; chunk ids
    are listed group after group. Raises ValueError on a count mismatch.
    """
    rows: list[int] = []
    c = 0
    for size, first in zip(group_sizes, block_indices):
        if size == 0:
            continue
        skip = int(first) % blocks_per_chunk
        n_chunks = -(-(size + skip) // blocks_per_chunk)
        if c + n_chunks > len(chunk_ids):
            raise ValueError(
                f"{len(chunk_ids)} host chunks cannot hold device blocks grouped as "
                f"{list(group_sizes)} from indices {list(block_indices)}"
            )
        group_chunks = chunk_ids[c : c + n_chunks]
        for i in range(size):
            pos = skip + i
            rows.append(
                int(group_chunks[pos // blocks_per_chunk]) * blocks_per_chunk
                + pos % blocks_per_chunk
            )
        c += n_chunks
    if c != len(chunk_ids):
        raise ValueError(f"{len(chunk_ids)} host chunks given, {c} used by the device blocks")
    return rows


@dataclass
class FinishedJob:
    job_id: int
    ok: bool
    nbytes: int
    seconds: float


class OffloadTransferWorker:
    """Runs a worker's offload jobs on a :class:`TransferEngine`.

    Args:
        kv_tensors: the engine's KV tensors, each ``[num_device_blocks, ...]``.
        region: host region of ``num_chunks * blocks_per_chunk * sub_block_bytes`` bytes.
        num_chunks: host blocks (chunks) in the region.
        blocks_per_chunk: device blocks per chunk.
        sub_block_bytes: host bytes per device block (>= the KV bytes of one device block).
    """

    def __init__(
        self,
        kv_tensors: Sequence[torch.Tensor],
        region: HostRegion,
        *,
        num_chunks: int,
        blocks_per_chunk: int,
        sub_block_bytes: int,
    ) -> None:
        layout = KVLayout.from_kv_caches(list(kv_tensors))
        if layout.block_bytes > sub_block_bytes:
            raise ValueError(
                f"a device block holds {layout.block_bytes} KV bytes, but the host tier was "
                f"sized for {sub_block_bytes} bytes per device block; scheduler and worker "
                "disagree on the KV layout"
            )
        self.blocks_per_chunk = blocks_per_chunk
        self.region = region
        rows = region.tensor[: num_chunks * blocks_per_chunk * sub_block_bytes].view(
            num_chunks * blocks_per_chunk, sub_block_bytes
        )
        on_device = layout.device.type != "cpu"
        if on_device and not region.pinned:
            logger.warning(
                "kvtier: host region is not page-locked (%s); copies to %s go through the "
                "driver's staging",
                region.pin_method,
                layout.device,
            )
        self.engine = TransferEngine(layout, rows, require_pinned=False)
        self.block_bytes = layout.block_bytes
        self._jobs: dict[int, tuple[TransferHandle, float, int]] = {}

    def submit_store(
        self,
        job_id: int,
        device_ids: Sequence[int],
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        chunk_ids: Sequence[int],
    ) -> None:
        """Copy device blocks into host chunks, asynchronously."""
        rows = host_rows(group_sizes, block_indices, chunk_ids, self.blocks_per_chunk)
        handle = self.engine.store(list(device_ids), rows)
        self._jobs[job_id] = (handle, time.perf_counter(), len(rows) * self.block_bytes)

    def submit_load(
        self,
        job_id: int,
        chunk_ids: Sequence[int],
        device_ids: Sequence[int],
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ) -> None:
        """Copy host chunks into device blocks, asynchronously."""
        rows = host_rows(group_sizes, block_indices, chunk_ids, self.blocks_per_chunk)
        handle = self.engine.load(rows, list(device_ids))
        self._jobs[job_id] = (handle, time.perf_counter(), len(rows) * self.block_bytes)

    @property
    def busy(self) -> bool:
        """Whether a copy job is in flight (submitted, not yet returned as finished)."""
        return bool(self._jobs)

    def copied(self, job_id: int) -> bool:
        """Whether the copy of ``job_id`` has ended (also for a job not in flight)."""
        entry = self._jobs.get(job_id)
        return entry is None or entry[0].done()

    def get_finished(self) -> list[FinishedJob]:
        """Jobs finished since the last call."""
        if not self._jobs:
            return []
        done: list[FinishedJob] = []
        now = time.perf_counter()
        for job_id, (handle, t0, nbytes) in list(self._jobs.items()):
            if handle.done():
                del self._jobs[job_id]
                if not handle.ok:
                    logger.error("kvtier: offload copy job %d failed: %s", job_id, handle.error)
                done.append(FinishedJob(job_id, handle.ok, nbytes, now - t0))
        return done

    def wait(self, job_ids: set[int] | Sequence[int]) -> None:
        for job_id in job_ids:
            entry = self._jobs.get(job_id)
            if entry is not None:
                entry[0].wait()

    def shutdown(self) -> None:
        try:
            self.engine.close()
        finally:
            self.region.close()
