"""The package stands alone: packaging only, no torch, no vLLM, no sibling package."""

import subprocess
import sys
from importlib.metadata import requires


def test_declared_runtime_dependencies_are_packaging_only() -> None:
    runtime = [r for r in requires("kvtier-vllm-port") or [] if "extra ==" not in r]
    names = sorted(r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in runtime)
    assert names == ["packaging"], f"unexpected runtime dependencies: {runtime}"


def test_import_does_not_pull_torch_vllm_or_siblings() -> None:
    code = (
        "import sys, kvtier.vllm_port.plugins\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')"
        " or m.startswith('kvtier.') and not m.startswith('kvtier.vllm_port')]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
