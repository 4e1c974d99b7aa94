"""Registration through vLLM's plugin entry point: idempotent, never raising.

Each registration runs in a process of its own, forked from one that has imported vLLM
and nothing of kvtier (``run_python``): the state under test, vLLM's factories and
kvtier's plugin, is as new in each as in a new interpreter."""

from __future__ import annotations

import logging
import sys
from importlib.metadata import entry_points
from typing import Any

import pytest

from kvtier.recompute_connector import plugin
from kvtier.testkit import requires_vllm, run_python, script_env


def test_entry_point_is_declared_for_vllm_general_plugins() -> None:
    eps = [
        ep
        for ep in entry_points(group="vllm.general_plugins")
        if ep.value.startswith("kvtier.recompute_connector")
    ]
    assert [ep.value for ep in eps] == ["kvtier.recompute_connector.plugin:register"]


@requires_vllm
def test_register_twice_is_fine_and_the_factory_knows_the_connector() -> None:
    code = (
        "from kvtier.recompute_connector import register\n"
        "assert register() and register()\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "cls = KVConnectorFactory.get_connector_class_by_name('RecomputeCPUOffloadConnector')\n"
        "assert cls.__name__ == 'RecomputeCPUOffloadConnector', cls\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]


def test_unsupported_vllm_is_one_log_line_and_no_registration(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import types

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.8.5"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(plugin._state, "registered", False)
    with caplog.at_level(logging.WARNING):
        assert plugin.register() is False
    lines = [r.getMessage() for r in caplog.records if "0.8.5" in r.getMessage()]
    from kvtier.vllm_port.plugins import declared_vllm_range

    assert len(lines) == 1 and str(declared_vllm_range(plugin.DISTRIBUTION)) in lines[0], lines


def test_broken_vllm_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    monkeypatch.setitem(plugin._state, "registered", False)
    assert plugin.register() is False


# ------------------------------------------------------------------ beside vllm-ascend

COEXIST = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from recompute_connector_tests import ascend_standin
from kvtier.recompute_connector import plugin
# The stand-in plays vllm-ascend: an installed plugin with a connector of that name.
plugin.OTHER_PROVIDERS = {providers!r}
order = {order!r}
for name in order.split(","):
    (plugin.register if name == "kvtier" else ascend_standin.register)()
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F
for name in ("RecomputeCPUOffloadConnector", "KvtierRecomputeCPUOffloadConnector",
             "MultiConnector", "MooncakeConnectorV1"):
    try:
        print(name, F.get_connector_class_by_name(name).__module__)
    except ValueError:  # not registered
        print(name, "-")
"""
STANDIN = ("recompute_connector_tests.ascend_standin",)
KVTIER = "kvtier.recompute_connector.connector"


def coexist(
    order: str, providers: tuple[str, ...] = STANDIN, **env: str
) -> tuple[dict[str, str], str]:
    result = run_python(
        COEXIST.format(order=order, providers=providers), script_env(__file__, env), timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # vLLM's logging setup may print log lines to stdout as well.
    rows = [line.split() for line in result.stdout.splitlines()]
    classes = {r[0]: r[1] for r in rows if len(r) == 2 and "Connector" in r[0]}
    return classes, result.stdout + result.stderr


def said_about_the_name(log: str) -> list[str]:
    marks = ("kvtier: RecomputeCPUOffloadConnector left", "kvtier: RecomputeCPUOffloadConnector is")
    return [line for line in log.splitlines() if any(m in line for m in marks)]


@requires_vllm
@pytest.mark.parametrize("order", ["kvtier,ascend", "ascend,kvtier"])
def test_beside_vllm_ascend_the_guides_name_stays_vllm_ascends_in_either_order(
    order: str,
) -> None:
    """vllm-ascend has a connector of its own under the guide's name: kvtier registers
    its alias only, and vLLM's factory keeps refusing duplicates (nothing patched)."""
    classes, log = coexist(order)
    assert classes["RecomputeCPUOffloadConnector"].endswith("ascend_standin")
    assert classes["KvtierRecomputeCPUOffloadConnector"] == KVTIER
    # vllm-ascend's other registrations are untouched.
    assert classes["MultiConnector"].endswith("ascend_standin")
    assert classes["MooncakeConnectorV1"].endswith("ascend_standin")
    said = said_about_the_name(log)
    assert len(said) == 1 and "KVTIER_UPSTREAM_NAMES=1" in said[0], said


@requires_vllm
def test_the_switch_takes_the_name_from_vllm_ascend_when_it_registered_first() -> None:
    classes, log = coexist("ascend,kvtier", KVTIER_UPSTREAM_NAMES="1")
    assert classes["RecomputeCPUOffloadConnector"] == KVTIER
    assert classes["MultiConnector"].endswith("ascend_standin")
    said = said_about_the_name(log)
    assert len(said) == 1 and "KVTIER_UPSTREAM_NAMES=0" in said[0], said


@requires_vllm
def test_the_switch_never_makes_a_later_vllm_ascend_registration_fail() -> None:
    """vllm-ascend's plugin registers the name after kvtier's: taking it first would
    make vLLM stop in vllm-ascend's plugin, so kvtier leaves it and says so."""
    classes, log = coexist("kvtier,ascend", KVTIER_UPSTREAM_NAMES="1")
    assert classes["RecomputeCPUOffloadConnector"].endswith("ascend_standin")
    assert classes["KvtierRecomputeCPUOffloadConnector"] == KVTIER
    said = said_about_the_name(log)
    assert len(said) == 1 and "KvtierRecomputeCPUOffloadConnector" in said[0], said


@requires_vllm
def test_without_another_provider_the_guides_name_is_kvtiers_unless_switched_off() -> None:
    classes, _ = coexist("kvtier", providers=())
    assert classes["RecomputeCPUOffloadConnector"] == KVTIER
    classes, _ = coexist("kvtier", providers=(), KVTIER_UPSTREAM_NAMES="0")
    assert classes["RecomputeCPUOffloadConnector"] == "-"
    assert classes["KvtierRecomputeCPUOffloadConnector"] == KVTIER


@requires_vllm
def test_the_earlier_switch_name_still_counts_with_a_warning() -> None:
    classes, log = coexist("kvtier", providers=(), KVTIER_OVERRIDE_RECOMPUTE_CONNECTOR="0")
    assert classes["RecomputeCPUOffloadConnector"] == "-"
    assert "KVTIER_OVERRIDE_RECOMPUTE_CONNECTOR is deprecated" in log


@requires_vllm
def test_the_connector_sets_the_policy_on_its_own_configuration_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Standing alone, the connector's configuration is the one vLLM's scheduler reads;
    inside MultiConnector it is a private copy, and the top-level policy governs (the
    connector reads no caller's state to find it)."""
    from types import SimpleNamespace

    from kvtier.recompute_connector.connector import _recompute_failed_restores

    def config(policy: str) -> Any:
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(
                kv_load_failure_policy=policy, kv_connector="RecomputeCPUOffloadConnector"
            )
        )

    own = config("fail")
    with caplog.at_level(logging.INFO, logger="vllm.kvtier.recompute_connector"):
        _recompute_failed_restores(own)
    assert own.kv_transfer_config.kv_load_failure_policy == "recompute"
    said = [r.getMessage() for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
    assert len(said) == 1 and "top-level" in said[0], said
    caplog.clear()
    kept = config("recompute")
    with caplog.at_level(logging.INFO, logger="vllm.kvtier.recompute_connector"):
        _recompute_failed_restores(kept)
    assert kept.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert not [r for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
