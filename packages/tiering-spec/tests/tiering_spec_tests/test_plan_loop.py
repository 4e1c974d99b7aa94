"""The loop closes: serve a window of the shipped trace through ``vllm serve`` with the
traffic recorded, plan from the recording at the engine's own capacities, and find the
share of prompt tokens the plan says come from outside the device where the engine's
own metrics counted it (within 5 points; on this window, one request at a time, the
two agree to the token).

Each trace id is one 32-token block of the tiny model (its prompt: its ids' tokens,
at most 30 of them, then one token of its own); requests go one at a time, as the
replay serves them. The device holds 40 blocks (the longest prompt and a few more),
in front of a host tier of 256 or 2,048 blocks with the default policy.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from kvtier.testkit import make_tiny_llama  # noqa: E402
from kvtier.testkit.server import VllmServer, kv_transfer_arg, prometheus_values  # noqa: E402
from kvtier.tiering_spec import plan  # noqa: E402
from kvtier.tiering_spec.tracefile import load_trace  # noqa: E402

WINDOW = 300  # requests of the shipped conversation trace
MAX_IDS = 30  # a prompt's ids at most (the tiny model's 1,024 positions)
TOKENS = 32  # one id: one device block, one offloaded chunk
DEVICE = 40
ENGINE = ["--dtype", "float32", "--enforce-eager", "--block-size", str(TOKENS), "--seed", "0",
          "--max-model-len", "1024", "--gpu-memory-utilization", "0.2", "--max-num-seqs", "1",
          "--num-gpu-blocks-override", str(DEVICE)]  # fmt: skip
CHUNK_BYTES = 65536  # one block of the tiny model


def _prompts() -> list[list[int]]:
    def block(i: int) -> list[int]:
        return [3 + (i * 7919 + j * 104729) % 500 for j in range(TOKENS)]

    return [
        [t for b in r.hash_ids[:MAX_IDS] for t in block(b)] + [3 + n % 500]
        for n, r in enumerate(load_trace()[:WINDOW])
    ]


@pytest.fixture(scope="module")
def model() -> Path:
    return make_tiny_llama()  # type: ignore[no-any-return]


def _serve(model: Path, folder: Path, host_blocks: int) -> float:
    """Serve the window; the share of prompt tokens vLLM counted as the connector's."""
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": host_blocks * CHUNK_BYTES,
            "spec_name": "CPUOffloadingSpec",
            "record_traffic_dir": str(folder),
        },
    }
    args = ENGINE + kv_transfer_arg(config)
    with VllmServer(model, args, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=600)
        for prompt in _prompts():
            client.completions.create(
                model=str(model), prompt=prompt, max_tokens=1, temperature=0.0
            )
        time.sleep(0.5)  # the record's writer polls every 50 ms
        metrics = server.metrics()

    def total(name: str) -> float:
        return sum(prometheus_values(metrics, name).values())

    return total("vllm:external_prefix_cache_hits_total") / total("vllm:prompt_tokens_total")


@pytest.mark.parametrize("host_blocks", [256, 2048])
def test_the_plan_of_a_recorded_run_finds_what_the_engine_counted(
    model: Path, tmp_path: Path, host_blocks: int
) -> None:
    engine_share = _serve(model, tmp_path / "traffic", host_blocks)
    (recorded,) = (tmp_path / "traffic").glob("traffic-*.jsonl")
    out = tmp_path / "plan.json"
    args = ["--trace", str(recorded), "--capacities", str(host_blocks), "--policies", "frecency"]
    assert plan.main([*args, "--workers", "1", "--no-progress", "--json", str(out)]) == 0
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["device_ids"] == DEVICE, "the device's blocks, from the recording's header"
    planned = report["outside_device_tokens"]["frecency"][0]
    print(f"host {host_blocks}: engine {engine_share:.4f}, plan {planned:.4f}")
    assert abs(planned - engine_share) <= 0.05, (planned, engine_share)
    if host_blocks == 2048:
        assert engine_share > 0.05, "the window must reuse what the device dropped"
        _paste_and_serve(model, recorded, tmp_path)


def _paste_and_serve(model: Path, recorded: Path, tmp_path: Path) -> None:
    """The recommendation's ``kv_transfer_config``, pasted as printed (its fs folder
    aside), starts ``vllm serve`` and serves."""
    out = tmp_path / "recommend.json"
    args = ["--trace", str(recorded), "--fs-root", str(tmp_path / "fs"), "--threshold", "1"]
    assert plan.main([*args, "--workers", "1", "--no-progress", "--json", str(out)]) == 0
    config = json.loads(out.read_text())["recommendation"]["kv_transfer_config"]
    serve = ENGINE + kv_transfer_arg(config)
    with VllmServer(model, serve, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=600)
        for prompt in _prompts()[:4]:
            client.completions.create(
                model=str(model), prompt=prompt, max_tokens=1, temperature=0.0
            )
        assert "kvtier" in server.log_text()
