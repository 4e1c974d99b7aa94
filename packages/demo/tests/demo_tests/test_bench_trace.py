"""The trace replay through ``vllm serve``, without an engine: reading a trace (clear
errors naming the line), choosing the window, block ids as tokens, the table and goals."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvtier.demo import bench_trace as bt
from kvtier.demo.bench_trace import (
    BlockTokens,
    Request,
    TraceError,
    TraceRequest,
    Window,
    read_trace,
    reuse_share,
)


def write_trace(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def line(ts: float, ids: list[int], out: int = 10) -> dict[str, object]:
    return {"timestamp": ts, "input_length": 512 * len(ids), "output_length": out, "hash_ids": ids}


def test_reads_a_trace_plain_and_compressed(tmp_path: Path) -> None:
    rows = [line(0, [0, 1, 2]), line(1500, [0, 1, 2, 3], 7)]
    plain = write_trace(tmp_path / "t.jsonl", rows)
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        assert read_trace(path) == [
            TraceRequest(0.0, (0, 1, 2), 10),
            TraceRequest(1500.0, (0, 1, 2, 3), 7),
        ]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps(line(-1, [0])), "timestamp"),
        (json.dumps({**line(0, [0]), "hash_ids": []}), "hash_ids"),
        (json.dumps({**line(0, [0]), "hash_ids": [0, "x"]}), "hash_ids"),
        (json.dumps({**line(0, [0]), "output_length": -3}), "output_length"),
    ],
)
def test_a_bad_line_is_an_error_naming_it(tmp_path: Path, bad: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line(0, [0])) + "\n" + bad + "\n")
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: .*{message}"):
        read_trace(path)


def test_no_trace_given_and_none_packaged_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bt, "packaged_trace", lambda: None)
    assert bt.main([]) == 2
    assert "--trace PATH" in capsys.readouterr().err
    with pytest.raises(TraceError, match="no such file"):
        bt.resolve_trace("/nonexistent/trace.jsonl")


def test_window_keeps_whole_conversations_and_compresses_arrivals() -> None:
    trace = [TraceRequest(1000.0 * t, (0, 100 + t % 5, 200 + t), 50) for t in range(400)]
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


def test_the_synthetic_smoke_trace_has_reusable_prefixes() -> None:
    trace = bt.synthetic_trace()
    assert [r.timestamp_ms for r in trace] == sorted(r.timestamp_ms for r in trace)
    chosen = Window(sample=1.0, speedup=200).select(trace)
    assert len(chosen) == 24 and reuse_share(chosen) > 0.3


def test_the_packaged_trace_is_found_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.resources

    traces = tmp_path / "traces"
    traces.mkdir()
    monkeypatch.setattr(importlib.resources, "files", lambda _pkg: tmp_path)
    assert bt.packaged_trace() is None
    (traces / "NOTICE").write_text("")
    (traces / "mooncake-conversation.jsonl.gz").write_bytes(b"")
    found = bt.packaged_trace()
    assert found is not None and found.name == "mooncake-conversation.jsonl.gz"
