"""The guide's P/D decode node for real: vLLM's MooncakeConnector moves each prompt's KV
from a prefill server to a decode server over TCP, and on the decode node, whose
MultiConnector holds Mooncake and this connector (the guide's "Usage with P/D
Disaggregation", the Mooncake child under vLLM's name), requests are preempted and
restored from host memory.

Needs ``mooncake-transfer-engine-non-cuda`` (and Debian's ``libibverbs1``): the ``pd``
nox session installs both and sets ``KVTIER_PD_MOONCAKE=1``, which turns a missing
Mooncake into a failure; elsewhere the test skips.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvtier.testkit import FORCED_PREEMPTION_WORKLOAD, requires_vllm, script_env
from kvtier.testkit.server import VllmServer, free_port, kv_transfer_arg, prometheus_values

pytestmark = [pytest.mark.e2e, requires_vllm]

if os.environ.get("KVTIER_PD_MOONCAKE") != "1":
    pytest.importorskip("mooncake.engine", reason="Mooncake is not installed")

SHIM = "recompute_connector_tests.mooncake_cpu"
MOONCAKE = {
    "kv_connector": "MooncakeConnector",
    "kv_connector_module_path": SHIM,
    "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
}
PREFILL = {**MOONCAKE, "kv_role": "kv_producer", "engine_id": "prefill0"}
DECODE = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_consumer",
    "kv_connector_extra_config": {
        "connectors": [
            {**MOONCAKE, "kv_role": "kv_consumer"},
            {
                "kv_connector": "RecomputeCPUOffloadConnector",
                "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"cpu_bytes_to_use_per_rank": 64 << 20},
            },
        ]
    },
}
COMMON = ["--block-size", "32", "--dtype", "float32", "--enforce-eager", "--seed", "0"]
PROMPTS = [list(p) for p in FORCED_PREEMPTION_WORKLOAD.prompts[:8]]
MAX_TOKENS = 150


def post(server: VllmServer, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        server.base_url + "/completions",
        data=json.dumps({"model": "tiny", "temperature": 0.0, "ignore_eos": True, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def total(server: VllmServer, name: str, label: str = "") -> float:
    return sum(v for k, v in prometheus_values(server.metrics(), name).items() if label in k)


def test_guide_pd_decode_node_with_real_mooncake_restores_preempted_requests(
    tiny_model: Path, tmp_path: Path
) -> None:
    bootstrap = free_port()
    env = {
        "PYTHONPATH": script_env(__file__)["PYTHONPATH"],
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    served = ["--served-model-name", "tiny", "--max-model-len", "256", *COMMON]
    prefill = VllmServer(
        tiny_model,
        [*served, "--num-gpu-blocks-override", "64", *kv_transfer_arg(PREFILL)],
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": "0"},
        log_path=tmp_path / "prefill.log",
    )
    # The decode node: 16 device blocks for 8 requests of 40 + 150 tokens (6 blocks
    # each), so requests are preempted and resumed.
    decode = VllmServer(
        tiny_model,
        [
            *served,
            "--num-gpu-blocks-override",
            "16",
            "--max-num-seqs",
            "8",
            *kv_transfer_arg(DECODE),
        ],
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": "1"},
        log_path=tmp_path / "decode.log",
    )
    with prefill, decode:
        transfers = []
        for prompt in PROMPTS:
            tid = str(uuid.uuid4())
            post(
                prefill,
                {
                    "prompt": prompt,
                    "max_tokens": 1,
                    "kv_transfer_params": {
                        "do_remote_decode": True,
                        "do_remote_prefill": False,
                        "transfer_id": tid,
                    },
                },
            )
            transfers.append(
                {
                    "do_remote_decode": False,
                    "do_remote_prefill": True,
                    "transfer_id": tid,
                    "remote_engine_id": "prefill0",
                    "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap}",
                }
            )
        texts: list[str | None] = [None] * len(PROMPTS)
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                body = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS}
                reply = post(decode, {**body, "kv_transfer_params": transfers[i]})
                texts[i] = reply["choices"][0]["text"]
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        assert not errors, f"{errors[0]!r}\n{decode.log_tail()}"
        # One engine, room for everything: the reference.
        expected = [
            post(prefill, {"prompt": p, "max_tokens": MAX_TOKENS})["choices"][0]["text"]
            for p in PROMPTS
        ]
        assert texts == expected, "decode outputs differ from a single engine's"
        remote = total(decode, "vllm:prompt_tokens_by_source_total", "external_kv_transfer")
        assert remote >= sum(len(p) for p in PROMPTS) - len(PROMPTS), (
            f"only {remote} prompt tokens came from the prefill node"
        )
        assert total(decode, "vllm:num_preemptions_total") > 0, "no preemption on decode"
        restored = total(decode, "vllm:kvtier_recompute_tokens_restored_total")
        assert restored > 0, f"nothing restored:\n{decode.log_tail()}"
