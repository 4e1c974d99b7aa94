"""Source rules ruff cannot express, for ``nox -s lint``. Under a package's ``src/``:

* **no stack-frame reads.** Reading frames (``sys._getframe``,
  ``inspect.currentframe``/``stack``, ``f_locals``, ``f_back``) ties kvtier to the names
  of vLLM's locals and callers: a renamed argument upstream silently changes what
  kvtier finds. vLLM's objects are handed over explicitly instead.
* **no class defined under an ``if`` or a ``try``.** What differs between vLLM
  releases lives in a module per interface generation that only that generation
  imports; a class whose existence depends on an import-time branch is invisible to
  readers and type checkers.
* **no vLLM probe outside the port.** Which vLLM runs here is asked of
  ``kvtier.vllm_port.port`` alone: elsewhere in the plugins (``PLUGINS``) no
  ``find_spec("vllm...")``, no ``try`` around an import of vLLM, no ``hasattr`` on a
  name imported from vLLM. (The test kit and the pool's benchmark only ask whether vLLM
  is installed at all.)
* **no factory patches.** vLLM's factories (``KVConnectorFactory``,
  ``OffloadingSpecFactory``, ...) are used through what they offer; kvtier never
  assigns to their attributes (``setattr(factory, ...)``, ``Factory.method = ...``).

``ALLOWED`` names, per rule, the files that still break it, each with the reason; a
rule fails on any other file, and on an allowed file that no longer needs its entry.

    python tools/check_src.py             # check the repository
    python tools/check_src.py --self-test # show that each planted offence is caught
"""

from __future__ import annotations

import ast
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRAME_READ = re.compile(
    r"\bsys\._getframe\b|\binspect\.(?:currentframe|stack|getouterframes)\b"
    r"|\.f_locals\b|\.f_back\b|\.f_globals\b"
)
FACTORY = re.compile(r"factory", re.IGNORECASE)

PORT = "packages/vllm-port/src/kvtier/vllm_port/"  # the port's modules
PLUGINS = re.compile(r"packages/(recompute-connector|tiering-spec|vllm-port)/")
# The files each rule reads (every rule: every package's src/).
SCOPE: dict[str, re.Pattern[str]] = {"vllm probe": PLUGINS}

ALLOWED: dict[str, dict[str, str]] = {
    "frame read": {},
    "class under a branch": {},
    "factory patch": {},
    "vllm probe": {
        PORT + "interface.py": "the port: the one place that asks which vLLM runs here",
        PORT + "facts_reader.py": "the port's reader of the engine's facts",
    },
}


def _frame_reads(text: str, tree: ast.Module) -> list[int]:
    lines = text.splitlines()
    return [n for n, line in enumerate(lines, 1) if FRAME_READ.search(line.split("#")[0])]


def _classes_under_branches(text: str, tree: ast.Module) -> list[int]:
    hits: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.Try)):
            hits.update(sub.lineno for sub in ast.walk(node) if isinstance(sub, ast.ClassDef))
    return sorted(hits)


def _names(node: ast.expr) -> str:
    """The dotted text of a name or attribute chain (other expressions: '')."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_names(node.value)}.{node.attr}"
    return ""


def _factory_patches(text: str, tree: ast.Module) -> list[int]:
    hits: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and FACTORY.search(_names(node.args[0]))
        ):
            hits.add(node.lineno)
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and FACTORY.search(_names(target.value)):
                hits.add(node.lineno)
    return sorted(hits)


def _is_vllm(module: str | None) -> bool:
    return bool(module) and (module == "vllm" or str(module).startswith("vllm."))


def _imports_vllm(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return _is_vllm(node.module)
    if isinstance(node, ast.Import):
        return any(_is_vllm(alias.name) for alias in node.names)
    if isinstance(node, ast.Call) and _names(node.func).endswith("import_module") and node.args:
        first = node.args[0]
        return isinstance(first, ast.Constant) and _is_vllm(str(first.value))
    return False


def _vllm_probes(text: str, tree: ast.Module) -> list[int]:
    hits: set[int] = set()
    from_vllm: set[str] = set()  # names this file binds to vLLM's modules and classes
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _is_vllm(node.module):
            from_vllm.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            from_vllm.update(
                (a.asname or a.name).split(".")[0] for a in node.names if _is_vllm(a.name)
            )
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            _imports_vllm(sub) for stmt in node.body for sub in ast.walk(stmt)
        ):
            hits.add(node.lineno)
        elif isinstance(node, ast.Call) and node.args:
            name, first = _names(node.func), node.args[0]
            if name.endswith("find_spec") and isinstance(first, ast.Constant):
                if _is_vllm(str(first.value)):
                    hits.add(node.lineno)
            elif name == "hasattr" and _names(first).split(".")[0] in from_vllm:
                hits.add(node.lineno)
    return sorted(hits)


RULES: dict[str, tuple[Callable[[str, ast.Module], list[int]], str]] = {
    "frame read": (_frame_reads, "reads the call stack; hand vLLM's objects over explicitly"),
    "class under a branch": (
        _classes_under_branches,
        "defines a class under an if/try; put each vLLM generation's code in its own module",
    ),
    "factory patch": (
        _factory_patches,
        "assigns to a vLLM factory; register through the factory's own methods",
    ),
    "vllm probe": (
        _vllm_probes,
        "asks which vLLM runs here outside the port; ask kvtier.vllm_port.port",
    ),
}


def offences(root: Path) -> dict[str, dict[str, list[int]]]:
    """Per rule, the files under ``root``'s ``packages/*/src`` that break it, with lines."""
    found: dict[str, dict[str, list[int]]] = {rule: {} for rule in RULES}
    for path in sorted(root.glob("packages/*/src/**/*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        name = path.relative_to(root).as_posix()
        for rule, (check, _) in RULES.items():
            scope = SCOPE.get(rule)
            if scope is not None and not scope.match(name):
                continue
            lines = check(text, tree)
            if lines:
                found[rule][name] = lines
    return found


def problems(root: Path, allowed: dict[str, dict[str, str]]) -> list[str]:
    out: list[str] = []
    for rule, files in offences(root).items():
        permitted = set(allowed.get(rule, {}))
        message = RULES[rule][1]
        out += [
            f"{name}:{line}: {message}"
            for name, lines in files.items()
            if name not in permitted
            for line in lines
        ]
        out += [
            f"{name}: allowed a {rule} but has none: drop it from ALLOWED"
            for name in sorted(permitted - files.keys())
        ]
    return out


def self_test() -> None:
    planted = {
        "frame read": "import sys\nowner = sys._getframe(1).f_locals['self']\n",
        "class under a branch": "import os\nif os.sep:\n    class A:\n        pass\n",
        "factory patch": "from v import KVConnectorFactory\n"
        "setattr(KVConnectorFactory, 'register_connector', print)\n",
        "vllm probe": "from vllm.v1.kv_offload import base\nNEW = hasattr(base, 'Medium')\n",
    }
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "packages/tiering-spec/src/kvtier/x"
        src.mkdir(parents=True)
        (src / "clean.py").write_text(
            "import sys\nframe_count = 0  # no sys._getframe here\n"
            "class B:\n    pass\nregistry = {}\nregistry['n'] = B\n"
        )
        assert problems(Path(tmp), {}) == [], problems(Path(tmp), {})
        for rule, text in planted.items():
            bad = src / "bad.py"
            bad.write_text(text)
            found = problems(Path(tmp), {})
            assert len(found) == 1 and found[0].startswith(
                "packages/tiering-spec/src/kvtier/x/bad.py:"
            ), (
                rule,
                found,
            )
            assert RULES[rule][1] in found[0]
            assert (
                problems(Path(tmp), {rule: {"packages/tiering-spec/src/kvtier/x/bad.py": "why"}})
                == []
            )
            stale = problems(Path(tmp), {rule: {"packages/x/gone.py": "why"}})
            assert any("has none" in line for line in stale), stale
            bad.unlink()
        (src / "attr.py").write_text("import f\nf.OffloadingSpecFactory.get_spec_cls = print\n")
        assert len(problems(Path(tmp), {})) == 1
        (src / "attr.py").unlink()
        for probe in (
            "try:\n    from vllm.x import Y\nexcept ImportError:\n    Y = None\n",
            "import importlib.util\nOK = importlib.util.find_spec('vllm.v1.x') is not None\n",
            "import importlib\ntry:\n    m = importlib.import_module('vllm.x')\n"
            "except ImportError:\n    m = None\n",
        ):
            (src / "probe.py").write_text(probe)
            assert len(problems(Path(tmp), {})) == 1, probe
        outside = Path(tmp) / "packages/testkit/src/kvtier/testkit"
        outside.mkdir(parents=True)
        (outside / "probe.py").write_text(probe)  # outside the plugins: not a port matter
        assert len(problems(Path(tmp), {})) == 1


def main(argv: list[str]) -> int:
    if "--self-test" in argv:
        self_test()
        print("check_src: self-test passed")
        return 0
    found = problems(ROOT, ALLOWED)
    for line in found:
        print(line)
    if not found:
        counts = ", ".join(f"{rule}: {len(files)} allowed" for rule, files in ALLOWED.items())
        print(f"check_src: packages/*/src keeps the source rules ({counts})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
