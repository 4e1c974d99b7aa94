"""The trace replay through ``vllm serve``, without an engine: the trace read through the
tiering spec's loader, choosing the window, block ids as tokens, the table and goals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.demo import bench_trace as bt
from kvtier.demo.bench_trace import BlockTokens, Request, Window, reuse_share
from kvtier.tiering_spec.trace import TraceRequest, load_trace


def write_trace(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def line(ts: float, ids: list[int], out: int = 10) -> dict[str, object]:
    return {"timestamp": ts, "input_length": 512 * len(ids), "output_length": out, "hash_ids": ids}


def test_the_trace_goes_through_the_tiering_specs_loader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad line is refused with its line number (the loader's own tests cover the
    format); a missing file is an error, not a traceback."""
    bad = write_trace(tmp_path / "t.jsonl", [line(0, [0]), {**line(1, [0]), "hash_ids": [0, "x"]}])
    assert bt.main(["--trace", str(bad)]) == 2
    assert "t.jsonl" in capsys.readouterr().err
    assert bt.main(["--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_the_packaged_trace_is_read_by_default() -> None:
    trace = load_trace()
    assert len(trace) == 12031
    assert Window().select(trace), "the default window holds requests"


def _req(ts_ms: float, ids: tuple[int, ...], out: int) -> TraceRequest:
    return TraceRequest(1, ts_ms, 512 * len(ids), out, ids)


def test_window_keeps_whole_conversations_and_compresses_arrivals() -> None:
    trace = [_req(1000.0 * t, (0, 100 + t % 5, 200 + t), 50) for t in range(400)]
    window = Window(start_s=10, seconds=300, sample=0.4, speedup=10, max_blocks=2, max_output=8)
    chosen = window.select(trace)
    kept = {r.hash_ids[1] for r in chosen}
    assert 0 < len(kept) < 5
    # Every request of a kept conversation inside the span is there, none outside.
    assert len(chosen) == sum(1 for t in range(10, 310) if 100 + t % 5 in kept)
    assert chosen[0].arrival_s == pytest.approx(
        (min(t for t in range(10, 310) if 100 + t % 5 in kept) - 10) / 10
    )
    assert all(len(r.hash_ids) == 2 and r.max_tokens == 8 for r in chosen)
    assert [r.index for r in chosen] == list(range(len(chosen)))
    assert window.select(trace) == chosen, "the window must be the same in every run"
    assert Window(seed=1, sample=0.4).select(trace) != Window(sample=0.4).select(trace)
    assert Window(sample=1.0).select([_req(0.0, (), 5)]) == [], "no block, no prompt"


def test_a_block_id_is_the_same_tokens_wherever_it_appears() -> None:
    tokens = BlockTokens(16, 512, seed=0)
    a, b = tokens.prompt([0, 7, 9]), tokens.prompt([0, 7, 3])
    assert len(a) == 48 and a[:32] == b[:32] and a[32:] != b[32:]
    assert all(3 <= t < 512 for t in a)
    assert BlockTokens(16, 512, seed=0).prompt([0, 7, 9]) == a
    assert BlockTokens(16, 512, seed=1).prompt([0, 7, 9]) != a


def test_reuse_share_counts_the_longest_cached_prefix() -> None:
    reqs = [
        Request(0, 0.0, (0, 1, 2), 1),
        Request(1, 0.0, (0, 1, 5), 1),  # 2 of 3 blocks
        Request(2, 0.0, (9, 1, 2), 1),  # 0: another prefix
    ]
    assert reuse_share(reqs) == pytest.approx(2 / 9)


def row(run: str, kind: str, policy: str | None, ttft: float, prefill: int) -> dict[str, object]:
    return {
        "run": run,
        "kind": kind,
        "policy": policy,
        "ttft_p50_s": ttft,
        "ttft_p90_s": ttft * 2,
        "prefill_tokens": prefill,
        "identical": True,
    }


def test_goals_and_table() -> None:
    rows = [
        row("vLLM alone", "alone", None, 4.0, 1000),
        row("host lru", "host", "lru", 2.5, 800),
        row("host best", "host", "best", 1.5, 600),
        row("2 engines, private host best", "private", "best", 2.0, 900),
        row("2 engines, host best + shared store", "shared", "best", 1.0, 700),
    ]
    checked = {g["goal"]: g for g in bt.goals(rows, ["best"])}
    assert checked["TTFT p50, vLLM alone / host best"]["value"] == pytest.approx(2.667)
    assert all(g["met"] for g in checked.values())
    missing = bt.goals(rows[:2], [])
    assert missing[0]["value"] is None and not missing[0]["met"]
    table = bt.format_table(rows)
    assert "host best" in table and "match" in table and len(table.splitlines()) == 6


def test_rows_skip_the_new_policy_with_a_note_when_there_is_none() -> None:
    notes: list[str] = []
    rows = bt.plan_rows(bt.SMOKE, [], "/tmp/x", {"type": "mooncake"}, notes, None)
    assert [r.kind for r in rows] == ["alone", "host", "fs", "private", "shared"]
    assert "no policy beyond lru and arc" in notes[0]
    shared = rows[-1].kv[0]
    assert shared is not None
    tiers = shared["kv_connector_extra_config"]["secondary_tiers"]
    assert tiers == [{"type": "mooncake"}] and len(rows[-1].kv) == 2
