"""A Mooncake Store on loopback for the store-tier tests: ``mooncake_master`` with its
HTTP metadata server, and clients. Without Mooncake's client the tests skip, unless
``KVTIER_REQUIRE_MOONCAKE=1`` (the nox session that installs it): then they fail."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest


def _mooncake() -> Any:
    """Mooncake's store client class, or a skip (a failure where it is required)."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except Exception as exc:  # ImportError, or a missing libibverbs
        if os.environ.get("KVTIER_REQUIRE_MOONCAKE") == "1":
            raise
        pytest.skip(f"Mooncake Store client not available: {exc}")
    return MooncakeDistributedStore


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Master:
    """A ``mooncake_master`` with its HTTP metadata server, on loopback."""

    def __init__(self, workdir: Path) -> None:
        beside = Path(sys.executable).with_name("mooncake_master")  # in the venv's bin
        exe = shutil.which("mooncake_master") or str(beside)
        self.rpc, self.http, self.metrics = _free_port(), _free_port(), _free_port()
        self.log = open(workdir / f"master-{self.rpc}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                exe,
                f"--rpc_port={self.rpc}",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http}",
                f"--metrics_port={self.metrics}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.rpc), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"mooncake_master did not start (see {self.log.name})")

    def client(self) -> Any:
        store = _mooncake()()
        rc = store.setup(
            "127.0.0.1",
            f"http://127.0.0.1:{self.http}/metadata",
            64 << 20,
            16 << 20,
            "tcp",
            "",
            f"127.0.0.1:{self.rpc}",
        )
        assert rc == 0, f"setup returned {rc}"
        return store

    def stop(self, *, kill: bool = False) -> None:
        """Stop the master: SIGTERM and a wait (or SIGKILL, as a crash)."""
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def lend_memory(master: Master, nbytes: int) -> subprocess.Popen[bytes]:
    """A process that lends ``nbytes`` of its memory to the store, as a store service
    does: objects put there outlive the engines that put them."""
    code = (
        "import sys, time\n"
        "from mooncake.store import MooncakeDistributedStore as S\n"
        "s = S()\n"
        f"rc = s.setup('127.0.0.1', 'http://127.0.0.1:{master.http}/metadata', {nbytes}, "
        f"16 << 20, 'tcp', '', '127.0.0.1:{master.rpc}')\n"
        "print('lending', rc, flush=True)\n"
        "time.sleep(3600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.strip() == "lending 0", f"the memory lender did not start: {line!r}"
    return proc
