"""The vllm.general_plugins entry point and the specs, without an engine."""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiering_spec import plugin

vllm = pytest.importorskip("vllm")


class FakePlatform:
    def __init__(self, cuda: bool = False, xpu: bool = False) -> None:
        self._cuda, self._xpu = cuda, xpu

    def is_cuda_alike(self) -> bool:
        return self._cuda

    def is_xpu(self) -> bool:
        return self._xpu


def test_entry_point_is_declared() -> None:
    eps = [
        e
        for e in entry_points(group="vllm.general_plugins")
        if e.value.startswith("kvtier.tiering_spec")
    ]
    assert [e.value for e in eps] == ["kvtier.tiering_spec.plugin:register"]


@pytest.mark.parametrize(
    ("platform", "env", "expected"),
    [
        (FakePlatform(), None, True),  # vLLM's CPU platform, Ascend
        (FakePlatform(cuda=True), None, False),
        (FakePlatform(xpu=True), None, False),
        (FakePlatform(cuda=True), "1", True),
        (FakePlatform(), "0", False),
    ],
)
def test_upstream_names_are_overridden_only_where_vllms_cannot_run(
    platform: FakePlatform, env: str | None, expected: bool
) -> None:
    assert plugin.should_override(platform, env) is expected


def run_py(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_register_resolves_the_upstream_names_to_kvtier_on_cpu_and_is_idempotent() -> None:
    code = (
        "from kvtier.tiering_spec import plugin\n"
        "plugin.register(); plugin.register()\n"
        "from vllm.v1.kv_offload.factory import OffloadingSpecFactory as F\n"
        "for n in ('CPUOffloadingSpec','TieringOffloadingSpec','KvtierCPUOffloadingSpec'):\n"
        "    print(n, F.get_spec_cls({'spec_name': n}).__module__)\n"
    )
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("kvtier.tiering_spec.vllm_adapter") == 3, out.stdout


def test_opt_out_keeps_vllms_names() -> None:
    code = (
        "from kvtier.tiering_spec import plugin\nplugin.register()\n"
        "from vllm.v1.kv_offload.factory import OffloadingSpecFactory as F\n"
        "print(F._registry['CPUOffloadingSpec']().__module__)\n"
        "print(F.get_spec_cls({'spec_name': 'KvtierTieringOffloadingSpec'}).__module__)\n"
    )
    out = run_py(code, KVTIER_OVERRIDE_UPSTREAM_SPECS="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["vllm.v1.kv_offload.cpu.spec", "kvtier.tiering_spec.vllm_adapter"]


def test_spec_module_path_reaches_kvtier_without_the_plugin() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    cls = OffloadingSpecFactory.get_spec_cls(
        {"spec_name": "KvtierTieringOffloadingSpec", "spec_module_path": "kvtier.tiering_spec"}
    )
    assert cls.__module__ == "kvtier.tiering_spec.vllm_adapter"


def test_register_never_raises_and_logs_one_line_on_an_unsupported_vllm(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    monkeypatch.setitem(plugin._state, "done", False)
    with caplog.at_level(logging.INFO, logger="kvtier.tiering_spec"):
        plugin.register()
    lines = [r.getMessage() for r in caplog.records if "kvtier" in r.getMessage()]
    assert len(lines) == 1 and "0.40.0" in lines[0] and "0.32" in lines[0]


def test_register_swallows_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> None:
        raise RuntimeError("broken vLLM")

    monkeypatch.setattr(plugin, "_register", boom)
    monkeypatch.setitem(plugin._state, "done", False)
    plugin.register()  # must not raise


# ------------------------------------------------------------------ specs without an engine


def offloading_config(extra: dict[str, Any], *, world_size: int = 1, rank: int = 0) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=65536,
        enable_kv_cache_events=True,
        extra_config=extra,
        engine_id="unit-engine",
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def test_host_tier_is_sized_from_the_budget_exactly() -> None:
    from kvtier.tiering_spec import CPUOffloadingSpec

    spec = CPUOffloadingSpec(offloading_config({"cpu_bytes_to_use": 10 * 65536 + 100}))
    assert spec.num_chunks == 10 and spec.chunk_bytes == 65536
    spec2 = CPUOffloadingSpec(offloading_config({"cpu_bytes_to_use": 8 * 65536}, world_size=2))
    assert spec2.num_chunks == 4, "cpu_bytes_to_use is for all ranks together"


def test_start_up_error_names_cpu_bytes_to_use() -> None:
    from kvtier.tiering_spec import CPUOffloadingSpec
    from kvtier.tiering_spec.config import ConfigError

    with pytest.raises(ConfigError, match="cpu_bytes_to_use is required"):
        CPUOffloadingSpec(offloading_config({}))
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        CPUOffloadingSpec(offloading_config({"cpu_bytes_to_use": 100}))


def test_declared_metrics_cover_the_excerpts_names(tmp_path: Path) -> None:
    from kvtier.tiering_spec import CPUOffloadingSpec, TieringOffloadingSpec

    cpu = CPUOffloadingSpec.build_metric_definitions({"store_threshold": 2})
    for name in (
        "vllm:kv_offload_cpu_cache_usage_perc",
        "vllm:kv_offload_cpu_cache_write_usage_perc",
        "vllm:kv_offload_cpu_cache_read_usage_perc",
        "vllm:kv_offload_cpu_allocation_size",
        "vllm:kv_offload_stores_skipped",
    ):
        assert name in cpu, name
    assert "vllm:kv_offload_stores_skipped" not in CPUOffloadingSpec.build_metric_definitions({})
    tier = TieringOffloadingSpec.build_metric_definitions({})
    assert "vllm:kvtier_fs_faults" in tier and tier["vllm:kvtier_fs_faults"].labelnames == (
        "tier",
        "kind",
    )


def test_manager_through_vllms_interface(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier.tiering_spec import TieringOffloadingSpec

    extra = {
        "cpu_bytes_to_use": 4 * 65536,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs")}],
    }
    spec = TieringOffloadingSpec(offloading_config(extra))
    mgr = spec.get_manager()
    ctx = ReqContext(req_id="r")
    assert mgr.lookup(b"k" * 36, ctx) is LookupResult.MISS
    out = mgr.prepare_store([b"k" * 36], ctx)
    assert out is not None and out.keys_to_store == [b"k" * 36]
    mgr.complete_store(out.keys_to_store, ctx)  # no worker region yet: the write is dropped
    assert mgr.lookup(b"k" * 36, ctx) is LookupResult.HIT
    stats = mgr.get_stats()
    assert stats is not None
    events = list(mgr.take_events())
    assert events and events[0].removed is False
    mgr.shutdown()
