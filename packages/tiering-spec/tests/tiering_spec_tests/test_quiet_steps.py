"""Worker steps that move nothing answer at once, and still report what ends in them.

A step whose metadata moves nothing (no load, flush or store, none deferred) on a
worker with nothing in flight has nothing to report, and the connector answers vLLM's
questions for it without asking vLLM's code. A copy still in flight keeps its steps on
vLLM's path: a store that ends while the request decodes (steps that move nothing) is
reported in the step it ends, not when the request finishes; and in every step that
takes the quick path, vLLM's own code, asked the same, finds nothing either. Real engine
(vLLM's CPU platform), with the copy engine's asynchronous CPU backend and slow stores,
as on an accelerator where a copy ends steps after it started.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import kvtier.testkit as testkit
from kvtier.testkit import Workload, free_llm, make_llm, run_workload
from kvtier.testkit.engine import kv_connector_of, scheduler_of

from .e2e_support import ENGINE, offload_config

pytestmark = pytest.mark.e2e

STORE_SECONDS = 0.1
# One request: a 3-block prompt, then decoding steps that move nothing (prompts only
# are stored) for much longer than a store takes.
WORKLOAD = Workload((tuple(range(7, 7 + 96)),), 150)


def slow_asynchronous_stores(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Copies on the CPU backend's own threads (as a device stream would run them),
    each store taking at least ``seconds``, until the test ends."""
    from kvtier.npu_copy import TransferEngine
    from kvtier.npu_copy.cpu_backend import CPUBackend

    init, copy = TransferEngine.__init__, CPUBackend._copy

    def asynchronous_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "asynchronous": True})

    def slow_copy(self: Any, device_ids: Any, host_ids: Any, *, to_host: bool) -> None:
        if to_host:
            time.sleep(seconds)
        copy(self, device_ids, host_ids, to_host=to_host)

    monkeypatch.setattr(TransferEngine, "__init__", asynchronous_init)
    monkeypatch.setattr(CPUBackend, "_copy", slow_copy)


def test_a_store_ending_in_a_step_that_moves_nothing_is_reported(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = offload_config("CPUOffloadingSpec", host_chunks=16)
    slow_asynchronous_stores(monkeypatch, STORE_SECONDS)
    llm = make_llm(tiny_model, **ENGINE, kv_transfer_config=testkit.kv_transfer_config(kv))
    try:
        scheduler = scheduler_of(llm)
        connector = kv_connector_of(llm)
        pool = connector.connector_scheduler.manager.core.pool
        update = scheduler.update_from_output
        # Per step: host blocks still being stored, requests still running.
        steps: list[tuple[int, int]] = []

        def updated(*args: Any, **kwargs: Any) -> Any:
            out = update(*args, **kwargs)
            steps.append((pool.num_storing, len(scheduler.running)))
            return out

        scheduler.update_from_output = updated
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()
        answer = worker.build_connector_worker_meta
        quiet = {"steps": 0}
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector as vllms,
        )

        def built(*args: Any, **kwargs: Any) -> Any:
            if getattr(worker, "_quiet_step", False):
                quiet["steps"] += 1
                # What vLLM's own code answers in the same step: nothing either.
                assert vllms.get_finished(worker, set()) == (set(), set())
                assert vllms.get_block_ids_with_load_errors(worker) == set()
                assert vllms.build_connector_worker_meta(worker) is None
            return answer(*args, **kwargs)

        worker.build_connector_worker_meta = built
        run_workload(llm, WORKLOAD)
    finally:
        free_llm(llm)
    storing = [i for i, (n, _) in enumerate(steps) if n]
    assert storing, f"the prompt was never stored: {steps}"
    done = next((i for i in range(storing[0], len(steps)) if not steps[i][0]), None)
    assert done is not None, f"the store never ended: {steps}"
    assert steps[done][1] == 1, f"the store was reported only when the request ended: {steps}"
    if quiet["steps"] == 0 and hasattr(worker, "_quiet_step"):
        pytest.fail("no step took the quiet path: the test no longer checks it")


def test_a_step_that_finishes_requests_and_moves_nothing_answers_as_vllm(
    tiny_model: Path,
) -> None:
    """Requests that end while others decode: where vLLM's worker ignores the finished
    requests (0.32 and later track stores through the worker metadata), such a step
    takes the quick path, and vLLM's own code, asked the same, reports nothing."""
    kv = offload_config("CPUOffloadingSpec", host_chunks=16)
    # Four requests ending one after another (8, 16, 24, 32 tokens generated).
    prompts = tuple(tuple(range(11 + 100 * i, 11 + 100 * i + 64)) for i in range(4))
    llm = make_llm(tiny_model, **ENGINE, kv_transfer_config=testkit.kv_transfer_config(kv))
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector as vllms,
        )

        worker = get_kv_transfer_group()
        answer = worker.get_transfer_results
        seen = {"finishing": 0, "quick": 0}

        def results(finished_req_ids: set[str]) -> Any:
            if finished_req_ids:
                seen["finishing"] += 1
                if worker._quiet(finished_req_ids):
                    seen["quick"] += 1
                    theirs = vllms.get_transfer_results(worker, set(finished_req_ids))
                    assert not theirs.finished_sending and not theirs.finished_recving
            return answer(finished_req_ids)

        worker.get_transfer_results = results
        for i, prompt in enumerate(prompts):
            llm.llm_engine.add_request(
                str(i), {"prompt_token_ids": list(prompt)}, testkit.greedy_params(8 * (i + 1))
            )
        while llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()
    finally:
        free_llm(llm)
    assert seen["finishing"] >= 3, seen
    if not worker._reads_finished_reqs:
        assert seen["quick"] >= 1, f"no step that finished requests took the quick path: {seen}"
    else:
        assert seen["quick"] == 0, seen
