"""The import layers of kvtier's packages: import-linter's contracts in ``.importlinter``.

``python tools/check_imports.py`` runs ``lint-imports`` over every package's ``src/``
(each a root of the ``kvtier`` namespace). ``--self-test`` first copies the sources,
plants an import that goes up a layer and, separately, an import cycle, and checks that
the contracts catch each (and that the unplanted copy passes), so a contract that no
longer matches the tree cannot pass silently. Needs import-linter.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / ".importlinter"

# (what is planted, file under a src/ folder, the line added, the contract it breaks)
PLANTS = (
    (
        "an upward import (the vLLM-free errors module importing the connector)",
        "kvtier/tiering_spec/errors.py",
        "import kvtier.tiering_spec.connector",
        "Tiering spec: vLLM's shapes at the top, the vLLM-free core below BROKEN",
    ),
    (
        "an import cycle (the allocator importing the pool, which imports it)",
        "kvtier/blockpool/allocator.py",
        "import kvtier.blockpool.pool",
        "No import cycles, at any depth BROKEN",
    ),
    (
        "the pool importing vLLM",
        "kvtier/blockpool/budget.py",
        "import vllm",
        "The pool and the copy engine run without vLLM BROKEN",
    ),
)


def src_dirs(root: Path = ROOT) -> list[Path]:
    return sorted(p for p in (root / "packages").glob("*/src") if p.is_dir())


def lint_imports(srcs: list[Path]) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the contracts of ``.importlinter``, over ``srcs``."""
    tool = Path(sys.executable).parent / "lint-imports"
    command = [str(tool)] if tool.exists() else ["lint-imports"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(s) for s in srcs)}
    return subprocess.run(
        [*command, str(CONFIG), "--no-cache"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def self_test() -> int:
    with tempfile.TemporaryDirectory(prefix="kvtier-imports-") as tmp:
        copies = []
        for src in src_dirs():
            dest = Path(tmp) / src.parent.name / "src"
            shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
            copies.append(dest)
        clean = lint_imports(copies)
        if clean.returncode != 0:
            print(clean.stdout + clean.stderr)
            print("self-test: the unplanted copy of the sources breaks a contract")
            return 1
        for what, rel, line, broken in PLANTS:
            target = next(c / rel for c in copies if (c / rel).exists())
            original = target.read_text()
            target.write_text(original + f"\n{line}  # planted by the self-test\n")
            try:
                planted = lint_imports(copies)
            finally:
                target.write_text(original)
            if planted.returncode == 0 or broken not in planted.stdout:
                print(planted.stdout + planted.stderr)
                print(f"self-test: {what} was not caught (expected {broken!r})")
                return 1
            print(f"self-test: {what}: caught")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args(argv)
    if args.self_test:
        return self_test()
    result = lint_imports(src_dirs())
    print(result.stdout + result.stderr, end="")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
