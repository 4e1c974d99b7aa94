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

    def on_new_request(self, request: Any) -> None:
        from vllm.v1.kv_offload.base import ReqContext

        ctx = ReqContext(req_id=request.request_id)
        self.manager.on_new_request(ctx)
        self.contexts[request.request_id] = ctx


class EngineStart:
    """One start of an engine's scheduler side with an fs tier at ``root``."""

    def __init__(self, model: Path, root: Path, *, lora: bool = True) -> None:
        from kvtier.blockpool import HostRegion
        from kvtier.tiering_spec import TieringOffloadingSpec
        from kvtier.tiering_spec.connector import OffloadingConnector
        from kvtier.tiering_spec.vllm_adapter import _region_name

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
        self.fs = self.manager.core.fs_tiers[0]
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
