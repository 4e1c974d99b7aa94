"""kvtier's plugin convention, without vLLM: version gate, switches, registration."""

from __future__ import annotations

import logging

import pytest
from packaging.specifiers import SpecifierSet

from kvtier.vllm_port import plugins as glue

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


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, True),
        ({"KVTIER_UPSTREAM_NAMES": "0"}, False),
        ({"KVTIER_OLD": "0"}, False),
        ({"KVTIER_UPSTREAM_NAMES": "1", "KVTIER_OLD": "0"}, True),
        ({"KVTIER_UPSTREAM_NAMES": "", "KVTIER_OLD": "off"}, False),
    ],
)
def test_one_switch_decides_upstream_names_and_the_old_one_still_counts(
    env: dict[str, str], expected: bool
) -> None:
    assert glue.upstream_names(True, LOG, deprecated="KVTIER_OLD", environ=env) is expected


def test_the_deprecated_switch_says_which_replaces_it(caplog: pytest.LogCaptureFixture) -> None:
    glue._WARNED.discard("KVTIER_OLDER")
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        for _ in range(2):
            assert glue.upstream_names(False, LOG, deprecated="KVTIER_OLDER", environ={
                "KVTIER_OLDER": "1"
            })  # fmt: skip
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "KVTIER_OLDER" in said[0] and "KVTIER_UPSTREAM_NAMES" in said[0]


def make_factory() -> type:
    """vLLM's factories' shape: a registry and a register method refusing duplicates."""

    class Factory:
        _registry: dict = {}

        @classmethod
        def register(cls, name: str, module_path: str, class_name: str) -> None:
            if name in cls._registry:
                raise ValueError(f"{name} is already registered")

            def load() -> tuple[str, str]:
                return module_path, class_name

            cls._registry[name] = load

    return Factory


def test_names_are_registered_through_the_factorys_own_method() -> None:
    factory = make_factory()
    method = factory.__dict__["register"]
    factory.register("Theirs", "other.plugin", "Theirs")
    theirs = factory._registry["Theirs"]
    assert glue.register_name(factory, "register", "Mine", "kvtier.x", "Mine", take=True) == (
        glue.REGISTERED
    )
    assert glue.register_name(factory, "register", "Mine", "kvtier.x", "Mine", take=True) == (
        glue.KEPT
    )
    assert glue.is_ours(factory, "Mine") and not glue.is_ours(factory, "Theirs")
    assert glue.register_name(factory, "register", "Theirs", "kvtier.x", "T", take=False) == (
        glue.LEFT
    )
    assert factory._registry["Theirs"] is theirs
    assert glue.register_name(factory, "register", "Theirs", "kvtier.x", "T", take=True) == (
        glue.REPLACED
    )
    assert factory._registry["Theirs"]() == ("kvtier.x", "T")
    # The factory is used, never patched: its method is the one it was built with.
    assert factory.__dict__["register"] is method
    with pytest.raises(ValueError):
        factory.register("Mine", "other.plugin", "Mine")  # vLLM's duplicate check stands


def test_an_entry_replaced_by_another_plugin_is_no_longer_ours() -> None:
    factory = make_factory()
    glue.register_name(factory, "register", "Seed", "kvtier.x", "Seed", take=True)
    factory._registry.pop("Seed")
    factory.register("Seed", "other.plugin", "SeedV1")
    assert not glue.is_ours(factory, "Seed")
    assert glue.register_name(factory, "register", "Seed", "kvtier.x", "Seed", take=False) == (
        glue.LEFT
    )


def test_installed_finds_modules_without_importing_them() -> None:
    assert glue.installed("json")
    assert not glue.installed("kvtier_no_such_module")
    assert not glue.installed("kvtier_no_such_package.sub")
