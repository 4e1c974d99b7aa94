"""Wheel build hook: compiles the CPU backend's piece copier into a platform wheel.

A wheel built here holds ``kvtier/npu_copy/_native/copy_pieces.so`` and is tagged
``py3-none-<platform>`` (for example ``py3-none-linux_x86_64``; auditwheel, as run by
cibuildwheel, renames it to a manylinux tag): the library does not link libpython, so one
wheel serves every Python 3 on that platform. It is compiled with the command the
run-time build uses (``kvtier.npu_copy.native.compile_library``: ``$CC``, else ``cc`` or
``gcc``, with ``native.CFLAGS``).

Editable installs and sdists get no library: the run-time build covers them. Without a
working compiler the hook warns and builds a pure ``py3-none-any`` wheel (users then get
the run-time build or the portable path), unless ``KVTIER_REQUIRE_NATIVE_BUILD=1``, which
makes it an error; CI and release builds set it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

REQUIRE = "KVTIER_REQUIRE_NATIVE_BUILD"
IN_WHEEL = "kvtier/npu_copy/_native/"


def _native_module(root: str) -> ModuleType:
    """``kvtier.npu_copy.native`` loaded by path: it imports only the standard library,
    while importing the package would need torch at build time."""
    path = Path(root) / "src" / "kvtier" / "npu_copy" / "native.py"
    spec = importlib.util.spec_from_file_location("_kvtier_npu_copy_native_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def platform_tag() -> str:
    """This interpreter's platform as a wheel tag, e.g. ``linux_x86_64``, ``linux_aarch64``."""
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


class NativeCopierBuildHook(BuildHookInterface):
    """Adds the compiled copier to wheels (not editable ones) and tags them per platform."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        native = _native_module(self.root)
        self._tmp = tempfile.mkdtemp(prefix="kvtier-native-")
        library = Path(self._tmp) / native.PREBUILT.name
        try:
            cc = native.compiler()
            if cc is None:
                raise RuntimeError("no C compiler found (set CC, or install cc or gcc)")
            native.compile_library(cc, library)
        except RuntimeError as exc:
            shutil.rmtree(self._tmp, ignore_errors=True)
            if os.environ.get(REQUIRE) == "1":
                raise RuntimeError(f"kvtier-npu-copy: {exc}; {REQUIRE}=1 requires it") from exc
            self.app.display_warning(
                f"kvtier-npu-copy: {exc}; building a pure wheel without the compiled copier "
                "(it is built at run time where a compiler exists)"
            )
            return
        build_data["force_include"][str(library)] = IN_WHEEL + library.name
        build_data["pure_python"] = False
        build_data["tag"] = f"py3-none-{platform_tag()}"
        self.app.display_info(f"kvtier-npu-copy: compiled {IN_WHEEL}{library.name} with {cc}")

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
