"""The vllm.general_plugins entry point and the specs, without an engine."""

from __future__ import annotations

import logging
import subprocess
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from kvtier.testkit import run_python
from kvtier.tiering_spec import plugin

from .vllm_configs import spec_without_engine as make_spec

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
        (FakePlatform(), {}, True),  # vLLM's CPU platform, Ascend
        (FakePlatform(cuda=True), {}, False),
        (FakePlatform(xpu=True), {}, False),
        (FakePlatform(cuda=True), {"KVTIER_UPSTREAM_NAMES": "1"}, True),
        (FakePlatform(), {"KVTIER_UPSTREAM_NAMES": "0"}, False),
        # The switch's earlier name still counts (deprecated).
        (FakePlatform(cuda=True), {"KVTIER_OVERRIDE_UPSTREAM_SPECS": "1"}, True),
        (FakePlatform(), {"KVTIER_OVERRIDE_UPSTREAM_SPECS": "0"}, False),
    ],
)
def test_upstream_names_are_overridden_only_where_vllms_cannot_run(
    platform: FakePlatform, env: dict[str, str], expected: bool
) -> None:
    assert plugin.should_override(platform, env) is expected


def run_py(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a process of its own, forked from one that has imported vLLM and
    nothing of kvtier: vLLM's factories and kvtier's plugin are as new as in a new
    interpreter."""
    import os

    return run_python(code, {**os.environ, **env}, timeout=300)


def printed(out: subprocess.CompletedProcess[str]) -> list[str]:
    """What the code printed with ``print("=>", ...)`` (vLLM may log to stdout too)."""
    return [
        w for line in out.stdout.splitlines() if line.startswith("=> ") for w in line.split()[1:]
    ]


def test_register_resolves_the_upstream_names_to_kvtier_on_cpu_and_is_idempotent() -> None:
    code = (
        "from kvtier.tiering_spec import plugin\n"
        "plugin.register(); plugin.register()\n"
        "from vllm.v1.kv_offload.factory import OffloadingSpecFactory as F\n"
        "for n in ('CPUOffloadingSpec','TieringOffloadingSpec','KvtierCPUOffloadingSpec'):\n"
        "    print('=>', n, F._registry[n]().__module__)\n"
    )
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    assert printed(out).count("kvtier.tiering_spec.vllm_adapter") == 3, out.stdout


def test_opt_out_keeps_vllms_names() -> None:
    code = (
        "from kvtier.tiering_spec import plugin\nplugin.register()\n"
        "from vllm.v1.kv_offload.factory import OffloadingSpecFactory as F\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as K\n"
        "print('=>', F._registry['CPUOffloadingSpec']().__module__)\n"
        "print('=>', F._registry['KvtierTieringOffloadingSpec']().__module__)\n"
        "print('=>', K.get_connector_class_by_name('OffloadingConnector').__module__)\n"
        "print('=>', K.get_connector_class_by_name('KvtierOffloadingConnector').__module__)\n"
    )
    out = run_py(code, KVTIER_UPSTREAM_NAMES="0")
    assert out.returncode == 0, out.stderr
    assert printed(out) == [
        "vllm.v1.kv_offload.cpu.spec",
        "kvtier.tiering_spec.vllm_adapter",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
        "kvtier.tiering_spec.connector",
    ]


def test_the_factories_are_used_never_patched() -> None:
    code = (
        "from vllm.v1.kv_offload.factory import OffloadingSpecFactory as F\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as K\n"
        "before = {**vars(F), **vars(K)}\n"
        "from kvtier.tiering_spec import plugin\nplugin.register()\n"
        "from kvtier.recompute_connector import plugin as p2\np2.register()\n"
        "after = {**vars(F), **vars(K)}\n"
        "print('=>', sorted(k for k in after if after[k] is not before.get(k)))\n"
        "try:\n    F.register_spec('CPUOffloadingSpec', 'x', 'y')\n"
        "except ValueError:\n    print('=> refused')\n"
    )
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    # Only the registries' contents changed; a later duplicate still raises as vLLM says.
    assert printed(out) == ["[]", "refused"], out.stdout


def test_spec_module_path_reaches_kvtier_without_the_plugin() -> None:
    import importlib

    # What vLLM's OffloadingSpecFactory does with a name it has not registered.
    cls = importlib.import_module("kvtier.tiering_spec").KvtierTieringOffloadingSpec
    assert cls.__module__ == "kvtier.tiering_spec.vllm_adapter"


def test_the_connector_name_resolves_to_kvtiers_connector() -> None:
    code = (
        "from kvtier.tiering_spec import plugin\nplugin.register()\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as K\n"
        "c = K._registry['OffloadingConnector']()\n"
        "bases = [b.__module__ for b in c.__mro__[1:3]]\n"
        "print('=>', c.__module__, *bases, type(c.build_kv_connector_stats()).__module__)\n"
    )
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    from kvtier.tiering_spec import vllm_compat

    # vLLM's connector on every release (its base is never chosen at import), with
    # kvtier's metrics reported by the connector itself where specs cannot declare them.
    stats = (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics"
        if vllm_compat.SPEC_METRICS
        else "kvtier.tiering_spec.vllm_legacy_metrics"
    )
    words = printed(out)
    assert words[0] == "kvtier.tiering_spec.connector", out.stdout
    assert "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector" in words[1:3]
    assert words[3] == stats, out.stdout


@pytest.mark.parametrize("version", ["0.22.0", "0.34.0"])
def test_register_never_raises_and_logs_one_line_on_an_unsupported_vllm(
    version: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    specs, connectors = dict(OffloadingSpecFactory._registry), dict(KVConnectorFactory._registry)
    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.setitem(plugin._state, "done", False)
    with caplog.at_level(logging.INFO, logger="kvtier.tiering_spec"):
        plugin.register()
    lines = [r.getMessage() for r in caplog.records if "kvtier" in r.getMessage()]
    assert len(lines) == 1 and version in lines[0] and ">=0.23" in lines[0], lines
    assert OffloadingSpecFactory._registry == specs, "registered on an unsupported vLLM"
    assert KVConnectorFactory._registry == connectors


def test_register_swallows_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> None:
        raise RuntimeError("broken vLLM")

    monkeypatch.setattr(plugin, "_register", boom)
    monkeypatch.setitem(plugin._state, "done", False)
    plugin.register()  # must not raise


# ------------------------------------------------------------------ specs without an engine


@pytest.fixture(scope="module")
def model() -> Path:
    testkit = pytest.importorskip("kvtier.testkit")
    return testkit.make_tiny_llama()  # type: ignore[no-any-return]


def test_host_tier_is_sized_from_the_budget_exactly(model: Path) -> None:
    from kvtier.tiering_spec import CPUOffloadingSpec

    spec = make_spec(CPUOffloadingSpec, model, {"cpu_bytes_to_use": 10 * 65536 + 100})
    assert spec.num_chunks == 10 and spec.chunk_bytes == 65536
    spec2 = make_spec(CPUOffloadingSpec, model, {"cpu_bytes_to_use": 8 * 65536}, world_size=2)
    assert spec2.num_chunks == 4, "cpu_bytes_to_use is for all ranks together"


def test_blocks_per_chunk_sets_the_chunk_vllm_schedules_by(model: Path) -> None:
    from kvtier.tiering_spec import CPUOffloadingSpec

    extra = {"cpu_bytes_to_use": 8 * 4 * 65536, "blocks_per_chunk": 4}
    spec = make_spec(CPUOffloadingSpec, model, extra)
    assert spec.blocks_per_chunk == 4 and spec.num_chunks == 8
    # Older vLLM schedules chunks by block_size_factor (it reads only block_size).
    assert getattr(spec, "block_size_factor", 4) == 4
    by_tokens = make_spec(
        CPUOffloadingSpec, model, {**extra, "blocks_per_chunk": None, "block_size": 128}
    )
    assert by_tokens.blocks_per_chunk == 4


def test_start_up_error_names_cpu_bytes_to_use(model: Path) -> None:
    from kvtier.tiering_spec import CPUOffloadingSpec
    from kvtier.tiering_spec.config import ConfigError

    with pytest.raises(ConfigError, match="cpu_bytes_to_use is required"):
        make_spec(CPUOffloadingSpec, model, {})
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        make_spec(CPUOffloadingSpec, model, {"cpu_bytes_to_use": 100})


def test_declared_metrics_cover_the_excerpts_names(tmp_path: Path) -> None:
    from kvtier.tiering_spec import CPUOffloadingSpec, TieringOffloadingSpec, vllm_compat

    cpu = CPUOffloadingSpec.kvtier_metric_table({"store_threshold": 2})
    for name in (
        "vllm:kv_offload_cpu_cache_usage_perc",
        "vllm:kv_offload_cpu_cache_write_usage_perc",
        "vllm:kv_offload_cpu_cache_read_usage_perc",
        "vllm:kv_offload_cpu_allocation_size",
        "vllm:kv_offload_stores_skipped",
    ):
        assert name in cpu, name
    assert "vllm:kv_offload_stores_skipped" not in CPUOffloadingSpec.kvtier_metric_table({})
    table = TieringOffloadingSpec.kvtier_metric_table({})
    assert table["vllm:kvtier_fs_faults"][2] == ("tier", "kind")
    if vllm_compat.SPEC_METRICS:  # vLLM asks the spec to declare its metrics
        tier = TieringOffloadingSpec.build_metric_definitions({})
        assert set(tier) == set(table)
        assert tier["vllm:kvtier_fs_faults"].labelnames == ("tier", "kind")


def test_tiering_metrics_are_declared_with_vllms_kinds_and_tier_label() -> None:
    """Mirrors vLLM 0.32's ``test_tiering_offloading.py::
    test_tiering_spec_collects_secondary_metric_definitions`` past its first check (a
    metric of a tier type registered with vLLM, which kvtier does not run): vLLM's
    tiering metrics, declared with vLLM's kinds, ``tier`` label and buckets."""
    from kvtier.tiering_spec import TieringOffloadingSpec, metrics, vllm_compat

    table = TieringOffloadingSpec.kvtier_metric_table({"secondary_tiers": [{"type": "fs"}]})
    kinds = {
        metrics.CHUNK_QUERIES: "counter",
        metrics.PROMOTION_JOB_FAILURES: "counter",
        metrics.STORES_DROPPED: "counter",
        metrics.BLOCKS_DROPPED: "counter",
        metrics.STORE_LATENCY_EMA: "gauge",
        metrics.LOOKUP_SYNC_DELAY: "histogram",
        metrics.LOOKUP_ASYNC_DELAY: "histogram",
        metrics.PRIMARY_WRITE_USAGE_PERC: "gauge",
        metrics.PRIMARY_READ_USAGE_PERC: "gauge",
        metrics.ACTIVE_PROMOTION_JOBS: "gauge",
        metrics.ACTIVE_CASCADE_JOBS: "gauge",
        metrics.PROMOTION_ALLOCATION_FAILURES: "counter",
    }
    for name, kind in kinds.items():
        assert table[name].kind == kind, name
        labels = () if name == metrics.PROMOTION_ALLOCATION_FAILURES else ("tier",)
        assert table[name].labels == labels, name
    if not vllm_compat.SPEC_METRICS:
        return
    from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics as Names

    declared = TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": []})
    for name in (
        Names.LOOKUP_SYNC_DELAY,
        Names.LOOKUP_ASYNC_DELAY,
        Names.BACKPRESSURE_STORE_LATENCY_EMA,
        Names.BACKPRESSURE_STORES_DROPPED,
        Names.BACKPRESSURE_BLOCKS_DROPPED,
        Names.CHUNK_QUERIES,
        Names.PROMOTION_JOB_FAILURES,
    ):
        assert declared[name].labelnames == ("tier",), name
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec as VllmTieringSpec

    vllm_tiering = VllmTieringSpec
    theirs = vllm_tiering.build_metric_definitions({"secondary_tiers": []})
    for name in (Names.LOOKUP_SYNC_DELAY, Names.LOOKUP_ASYNC_DELAY):
        assert type(declared[name]) is type(theirs[name])
        assert tuple(declared[name].buckets) == tuple(theirs[name].buckets), name
    for name in (Names.BACKPRESSURE_STORE_LATENCY_EMA, Names.BACKPRESSURE_BLOCKS_DROPPED):
        assert type(declared[name]) is type(theirs[name]), name


def test_manager_through_vllms_interface(model: Path, tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.tiering_spec import TieringOffloadingSpec, vllm_compat
    from kvtier.tiering_spec.manager import Lookup

    miss, hit = vllm_compat.lookup_result(Lookup.MISS), vllm_compat.lookup_result(Lookup.HIT)

    extra = {
        "cpu_bytes_to_use": 4 * 65536,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs")}],
    }
    spec = make_spec(TieringOffloadingSpec, model, extra, kv_events=True)
    mgr = spec.get_manager()
    ctx = ReqContext(req_id="r")
    assert mgr.lookup(b"k" * 36, ctx) is miss
    out = mgr.prepare_store([b"k" * 36], ctx)
    assert out is not None and out.keys_to_store == [b"k" * 36]
    mgr.complete_store(out.keys_to_store, ctx)  # no worker region yet: the write is dropped
    assert mgr.lookup(b"k" * 36, ctx) is hit
    if vllm_compat.SPEC_METRICS:  # vLLM asks the manager for its stats
        assert mgr.get_stats() is not None
    else:  # kvtier's connector collects them
        assert any(name == "vllm:kvtier_host_hits" for _, name, _, _ in mgr.collect_metrics())
    events = list(mgr.take_events())
    assert events and events[0].removed is False
    mgr.shutdown()


def test_store_threshold_filters_the_cpu_specs_stores(model: Path) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.tiering_spec import CPUOffloadingSpec

    spec = make_spec(
        CPUOffloadingSpec, model, {"cpu_bytes_to_use": 4 * 65536, "store_threshold": 2}
    )
    mgr = spec.get_manager()
    ctx = ReqContext(req_id="r")
    key = b"k" * 36
    first = mgr.prepare_store([key], ctx)
    assert first is not None and first.keys_to_store == [], "stored on the first offer"
    second = mgr.prepare_store([key], ctx)
    assert second is not None and second.keys_to_store == [key], "not stored on the second"
    skipped = [v for _, name, v, _ in mgr.collect_metrics() if name.endswith("stores_skipped")]
    assert skipped == [1]
    mgr.shutdown()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_finished_requests_loads_keep_its_prefix_over_older_stores(
    model: Path, policy: str
) -> None:
    # vLLM 0.32 and later never call touch: the manager applies a request's reuse when
    # it finishes. Without that, a hot prefix is evicted as if it had never been used.
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.tiering_spec import CPUOffloadingSpec

    spec = make_spec(
        CPUOffloadingSpec, model, {"cpu_bytes_to_use": 3 * 65536, "eviction_policy": policy}
    )
    mgr = spec.get_manager()
    hot, b, c, d = (bytes([i]) * 36 for i in range(4))

    def store(key: bytes, req: str) -> None:
        out = mgr.prepare_store([key], ReqContext(req_id=req))
        assert out is not None and out.keys_to_store == [key], f"{key[:1]!r} not stored"
        mgr.complete_store([key], ReqContext(req_id=req))

    for i, key in enumerate((hot, b, c)):
        store(key, f"w{i}")
    reader = ReqContext(req_id="reader")
    mgr.prepare_load([hot], reader)
    mgr.complete_load([hot], reader)
    if hasattr(reader, "get_state"):
        mgr.on_request_finished(reader)
    else:  # vLLM before 0.32 touches the keys a request uses itself
        mgr.touch([hot], reader)
    out = mgr.prepare_store([d], ReqContext(req_id="w3"))
    assert out is not None and list(out.evicted_keys) == [b], (
        f"{policy}: evicted {[k[:1] for k in out.evicted_keys]}, expected the oldest unused"
    )
    mgr.shutdown()


@pytest.mark.parametrize(
    "finish_first", [False, True], ids=["stored-then-finished", "finished-first"]
)
@pytest.mark.parametrize("policy", ["lru", "arc", "frecency"])
def test_a_finished_requests_stored_prefix_is_evicted_from_its_tail(
    model: Path, policy: str, finish_first: bool
) -> None:
    # One request stores keys 1-4 of its prompt; another then stores key 5 into the full
    # 4-block tier. The victim must be the tail (key 4), leaving a 3-block prefix usable,
    # as in vLLM 0.32's manager, whether the store completes before or after the finish.
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.tiering_spec import CPUOffloadingSpec

    spec = make_spec(
        CPUOffloadingSpec, model, {"cpu_bytes_to_use": 4 * 65536, "eviction_policy": policy}
    )
    mgr = spec.get_manager()
    k1, k2, k3, k4, k5 = (bytes([i]) * 36 for i in range(1, 6))
    writer = ReqContext(req_id="writer")
    out = mgr.prepare_store([k1, k2, k3, k4], writer)
    assert out is not None and out.keys_to_store == [k1, k2, k3, k4]
    if not hasattr(writer, "get_state"):  # vLLM before 0.32 touches after each store
        mgr.touch([k1, k2, k3, k4], writer)
    if finish_first:
        mgr.on_request_finished(writer)
        mgr.complete_store(out.keys_to_store, writer)
    else:
        mgr.complete_store(out.keys_to_store, writer)
        mgr.on_request_finished(writer)
    out = mgr.prepare_store([k5], ReqContext(req_id="other"))
    assert out is not None and list(out.evicted_keys) == [k4], (
        f"{policy}: evicted {[k[:1] for k in out.evicted_keys]}, expected the tail (4)"
    )
    mgr.shutdown()


class _RecordingMetric:
    """A Prometheus metric class that records what it is given (one per label set)."""

    made: list[_RecordingMetric] = []

    def __init__(self, **kwargs: object) -> None:
        self.name = kwargs.get("name")
        self.labelvalues: tuple[object, ...] = ()
        self.values: list[float] = []
        self.children: list[_RecordingMetric] = []
        _RecordingMetric.made.append(self)

    def labels(self, *labelvalues: object) -> _RecordingMetric:
        child = _RecordingMetric(name=self.name)
        child.labelvalues = labelvalues
        self.children.append(child)
        return child

    def inc(self, value: float) -> None:
        self.values.append(value)

    observe = set = inc


@pytest.mark.parametrize("spec_name", ["KvtierCPUOffloadingSpec", "KvtierTieringOffloadingSpec"])
def test_vllms_deprecated_transfer_metrics_count_kvtiers_specs(spec_name: str) -> None:
    """vLLM keeps vllm:kv_offload_total_bytes and its siblings for its CPUOffloadingSpec
    and subclasses only: kvtier's specs, which answer that name, must count too."""
    from types import SimpleNamespace

    from prometheus_client import Counter, Gauge, Histogram

    metrics = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics")
    if not hasattr(metrics, "OffloadPromMetrics") or not hasattr(metrics, "_TransferMetricName"):
        pytest.skip("this vLLM has no deprecated transfer metrics")
    from kvtier.tiering_spec import vllm_adapter

    plugin.register()
    extra = {"spec_name": spec_name, "cpu_bytes_to_use": 1 << 20}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    types = {t: _RecordingMetric for t in (Counter, Gauge, Histogram)}
    _RecordingMetric.made = []
    prom = metrics.OffloadPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})
    load_bytes = metrics._TransferMetricName.LOAD_BYTES
    prom.observe(
        {
            metrics._StatsKey.TYPES: {load_bytes: metrics._MetricType.COUNTER},
            metrics._StatsKey.DATA: {load_bytes: {(): 4096}},
        }
    )
    deprecated = [
        m for m in _RecordingMetric.made if m.name == "vllm:kv_offload_total_bytes" and m.values
    ]
    assert [m.values for m in deprecated] == [[4096]], "the deprecated metric stayed silent"
    vllm_cpu_spec = pytest.importorskip("vllm.v1.kv_offload.cpu.spec")
    assert issubclass(vllm_adapter.CPUOffloadingSpec, vllm_cpu_spec.CPUOffloadingSpec)
    assert vllm_adapter.CPUOffloadingSpec.__mro__[1:] == vllm_adapter._KvtierSpec.__mro__, (
        "nothing of vLLM's class is inherited"
    )


@pytest.mark.parametrize("spec_name", ["CPUOffloadingSpec", "TieringOffloadingSpec"])
def test_config_info_publishes_the_host_tiers_sizing(
    model: Path, tmp_path: Path, spec_name: str
) -> None:
    """vLLM 0.33's info metric (``vllm:kv_offload_config_info``): the labels the spec
    declares are the ones the manager fills, with the host tier's chunks, bytes in every
    copy and tokens at the model's longest length, as vLLM's CPU spec reckons them."""
    import kvtier.tiering_spec as ts

    from .vllm_configs import spec_without_engine

    cls = getattr(ts, spec_name)
    extra: dict[str, object] = {"cpu_bytes_to_use": 8 * 65536, "blocks_per_chunk": 2}
    if spec_name == "TieringOffloadingSpec":
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": str(tmp_path / "fs")}]
    spec = spec_without_engine(cls, model, extra, world_size=2)
    rows = spec.get_manager().config_info()
    keys = cls.config_info_keys(extra)
    host = rows[0]
    assert set(host) == set(keys)
    assert spec.kv_bytes_per_chunk == 2 * 2 * 65536, "two blocks a chunk, two copies"
    assert host["cpu_num_chunks"] == spec.num_chunks == 2
    assert host["cpu_blocks_per_chunk"] == 2
    assert host["cpu_kv_cache_size_bytes"] == 2 * spec.kv_bytes_per_chunk
    length = int(getattr(spec.config.model, "max_model_len", 0) or 0)
    per_request = -(-length // (32 * 2)) if length else 0
    expected = 2 * length // per_request if per_request else "None"
    assert host["cpu_kv_cache_size_tokens"] == expected
    if spec_name == "TieringOffloadingSpec":
        assert "tier" in keys and [r["tier"] for r in rows] == ["CPU", "fs"]
    else:
        assert "tier" not in keys and len(rows) == 1


def test_a_failed_store_is_a_metadata_only_removal_where_vllm_has_them(model: Path) -> None:
    """vLLM 0.33's manager reports a failed store as a metadata-only removal (its KV-event
    tracker then forgets what it noted for the keys), pruned of keys a retry stored
    again, and hands over every event of a call at once."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.tiering_spec import CPUOffloadingSpec, vllm_compat

    from .vllm_configs import spec_without_engine

    spec = spec_without_engine(CPUOffloadingSpec, model, {"cpu_bytes_to_use": 4 * 65536},
                               kv_events=True)  # fmt: skip
    mgr = spec.get_manager()
    ctx = ReqContext(req_id="r")
    k1, k2, k3 = (bytes([i]) * 36 for i in (1, 2, 3))
    assert mgr.prepare_store([k1, k2], ctx) is not None
    mgr.complete_store([k1, k2], ctx, success=False)
    assert mgr.prepare_store([k1], ctx) is not None  # a retry owns k1 again
    assert mgr.prepare_store([k3], ctx) is not None
    mgr.complete_store([k3], ctx)
    drain = iter(mgr.take_events())
    if not vllm_compat.PORT.metadata_only_events:  # before vLLM 0.33: stores only
        assert [e.keys for e in drain] == [[k3]]
        return
    cleanup = next(drain)
    assert cleanup.removed and cleanup.metadata_only and list(cleanup.keys) == [k2]
    assert list(mgr.take_events()) == [], "a drain stopped early leaves nothing queued"
    assert [list(e.keys) for e in drain] == [[k3]]
    assert not any(e.metadata_only for e in mgr.take_events())
