"""Trace parsing, Belady's MIN and the engine-free replay (``kvtier.tiering_spec.trace``)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import lzma
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiering_spec import replay
from kvtier.tiering_spec.trace import (
    DEFAULT_TRACE,
    Optimum,
    TraceError,
    TraceRequest,
    load_trace,
    main,
    optimum,
    parse_trace,
    reuse_oracle,
)


def _line(ts: float, ids: list[int], **extra: Any) -> str:
    return json.dumps(
        {
            "timestamp": ts,
            "input_length": 512 * len(ids),
            "output_length": 10,
            "hash_ids": ids,
            **extra,
        }
    )


GOOD = [_line(0, [0, 1, 2]), "", _line(0, [0, 3]), _line(7.5, [4], note="ignored")]


def _write(path: Path, lines: list[str], opener: Any = open) -> Path:
    with opener(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------- parsing


def test_parse_good_lines() -> None:
    reqs = parse_trace(GOOD, "t.jsonl")
    assert [r.line for r in reqs] == [1, 3, 4]  # the blank line is skipped, lines kept
    assert [r.hash_ids for r in reqs] == [(0, 1, 2), (0, 3), (4,)]
    assert reqs[2].timestamp == 7.5 and reqs[0].input_length == 1536
    assert reqs[1].output_length == 10


@pytest.mark.parametrize(
    ("suffix", "opener"), [(".jsonl", open), (".jsonl.gz", gzip.open), (".xz", lzma.open)]
)
def test_load_plain_and_compressed(tmp_path: Path, suffix: str, opener: Any) -> None:
    path = _write(tmp_path / f"t{suffix}", GOOD, opener)
    assert [r.hash_ids for r in load_trace(path)] == [(0, 1, 2), (0, 3), (4,)]


def test_compression_is_found_by_content(tmp_path: Path) -> None:
    path = _write(tmp_path / "no-suffix", GOOD, gzip.open)
    assert len(load_trace(path)) == 3


BAD = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1}', "missing key 'hash_ids'"),
    (
        '{"input_length": 1, "output_length": 1, "hash_ids": []}',
        "missing key 'timestamp'",
    ),
    (_line("5", [9]), "'timestamp' must be a number, got '5'"),
    (_line(True, [9]), "'timestamp' must be a number"),
    (_line(-1, [9]), "'timestamp' must be >= 0"),
    (_line(3, [9]).replace('"input_length": 512', '"input_length": 1.5'), "'input_length'"),
    (_line(3, [9]).replace('"output_length": 10', '"output_length": -2'), "'output_length'"),
    (_line(3, [9]).replace("[9]", '"9"'), "'hash_ids' must be a list"),
    (_line(3, [9, -4]), "'hash_ids'[1] must be an integer >= 0, got -4"),
    (_line(3, [9, True]), "'hash_ids'[1] must be an integer >= 0, got True"),
    (_line(3, [9, 10, 9]), "'hash_ids'[2] = 9 repeats an earlier id"),
    (_line(3, [7, 1]), "'hash_ids'[1] = 1 follows 7 but follows 0 on line 1"),
    (_line(3, [2]), "'hash_ids'[0] = 2 starts the prompt but follows 1 on line 1"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_line_is_named(text: str, message: str) -> None:
    lines = [_line(2, [0, 1, 2]), text]
    with pytest.raises(TraceError) as info:
        parse_trace(lines, "t.jsonl")
    assert str(info.value).startswith("t.jsonl:2: ")
    assert message in str(info.value)


def test_timestamps_must_not_go_back() -> None:
    with pytest.raises(TraceError, match=r"t:3: 'timestamp' 4 is earlier than 5 on line 2"):
        parse_trace([_line(1, [0]), _line(5, [1]), _line(4, [2])], "t")
    assert len(parse_trace([_line(5, [0]), _line(5, [1])])) == 2  # ties are fine


def test_bad_compressed_file(tmp_path: Path) -> None:
    path = tmp_path / "t.xz"
    path.write_bytes(lzma.compress(b"x" * 100)[:-20])
    with pytest.raises(TraceError, match="cannot be read"):
        load_trace(path)
    with pytest.raises(TraceError, match="cannot be read"):
        load_trace(tmp_path / "missing.jsonl")


def test_bundled_trace() -> None:
    assert DEFAULT_TRACE.is_file() and (DEFAULT_TRACE.parent / "NOTICE").is_file()
    assert (DEFAULT_TRACE.parent / "LICENSE-APACHE").is_file()
    reqs = load_trace()
    assert len(reqs) == 12_031
    assert sum(len(r.hash_ids) for r in reqs) == 288_500
    assert len({b for r in reqs for b in r.hash_ids}) == 182_790


# ---------------------------------------------------------------------------- optimum

# Capacity 2. r1's block 3 pushes out one of 1 and 2, which r3 uses again (a tie);
# r2 reuses 3. 6 prompt blocks.
HAND = [[1, 2], [3], [3], [1, 2]]


def test_optimum_by_hand() -> None:
    # Dropping 2 (the tail) at r1 serves r2's 3 and r3's 1: 2 blocks.
    assert optimum(HAND, 2) == Optimum(2, 2)
    # Dropping 1 (the head) leaves r3's 2 cached but not servable.
    assert optimum(HAND, 2, ties="head") == Optimum(1, 2)
    # A cache as large as the trace serves every repeat: 3, 1, 2.
    assert optimum(HAND, 3).served == 3
    # A block never used again is not kept: 4 and 5 do not push out 1 and 2.
    assert optimum([[1, 2], [4], [5], [1, 2]], 2) == Optimum(2, 2)


def test_reuse_oracle_by_hand() -> None:
    # 2 and 3 never come back, so they take no room from 1: served at r3.
    assert reuse_oracle([[1], [2], [3], [1]], 1) == 1
    # Both 1 and 2 come back but one block fits: the one used more (1) stays.
    assert reuse_oracle([[1], [1], [2], [1], [2]], 1) == 2
    # Room for everything: every repeat (as MIN).
    assert reuse_oracle(HAND, 3) == optimum(HAND, 3).served == 3
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        reuse_oracle(HAND, 0)


def test_reuse_oracle_never_beats_the_bound() -> None:
    for seed in range(5):
        ids = _random_trace(random.Random(seed), 200)
        for capacity in (4, 16, 64):
            assert reuse_oracle(ids, capacity) <= optimum(ids, capacity).bound


def test_optimum_reproduces_the_issue_figure() -> None:
    ids = [r.hash_ids for r in load_trace()]
    total = sum(map(len, ids))
    # The figure first quoted for this trace (17.9% at 1,000 blocks) drops the head of
    # tied blocks; dropping the tail serves more, close to the bound.
    assert round(100 * optimum(ids, 1000, ties="head").served / total, 1) == 17.9
    best = optimum(ids, 1000)
    assert round(100 * best.served / total, 1) == 19.0
    assert round(100 * best.bound / total, 1) == 19.1


# ---------------------------------------------------------------------------- replay


def _has_offloading_config() -> bool:
    try:
        return importlib.util.find_spec("vllm.v1.kv_offload.config") is not None
    except ImportError:  # no vLLM at all
        return False


# The replay drives vLLM 0.32's offloading API (OffloadingConfig, ReqContext positions).
needs_vllm = pytest.mark.skipif(not _has_offloading_config(), reason="needs vLLM 0.32 or later")


def _requests(ids: list[list[int]]) -> list[TraceRequest]:
    return [TraceRequest(i + 1, float(i), 512 * len(b), 1, tuple(b)) for i, b in enumerate(ids)]


def _served(policy: str, ids: list[list[int]], capacity: int, **kw: Any) -> replay.RunStats:
    keys = replay.trace_keys(_requests(ids))
    if policy.startswith("vllm-"):
        ctx = replay.vllm_manager(policy, capacity)
    else:
        ctx = replay.kvtier_manager(policy, capacity, **kw)
    with ctx as manager:
        return replay.replay(manager, keys)


@needs_vllm
def test_vllm_lru_by_hand() -> None:
    # r0 stores 1, 2 and finishes with its head the most recent; r1's store of 3 drops
    # 2; r2 is served 3; r3 is served 1 (and its store of 2 then drops 1: vLLM makes a
    # request's hits recent only when it finishes).
    st = _served("vllm-lru", HAND, 2)
    assert (st.served, st.served_host, st.host_written) == (2, 2, 4)


@needs_vllm
def test_kvtier_lru_by_hand() -> None:
    assert _served("lru", HAND, 2).served == 2


@needs_vllm
@pytest.mark.parametrize("policy", ["lru", "arc", "vllm-lru", "vllm-arc"])
def test_room_for_everything_serves_every_repeat(policy: str) -> None:
    rng = random.Random(7)
    ids = _random_trace(rng, 60)
    every_repeat = optimum(ids, 10**6).served
    assert _served(policy, ids, 10**6).served == every_repeat


def _random_trace(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts that share prefixes: each extends a random earlier prompt's prefix."""
    prompts: list[list[int]] = []
    next_id = 0
    for _ in range(n):
        base = rng.choice(prompts)[: rng.randint(0, 6)] if prompts and rng.random() < 0.7 else []
        fresh = list(range(next_id, next_id + rng.randint(1, 5)))
        next_id += len(fresh)
        prompts.append(base + fresh)
    return prompts


@needs_vllm
def test_kvtier_lru_is_its_one_pass_curve_and_serves_at_least_vllms() -> None:
    """kvtier's ``lru`` keeps what a request loaded while it stores its tail, so it is a
    stack policy: the replay serves and writes what the stack depths say (prompts of
    at most 11 blocks here, so every one fits); vLLM's LRU may evict a request's
    just-loaded head for its tail, and serves no more."""
    from kvtier.tiering_spec import lru_curve

    rng = random.Random(3)
    ids = _random_trace(rng, 300)
    found = lru_curve.depths(ids)
    caps = [12, 20, 40]
    curve = zip(caps, lru_curve.served_curve(found, caps), lru_curve.written_curve(found, caps))
    for capacity, served, written in curve:
        ours = _served("lru", ids, capacity)
        assert (ours.served, ours.host_written) == (served, written), capacity
        assert ours.served >= _served("vllm-lru", ids, capacity).served


@needs_vllm
def test_policies_never_beat_the_bound() -> None:
    ids = _random_trace(random.Random(11), 300)
    for capacity in (8, 30):
        bound = optimum(ids, capacity).bound
        for policy in ("lru", "arc", "vllm-lru", "vllm-arc"):
            assert _served(policy, ids, capacity).served <= bound


@needs_vllm
def test_fs_tier_serves_what_the_host_tier_dropped(tmp_path: Path) -> None:
    # Host tier of 4: r1 and r2 push 1 and 2 out of it, but they were written through
    # to the fs tier; r3 is served both from there (promoted into the host tier).
    ids = [[1, 2], [3, 4], [5, 6], [1, 2]]
    st = _served("lru", ids, 4, fs_capacity=16, fs_dir=str(tmp_path))
    assert (st.served_host, st.served_fs) == (0, 2)
    assert st.fs_written == 6  # every stored block once
    assert st.host_written == 6 + 2  # six stores from the device, two promotions
    assert list(tmp_path.iterdir()) == []  # the temporary fs directory is removed


@needs_vllm
def test_every_registered_policy_is_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.blockpool import policies

    monkeypatch.setitem(policies.POLICIES, "lru-copy", policies.LRUPolicy)
    assert replay.resolve_policies(None) == [*policies.POLICIES, "vllm-lru", "vllm-arc"]
    assert replay.resolve_policies("LRU-copy,vllm-arc") == ["lru-copy", "vllm-arc"]
    # Not in the spec's list of names: chosen by its class path, same decisions as lru.
    assert _served("lru-copy", HAND, 2).served == _served("lru", HAND, 2).served
    with pytest.raises(SystemExit, match="unknown policy nope"):
        replay.resolve_policies("lru,nope")


@needs_vllm
def test_cli_json_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write(
        tmp_path / "t.jsonl.gz",
        [_line(i, b) for i, b in enumerate(_random_trace(random.Random(5), 80))],
        gzip.open,
    )
    out = tmp_path / "r.json"
    args = ["--trace", str(trace), "--capacities", "5,20", "--json", str(out), "--no-progress"]
    assert main([*args, "--policies", "lru,vllm-lru", "--layers", "1", "--markdown"]) == 0
    report = json.loads(out.read_text())
    assert report["capacities"] == [5, 20]
    assert report["bytes_per_block"] == 2 * 1 * 8 * 128 * 2 * 512
    assert len(report["optimum"]) == 2 and report["optimum"][0] <= report["optimum"][1]
    assert all(0 <= v <= b for v, b in zip(report["reuse_oracle"], report["optimum_bound"]))
    assert list(report["policies"]) == ["lru", "vllm-lru"]
    for row in report["policies"].values():
        assert len(row["served"]) == 2
        assert all(0 <= s <= o + 1e-12 for s, o in zip(row["served"], report["optimum_bound"]))
    text = capsys.readouterr().out
    assert "capacity 5 blocks" in text and "vllm-lru" in text
    assert "| policy | 5 (10 MiB) | 20 (40 MiB) |" in text  # the Markdown table
    assert "\n| lru | " in text and "\n| optimum (MIN) | " in text
    assert "knowing only which blocks come back" in text


def test_cli_refuses_a_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write(tmp_path / "t.jsonl", [_line(0, [0]), '{"timestamp": 1}'])
    assert main(["--trace", str(trace), "--no-progress"]) == 2
    assert "t.jsonl:2: missing key 'input_length'" in capsys.readouterr().err


REPORT = {
    "trace": "t.jsonl",
    "block_tokens": 512,
    "capacities": [10, 100],
    "optimum": [0.2, 0.3],
    "optimum_bound": [0.2, 0.3],
    "policies": {"lru": {"served": [0.05, 0.2]}, "vllm-lru": {"served": [0.05, 0.2]}},
}


def test_chart_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    report = tmp_path / "r.json"
    report.write_text(json.dumps(REPORT))
    assert main(["--plot", str(report), "--png", str(tmp_path / "c.png")]) == 1
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def test_chart_from_json(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    report = tmp_path / "r.json"
    report.write_text(json.dumps(REPORT))
    assert main(["--plot", str(report), "--png", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
