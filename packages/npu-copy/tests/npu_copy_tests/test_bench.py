"""The benchmark program runs end to end on a tiny case and writes the documented JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.npu_copy import bench


def test_bench_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    code = bench.main(
        [
            "--device",
            "cpu",
            "--sizes",
            "4096,65536",
            "--layers",
            "4",
            "--blocks",
            "8",
            "--repeats",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    keys = {"direction", "layer_block_bytes", "limit_gbps", "kvtier_gbps", "loop_gbps"}
    assert [(c["direction"], c["layer_block_bytes"]) for c in data["cases"]] == [
        ("store", 4096),
        ("load", 4096),
        ("store", 65536),
        ("load", 65536),
    ]
    assert all(set(c) == keys and c["kvtier_gbps"] > 0 for c in data["cases"])
    assert "kvtier/limit" in capsys.readouterr().out
