"""The demo's two workloads, each run with and without kvtier on an in-process engine.

Every run's greedy outputs are compared token by token with a reference run that
has room for everything, so a row also says whether kvtier changed any output.

*Prefill tokens computed* is the engine's prompt work: tokens its scheduler ran a
forward over (summed from the scheduler outputs) minus one decode token per
generated token after the first. A preempted request that vLLM recomputes shows up
here; one whose KV kvtier restored does not.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.demo.model import BLOCK_TOKENS, ModelError, ModelSizes

Progress = Callable[[str], None]

# The tiering spec's per-tier hit counter (label "tier": the host tier, "fs", ...).
CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"
RECOMPUTE = "vllm:kvtier_recompute_"


@dataclass
class Row:
    """One run of a workload. Token counts are tokens; bytes are bytes."""

    run: str
    preemptions: int = 0
    prefill_tokens: int = 0
    restored_or_hit: dict[str, float] = field(default_factory=dict)
    bytes_moved: float = 0.0
    wall_s: float = 0.0
    outputs_match: bool = True
    mismatch_report: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class WorkloadReport:
    name: str
    description: str
    requests: int
    prompt_tokens: int
    generated_tokens: int
    rows: list[Row]

    @property
    def all_match(self) -> bool:
        return all(r.outputs_match for r in self.rows)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "rows": [r.as_dict() for r in self.rows],
            "all_outputs_match": self.all_match,
        }


def _base_engine(model: ModelSizes, max_model_len: int) -> dict[str, Any]:
    if model.max_positions < max_model_len:
        raise ModelError(
            f"--model {model.path}: supports {model.max_positions} positions; the demo "
            f"needs at least {max_model_len}"
        )
    return {
        "block_size": BLOCK_TOKENS,
        "enforce_eager": True,
        "dtype": "float32",
        "disable_log_stats": False,
        "max_model_len": max_model_len,
        "gpu_memory_utilization": 0.2,
        "seed": 0,
    }


def _row(name: str, result: Any, reference: Any, decode_tokens: int, **extra: Any) -> Row:
    from kvtier.testkit import compare_outputs

    cmp = compare_outputs(reference.outputs, result.outputs)
    return Row(
        run=name,
        preemptions=result.preemptions,
        prefill_tokens=max(0, result.scheduled_tokens - decode_tokens),
        wall_s=round(result.wall_s, 3),
        outputs_match=cmp.identical,
        mismatch_report="" if cmp.identical else cmp.report(),
        **extra,
    )


def _runner(
    model: ModelSizes, workload: Any, engine: dict[str, Any], step: Progress, name: str
) -> Callable[..., Any]:
    """``run(label, device_blocks, kv_transfer=None)``: one engine run of ``workload``."""
    from kvtier.testkit import kv_transfer_config, run_with

    def run(label: str, device_blocks: int, kv_transfer: dict[str, Any] | None = None) -> Any:
        step(f"{name}: {label}")
        extra = (
            {} if kv_transfer is None else {"kv_transfer_config": kv_transfer_config(kv_transfer)}
        )
        result, _ = run_with(
            model.path, workload, **engine, num_gpu_blocks_override=device_blocks, **extra
        )
        return result

    return run


def _labelled(result: Any, name: str, label: str) -> dict[str, float]:
    from kvtier.testkit import labelled_metric_values

    return labelled_metric_values(result.raw_metrics, name, label)


def preemption_workload(model: ModelSizes, step: Progress) -> WorkloadReport:
    """A decode node under memory pressure: 16 requests of long prompts in a KV cache of
    15 blocks, with ``RecomputeCPUOffloadConnector`` keeping preempted requests' KV in
    host DRAM.

    The engine is tuned as the recompute guide describes a decode node:
    ``max_num_batched_tokens`` equal to ``max_num_seqs``, so a preempted request's
    prompt is recomputed 16 tokens a step. vLLM admits a request when its whole prompt
    fits; the decode growth of the older running request then preempts it, right after
    its prefill. vLLM's device prefix cache is off, so vLLM alone recomputes every
    preempted token (with it on, freed blocks that no other request reused come back
    for free and vLLM alone recomputes less).
    """
    from kvtier.testkit import make_workload

    requests, prompt, generated = 16, 192, 64
    engine = {
        **_base_engine(model, 256),
        "max_num_seqs": 16,
        "max_num_batched_tokens": 16,
        "enable_prefix_caching": False,
    }
    workload = make_workload(
        requests, prompt, generated, vocab=model.vocab, exclude=model.special_ids
    )
    decode = requests * (generated - 1)
    blocks_per_request = -(-(prompt + generated) // BLOCK_TOKENS)
    # Room for every request's KV at once, with slack for the host block alignment.
    budget = int(model.kv_bytes_per_block * requests * blocks_per_request * 1.25) + (1 << 20)
    connector = {
        "kv_connector": "RecomputeCPUOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use_per_rank": budget,
            "enable_offload_prefix_caching": False,
        },
    }
    run = _runner(model, workload, engine, step, "preemption")
    reference = run("reference (room for all)", 160)
    plain = run("vLLM alone (recompute)", 15)
    kv = run("vLLM + kvtier RecomputeCPUOffloadConnector", 15, connector)
    moved = sum(_labelled(kv, RECOMPUTE + "transfer_bytes", "direction").values())
    rows = [
        _row("reference (room for all)", reference, reference, decode),
        _row("vLLM alone (recompute)", plain, reference, decode),
        _row(
            "vLLM + kvtier recompute connector",
            kv,
            reference,
            decode,
            restored_or_hit={"restored": kv.metrics.get(RECOMPUTE + "tokens_restored", 0.0)},
            bytes_moved=moved,
        ),
    ]
    return WorkloadReport(
        "preemption",
        f"decode node: {requests} requests x ({prompt} prompt + {generated} generated "
        "tokens), a device KV cache of 15 blocks of 32 tokens, max_num_batched_tokens = "
        "max_num_seqs = 16, no device prefix cache: vLLM preempts and recomputes 16 tokens "
        "a step; kvtier keeps preempted KV in host DRAM",
        requests,
        requests * prompt,
        requests * generated,
        rows,
    )


def prefix_workload(model: ModelSizes, fs_root: Path, step: Progress) -> WorkloadReport:
    """Prefix-heavy prompts: 8 long prefixes asked twice, a device cache of 12 blocks
    that cannot keep them, then kvtier's host tier, then host + fs tiers."""
    from kvtier.testkit import PREFIX_ENGINE, make_prefix_workload

    groups, prefix, suffix, rounds = 8, 128, 32, 2
    workload = make_prefix_workload(
        groups, prefix, suffix, rounds, vocab=model.vocab, exclude=model.special_ids
    )
    engine = {**_base_engine(model, 256), "max_num_seqs": PREFIX_ENGINE["max_num_seqs"]}
    requests = len(workload)
    decode = requests * (workload.max_tokens - 1)
    block = model.kv_bytes_per_block

    def offload(spec: str, host_blocks: int, fs: bool) -> dict[str, Any]:
        extra: dict[str, Any] = {"cpu_bytes_to_use": host_blocks * block, "spec_name": spec}
        if fs:
            extra["secondary_tiers"] = [{"type": "fs", "root_dir": str(fs_root)}]
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }

    shutil.rmtree(fs_root, ignore_errors=True)
    run = _runner(model, workload, engine, step, "prefix")
    reference = run("reference (room for all)", 200)
    plain = run("vLLM alone (device prefix cache only)", 12)
    host = run(
        "vLLM + kvtier CPUOffloadingSpec (host tier)", 12, offload("CPUOffloadingSpec", 64, False)
    )
    tiered = run(
        "vLLM + kvtier TieringOffloadingSpec (small host tier + fs tier)",
        12,
        offload("TieringOffloadingSpec", 12, True),
    )

    def hits(result: Any) -> dict[str, float]:
        out = {"device": result.metrics.get("vllm:prefix_cache_hits", 0.0)}
        ext = result.metrics.get("vllm:external_prefix_cache_hits", 0.0)
        if ext:
            out["offload"] = ext
        for tier, chunks in _labelled(result, CHUNK_HITS, "tier").items():
            out[f"{tier} chunks"] = chunks
        return out

    def fs_bytes(result: Any) -> float:
        return result.metrics.get("vllm:kv_offload_tiering_read_bytes", 0.0) + result.metrics.get(
            "vllm:kv_offload_tiering_write_bytes", 0.0
        )

    rows = [
        _row(
            "reference (room for all)",
            reference,
            reference,
            decode,
            restored_or_hit=hits(reference),
        ),
        _row("vLLM alone (device cache)", plain, reference, decode, restored_or_hit=hits(plain)),
        _row("vLLM + kvtier host tier", host, reference, decode, restored_or_hit=hits(host)),
        _row(
            "vLLM + kvtier host + fs tiers",
            tiered,
            reference,
            decode,
            restored_or_hit=hits(tiered),
            bytes_moved=fs_bytes(tiered),
        ),
    ]
    return WorkloadReport(
        "prefix",
        f"{groups} prefixes of {prefix} tokens, each asked {rounds} times with its own "
        f"{suffix}-token suffix, in a device KV cache of 12 blocks of 32 tokens",
        requests,
        workload.prompt_tokens,
        requests * workload.max_tokens,
        rows,
    )
