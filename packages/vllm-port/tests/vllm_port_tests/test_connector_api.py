"""What vLLM's connector interface offers, read from vLLM's classes (needs vLLM)."""

from __future__ import annotations

import pytest

from kvtier.vllm_port import connector_api


def _release() -> object:
    vllm = pytest.importorskip("vllm")
    from packaging.version import Version

    return Version(Version(vllm.__version__).base_version)


def test_this_vllms_connector_interface_is_detected() -> None:
    from packaging.version import Version

    release = _release()
    if release >= Version("0.32"):
        assert connector_api.binds_kv_cache_manager()
        assert connector_api.request_level_load_failures()
        results = connector_api.transfer_results({"a"}, {"b"})
        assert results.finished_recving == {"a"} and results.failed_recving == {"b"}
    elif release < Version("0.24"):
        assert not connector_api.binds_kv_cache_manager()
        assert not connector_api.request_level_load_failures()
    else:
        pytest.skip(f"vLLM {release}: either answer is possible")


def test_the_module_imports_without_vllm() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kvtier.vllm_port.connector_api\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm']\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
