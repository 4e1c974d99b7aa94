"""kvtier's quicker scheduler-side steps plan exactly what vLLM's own do.

:mod:`kvtier.vllm_port.store_planning` skips, per step, the requests that cannot store
and the key updates that find no new hash, and plans a quiet step (nothing admitted,
loaded, preempted or finished) without vLLM's event handling;
:mod:`kvtier.vllm_port.lookups` looks a prefix up in one call and answers a one-tier
hit's sources at once; :mod:`kvtier.vllm_port.lookup_memo` answers a waiting request's
lookup again when nothing it read changed. Here a real engine
runs a workload with prefix reuse, preemptions and stores during decode twice, with and
without them, and every step's connector metadata (store and load jobs with their
blocks, jobs to flush), every hit's split by tier and the lookup counters must be the
same.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from .e2e_support import ENGINE, offload_config, prefix_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
import kvtier.testkit as testkit  # noqa: E402

pytest.importorskip("vllm")

from kvtier.testkit import Workload, free_llm, make_llm, run_workload  # noqa: E402
from kvtier.testkit.engine import kv_connector_of  # noqa: E402
from kvtier.vllm_port import lookup_memo, lookups, store_planning  # noqa: E402

# 4 requests of 160 prompt tokens decoding 48 tokens each need 28 blocks; 16 preempt.
TIGHT = {**ENGINE, "max_num_seqs": 4, "num_gpu_blocks_override": 16}
WORKLOAD = Workload(prefix_prompts(), 48)


@pytest.fixture(scope="module")
def model() -> Path:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return testkit.make_tiny_llama()


def _ids(spec: Any) -> list[int]:
    ids = getattr(spec, "block_ids", None)
    return [] if ids is None else [int(b) for b in ids]


def _jobs(jobs: Any) -> dict[int, tuple[str, list[int], list[int]]]:
    return {
        # vLLM's request ids end in a random suffix; the index names the request.
        job_id: (job.req_id.split("-")[0], _ids(job.src_spec), _ids(job.dst_spec))
        for job_id, job in (jobs or {}).items()
    }


def _plans(
    model: Path, prompt_only: bool
) -> tuple[list[Any], list[list[int]], bool, tuple[int, int]]:
    """Every step's metadata of one run, its outputs, whether kvtier's steps ran, and
    the host tier's lookup counters (queries, hits)."""
    kv = offload_config("CPUOffloadingSpec", host_chunks=256)
    kv["kv_connector_extra_config"]["offload_prompt_only"] = prompt_only
    llm = make_llm(model, **TIGHT, kv_transfer_config=testkit.kv_transfer_config(kv))
    try:
        connector = kv_connector_of(llm)
        scheduler = connector.connector_scheduler
        quick = "_build_store_jobs" in vars(scheduler)
        build = connector.build_connector_meta
        steps: list[Any] = []

        def recorded(scheduler_output: Any) -> Any:
            meta = build(scheduler_output)
            steps.append(
                (
                    _jobs(getattr(meta, "store_jobs", None)),
                    _jobs(getattr(meta, "load_jobs", None)),
                    sorted(getattr(meta, "jobs_to_flush", None) or ()),
                )
            )
            return meta

        connector.build_connector_meta = recorded
        sources = connector.get_external_cache_hit_sources

        def split(request: Any, num_external_tokens: int) -> Any:
            found = sources(request, num_external_tokens)
            steps.append(("sources", request.request_id.split("-")[0], found))
            return found

        connector.get_external_cache_hit_sources = split
        one_call = "_maximal_prefix_lookup" in vars(scheduler)
        result = run_workload(llm, WORKLOAD)
        quiet = getattr(scheduler, "kvtier_quiet_steps", None)
        repeated = getattr(scheduler, "kvtier_repeated_lookups", None)
        counters = scheduler.manager.core.counters
        counts = (counters.host_queries, counters.host_hits)
    finally:
        free_llm(llm)
    assert result.preemptions > 0, "the workload must preempt"
    if quick and quiet is not None:
        # Most steps plan nothing but the running requests' keys: kvtier's quiet path.
        assert 0 < quiet < len([s for s in steps if s[0] != "sources"]), quiet
    if quick and repeated is not None:
        # Preempted requests wait for room: vLLM asks about them again each step.
        assert repeated > 0, "no lookup was answered again"
    return steps, result.outputs, quick and one_call, counts


@pytest.mark.parametrize("prompt_only", [True, False], ids=["prompt-only", "decode-stores"])
def test_quick_steps_plan_what_vllm_plans(
    model: Path, prompt_only: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    quick_steps, quick_out, applied, quick_counts = _plans(model, prompt_only)
    if not applied:
        pytest.skip("this vLLM's offloading scheduler is not the shape kvtier speeds up")
    with monkeypatch.context() as mp:
        mp.setattr(store_planning, "speed_up", lambda scheduler: False)
        mp.setattr(lookups, "speed_up", lambda scheduler: (False, False))
        mp.setattr(lookup_memo, "install", lambda scheduler: False)
        vllm_steps, vllm_out, applied_again, vllm_counts = _plans(model, prompt_only)
    assert not applied_again
    plans = [step for step in vllm_steps if step[0] != "sources"]
    assert any(stores for stores, _, _ in plans), "the workload must store"
    assert any(loads for _, loads, _ in plans), "the workload must load"
    assert any(step[0] == "sources" and step[2] for step in vllm_steps), "hits must split"
    assert len(quick_steps) == len(vllm_steps), "the two runs took different numbers of steps"
    for step, (quick, vllm) in enumerate(zip(quick_steps, vllm_steps)):
        assert quick == vllm, f"step {step}: kvtier planned {quick}, vLLM {vllm}"
    assert quick_out == vllm_out
    assert quick_counts == vllm_counts, "lookups answered again must count as asked"
