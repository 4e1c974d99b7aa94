"""Fixtures shared by the native copier's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.npu_copy import native


@pytest.fixture
def fresh_native(tmp_path, monkeypatch) -> Iterator[None]:
    """An empty library cache, no shipped library (as in a source install) and no
    remembered load, before and after the test."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "PREBUILT", tmp_path / "not-shipped" / "copy_pieces.so")
    native.reset_for_tests()
    yield
    native.reset_for_tests()
