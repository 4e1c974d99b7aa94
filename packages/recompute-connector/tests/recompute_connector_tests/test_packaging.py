"""Packaging: siblings as ranges, vLLM only as an extra, no vLLM import at package import."""

import subprocess
import sys
from importlib.metadata import requires, version


def test_vllm_is_an_extra_and_siblings_are_ranges() -> None:
    from packaging.requirements import Requirement

    reqs = requires("kvtier-recompute-connector") or []
    runtime = [r for r in reqs if "extra ==" not in r]
    pins = {req.name: req.specifier for req in map(Requirement, runtime)}
    for sibling in ("kvtier-blockpool", "kvtier-npu-copy", "kvtier-vllm-port"):
        spec = pins.get(sibling)
        assert spec is not None, f"{sibling} is not a dependency: {runtime}"
        assert {s.operator for s in spec} == {">=", "<"}, f"{sibling}{spec} is not a range"
        assert spec.contains(version(sibling)), f"{sibling} {version(sibling)} not in {spec}"
    assert not any(r.startswith("vllm") for r in runtime), "vLLM must not be a hard dependency"
    assert any(r.startswith("vllm") and "extra ==" in r and "vllm" in r.split(";")[1] for r in reqs)


def test_import_does_not_pull_vllm() -> None:
    code = (
        "import sys, kvtier.recompute_connector\n"
        "from kvtier.recompute_connector import plugin, state, worker, config, protocol\n"
        "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
        "assert not bad, bad[:5]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_kvtier_is_a_namespace_package() -> None:
    import kvtier
    import kvtier.recompute_connector

    assert getattr(kvtier, "__file__", None) is None, "kvtier must not ship an __init__.py"
    assert kvtier.recompute_connector.__version__
