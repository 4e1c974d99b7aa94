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


def _case(direction: str, size: int, limit: float, kvtier: float, loop: float) -> bench.Case:
    return bench.Case(direction, size, limit, kvtier, loop)


def test_the_bar_is_met_when_every_covered_case_clears_it() -> None:
    cases = [
        _case("store", 4096, limit=9.0, kvtier=6.0, loop=0.4),  # 15x the loop
        _case("load", 65536, limit=10.0, kvtier=8.0, loop=3.0),  # exactly 0.8x the limit
        _case("store", 524288, limit=11.0, kvtier=14.0, loop=8.0),
    ]
    assert bench.bar_misses(cases) == []
    assert bench.format_bar(cases).endswith(": met")


def test_the_bar_names_each_case_below_it() -> None:
    cases = [
        _case("store", 4096, limit=9.0, kvtier=1.6, loop=0.4),  # 4x the loop, 0.18x limit
        _case("load", 65536, limit=10.0, kvtier=7.1, loop=3.0),  # 0.71x the limit
        _case("store", 524288, limit=11.0, kvtier=14.0, loop=8.0),
    ]
    assert bench.bar_misses(cases) == [
        "store 4 KiB: 4.0x the loop (bar 5.0x)",
        "load 64 KiB: 0.71x the limit (bar 0.8x)",
    ]
    assert "NOT met" in bench.format_bar(cases)


def test_the_bar_says_when_no_measured_size_is_covered() -> None:
    cases = [_case("store", 1024, limit=9.0, kvtier=1.0, loop=0.4)]
    assert bench.format_bar(cases).endswith("not measured (no such sizes)")
