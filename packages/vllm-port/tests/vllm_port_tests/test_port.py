"""The port: one implementation per vLLM interface generation, chosen once; the engine
facts read from vLLM's configs (the tests that need vLLM skip without it)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from kvtier.vllm_port import facts, interface, port


def _release() -> object:
    vllm = pytest.importorskip("vllm")
    from packaging.version import Version

    return Version(Version(vllm.__version__).base_version)


def test_the_port_imports_without_vllm() -> None:
    code = (
        "import sys, kvtier.vllm_port.port, kvtier.vllm_port.facts\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm']\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_generation_implements_the_whole_port() -> None:
    for generation in port.GENERATIONS:
        assert not getattr(generation, "__abstractmethods__", None), generation
        assert issubclass(generation, port.VllmPort)
        assert generation.generation and generation.releases
    assert len({g.generation for g in port.GENERATIONS}) == len(port.GENERATIONS)


def test_this_vllms_generation_is_chosen_once() -> None:
    from packaging.version import Version

    release = _release()
    chosen = port.select()
    assert port.current() is chosen and port.select() is chosen
    if release >= Version("0.26"):
        assert isinstance(chosen, port.OffloadingConfigPort)
        assert chosen.spec_takes_offloading_config and chosen.worker_api and chosen.spec_metrics
    else:
        assert isinstance(chosen, port.LegacyPort)
        assert not chosen.spec_takes_offloading_config
    if release >= Version("0.32"):
        assert chosen.binds_kv_cache_manager and chosen.request_level_load_failures
        assert chosen.fixed_hash_seed
        results = chosen.transfer_results({"a"}, {"b"})
        assert results.finished_recving == {"a"} and results.failed_recving == {"b"}
    elif release < Version("0.24"):
        assert not chosen.binds_kv_cache_manager and not chosen.request_level_load_failures
        assert not chosen.worker_api and not chosen.spec_metrics


def test_lookup_answers_are_vllms() -> None:
    from packaging.version import Version

    release = _release()
    chosen = port.current()
    hit, pending, miss = (chosen.lookup_result(x) for x in ("hit", "pending", "miss"))
    if release >= Version("0.25"):
        from vllm.v1.kv_offload.base import LookupResult  # type: ignore[attr-defined]

        assert (hit, pending, miss) == (
            LookupResult.HIT,
            LookupResult.HIT_PENDING,
            LookupResult.MISS,
        )
    else:
        assert (hit, pending, miss) == (True, None, False)


def test_a_requests_kv_load_tiers_say_which_secondary_tiers_it_loads_from() -> None:
    chosen = port.current()
    tiers = ["LOCAL", "REMOTE"]  # an fs tier and a store tier
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler
        from vllm.v1.kv_offload.base import ReqContext  # type: ignore[attr-defined]

        parse = scheduler._parse_tier_filter  # vLLM's reading of kv_load_tiers
    except (ImportError, AttributeError):  # a release without per-request tiers
        assert chosen.load_tiers(object(), tiers) is None
        return

    def allowed(raw: object) -> object:
        return chosen.load_tiers(ReqContext(req_id="r", load_tier_filter=parse(raw)), tiers)

    assert chosen.load_tiers(ReqContext(req_id="r"), tiers) is None  # no kv_load_tiers
    assert allowed([{"medium": "CPU"}]) == (False, False)  # the host tier alone
    assert allowed([{"locality": "LOCAL"}]) == (True, False)
    assert allowed([{"medium": "STORAGE", "locality": "REMOTE"}]) == (False, True)
    assert allowed([{"medium": "STORAGE"}]) == (True, True)
    assert allowed([]) == (False, False)  # asked for no tier at all
    assert allowed([{"medium": "TAPE"}]) is None  # nothing vLLM knows: every tier


def test_request_state_is_kept_on_a_context_without_vllms_store() -> None:
    class Context:  # vLLM 0.23's request context: no get_state / set_state
        pass

    chosen = port.LegacyPort()  # these methods need no vLLM

    @dataclasses.dataclass
    class Mark:
        value: int

    ctx = Context()
    assert not chosen.keeps_request_state(ctx)
    assert chosen.request_state(ctx, Mark) is None
    assert chosen.set_request_state(ctx, Mark(3))
    assert chosen.request_state(ctx, Mark) == Mark(3)
    # (Kept on the context by kvtier, not by vLLM: the one-call form says not kept.)
    assert chosen.kept_request_state(ctx, Mark) == (False, None)
    assert chosen.key_positions(ctx, ["k"]) is None
    assert not chosen.set_request_state(object(), Mark(1))  # no attributes: nothing kept


def test_key_positions_are_what_vllms_context_answers() -> None:
    base = pytest.importorskip("vllm.v1.kv_offload.base")
    chosen = port.LegacyPort()
    ctx = base.ReqContext(req_id="r")
    for i, key in enumerate([b"a", b"b", b"c"]):
        ctx.set_offload_key_position(key, 32 * (i + 1))
    keys = [b"c", b"x", b"a", b"b"]
    want = [ctx.get_offload_key_position(k) for k in keys]
    assert want == [96, None, 32, 64]
    assert interface.positions_table(type(ctx)), "vLLM's context read directly"
    assert chosen.key_positions(ctx, keys) == want
    # vLLM's context keeps per-request state: the one-call form reads it.
    assert chosen.kept_request_state(ctx, dict) == (True, None)
    assert chosen.set_request_state(ctx, {"n": 1})
    assert chosen.kept_request_state(ctx, dict) == (True, {"n": 1})

    class Other(base.ReqContext):  # a context that places keys its own way
        def get_offload_key_position(self, key: Any) -> int | None:
            return 7

    other = Other(req_id="o")
    other.set_offload_key_position(b"a", 32)
    assert not interface.positions_table(Other)
    assert chosen.key_positions(other, [b"a", b"z"]) == [7, 7]


def test_plain_renders_dataclasses_enums_and_sets_stably() -> None:
    import enum

    class Kind(enum.Enum):
        A = "a"

    @dataclasses.dataclass
    class Spec:
        kind: Kind
        sizes: frozenset[int]
        extra: dict[str, object]

    assert facts.plain(Spec(Kind.A, frozenset({3, 1}), {"b": 1, "a": (2,)})) == {
        "type": "Spec",
        "kind": "a",
        "sizes": [1, 3],
        "extra": {"a": [2], "b": 1},
    }
    torch = pytest.importorskip("torch")
    assert facts.plain(torch.float16) == "float16"


def test_kv_shape_reads_each_model_familys_names() -> None:
    llama = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "hidden_size": 4096}  # fmt: skip
    assert facts.kv_shape(facts.text_config(llama)) == (32, 8, 128)
    gpt2 = {"n_layer": 12, "n_head": 12, "n_embd": 768}
    assert facts.kv_shape(gpt2) == (12, 12, 64)
    nested = {"text_config": {"num_layers": 4, "n_head": 2, "head_dim": 80}, "vision": {}}
    assert facts.kv_shape(facts.text_config(nested)) == (4, 2, 80)
    # Not a positive integer: not given.
    assert facts.kv_shape({"num_hidden_layers": True, "num_attention_heads": 0}) == (
        None, None, None)  # fmt: skip
    assert facts.text_config(["not", "a", "config"]) == {}


def test_engine_facts_come_from_vllms_configs(tmp_path: object) -> None:
    pytest.importorskip("vllm")
    testkit = pytest.importorskip("kvtier.testkit")
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    model = testkit.make_tiny_llama()  # type: ignore[attr-defined]
    vllm_config = EngineArgs(
        model=str(model), enforce_eager=True, dtype="float32", block_size=32
    ).create_engine_config()
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    page = spec.page_size_bytes
    if "layer_stride" in {f.name for f in dataclasses.fields(KVCacheTensor)}:  # vLLM 0.32
        tensors = [
            KVCacheTensor(size=page * 16, layers=layers, layer_stride=page * 8, block_stride=page)
        ]
    else:  # one allocation per layer
        tensors = [KVCacheTensor(size=page * 8, shared_by=[x]) for x in layers]
    kv_cache_config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)],
    )
    got = port.current().engine_facts(vllm_config, kv_cache_config)
    assert got is not None and got.kv is not None
    assert got.model.name == str(model) and got.model.dtype == "float32"
    assert got.platform_is_cpu and got.parallel.world_size == 1 and not got.lora.enabled
    assert got.block_hash.algo == str(vllm_config.cache_config.prefix_caching_hash_algo)
    (group,) = got.kv.groups
    assert group.layer_names == tuple(layers) and group.kind == "FullAttentionSpec"
    assert group.has_heads and group.block_size == 32
    assert set(group.page_bytes.values()) == {spec.page_size_bytes}
    assert got.kv.num_blocks == 8 and got.kv.hash_block_size == 32
    placed = [t.placement for t in got.kv.tensors]
    if len(tensors) == 1:
        assert placed == [facts.KVPlacement(0, page * 8, page)]
    else:
        assert placed == [None, None]
    assert port.current().engine_facts(None, kv_cache_config) is None


def test_no_supported_vllm_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class Nothing(port.LegacyPort):
        @classmethod
        def serves(cls) -> bool:
            return False

    monkeypatch.setattr(port, "GENERATIONS", (Nothing,))
    monkeypatch.setattr(port, "_selected", [])
    with pytest.raises(RuntimeError, match=r"vLLM 0\.23 and later"):
        port.current()
    assert not interface.module_exists("kvtier_no_such_package.sub")
