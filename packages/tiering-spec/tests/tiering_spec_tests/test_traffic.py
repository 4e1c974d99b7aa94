"""The traffic record: what the scheduler writes, and the trace the plan reads from it."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiering_spec.config import ConfigError, parse_config
from kvtier.tiering_spec.tracefile import TraceError, load_trace_file, parse_trace_file
from kvtier.tiering_spec.traffic import END_KEY, HEADER_KEY, TrafficRecorder

HEADER = {"tokens_per_id": 32, "bytes_per_id": 65536, "model": "tiny"}


def _record(folder: Path, **kwargs: Any) -> TrafficRecorder:
    return TrafficRecorder(
        str(folder), HEADER, max_bytes=kwargs.pop("max_bytes", 1 << 20), **kwargs
    )


def _lines(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_requests_are_written_in_arrival_order_once_finished(tmp_path: Path) -> None:
    rec = _record(tmp_path)
    rec.arrive("a", 96, [b"x1", b"x2", b"x3"])
    rec.arrive("b", 64, [b"x1", b"y2"])
    rec.finish("b", 7)  # b finished first: it waits for a
    time.sleep(0.2)
    (path,) = rec.files
    assert len(_lines(path)) == 1, "only the header while a is running"
    rec.finish("a", 3)
    rec.arrive("c", 40, [b"z1"])
    rec.close()
    lines = _lines(path)
    assert lines[0] == {HEADER_KEY: {"version": 1, "timestamp_unit": "s", **HEADER}}
    a, b, c = lines[1:4]
    assert (a["input_length"], a["output_length"]) == (96, 3)
    assert (b["input_length"], b["output_length"]) == (64, 7)
    assert c["output_length"] == 0, "still running at shutdown: written with 0"
    assert a["hash_ids"] == [0, 1, 2] and b["hash_ids"] == [0, 3] and c["hash_ids"] == [4]
    assert a["timestamp"] <= b["timestamp"] <= c["timestamp"]
    assert lines[4] == {END_KEY: {"requests": 3, "dropped": 0}}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    trace = load_trace_file(path)
    assert [r.hash_ids for r in trace.requests] == [(0, 1, 2), (0, 3), (4,)]
    assert trace.header is not None and trace.header["tokens_per_id"] == 32
    assert trace.end == {"requests": 3, "dropped": 0}


def test_a_full_queue_drops_arrivals_and_counts_them(tmp_path: Path) -> None:
    rec = _record(tmp_path, max_pending=2)
    rec.arrive("a", 32, [b"1"])  # a never finishes while b, c arrive: all wait
    rec.arrive("b", 32, [b"2"])
    rec.arrive("c", 32, [b"3"])
    rec.finish("c", 1)  # dropped: its finish is ignored too
    assert rec.dropped == 1
    rec.close()
    lines = _lines(rec.files[0])
    assert [line.get("input_length") for line in lines[1:3]] == [32, 32]
    assert lines[-1] == {END_KEY: {"requests": 2, "dropped": 1}}


def test_files_rotate_by_size_and_number_ids_afresh(tmp_path: Path) -> None:
    rec = _record(tmp_path, max_bytes=200)
    for i in range(12):
        rec.arrive(f"r{i}", 64, [b"shared", b"own%d" % i])
        rec.finish(f"r{i}", 1)
    rec.close()
    assert len(rec.files) >= 3
    seen = 0
    for path in rec.files:
        trace = load_trace_file(path)
        assert trace.header is not None and trace.end is not None
        assert trace.requests[0].hash_ids == (0, 1), "each file numbers its ids from 0"
        assert all(r.hash_ids[0] == 0 for r in trace.requests), "stable within a file"
        seen += len(trace.requests)
    assert seen == 12


def test_a_failed_write_loses_its_line_whole_never_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.tiering_spec import traffic

    rec = _record(tmp_path)
    rec.arrive("a", 32, [b"1"])
    rec.finish("a", 1)
    time.sleep(0.2)
    real = traffic._write

    def half_then_full(fd: int, data: Any) -> int:
        monkeypatch.setattr(traffic, "_write", full)
        return real(fd, bytes(data[:5]))  # part of the line, then the disk is full

    def full(fd: int, data: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(traffic, "_write", half_then_full)
    rec.arrive("b", 32, [b"2"])
    rec.finish("b", 1)
    time.sleep(0.3)
    assert rec.dropped == 1
    monkeypatch.setattr(traffic, "_write", real)
    rec.arrive("c", 48, [b"3"])
    rec.finish("c", 1)
    rec.close()
    trace = load_trace_file(rec.files[0])  # nothing of b's line is left in the file
    assert [r.input_length for r in trace.requests] == [32, 48]
    assert trace.end == {"requests": 2, "dropped": 1}


def test_a_request_id_that_comes_back_is_a_new_line(tmp_path: Path) -> None:
    rec = _record(tmp_path)
    rec.arrive("a", 32, [b"1"])
    rec.arrive("long", 32, [b"2"])  # holds back what comes after it
    rec.finish("a", 1)
    rec.arrive("a", 64, [b"1", b"3"])  # vLLM may reuse an id once its request ended
    rec.finish("a", 2)
    rec.finish("long", 9)
    rec.close()
    trace = load_trace_file(rec.files[0])
    assert [(r.input_length, r.output_length) for r in trace.requests] == [
        (32, 1),
        (32, 9),
        (64, 2),
    ]


def test_the_folder_is_checked_as_an_fs_tier_root_when_the_scheduler_starts(
    tmp_path: Path,
) -> None:
    from kvtier.tiering_spec.build import build

    from .test_build import facts

    def scheduler(folder: str) -> Any:
        extra = {"cpu_bytes_to_use": 8 * 2 * 65536, "record_traffic_dir": folder}
        return build(facts(), parse_config(extra, tiering=False), tiering=False, name="t")

    side = scheduler(str(tmp_path / "rec")).scheduler()
    assert side.traffic is not None
    assert side.traffic.header["tokens_per_id"] == 32  # 2 blocks of 16 tokens
    assert side.traffic.header["bytes_per_id"] == 2 * 65536
    side.traffic.close()
    assert stat.S_IMODE(os.stat(tmp_path / "rec").st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(ConfigError, match=r"record_traffic_dir: directory .* writable by group"):
        scheduler(str(open_dir)).scheduler()
    with pytest.raises(ConfigError, match="record_traffic_max_bytes"):
        parse_config({"cpu_bytes_to_use": 1, "record_traffic_max_bytes": 10}, tiering=False)
    with pytest.raises(ConfigError, match="record_traffic_dir must be a folder"):
        parse_config({"cpu_bytes_to_use": 1, "record_traffic_dir": ""}, tiering=False)


@pytest.mark.parametrize(
    ("lines", "reason"),
    [
        (['{"kvtier_trace": {}}', '{"timestamp": 1'], r":2: not valid JSON"),
        (
            [
                '{"timestamp": 2, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
                '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [2]}',
            ],
            r":2: 'timestamp' 1 is earlier than 2 on line 1",
        ),
        (
            [
                '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
                '{"kvtier_trace": {}}',
            ],
            r":2: 'kvtier_trace' must be an object, on the trace's first line",
        ),
        (
            [
                '{"kvtier_trace_end": {}}',
                '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1]}',
            ],
            r":2: a line after the trace's end line \(line 1\)",
        ),
    ],
)
def test_bad_recordings_are_refused_with_the_line(lines: list[str], reason: str) -> None:
    with pytest.raises(TraceError, match=reason):
        parse_trace_file(lines, "rec.jsonl")


def test_salts_and_adapters_never_share_an_id(tmp_path: Path) -> None:
    """vLLM's block hashes cover a request's cache_salt and LoRA adapter: the record
    numbers them apart, and equal prompts with equal salts alike."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvtier.vllm_port.connector_reads import chunk_hashes

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    prompt = list(range(100, 164))  # 4 hash blocks, 2 chunks of 32 tokens

    def request(rid: str, **kwargs: Any) -> Any:
        return Request(
            rid, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher, **kwargs
        )

    reqs = {
        "plain": request("plain"),
        "plain-again": request("plain-again"),
        "salt-a": request("salt-a", cache_salt="a"),
        "salt-a-again": request("salt-a-again", cache_salt="a"),
        "salt-b": request("salt-b", cache_salt="b"),
        "lora": request("lora", lora_request=LoRARequest("bot", 1, str(tmp_path))),
    }
    (tmp_path / "rec").mkdir()
    rec = _record(tmp_path / "rec")
    for rid, req in reqs.items():
        rec.arrive(rid, req.num_prompt_tokens, chunk_hashes(req, 2))
        rec.finish(rid, 1)
    rec.close()
    got = dict(zip(reqs, (r.hash_ids for r in load_trace_file(rec.files[0]).requests)))
    assert all(len(ids) == 2 for ids in got.values())
    assert got["plain"] == got["plain-again"] and got["salt-a"] == got["salt-a-again"]
    apart = [got[k] for k in ("plain", "salt-a", "salt-b", "lora")]
    flat = [i for ids in apart for i in ids]
    assert len(set(flat)) == len(flat), f"an id shared across salts or adapters: {got}"
