"""kvtier's ``OffloadingConnector`` hands its spec the engine's facts as an argument.

vLLM 0.26 and later build a spec from an ``OffloadingConfig`` alone, inside vLLM's
connector constructor. kvtier's connector has the port run that constructor's steps,
building a kvtier spec with the facts (``engine_facts=``); these tests build both
connectors from the same configs, without an engine.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from .vllm_configs import engine_configs

pytest.importorskip("vllm")

EXTRA = {
    "cpu_bytes_to_use": 8 * 65536,
    "spec_name": "KvtierCPUOffloadingSpec",
    "spec_module_path": "kvtier.tiering_spec.vllm_adapter",
}


@pytest.fixture(scope="module")
def model() -> Path:
    testkit = pytest.importorskip("kvtier.testkit")
    return testkit.make_tiny_llama()  # type: ignore[no-any-return]


def _build(cls: type, model: Path, role_name: str, extra: dict[str, Any] = EXTRA) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    vllm_config, kv_cache_config = engine_configs(model, dict(extra))
    return cls(vllm_config, getattr(KVConnectorRole, role_name), kv_cache_config)


def _engine(side: Any) -> Any:
    """The engine facts kvtier's build was given, on a scheduler or worker side."""
    offload = side.manager.side.offload if hasattr(side, "manager") else side.spec.offload
    return offload.facts.engine


def _vllms_connector() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    return OffloadingConnector


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_the_spec_is_built_with_the_engines_facts_and_vllms_parts(model: Path, role: str) -> None:
    from kvtier.tiering_spec.connector import OffloadingConnector
    from kvtier.tiering_spec.vllm_manager import KvtierOffloadingManager

    ours = _build(OffloadingConnector, model, role)
    theirs = _build(_vllms_connector(), model, role)
    side = ours.connector_scheduler if role == "SCHEDULER" else ours.connector_worker
    other = theirs.connector_scheduler if role == "SCHEDULER" else theirs.connector_worker
    assert type(side) is type(other), "vLLM's own scheduler or worker side, built the same"
    # Everything vLLM's constructor sets, kvtier's sets too.
    assert set(vars(theirs)) <= set(vars(ours))
    engine = _engine(side)
    assert engine is not None, "kvtier's connector hands the spec the engine's facts"
    assert engine.model.name == str(model)
    if role == "SCHEDULER":
        assert isinstance(side.manager, KvtierOffloadingManager)
    from kvtier.tiering_spec import vllm_compat

    if vllm_compat.CONFIG_API:
        # vLLM's connector hands a spec only the OffloadingConfig: no facts.
        assert _engine(other) is None


def _plain_spec() -> type:
    """vLLM's own CPU spec under a name of this module's (kvtier's plugin registers
    vLLM's spec names to kvtier's classes)."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    return CPUOffloadingSpec


def __getattr__(name: str) -> Any:  # spec_module_path = this module
    if name == "PlainCPUSpec":
        return _plain_spec()
    raise AttributeError(name)


def test_another_spec_is_built_by_vllms_factory(model: Path) -> None:
    """With vLLM's own CPU spec, kvtier's connector is vLLM's connector unchanged."""
    from kvtier.tiering_spec.connector import OffloadingConnector
    from kvtier.tiering_spec.vllm_manager import KvtierOffloadingManager

    extra = {"cpu_bytes_to_use": 8 * 65536, "spec_name": "PlainCPUSpec"}
    extra["spec_module_path"] = __name__
    ours = _build(OffloadingConnector, model, "SCHEDULER", extra)
    theirs = _build(_vllms_connector(), model, "SCHEDULER", extra)
    manager = ours.connector_scheduler.manager
    assert type(manager) is type(theirs.connector_scheduler.manager)
    assert not isinstance(manager, KvtierOffloadingManager), "vLLM's own manager"
    assert set(vars(theirs)) <= set(vars(ours))
    worker = _build(OffloadingConnector, model, "WORKER", extra).connector_worker
    assert type(worker.spec) is _plain_spec()


def test_a_constructor_the_port_does_not_know_runs_as_vllms(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM whose connector constructor does more than the port's steps: vLLM's own
    constructor runs, and the spec has no facts (its fs fingerprint is unverified)."""
    from kvtier.tiering_spec import vllm_compat
    from kvtier.tiering_spec.connector import OffloadingConnector

    if not vllm_compat.CONFIG_API:
        pytest.skip("vLLM before 0.26 hands the spec the engine's configs themselves")
    from kvtier.vllm_port import gen_offloading

    monkeypatch.setattr(
        gen_offloading, "CONNECTOR_INIT_NAMES", gen_offloading.CONNECTOR_INIT_NAMES - {"WORKER"}
    )
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm_port"):
        ours = _build(OffloadingConnector, model, "SCHEDULER")
    assert "does not know (WORKER)" in caplog.text
    assert "fingerprint is unverified" in caplog.text
    assert _engine(ours.connector_scheduler) is None
