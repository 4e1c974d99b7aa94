"""The per-operation table's verdict: each row against the bar, and the geometric mean."""

from __future__ import annotations

import math

import pytest

from kvtier.blockpool import bench


def _ops(ratios: dict[str, float]) -> dict[str, dict[str, float]]:
    return {
        name: {"kvtier_per_s": 1000.0 * r, "vllm_per_s": 1000.0, "ratio": r}
        for name, r in ratios.items()
    }


def test_geometric_mean_of_the_ratios() -> None:
    ops = _ops({"touch@lru@1": 4.0, "lookup@lru@1": 1.0})
    assert bench.geomean(ops) == pytest.approx(2.0)


def test_table_names_the_rows_below_the_bar_and_the_mean() -> None:
    ratios = {"touch@arc@1": 1.05, "lookup@arc@1": 3.0, "prepare_store@arc@16": 2.0}
    text = bench.format_table({"ops": _ops(ratios)})
    mean = math.exp(sum(math.log(r) for r in ratios.values()) / 3)
    assert f"lowest ratio: 1.05x (bar: {bench.RATIO_BAR:g}x vLLM's manager)" in text
    assert f"geometric mean: {mean:.2f}x (bar: {bench.MEAN_BAR:g}x)" in text
    assert "below the bar: touch arc 1 (1.05x)" in text
    clean = bench.format_table({"ops": _ops({"touch@arc@1": 1.2})})
    assert "below the bar: none" in clean
