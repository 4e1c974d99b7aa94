"""The connector's reads of vLLM's objects: each field read where it is, and what a
release without it answers."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from kvtier.vllm_port import connector_reads as reads


def test_the_load_failure_policy_is_set_to_recompute_once() -> None:
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_load_failure_policy="fail"))
    assert reads.kv_load_failure_policy(config) == "fail"
    assert reads.recompute_failed_loads(config) is True
    assert reads.kv_load_failure_policy(config) == "recompute"
    assert reads.recompute_failed_loads(config) is False, "already recompute: unchanged"


def test_a_release_without_the_policy_gets_it_set() -> None:
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace())
    assert reads.kv_load_failure_policy(config) is None
    assert reads.recompute_failed_loads(config) is True
    assert config.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_no_transfer_config_is_left_alone() -> None:
    config = SimpleNamespace(kv_transfer_config=None)
    assert reads.kv_load_failure_policy(config) is None
    assert reads.recompute_failed_loads(config) is False
    assert reads.kv_load_failure_policy(SimpleNamespace()) is None


def test_missing_fields_read_as_a_release_without_them() -> None:
    bare = SimpleNamespace()
    assert reads.additional_config(bare) is None
    assert reads.resumed_req_ids(bare) == set()
    assert reads.resumed_req_ids(SimpleNamespace(resumed_req_ids=None)) == set()
    assert reads.block_hashes(bare) == []
    assert reads.block_hashes(SimpleNamespace(block_hashes=None)) == []
    assert reads.worker_meta(bare) is None
    assert reads.num_gpu_blocks(bare) is None


def test_present_fields_are_read() -> None:
    extra = {"recompute_scheduler_enable": True}
    assert reads.additional_config(SimpleNamespace(additional_config=extra)) is extra
    assert reads.resumed_req_ids(SimpleNamespace(resumed_req_ids={"a"})) == {"a"}
    assert reads.block_hashes(SimpleNamespace(block_hashes=(b"x", b"y"))) == [b"x", b"y"]
    meta = object()
    assert reads.worker_meta(SimpleNamespace(kv_connector_worker_meta=meta)) is meta
    assert reads.num_gpu_blocks(SimpleNamespace(num_gpu_blocks=17)) == 17


def test_the_fields_are_vllms_where_this_release_has_them() -> None:
    """The names read are vLLM's own (on the installed release, where it has them)."""
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.sched.output import CachedRequestData
    from vllm.v1.outputs import KVConnectorOutput

    def fields(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    assert "additional_config" in fields(VllmConfig)
    if "kv_load_failure_policy" in fields(KVTransferConfig):
        assert KVTransferConfig(kv_connector="x", kv_role="kv_both").kv_load_failure_policy in (
            "recompute",
            "fail",
        )
    if "resumed_req_ids" in fields(CachedRequestData):
        assert reads.resumed_req_ids(CachedRequestData.make_empty()) == set()
    if "kv_connector_worker_meta" in fields(KVConnectorOutput):
        assert reads.worker_meta(KVConnectorOutput()) is None


def test_layer_hooks_idle_only_where_both_hooks_do_nothing() -> None:
    class Idle:
        def wait_for_layer_load(self, layer_name: str) -> None:
            pass

        def save_kv_layer(self, layer_name: str, kv_layer: object, attn_metadata: object) -> None:
            """Nothing to save."""
            return

    class Saves(Idle):
        def save_kv_layer(self, layer_name: str, kv_layer: object, attn_metadata: object) -> None:
            self.saved = layer_name

    class Waits(Idle):
        def wait_for_layer_load(self, layer_name: str) -> None:
            print(layer_name)

    assert reads.layer_hooks_idle(Idle)
    assert not reads.layer_hooks_idle(Saves)
    assert not reads.layer_hooks_idle(Waits)
    assert not reads.layer_hooks_idle(object), "no hooks: not known to be idle"


def test_reads_argument_finds_every_read_of_it() -> None:
    def forwards(self: object, finished_req_ids: set[str]) -> object:
        return finished_req_ids

    def ignores(self: object, finished_req_ids: set[str]) -> object:
        done: set[str] = set()
        return done

    def in_closure(self: object, finished_req_ids: set[str]) -> object:
        return lambda: finished_req_ids

    def through_locals(self: object, finished_req_ids: set[str]) -> object:
        return locals()

    def rebinds(self: object, finished_req_ids: set[str]) -> object:
        finished_req_ids = set()
        return finished_req_ids

    def keyword(self: object, *, finished_req_ids: set[str]) -> object:
        return len(finished_req_ids)

    name = "finished_req_ids"
    assert not reads.reads_argument(ignores, name)
    for fn in (forwards, in_closure, through_locals, rebinds, keyword):
        assert reads.reads_argument(fn, name), fn.__name__
    # Not known: no such argument, no plain function.
    assert reads.reads_argument(ignores, "other")
    assert reads.reads_argument(len, name)
    assert reads.reads_argument(None, name)
