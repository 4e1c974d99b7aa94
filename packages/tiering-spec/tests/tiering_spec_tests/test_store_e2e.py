"""End to end: two vLLM engine processes, each with its own host region, share one
Mooncake Store through kvtier's store tier (``{"type": "mooncake", ...}``).

A process lends the store its memory, as a store service does, so objects outlive the
engine that put them. Engine A serves the prefix workload; engine B, started fresh,
serves it again from A's objects. The master is killed in the middle of a run: the
engine goes on with misses. Needs Mooncake (the ``pd`` nox session).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.testkit import script_env

from .mooncake_env import Master, _mooncake, lend_memory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SCRIPT = "tiering_spec_tests.store_engine_script"
DECODE_TOKENS = 16 * 7  # 16 requests x 8 generated tokens, the first from the prefill


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    _mooncake()
    master = Master(tmp_path_factory.mktemp("mooncake"))
    lender = lend_memory(master, 256 << 20)
    yield master
    lender.kill()
    lender.wait(10)
    master.stop()


def tier(master: Master) -> dict[str, Any]:
    return {
        "type": "mooncake",
        "master_server_address": f"127.0.0.1:{master.rpc}",
        "metadata_server": f"http://127.0.0.1:{master.http}/metadata",
        "protocol": "tcp",
        "local_hostname": "127.0.0.1",
        "global_segment_size": 0,  # the lender holds the objects
        "local_buffer_size": 16 << 20,
    }


def engine(tmp_path: Path, mode: str, cfg: Any = None, pause: Path | None = None) -> Any:
    out = tmp_path / f"{mode}-{time.monotonic_ns()}.json"
    args = [sys.executable, "-m", SCRIPT, str(out), mode]
    if cfg is not None:
        args.append(json.dumps(cfg))
    if pause is not None:
        args.append(str(pause))
    env = script_env(__file__, {"PYTHONHASHSEED": "0"})  # one block-hash seed for all
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out


def finish(started: Any) -> dict[str, Any]:
    proc, out = started
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log.decode(errors="replace")[-4000:]
    return dict(json.loads(out.read_text()))


def identical(expected: list[list[int]], got: list[list[int]]) -> str:
    bad = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
    return "" if not bad and len(expected) == len(got) else f"requests {bad} differ"


def test_a_fresh_engine_serves_another_engines_prefixes_from_the_store(
    store: Master, tmp_path: Path
) -> None:
    reference = finish(engine(tmp_path, "reference"))
    alone = finish(engine(tmp_path, "host"))
    a = finish(engine(tmp_path, "store", tier(store)))
    assert a["writes"] > 0, a
    # A corrupted object (another writer's bytes under the key) must be a miss.
    client = store.client()
    victim = a["objects"][0]
    size = client.get_size(victim)
    assert client.remove(victim, True) == 0 and client.put(victim, b"\0" * size) == 0
    b = finish(engine(tmp_path, "store", tier(store)))
    assert not identical(reference["outputs"], b["outputs"]), identical(
        reference["outputs"], b["outputs"]
    )
    assert b["faults"]["corrupt"] == 1, b["faults"]
    # vLLM's tiering metrics: engine B's lookups were first answered "not known yet" (the
    # tier asks the store in the background), then resolved: both delays observed.
    m = b["metrics"]
    sync = m.get("vllm:kv_offload_tiering_lookup_sync_delay_seconds:count", 0)
    waited = m.get("vllm:kv_offload_tiering_lookup_async_delay_seconds:count", 0)
    assert 0 < waited <= sync, m
    assert m.get("vllm:kv_offload_tiering_backpressure_store_latency_ema", 0) >= 0, m
    computed = b["scheduled_tokens"] - DECODE_TOKENS
    without = alone["scheduled_tokens"] - DECODE_TOKENS
    print(f"prompt tokens computed: {without} without the store tier, {computed} with it")
    print("engine B:", {k: v for k, v in b.items() if k not in ("outputs", "objects")})
    assert computed <= 0.2 * without, (computed, without, b)


def test_the_master_killed_mid_run_leaves_the_engine_serving(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _mooncake()
    master = Master(tmp_path_factory.mktemp("mooncake-killed"))
    lender = lend_memory(master, 128 << 20)
    try:
        reference = finish(engine(tmp_path, "reference"))
        assert finish(engine(tmp_path, "store", tier(master)))["writes"] > 0
        pause = tmp_path / "pause"
        pause.mkdir()
        started = engine(tmp_path, "store", tier(master), pause)
        deadline = time.monotonic() + 300
        while not (pause / "half").exists() and time.monotonic() < deadline:
            assert started[0].poll() is None, started[0].communicate()[0].decode()[-4000:]
            time.sleep(0.1)
        master.stop(kill=True)  # as a crash
        (pause / "go").write_text("go")
        c = finish(started)
    finally:
        lender.kill()
        lender.wait(10)
        master.stop()
    assert not identical(reference["outputs"], c["outputs"]), identical(
        reference["outputs"], c["outputs"]
    )
    assert c["hits"] > 0, "the first half was not served from the store"
    assert c["faults"]["unreachable"] + c["faults"]["unreadable"] > 0, c["faults"]
    # With the master gone, write-throughs are dropped: vLLM's back-pressure counters.
    m = c["metrics"]
    stores = m.get("vllm:kv_offload_tiering_backpressure_stores_dropped", 0)
    blocks = m.get("vllm:kv_offload_tiering_backpressure_blocks_dropped", 0)
    assert 0 < stores <= blocks, m
