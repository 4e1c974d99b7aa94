"""Registration through vLLM's plugin entry point: idempotent, never raising."""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from kvtier.recompute_connector import plugin
from kvtier.testkit import requires_vllm


def test_entry_point_is_declared_for_vllm_general_plugins() -> None:
    eps = [
        ep
        for ep in entry_points(group="vllm.general_plugins")
        if ep.value.startswith("kvtier.recompute_connector")
    ]
    assert [ep.value for ep in eps] == ["kvtier.recompute_connector.plugin:register"]


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("0.32.0", (0, 32)), ("0.32.0+cpu", (0, 32)), ("1.0", (1, 0)), ("dev", None), ("", None)],
)
def test_version_parsing(text: str, parsed) -> None:
    assert plugin.parse_version(text) == parsed


@requires_vllm
def test_register_twice_is_fine_and_the_factory_knows_the_connector() -> None:
    code = (
        "from kvtier.recompute_connector import register\n"
        "assert register() and register()\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "cls = KVConnectorFactory.get_connector_class_by_name('RecomputeCPUOffloadConnector')\n"
        "assert cls.__name__ == 'RecomputeCPUOffloadConnector', cls\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_unsupported_vllm_is_one_log_line_and_no_registration(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import types

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.8.5"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(plugin, "_registered", False)
    with caplog.at_level(logging.WARNING):
        assert plugin.register() is False
    lines = [r for r in caplog.records if "not supported" in r.getMessage()]
    assert len(lines) == 1 and "0.8.5" in lines[0].getMessage()


def test_broken_vllm_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    monkeypatch.setattr(plugin, "_registered", False)
    assert plugin.register() is False
