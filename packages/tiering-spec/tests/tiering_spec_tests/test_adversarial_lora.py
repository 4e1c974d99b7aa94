"""LoRA adapters and the persistent tiers (item 9 of the trust issue).

vLLM's block hashes name a request's LoRA adapter (0.23: its name; 0.32: its name and
path), never its weights. An adapter retrained at the same path therefore gets the same
keys, and a persistent tier would serve the old adapter's KV after a restart. kvtier
keeps requests with an adapter to the host tier, which dies with the process.

Engine-free: each "start" is kvtier's spec and manager built from vLLM's configs as the
connector builds them, the host region a worker would create, and kvtier's connector
adding requests the way vLLM's scheduler does (``on_new_request``), with a stand-in for
vLLM's scheduler-side helper that makes the request's context as vLLM's does.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")
testkit = pytest.importorskip("kvtier.testkit")

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

ADAPTER = ("support-bot", 1, "/models/adapters/support-bot")  # name, int id, path
LORA_KEY = b"L" * 36  # a block computed with the adapter
BASE_KEY = b"B" * 36  # a block of the base model


@pytest.fixture(scope="module")
def model() -> Path:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return testkit.make_tiny_llama()  # type: ignore[no-any-return]


def adapter() -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(*ADAPTER)


class SchedulerHelper:
    """What vLLM's scheduler-side offloading helper does when a request arrives: make
    its ``ReqContext`` and hand it to the manager (``on_new_request``)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.contexts: dict[str, Any] = {}
        self._req_status: dict[str, Any] = {}

    def on_new_request(self, request: Any) -> None:
        from vllm.v1.kv_offload.base import ReqContext

        ctx = ReqContext(req_id=request.request_id)
        self.manager.on_new_request(ctx)
        self.contexts[request.request_id] = ctx
        # vLLM keeps the context with the request's state (read by kvtier-vllm-port).
        self._req_status[request.request_id] = SimpleNamespace(req_context=ctx)


class EngineStart:
    """One start of an engine's scheduler side with an fs tier at ``root``."""

    def __init__(self, model: Path, root: Path, *, lora: bool = True) -> None:
        from kvtier.blockpool import HostRegion
        from kvtier.tiering_spec import TieringOffloadingSpec
        from kvtier.tiering_spec.connector import OffloadingConnector
        from kvtier.tiering_spec.regions import region_name as _region_name

        from .vllm_configs import make_spec

        extra = {
            "cpu_bytes_to_use": 8 * 65536,
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
        }
        engine = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1} if lora else {}
        self.spec = make_spec(TieringOffloadingSpec, model, extra, engine=engine)
        # The host region a worker creates and the scheduler's tiers read and write.
        self.region = HostRegion.create_shared(
            _region_name(self.spec.config.engine_id, 0),
            self.spec.num_chunks,
            self.spec.chunk_bytes,
            pin=False,
        )
        self.manager = self.spec.get_manager()
        self.fs = self.manager.core.secondary_tiers[0]
        assert self.fs.wait_scan(30), "the start-up scan did not finish"
        # kvtier's connector as vLLM's scheduler drives it (no engine behind it).
        self.connector = object.__new__(OffloadingConnector)
        self.connector.connector_scheduler = SchedulerHelper(self.manager)

    def add_request(self, req_id: str, lora_request: Any = None) -> Any:
        """The request's context, after kvtier's connector added it as vLLM does."""
        self.connector.on_new_request(SimpleNamespace(request_id=req_id, lora_request=lora_request))
        return self.connector.connector_scheduler.contexts[req_id]

    def store(self, key: bytes, ctx: Any, fill: int) -> None:
        out = self.manager.prepare_store([key], ctx)
        assert out is not None and list(out.keys_to_store) == [key]
        self.region.block(int(out.store_spec.block_ids[0])).fill_(fill)
        self.manager.complete_store([key], ctx)
        assert self.manager.core.drain(20), "fs writes did not finish"

    def lookup(self, key: bytes, ctx: Any, timeout: float = 20.0) -> str:
        """``hit`` or ``miss`` once any read from the fs tier has finished."""
        from kvtier.tiering_spec import vllm_compat
        from kvtier.tiering_spec.manager import Lookup

        hit = vllm_compat.lookup_result(Lookup.HIT)
        miss = vllm_compat.lookup_result(Lookup.MISS)
        deadline = time.monotonic() + timeout
        while True:
            result = self.manager.lookup(key, ctx)
            if result == hit:
                return "hit"
            if result == miss:
                return "miss"
            assert time.monotonic() < deadline, f"{key[:1]!r} stayed pending"
            self.manager.on_schedule_end()
            time.sleep(0.02)

    def loaded_bytes(self, key: bytes, ctx: Any) -> set[int]:
        spec = self.manager.prepare_load([key], ctx)
        block = self.region.block(int(spec.block_ids[0]))
        self.manager.complete_load([key], ctx)
        return set(block.unique().tolist())

    def close(self) -> None:
        self.manager.shutdown()
        self.region.close()


def test_a_retrained_adapter_at_the_same_path_is_never_served_the_old_kv(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "fs"
    first = EngineStart(model, root)
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.tiering_spec"):
            first.store(LORA_KEY, first.add_request("lora-1", adapter()), fill=0xA1)
        assert "LoRA adapter use the host tier only" in caplog.text
        first.store(BASE_KEY, first.add_request("base-1"), fill=0xB1)
        written = first.fs.stats.writes
    finally:
        first.close()

    # The adapter is retrained and saved at the same path; vLLM's keys do not change.
    second = EngineStart(model, root)
    try:
        got = second.lookup(LORA_KEY, second.add_request("lora-2", adapter()))
        assert got == "miss", (
            "a request with the retrained adapter was served the KV that the old adapter "
            "computed, from the fs tier, after a restart"
        )
        base = second.add_request("base-2")
        assert second.lookup(BASE_KEY, base) == "hit", "the base model's block was not kept"
        assert second.loaded_bytes(BASE_KEY, base) == {0xB1}
    finally:
        second.close()
    assert written == 1, (
        f"{written} blocks written to the fs tier; only the base model's block may be: "
        "one computed with an adapter stays in the host tier"
    )


def test_a_request_the_connector_did_not_announce_stays_in_the_host_tier_when_lora_is_on(
    model: Path, tmp_path: Path
) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    root = tmp_path / "fs"
    first = EngineStart(model, root)
    try:
        first.store(BASE_KEY, first.add_request("base-1"), fill=0xB1)
        # A context that did not come through kvtier's connector (another connector in
        # front of the manager): kvtier cannot tell whether an adapter computed it.
        unknown = ReqContext(req_id="unknown-1")
        first.store(LORA_KEY, unknown, fill=0xA1)
        written = first.fs.stats.writes
    finally:
        first.close()
    second = EngineStart(model, root)
    try:
        unknown = ReqContext(req_id="unknown-2")
        assert second.lookup(BASE_KEY, unknown) == "miss", (
            "a request kvtier cannot tell from a LoRA request was served from the fs tier"
        )
        assert second.lookup(BASE_KEY, second.add_request("base-2")) == "hit"
    finally:
        second.close()
    assert written == 1, "a block kvtier cannot tell from a LoRA request's was written"


def test_without_lora_every_request_uses_the_fs_tier(model: Path, tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    root = tmp_path / "fs"
    first = EngineStart(model, root, lora=False)
    try:
        first.store(BASE_KEY, ReqContext(req_id="any-1"), fill=0xB1)
    finally:
        first.close()
    second = EngineStart(model, root, lora=False)
    try:
        ctx = ReqContext(req_id="any-2")
        assert second.lookup(BASE_KEY, ctx) == "hit"
        assert second.loaded_bytes(BASE_KEY, ctx) == {0xB1}
    finally:
        second.close()


# ------------------------------------------------------------------ a real engine with LoRA


def write_adapter(path: Path, seed: int, rank: int = 8) -> None:
    """A PEFT LoRA adapter for the tiny model's key and value projections (so the KV
    depends on it), with random weights of ``seed``."""
    import json

    import torch
    from safetensors.torch import save_file

    hidden = kv_width = 128  # the tiny model: hidden 128, 2 KV heads x 64
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.3
            tensors[f"{name}.lora_B.weight"] = torch.randn(kv_width, rank, generator=gen) * 0.3
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["k_proj", "v_proj"],
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.e2e
@pytest.mark.slow
def test_an_engine_restarted_with_a_retrained_adapter_matches_vllm_alone(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finding end to end: an engine fills the fs tier with LoRA requests; the adapter
    is retrained at the same path; a restarted engine's outputs must match vLLM alone
    with the new adapter."""
    from vllm.lora.request import LoRARequest

    from kvtier.testkit import compare_outputs, greedy_params, kv_transfer_config, llm_session
    from kvtier.testkit.engine import kv_connector_of

    from .e2e_support import ENGINE, ROOMY, offload_config, prefix_prompts

    # One block-hash seed for every engine (vLLM 0.23 seeds at random per engine).
    monkeypatch.setenv("PYTHONHASHSEED", os.environ.get("PYTHONHASHSEED", "0"))
    path = tmp_path / "adapter"
    lora = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    cfg = kv_transfer_config(
        offload_config("TieringOffloadingSpec", host_chunks=10, root_dir=str(tmp_path / "fs"))
    )
    prompts = [{"prompt_token_ids": list(p)} for p in prefix_prompts()]

    def run(engine: dict[str, Any], **kv: Any) -> tuple[list[list[int]], Any]:
        with llm_session(model, **engine, **lora, **kv) as llm:
            results = llm.generate(
                prompts,
                greedy_params(8),
                lora_request=LoRARequest("support-bot", 1, str(path)),
                use_tqdm=False,
            )
            fs = kv_connector_of(llm).connector_scheduler.manager.core.secondary_tiers if kv else []
            stats = fs[0].stats if fs else None
        return [list(r.outputs[0].token_ids) for r in results], stats

    write_adapter(path, seed=1)
    _, first = run(ENGINE, kv_transfer_config=cfg)
    write_adapter(path, seed=2)  # retrained, saved at the same path
    reference, _ = run(ROOMY)
    got, second = run(ENGINE, kv_transfer_config=cfg)
    cmp = compare_outputs(reference, got)
    assert cmp.identical, "outputs differ from vLLM alone with the new adapter:\n" + cmp.report()
    assert first.writes == 0 and second.reads == 0, (first, second)
