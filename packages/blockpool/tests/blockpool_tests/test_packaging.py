"""The package stands alone: torch only, no vLLM, no sibling package."""

import subprocess
import sys
from importlib.metadata import requires


def test_declared_runtime_dependencies_are_torch_only() -> None:
    runtime = [r for r in requires("kvtier-blockpool") or [] if "extra ==" not in r]
    names = sorted(r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in runtime)
    assert names == ["torch"], f"unexpected runtime dependencies: {runtime}"


def test_import_does_not_pull_vllm_or_siblings() -> None:
    code = (
        "import sys, kvtier.blockpool, kvtier.blockpool.bench\n"
        "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')"
        " or m.startswith('kvtier.') and not m.startswith('kvtier.blockpool')]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_kvtier_is_a_namespace_package() -> None:
    import kvtier
    import kvtier.blockpool

    assert getattr(kvtier, "__file__", None) is None, "kvtier must not ship an __init__.py"
    assert kvtier.blockpool.__version__
