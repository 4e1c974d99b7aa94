"""The way users run vLLM: ``vllm serve`` with the guides' ``--kv-transfer-config``, and an
OpenAI client sending concurrent requests. Greedy completions must equal vLLM's alone, and
kvtier's figures must show on the server's ``/metrics``.

vLLM alone is the same engine (the same arguments as the server's command line) run
in-process on the same prompts: greedy decoding gives the same tokens however requests
are batched, which is what every engine test here relies on, and a server of its own
for the reference only cost two more `vllm serve` start-ups per test. The server under
test runs its engine in a process of its own, as `vllm serve` does by default.

The configurations are the guides' JSON with one change: host budgets sized for this
machine (the guides reserve 8 and 16 GiB).
"""

from __future__ import annotations

import concurrent.futures
import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvtier.testkit import (
    FORCED_PREEMPTION_ENGINE,
    PREFIX_ENGINE,
    Workload,
    WorkloadResult,
    requires_vllm,
    run_with,
)
from kvtier.testkit.server import VllmServer, kv_transfer_arg, prometheus_values

pytestmark = [pytest.mark.e2e, requires_vllm]

COMMON = ["--dtype", "float32", "--enforce-eager", "--block-size", "32", "--seed", "0",
          "--max-model-len", "256", "--gpu-memory-utilization", "0.2"]  # fmt: skip
PREEMPTION = [*COMMON, "--num-gpu-blocks-override", "16", "--max-num-seqs", "16"]
PREFIX = [*COMMON, "--num-gpu-blocks-override", "12", "--max-num-seqs", "2"]
# The same engines in-process, for vLLM alone (the testkit's recipes are these flags).
ALONE = {
    "preemption": {**FORCED_PREEMPTION_ENGINE, "seed": 0},
    "prefix": {**PREFIX_ENGINE, "seed": 0, "gpu_memory_utilization": 0.2},
}

# The guide's online-serving example for the recompute connector (decode node), with a
# host budget of 256 MiB per rank instead of 16 GiB.
RECOMPUTE_CONFIG = {
    "kv_connector": "RecomputeCPUOffloadConnector",
    "kv_role": "kv_consumer",
    "kv_connector_extra_config": {
        "cpu_bytes_to_use_per_rank": 256 << 20,
        "enable_offload_prefix_caching": False,
    },
}
RECOMPUTE_ARGS = [
    *kv_transfer_arg(RECOMPUTE_CONFIG),
    "--additional-config", json.dumps({"recompute_scheduler_enable": True}),
]  # fmt: skip


def tiering_config(root_dir: Path) -> dict[str, Any]:
    """The guide's multi-tier example, with a host tier too small for the working set
    (so the fs tier serves part of it) and the fs tier under the test's folder."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": 12 * 65536,  # 12 blocks of the tiny model
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [{"type": "fs", "root_dir": str(root_dir)}],
        },
    }


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(n)]


def prefix_prompts() -> list[list[int]]:
    """8 prefixes of 128 tokens, each asked twice with its own 32-token suffix."""
    rng = random.Random(1)
    heads = random_prompts(8, 128, seed=2)
    return [h + [rng.randrange(3, 512) for _ in range(32)] for _ in range(2) for h in heads]


def complete_all(
    server: VllmServer, model: Path, prompts: list[list[int]], max_tokens: int, workers: int
) -> list[list[int]]:
    """Greedy completions of every prompt, ``workers`` requests at a time; token ids."""
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=600)

    def one(prompt: list[int]) -> list[int]:
        resp = client.completions.create(
            model=str(model),
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        ids = getattr(resp.choices[0], "token_ids", None)
        assert ids is not None, "the server did not return token ids"
        return list(ids)

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, prompts))


def vllm_alone(
    model: Path, engine: str, prompts: list[list[int]], max_tokens: int
) -> WorkloadResult:
    """Greedy outputs of vLLM alone: the server's engine, in this process."""
    workload = Workload(tuple(tuple(p) for p in prompts), max_tokens)
    result, _ = run_with(model, workload, **ALONE[engine])
    return result


def serve_and_complete(
    model: Path, args: list[str], prompts: list[list[int]], max_tokens: int, workers: int
) -> tuple[list[list[int]], str, str]:
    """Start a server, complete the prompts, return outputs, /metrics text and the log."""
    # Its engine in a process of its own (vLLM's default), whatever in-process engines
    # this pytest process made before.
    with VllmServer(model, args, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) as server:
        outputs = complete_all(server, model, prompts, max_tokens, workers)
        return outputs, server.metrics(), server.log_text()


def total(metrics: str, name: str) -> float:
    return sum(prometheus_values(metrics, name).values())


def assert_same(expected: list[list[int]], actual: list[list[int]]) -> None:
    differ = [i for i, (a, b) in enumerate(zip(expected, actual)) if a != b]
    assert not differ, f"requests {differ} differ from vLLM alone"


def test_recompute_connector_through_vllm_serve(tiny_model: Path) -> None:
    prompts = random_prompts(16, 40, seed=0)
    alone = vllm_alone(tiny_model, "preemption", prompts, 200)
    assert alone.preemptions > 0, "the workload must preempt"
    expected = alone.outputs
    actual, metrics, log = serve_and_complete(
        tiny_model, PREEMPTION + RECOMPUTE_ARGS, prompts, 200, 16
    )
    assert_same(expected, actual)
    assert total(metrics, "vllm:num_preemptions_total") > 0
    restored = total(metrics, "vllm:kvtier_recompute_tokens_restored_total")
    assert restored > 0, "no tokens restored according to /metrics"
    assert "Recompute preemption offload enabled for request" in log


def test_tiering_spec_through_vllm_serve(tiny_model: Path, tmp_path: Path) -> None:
    prompts = prefix_prompts()
    expected = vllm_alone(tiny_model, "prefix", prompts, 8).outputs
    args = PREFIX + kv_transfer_arg(tiering_config(tmp_path / "kv"))
    actual, metrics, _ = serve_and_complete(tiny_model, args, prompts, 8, 2)
    assert_same(expected, actual)
    assert total(metrics, "vllm:external_prefix_cache_hits_total") > 0, "no offload hits"
    by_tier = prometheus_values(metrics, "vllm:kv_offload_tiering_chunk_hits_total")
    assert any("fs" in labels and v > 0 for labels, v in by_tier.items()), by_tier
    # vLLM's tiering metrics of lookup delays and back-pressure, labelled by tier: every
    # fs lookup that answered is observed once; the fs tier's writes (more than the
    # EMA's warm-up of 10) set its store latency EMA.
    fs_queries = sum(
        v
        for labels, v in prometheus_values(
            metrics, "vllm:kv_offload_tiering_chunk_queries_total"
        ).items()
        if 'tier="fs"' in labels
    )
    sync = prometheus_values(metrics, "vllm:kv_offload_tiering_lookup_sync_delay_seconds_count")
    assert (
        fs_queries > 0
        and sum(v for labels, v in sync.items() if 'tier="fs"' in labels) == fs_queries
    ), (sync, fs_queries)
    ema = prometheus_values(metrics, "vllm:kv_offload_tiering_backpressure_store_latency_ema")
    assert any('tier="fs"' in labels and 0 < v < 10 for labels, v in ema.items()), ema
    for name in (
        "vllm:kv_offload_tiering_lookup_async_delay_seconds",
        "vllm:kv_offload_tiering_backpressure_blocks_dropped",
    ):
        assert f"# TYPE {name}" in metrics, f"{name} is not declared"
