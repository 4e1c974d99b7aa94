"""pytest fixtures for engine tests. pytest loads this module through kvtier-testkit's
``pytest11`` entry point wherever the package is installed (the entry point's name is
the module's, so a ``pytest_plugins = ["kvtier.testkit.pytest_plugin"]`` elsewhere finds
it registered already).

Fixtures (session-scoped, made once per test session and cached on disk across
sessions, see :func:`kvtier.testkit.default_model_root`):

* ``tiny_model``: folder of the default tiny Llama (2 layers, hidden 128);
* ``tiny_sliding_window_model``: the same as a Mistral with a 64-token sliding window;
* ``tiny_hybrid_model``: a Qwen3-Next of linear and full attention layers.

Marker ``requires_vllm`` (registered here; or use ``kvtier.testkit.requires_vllm``, a
plain ``skipif``) skips a test where vLLM cannot be imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.testkit import make_tiny_hybrid, make_tiny_llama, vllm_available


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "requires_vllm: skipped where vLLM is not installed")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if vllm_available():
        return
    skip = pytest.mark.skip(reason="vLLM is not installed here")
    for item in items:
        if "requires_vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Folder of the default tiny Llama (see :func:`kvtier.testkit.make_tiny_llama`)."""
    return make_tiny_llama()


@pytest.fixture(scope="session")
def tiny_sliding_window_model() -> Path:
    """Folder of a tiny Mistral with a 64-token sliding window."""
    return make_tiny_llama(sliding_window=64)


@pytest.fixture(scope="session")
def tiny_hybrid_model() -> Path:
    """Folder of a tiny hybrid Qwen3-Next (see :func:`kvtier.testkit.make_tiny_hybrid`)."""
    return make_tiny_hybrid()
