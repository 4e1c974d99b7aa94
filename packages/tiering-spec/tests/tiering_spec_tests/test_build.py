"""kvtier's composition root (``kvtier.tiering_spec.build``) without vLLM: the host
tier's size, its regions, the pool, an fs tier, the tier manager and a worker, from
plain facts; and a block's round trip device -> host -> fs -> host -> device through
what it builds, in a process where vLLM cannot be imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from kvtier.tiering_spec.build import build
from kvtier.tiering_spec.config import ConfigError, parse_config
from kvtier.tiering_spec.offload_facts import GroupFacts, OffloadFacts

BLOCK = 65536  # KV bytes of one device block on one worker


def facts(**changes: object) -> OffloadFacts:
    fields: dict[str, object] = {
        "engine_id": f"unit-{uuid.uuid4().hex[:12]}",
        "model_name": "unit-model",
        "cache_dtype": "float32",
        "groups": (GroupFacts(0, ("layer.0", "layer.1"), 16),),
        "blocks_per_chunk": 2,
        "tokens_per_hash": 16,
        "worker_kv_bytes_per_block": BLOCK,
        "max_model_len": 256,
    }
    fields.update(changes)
    return OffloadFacts(**fields)  # type: ignore[arg-type]


def settings(tiering: bool = False, **extra: object) -> object:
    return parse_config({"cpu_bytes_to_use": 8 * 2 * BLOCK, **extra}, tiering=tiering)


def test_the_budget_buys_chunks_of_blocks_per_chunk_device_blocks() -> None:
    offload = build(facts(), settings(), tiering=False, name="CPUOffloadingSpec")  # type: ignore[arg-type]
    s = offload.sizing
    assert (s.chunk_bytes, s.num_chunks, s.num_copies) == (2 * BLOCK, 8, 1)
    assert offload.config_info_row() == {
        "cpu_num_chunks": 8,
        "cpu_blocks_per_chunk": 2,
        "cpu_kv_cache_size_bytes": 8 * 2 * BLOCK,
        # a request of 256 tokens takes 8 chunks of 2 blocks of 16 tokens
        "cpu_kv_cache_size_tokens": 256,
    }


def test_a_block_that_is_no_page_multiple_is_padded_so_chunks_stay_aligned() -> None:
    offload = build(
        facts(worker_kv_bytes_per_block=1000, blocks_per_chunk=1),
        settings(),  # type: ignore[arg-type]
        tiering=False,
        name="CPUOffloadingSpec",
    )
    assert offload.sizing.sub_block_bytes == 4096
    assert offload.sizing.chunk_bytes % 4096 == 0


def test_ranks_split_the_budget_unless_one_copy_serves_them_all() -> None:
    two = facts(world_size=2, rank=1)
    per_rank = build(two, settings(), tiering=True, name="TieringOffloadingSpec")  # type: ignore[arg-type]
    assert (per_rank.sizing.num_copies, per_rank.sizing.num_chunks) == (2, 4)
    one = build(
        facts(world_size=2, rank=1, replicated_layout=True),
        settings(),  # type: ignore[arg-type]
        tiering=True,
        name="TieringOffloadingSpec",
    )
    assert (one.sizing.num_copies, one.sizing.num_chunks) == (1, 8)
    assert "one copy for all 2 ranks" in one.sizing.budget_description


def test_a_scheduler_without_kv_bytes_is_a_clear_error() -> None:
    offload = build(
        facts(worker_kv_bytes_per_block=0),
        settings(),
        tiering=False,
        name="CPUOffloadingSpec",  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        offload.scheduler()


def test_the_fingerprint_names_the_layout_and_refuses_unknown_weights() -> None:
    offload = build(facts(), settings(), tiering=True, name="TieringOffloadingSpec")  # type: ignore[arg-type]
    identity, persistent = offload.engine_identity()
    assert not persistent and identity["weights"][0] == "unverified"
    assert identity["blocks_per_chunk"] == 2 and identity["tokens_per_block"] == [16]
    assert [layout["rank"] for layout in offload.layouts(identity)] == [0]


# A block's round trip through everything build() makes, with vLLM unimportable.
_ROUND_TRIP = textwrap.dedent(
    """
    import importlib.abc, sys, time

    class NoVllm(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "vllm" or name.startswith("vllm."):
                raise ImportError("vLLM is not installed here")
            return None

    sys.meta_path.insert(0, NoVllm())

    import torch
    from kvtier.tiering_spec.build import build
    from kvtier.tiering_spec.config import parse_config
    from kvtier.tiering_spec.manager import Lookup
    from kvtier.tiering_spec.offload_facts import GroupFacts, OffloadFacts

    root, engine_id = sys.argv[1], sys.argv[2]
    blocks, per_block = 4, 4096  # a device KV cache of 4 blocks of 4096 bytes
    facts = OffloadFacts(
        engine_id=engine_id, model_name="unit-model", cache_dtype="float32",
        groups=(GroupFacts(0, ("layer.0",), 16),), blocks_per_chunk=1,
        tokens_per_hash=16, worker_kv_bytes_per_block=per_block,
    )
    settings = parse_config(
        {"cpu_bytes_to_use": 4 * per_block,
         "secondary_tiers": [{"type": "fs", "root_dir": root}]},
        tiering=True,
    )
    offload = build(facts, settings, tiering=True, name="TieringOffloadingSpec")
    device = torch.arange(blocks * per_block // 4, dtype=torch.float32).view(blocks, -1)
    worker = offload.worker([device]).core  # creates the shared host region
    side = offload.scheduler()  # maps it, and starts the fs tier
    core = side.core
    key = b"k" * 16

    # device block 1 -> host -> fs
    keys, chunk_ids, _ = core.prepare_store([key])
    worker.submit_store(1, [1], [1], [0], chunk_ids)
    worker.wait({1})
    core.complete_store([key])
    core.end_step()
    assert core.drain(30)

    # the host tier is dropped; the fs tier brings the block back
    core.reset(side.new_pool())
    assert core.lookup(key, "r1") is Lookup.HIT_PENDING, "an fs hit starts a promotion"
    core.flush()
    deadline = time.monotonic() + 60
    while core.has_pending_work() and time.monotonic() < deadline:
        time.sleep(0.005)
        core.poll()
    assert core.lookup(key, "r2") is Lookup.HIT, "the fs tier did not bring the block back"
    (chunk,) = core.prepare_load([key])
    expected = device[1].clone()
    device[3].zero_()
    worker.submit_load(2, [chunk], [3], [1], [0])
    worker.wait({2})
    core.complete_load([key])
    assert torch.equal(device[3], expected), "the block came back changed"
    assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
    core.shutdown()
    worker.shutdown()
    side.regions.close()
    print("round trip ok")
    """
)


def test_a_block_goes_to_the_fs_tier_and_back_without_vllm(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", _ROUND_TRIP, str(tmp_path / "fs"), f"unit-{uuid.uuid4().hex}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0 and "round trip ok" in out.stdout, out.stdout + out.stderr
