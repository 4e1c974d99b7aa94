"""The plan: LRU's curve by stack distances, the knee, and the command's refusals."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiering_spec import lru_curve, plan, planner
from kvtier.tiering_spec.tracefile import load_trace


def _lru_by_hand(requests: list[list[int]], capacity: int) -> tuple[int, int]:
    """(served, written) of an LRU cache of ``capacity`` blocks under the replay's rule,
    simulated directly: a request is served its longest cached prefix, stores what is
    not cached, and then its blocks are the most recent, head first."""
    order: list[int] = []  # most recent first
    served = written = 0
    for blocks in requests:
        held = set(order)
        prefix = True
        for b in blocks:
            if b in held:
                served += prefix
            else:
                prefix = False
                written += 1
        order = list(blocks) + [b for b in order if b not in set(blocks)]
        del order[capacity:]
    return served, written


def _random_trace(seed: int, n: int = 300) -> list[list[int]]:
    rnd = random.Random(seed)
    prefixes: list[list[int]] = []
    next_id = 0
    out = []
    for _ in range(n):
        if prefixes and rnd.random() < 0.6:
            base = list(rnd.choice(prefixes))[: rnd.randint(1, 6)]
        else:
            base = []
        tail = rnd.randint(1, 5)
        blocks = base + list(range(next_id, next_id + tail))
        next_id += tail
        prefixes.append(blocks)
        out.append(blocks)
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stack_depths_give_lru_at_every_capacity(seed: int) -> None:
    trace = _random_trace(seed)
    found = lru_curve.depths(trace)
    caps = [1, 2, 5, 11, 20, 40, 80, 200, 2000]
    served = lru_curve.served_curve(found, caps)
    written = lru_curve.written_curve(found, caps)
    for cap, s, w in zip(caps, served, written):
        assert (s, w) == _lru_by_hand(trace, cap), cap


def test_the_lru_curve_equals_the_replay_of_kvtiers_lru_host_tier() -> None:
    """At each grid point, the one-pass curve serves exactly what replaying kvtier's
    manager with ``eviction_policy: lru`` serves (a window of the shipped trace)."""
    pytest.importorskip("vllm")
    from kvtier.tiering_spec import replay

    requests = load_trace()[:600]
    ids = [r.hash_ids for r in requests]
    longest = max(len(b) for b in ids)
    caps = planner.grid(longest, lru_curve.reused_blocks(ids), 5)
    found = lru_curve.depths(ids)
    served = lru_curve.served_curve(found, caps)
    written = lru_curve.written_curve(found, caps)
    keys = replay.trace_keys(requests)
    for cap, want_served, want_written in zip(caps, served, written):
        with replay.kvtier_manager("lru", cap) as manager:
            stats = replay.replay(manager, keys)
        assert (stats.served, stats.host_written) == (want_served, want_written), cap


def test_the_knee_is_where_a_gib_stops_paying() -> None:
    # 1 GiB per id; one request a second of 1 token per id: 10 tokens/s saved per
    # GiB up to 5 GiB, then 1.
    caps = list(range(1, 11))
    served = [10 * min(c, 5) + max(0, c - 5) for c in caps]
    unit = {"tokens_per_id": 1, "bytes_per_id": planner.GIB, "seconds": 1.0}
    assert planner.knee(caps, served, threshold=5, **unit) == 4  # index of 5 GiB
    assert planner.knee(caps, served, threshold=0.5, **unit) == 9  # every GiB pays
    assert planner.knee(caps, served, threshold=50, **unit) == 0  # none does


def _write(path: Path, lines: list[Any]) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _request(ts: float, ids: list[int]) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": 32 * len(ids), "output_length": 1, "hash_ids": ids}


def test_the_command_recommends_a_config_to_paste(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("vllm")
    header = {"kvtier_trace": {"tokens_per_id": 32, "bytes_per_id": 1 << 20, "timestamp_unit": "s"}}
    trace = [_request(float(i), [0, 1, 2, 3, 100 + i]) for i in range(40)]
    path = _write(tmp_path / "t.jsonl", [header, *trace])
    out = tmp_path / "report.json"
    assert plan.main(["--trace", path, "--no-progress", "--workers", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recommended: a host tier of" in text
    report = json.loads(out.read_text())
    rec = report["recommendation"]
    config = json.loads(text.split("kv_transfer_config:\n", 1)[1].splitlines()[0])
    assert config == rec["kv_transfer_config"]
    extra = config["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == rec["host_ids"] * (1 << 20)
    from kvtier.tiering_spec.config import parse_config

    parse_config(extra, tiering=extra["spec_name"] == "TieringOffloadingSpec", check_paths=False)
    # 4 shared blocks reused by 39 requests: LRU serves 4 * 39 at any capacity >= 5.
    assert report["served"]["lru"][-1] == pytest.approx(4 * 39 / (5 * 40))


@pytest.mark.parametrize(
    ("lines", "args", "reason"),
    [
        (None, [], r"cannot be read"),
        ([_request(0, [1])], [], r":1: no kvtier_trace header says how many tokens"),
        ([{"kvtier_trace": {"tokens_per_id": 32}}, _request(0, [1])], [], r"--bytes-per-id"),
        (['{"timestamp": 0, "input_le'], ["--tokens-per-id", "512"], r":1: not valid JSON"),
        (
            [_request(5, [1]), _request(1, [2])],
            ["--tokens-per-id", "512", "--bytes-per-id", "4096"],
            r":2: 'timestamp' 1 is earlier than 5 on line 1",
        ),
    ],
)
def test_bad_traces_are_refused_with_the_line_and_the_reason(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    lines: list[Any] | None,
    args: list[str],
    reason: str,
) -> None:
    path = tmp_path / "t.jsonl"
    if lines is not None:
        path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    assert plan.main(["--trace", str(path), "--no-progress", *args]) == 2
    assert re.search(reason, capsys.readouterr().err)


def test_an_fs_tier_behind_is_replayed_with_its_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--fs-ids``: each policy again with an fs tier behind a host tier too small for
    the shared prefixes; the fs tier serves what the host tier dropped, and its writes
    per block served are reported."""
    pytest.importorskip("vllm")
    header = {"kvtier_trace": {"tokens_per_id": 32, "bytes_per_id": 4096, "timestamp_unit": "s"}}
    # Two prefixes of 4 blocks alternate, each request with 4 new blocks of its own: a
    # host tier of 8 blocks loses a prefix between its uses.
    trace = [
        _request(
            float(i), [10 * (i % 2) + j for j in range(4)] + [100 + 4 * i + j for j in range(4)]
        )
        for i in range(30)
    ]
    path = _write(tmp_path / "t.jsonl", [header, *trace])
    out = tmp_path / "report.json"
    args = ["--trace", path, "--capacities", "8", "--fs-ids", "200", "--fs-dir", str(tmp_path)]
    assert plan.main([*args, "--no-progress", "--workers", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    with_fs = report["with_fs"]
    assert with_fs["fs_ids"] == 200
    for policy in report["policies"]:
        assert with_fs["served"][policy][0] > report["served"][policy][0], policy
        assert with_fs["fs_written_per_served"][policy][0] > 0
    assert "with an fs tier of 200 blocks behind" in capsys.readouterr().out
