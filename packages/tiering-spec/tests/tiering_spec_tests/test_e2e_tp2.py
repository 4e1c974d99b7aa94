"""Tensor parallel 2 on vLLM's CPU platform, end to end with the tiers (each test runs a
script whose engine has a worker process per rank, one core each).

A file of their own, apart from test_e2e.py's one-process engines: each test here takes
minutes, and pytest-xdist hands a whole file to one process, so kept together with the
others they left the other process idle at the end of the run.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from kvtier.testkit import run_script

pytestmark = [pytest.mark.e2e, pytest.mark.heavy, pytest.mark.slow]

pytest.importorskip("vllm")


# The engine core runs in the script's process, each rank's worker in a process of its
# own (vLLM's multiprocess executor): the scheduler side and the two workers still meet
# only through vLLM's messages. vLLM's CPU platform spawns its processes, and a spawned
# engine core imports vLLM again first (20-25 s per engine on 2 cores, 46 s of each
# test's 140). The trip of the connectors' metrics between processes is the `vllm serve`
# tests' (demo's test_server.py).
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run_tp2_script(module: str, tmp_path: Path, marker: str) -> None:
    """Run a TP 2 engine script (two worker processes, one core per rank) and check its
    marker."""
    out = run_script(__file__, module, str(tmp_path / "fs"), env=TP2_ENV, timeout=900, cwd=tmp_path)
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode == 0, tail
    assert marker in out.stdout, tail


def test_tensor_parallel_2_hits_host_and_fs_tiers_and_keeps_ranks_apart(tmp_path: Path) -> None:
    run_tp2_script("tiering_spec_tests.tp2_script", tmp_path, "TP2 OK")


@pytest.mark.skipif(
    not getattr(importlib.import_module("kvtier.tiering_spec.vllm_compat"), "CONFIG_API", False),
    reason="vLLM before 0.26 reports no replicated KV layout (and vLLM 0.23's CPU workers "
    "failed to start this MLA model with TP 2)",
)
def test_tensor_parallel_2_mla_keeps_one_copy_of_the_replicated_kv(tmp_path: Path) -> None:
    run_tp2_script("tiering_spec_tests.tp2_mla_script", tmp_path, "TP2 MLA OK")
