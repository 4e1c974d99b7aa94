"""Which copier library loads: the one a wheel ships, else a run-time build that processes
starting together compile once, under a key that changes with everything it depends on."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import pytest

from kvtier.npu_copy import native

needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler here")

REQUIRE_PREBUILT = "KVTIER_REQUIRE_PREBUILT"


def _compile(tmp_path: Path, name: str, text: str) -> Path:
    """A shared library from C ``text``, at ``tmp_path/name``."""
    cc = native.compiler()
    assert cc is not None
    src = tmp_path / (name + ".c")
    src.write_text(text)
    out = tmp_path / name
    subprocess.run([*cc.split(), *native.CFLAGS, "-o", str(out), str(src)], check=True)
    return out


def _fake_cc(tmp_path: Path, version: str = "fakecc 1.0", delay_s: float = 0.0) -> Path:
    """A compiler wrapper that logs each call to ``calls.log``, answers ``--version`` with
    ``version``, and otherwise sleeps ``delay_s`` seconds and runs the real compiler."""
    real = native.compiler()
    assert real is not None
    script = tmp_path / "fakecc"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> "{tmp_path / "calls.log"}"\n'
        f'if [ "$1" = --version ]; then echo "{version}"; exit 0; fi\n'
        f"sleep {delay_s}\n"
        f'exec {real} "$@"\n'
    )
    script.chmod(0o755)
    return script


def _compile_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [line for line in lines if line != "--version"]


@needs_cc
def test_the_shipped_library_is_loaded_before_any_build(fresh_native, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped.so"
    native.compile_library(native.compiler() or "cc", shipped)
    monkeypatch.setattr(native, "PREBUILT", shipped)
    monkeypatch.setenv("CC", str(_fake_cc(tmp_path)))
    assert native.load() is not None
    assert (native.source(), native.library_file()) == ("prebuilt", shipped)
    assert _compile_calls(tmp_path) == [], "a shipped library was there, yet it compiled"
    assert not (tmp_path / "cache").exists(), "a shipped library was there, yet it cached"


@needs_cc
def test_a_shipped_library_of_another_abi_falls_back_to_a_build(
    fresh_native, tmp_path, monkeypatch, caplog
) -> None:
    stale = _compile(tmp_path, "stale.so", "int kvtier_copy_abi_version(void) { return 999; }\n")
    monkeypatch.setattr(native, "PREBUILT", stale)
    with caplog.at_level(logging.WARNING, logger="kvtier.npu_copy.native"):
        assert native.load() is not None
    assert "cannot be used" in caplog.text
    assert native.source() == "built"
    assert native.library_file() == native.library_path(native.compiler() or "cc")


_LOAD_IN_A_PROCESS = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("native_under_test", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
mod.PREBUILT = Path(sys.argv[2])  # as in a source install
print(mod.load() is not None, mod.source())
"""


@needs_cc
def test_processes_starting_together_compile_once(tmp_path) -> None:
    """Eight tensor-parallel workers' first use: one compiles, the others wait for it."""
    cc = _fake_cc(tmp_path, delay_s=1.0)  # a slow compile: every process arrives during it
    env = {**os.environ, "CC": str(cc), "KVTIER_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("KVTIER_NATIVE_COPY", None)
    # native.py imports only the standard library: load it alone, without torch.
    argv = [sys.executable, "-c", _LOAD_IN_A_PROCESS, native.__file__, str(tmp_path / "none")]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) for _ in range(8)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outputs == ["True built"] * 8
    calls = _compile_calls(tmp_path)
    assert len(calls) == 1, f"8 processes compiled {len(calls)} times: {calls}"


Change = Callable[[pytest.MonkeyPatch, Path], None]


def _new_compiler_version(monkeypatch: pytest.MonkeyPatch, cc: Path) -> None:
    _fake_cc(cc.parent, version="fakecc 2.0")  # same command, another compiler release


def _new_flags(monkeypatch: pytest.MonkeyPatch, cc: Path) -> None:
    monkeypatch.setattr(native, "CFLAGS", (*native.CFLAGS, "-g"))


def _new_abi(monkeypatch: pytest.MonkeyPatch, cc: Path) -> None:
    monkeypatch.setattr(native, "ABI_VERSION", native.ABI_VERSION + 1)


def _new_source(monkeypatch: pytest.MonkeyPatch, cc: Path) -> None:
    edited = cc.parent / "edited.c"
    edited.write_text(native.C_SOURCE.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(native, "C_SOURCE", edited)


@needs_cc
@pytest.mark.parametrize(
    "change",
    [_new_compiler_version, _new_flags, _new_abi, _new_source],
    ids=["compiler-version", "flags", "abi-version", "source"],
)
def test_the_cache_key_changes_with(change: Change, fresh_native, tmp_path, monkeypatch) -> None:
    cc = _fake_cc(tmp_path)
    before = native.library_path(str(cc))
    change(monkeypatch, cc)
    assert native.library_path(str(cc)) != before, "a stale build would be loaded"


def test_a_compiler_that_cannot_say_its_version_is_not_used(fresh_native, monkeypatch):
    monkeypatch.setenv("CC", "false")
    assert native.load() is None
    assert native.source() == "none"


@pytest.mark.skipif(
    os.environ.get(REQUIRE_PREBUILT) != "1",
    reason=f"checks an installed platform wheel; set {REQUIRE_PREBUILT}=1 to require it",
)
def test_the_installed_wheel_ships_the_library_that_loads(monkeypatch) -> None:
    monkeypatch.delenv("KVTIER_NATIVE_COPY", raising=False)
    native.reset_for_tests()
    try:
        assert native.source() == "prebuilt", (
            f"{REQUIRE_PREBUILT}=1, but the copier came from {native.source()!r} "
            f"({native.library_file()}): the installed package ships no usable library"
        )
        loaded = native.library_file()
        shipped = [
            Path(str(f.locate())).resolve()
            for f in metadata.files("kvtier-npu-copy") or []
            if f.name == native.PREBUILT.name
        ]
        assert loaded is not None and shipped == [loaded.resolve()], (
            f"loaded {loaded}, but the installed distribution records {shipped}"
        )
    finally:
        native.reset_for_tests()
