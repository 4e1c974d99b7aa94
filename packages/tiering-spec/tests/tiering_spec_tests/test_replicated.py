"""KV that vLLM reports replicated across tensor-parallel ranks (MLA): the host and fs
tiers keep one copy, which rank 0 stores and every rank loads. Engine-free; the TP 2
run with an MLA model is in test_e2e_tp2."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.tiering_spec import build, regions, vllm_compat
from kvtier.tiering_spec.vllm_adapter import (
    CPUOffloadingSpec,
    TieringOffloadingSpec,
)
from kvtier.tiering_spec.vllm_worker import KvtierOffloadingWorker

from .vllm_configs import spec_without_engine

pytestmark = pytest.mark.skipif(
    not vllm_compat.CONFIG_API, reason="vLLM before 0.32 reports no replicated layout"
)

CHUNK = 65536  # the unit KV layout: 64 KiB per block, one block per chunk
MODEL = Path("unit-model")


def spec(
    cls: type, rank: int = 0, *, replicated: bool = True, engine_id: str = "unit", **extra: Any
) -> Any:
    extra = {"cpu_bytes_to_use": 8 * CHUNK, **extra}
    return spec_without_engine(
        cls,
        MODEL,
        extra,
        world_size=2,
        rank=rank,
        replicated_layout=replicated,
        engine_id=engine_id,
    )


def regions_of(engine_id: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if engine_id in n)


@pytest.mark.parametrize("cls", [CPUOffloadingSpec, TieringOffloadingSpec])
def test_one_copy_gets_the_whole_budget_and_lets_only_rank_0_store(cls: type) -> None:
    one = spec(cls)
    assert one.replicated_layout, "vLLM's worker lets only rank 0 store when this is set"
    assert (one.num_copies, one.num_chunks) == (1, 8), one.budget_description
    assert "one copy for all 2 ranks" in one.budget_description
    per_rank = spec(cls, replicated=False)
    assert not per_rank.replicated_layout
    assert (per_rank.num_copies, per_rank.num_chunks) == (2, 4)


def test_per_rank_budget_sizes_the_one_copy() -> None:
    one = spec(TieringOffloadingSpec, cpu_bytes_to_use_per_rank=3 * CHUNK)
    assert one.num_chunks == 3


def test_one_rank_is_never_replicated() -> None:
    alone = spec_without_engine(
        TieringOffloadingSpec, MODEL, {"cpu_bytes_to_use": CHUNK}, replicated_layout=True
    )
    assert not alone.replicated_layout and alone.num_copies == 1


def test_the_fs_tier_gets_one_layout() -> None:
    one = spec(TieringOffloadingSpec)
    layouts = one.offload.layouts({"replicated_layout": True})
    assert layouts == [{"replicated_layout": True, "rank": 0}]
    assert len(spec(TieringOffloadingSpec, replicated=False).offload.layouts({})) == 2


@pytest.mark.parametrize("cls", [CPUOffloadingSpec, TieringOffloadingSpec])
def test_all_ranks_map_one_host_region_whichever_starts_first(cls: type) -> None:
    engine_id = f"unit-{uuid.uuid4().hex[:12]}"
    rank0, rank1 = spec(cls, 0, engine_id=engine_id), spec(cls, 1, engine_id=engine_id)
    attached: list[Any] = []
    # Rank 1 first: it waits for rank 0's region instead of failing or making its own.
    waiter = threading.Thread(target=lambda: attached.append(rank1.offload.host_region()))
    waiter.start()
    created = rank0.offload.host_region()
    waiter.join(timeout=30)
    try:
        assert attached, "rank 1 did not map rank 0's region"
        assert created.owner and not attached[0].owner
        assert regions_of(engine_id) == [f"kvtier-tiering-{engine_id}-r0"]
        assert created.nbytes == 8 * CHUNK
        attached[0].block(5).fill_(9)
        assert int(created.block(5)[0]) == 9, "the ranks do not share the bytes"
        if cls is TieringOffloadingSpec:
            seen = rank0.offload.attach_regions()
            assert seen is not None and len(seen) == 1, "the scheduler maps the one copy"
            for r in seen:
                r.close()
    finally:
        for r in [*attached, created]:
            r.close()


@pytest.mark.parametrize("cls", [CPUOffloadingSpec, TieringOffloadingSpec])
def test_a_sharded_layout_gives_each_rank_a_region_of_its_own(cls: type) -> None:
    # vLLM's test_*_create_worker_uses_worker_rank_for_sharded_layout: without a
    # replicated layout each rank keeps its own copy, in a region of its own rank (the
    # tiering spec's is shared memory named by the rank, which its scheduler maps too).
    engine_id = f"unit-{uuid.uuid4().hex[:12]}"
    rank1 = spec(cls, 1, replicated=False, engine_id=engine_id)
    region = rank1.offload.host_region()
    try:
        if cls is TieringOffloadingSpec:
            assert region.owner and regions_of(engine_id) == [f"kvtier-tiering-{engine_id}-r1"]
        else:
            assert region.path is None and regions_of(engine_id) == []
        assert region.nbytes == rank1.num_chunks * CHUNK == 4 * CHUNK
        assert rank1.cpu_page_size_per_worker == CHUNK and rank1.kv_bytes_per_chunk == 2 * CHUNK
    finally:
        region.close()


def test_a_rank_waiting_for_rank_0_gives_up_with_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(regions, "REPLICA_WAIT_S", 0.2)
    lonely = spec(TieringOffloadingSpec, 1, engine_id=f"unit-{uuid.uuid4().hex[:12]}")
    with pytest.raises(RuntimeError, match=r"rank 1 waited 0\.2 s for rank 0"):
        lonely.offload.host_region()


def test_cpu_spec_keeps_pinned_copies_per_rank_where_shared_memory_cannot_be_pinned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    npu = SimpleNamespace(type="npu")
    monkeypatch.setattr(build.torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(build.torch.accelerator, "current_accelerator", lambda: npu)
    kept = spec(CPUOffloadingSpec)
    assert not kept.replicated_layout, "every rank must store its own copy then"
    assert (kept.num_copies, kept.num_chunks) == (2, 4)
    # The tiering spec's regions are shared memory anyway: one copy there.
    assert spec(TieringOffloadingSpec).replicated_layout


class FakeCore:
    busy = False  # no copy job of its own is ever in flight

    def __init__(self) -> None:
        self.stores: list[int] = []

    def submit_store(self, job_id: int, *args: Any) -> None:
        self.stores.append(job_id)

    def get_finished(self) -> list[Any]:
        return []

    def wait(self, job_ids: set[int]) -> None:
        pass


def test_a_non_writer_rank_acknowledges_a_store_without_copying() -> None:
    core = FakeCore()
    worker = KvtierOffloadingWorker(core, store=False)  # type: ignore[arg-type]
    assert worker.submit_store(7, None, None)  # type: ignore[arg-type]
    assert core.stores == [], "a non-writer rank rewrote rank 0's copy"
    done = worker.get_finished()
    assert [(r.job_id, r.success) for r in done] == [(7, True)], "vLLM waits for every rank"
    assert worker.get_finished() == []
