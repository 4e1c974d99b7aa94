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
from typing import Any


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


# What a process that registers with vLLM imports first: vLLM's two factories (and with
# them most of vLLM). Imported once per pytest process by run_python's fork server.
VLLM_PRELOAD = (
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.v1.kv_offload.factory",
)
_forkserver: list[Any] = []


def run_python(
    code: str,
    env: Mapping[str, str] | None = None,
    *,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``python -c code`` with environment ``env`` (this process's if None), output
    captured as text, in a process forked from a server that has imported vLLM already
    (:data:`VLLM_PRELOAD`, nothing of kvtier's and no plugin loaded).

    For tests of what happens when a process first meets kvtier: registration through
    entry points, names in vLLM's factories, log lines. A new interpreter would spend its
    first 10-20 s importing vLLM before the code under test runs; the child starts where
    that import ended. What vLLM reads from the environment when imported is read from
    the server's, the pytest process's; everything kvtier does, and all of vLLM's plugin
    loading, happens in the child with ``env``. ``PYTHONPATH`` entries of ``env`` are put
    first on the child's ``sys.path``; the exit status is the code's (1 and a traceback on
    stderr for an exception), and functions registered with ``atexit`` run."""
    import multiprocessing
    import tempfile

    if not _forkserver:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(VLLM_PRELOAD))
        _forkserver.append(ctx)
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="kvtier-run-python-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = _forkserver[0].Process(target=_exec_code, args=(code, env, str(out), str(err)))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["python", "-c", code], timeout)
        return subprocess.CompletedProcess(
            ["python", "-c", code],
            proc.exitcode if proc.exitcode is not None else -1,
            out.read_text(errors="replace") if out.exists() else "",
            err.read_text(errors="replace") if err.exists() else "",
        )


def _exec_code(code: str, env: dict[str, str], out: str, err: str) -> None:
    """Runs in the forked child: ``env`` and captured stdout/stderr, then ``code`` as
    ``__main__``; atexit's functions run before the process ends, as they would."""
    import atexit

    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    sys.argv = ["-c"]
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
