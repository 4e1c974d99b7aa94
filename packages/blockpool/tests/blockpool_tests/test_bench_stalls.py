"""The stall benchmark's scenarios run on the pool and fill their table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.blockpool import bench_stalls


def test_every_scenario_runs_and_is_tabled(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "stalls.json"
    blocks = bench_stalls.MIN_BLOCKS
    assert bench_stalls.main(["--blocks", str(blocks), "--no-vllm", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["scenario"], r["policy"]) for r in rows] == [
        *((s, p) for s in ("pinned", "scattered") for p in bench_stalls.POLICIES),
        ("halving", "frecency"),
    ]
    assert all(
        r["blocks"] == blocks and r["kvtier_max_ms"] >= r["kvtier_median_ms"] > 0 for r in rows
    )
    table = capsys.readouterr().out
    assert f"pinned     {blocks:>9,} frecency" in table and "halving" in table


def test_sizes_below_what_the_rounds_need_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        bench_stalls.main(["--blocks", "100", "--no-vllm"])
    assert f"at least {bench_stalls.MIN_BLOCKS}, got 100" in capsys.readouterr().err


def test_scattered_frees_every_other_block_before_the_timed_stores() -> None:
    side = bench_stalls._Kvtier(bench_stalls.MIN_BLOCKS, "lru")
    original = side.store
    seen: list[int] = []

    def store(keys: list[bytes]):  # type: ignore[no-untyped-def]
        call = original(keys)
        seen.append(len(side.pool._alloc.runs()))
        return call

    side.store = store  # type: ignore[method-assign]
    bench_stalls.scattered(side, bench_stalls.MIN_BLOCKS)
    # Once the pool's stores are made: as many free runs as every other block.
    assert max(seen) >= bench_stalls.MIN_BLOCKS // 2 - 1
