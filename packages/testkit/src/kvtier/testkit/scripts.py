"""Scripts that tests run in a subprocess (several engines, tensor parallel, a server).

A script is a module of its package's test package (``tests/<name>_tests/``) and runs as
``python -m <name>_tests.<script>``: it imports the test package's helpers as the tests
do, and a module path it hands vLLM resolves in every process the engine starts, with no
``sys.path`` edits anywhere. :func:`script_env` puts the ``tests/`` folder on
``PYTHONPATH`` for that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def tests_root(test_file: str | Path) -> Path:
    """The ``tests/`` folder above the test package that holds ``test_file``."""
    return Path(test_file).resolve().parents[1]


def script_env(test_file: str | Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus ``extra``, with the ``tests/`` folder of
    ``test_file``'s package first on ``PYTHONPATH``."""
    env = {**os.environ, **(extra or {})}
    path = [str(tests_root(test_file)), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return env


def run_script(
    test_file: str | Path,
    module: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module args...`` with :func:`script_env`; output captured as text.

    ``timeout`` is in seconds; the caller checks ``returncode``."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        env=script_env(test_file, env),
        timeout=timeout,
        cwd=None if cwd is None else str(cwd),
        check=False,
    )
