"""kvtier's plugin convention, without vLLM: version gate, switches, registry claims."""

from __future__ import annotations

import logging

import pytest
from packaging.specifiers import SpecifierSet

from kvtier.blockpool import plugin_glue as glue

LOG = logging.getLogger("kvtier.test.glue")


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.23.0", True),
        ("0.32.0+cpu", True),
        ("0.33.0rc1", True),
        ("0.33.1", True),
        ("0.22.9", False),
        ("0.34.0", False),
        ("0.34.0.dev12+g1234", False),
        ("dev", False),
        ("", False),
    ],
)
def test_version_gate_compares_release_numbers(version: str, ok: bool) -> None:
    assert glue.vllm_supported(version, SpecifierSet(">=0.23,<0.34")) is ok


def test_range_comes_from_the_vllm_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = [
        "torch>=2.6",
        'vllm>=0.23,<0.34; extra == "vllm"',
        'kvtier-testkit<0.2,>=0.1; extra == "test"',
    ]
    monkeypatch.setattr(glue.importlib.metadata, "requires", lambda dist: reqs)
    assert glue.declared_vllm_range("kvtier-x") == SpecifierSet(">=0.23,<0.34")


def test_missing_distribution_is_refused_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert not glue.version_gate("kvtier-no-such-dist", "0.32.0", LOG)
    assert len(caplog.records) == 1 and "kvtier-no-such-dist" in caplog.records[0].getMessage()


def test_unsupported_version_names_the_range(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(glue, "declared_vllm_range", lambda dist: SpecifierSet(">=0.23,<0.34"))
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert not glue.version_gate("kvtier-x", "0.22.0", LOG)
        assert glue.version_gate("kvtier-x", "0.23.0", LOG)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "0.22.0" in line and "<0.34" in line and ">=0.23" in line


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, True), ("", True), ("1", True), ("on", True), ("0", False), ("FALSE", False)],
)
def test_env_switch_values(raw: str | None, expected: bool) -> None:
    env = {} if raw is None else {"KVTIER_X": raw}
    assert glue.env_switch("KVTIER_X", True, LOG, env) is expected


def test_env_switch_rejects_other_values_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert glue.env_switch("KVTIER_X", False, LOG, {"KVTIER_X": "maybe"}) is False
    assert "KVTIER_X" in caplog.text and "maybe" in caplog.text


def test_claims() -> None:
    mine = glue.kvtier_loader("collections", "OrderedDict")

    def theirs() -> type:
        return dict

    registry: dict = {"taken": theirs}
    assert glue.claim_name(registry, "free", mine, take=True) == "registered"
    assert glue.claim_name(registry, "free", mine, take=True) == "kept"
    assert glue.claim_name(registry, "taken", mine, take=False) == "left"
    assert registry["taken"] is theirs
    assert glue.claim_name(registry, "taken", mine, take=True) == "replaced"
    assert registry["taken"]().__name__ == "OrderedDict"


class Factory:
    """vLLM's factories' shape: a registry and a register method refusing duplicates."""

    _registry: dict = {}

    @classmethod
    def register(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"{name} is already registered")
        cls._registry[name] = lambda: (module_path, class_name)


def test_guard_skips_later_registrations_of_claimed_names_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    Factory._registry = {}
    glue.claim_name(
        Factory._registry, "Seed", glue.kvtier_loader("collections", "deque"), take=True
    )
    glue.guard_registrations(Factory, "register", Factory._registry, {"Seed"}, LOG, "KVTIER_X")
    glue.guard_registrations(Factory, "register", Factory._registry, {"Seed"}, LOG, "KVTIER_X")
    with caplog.at_level(logging.INFO, logger=LOG.name):
        Factory.register("Seed", "other.plugin", "SeedV1")  # skipped, no raise
        Factory.register("Other", "other.plugin", "Other")
    assert Factory._registry["Seed"]().__name__ == "deque"
    assert Factory._registry["Other"]() == ("other.plugin", "Other")
    assert sum("other.plugin.SeedV1" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError):
        Factory.register("Other", "other.plugin", "Other")  # other duplicates still raise
