"""End to end on vLLM's CPU platform with the testkit's tiny model.

Every test compares greedy outputs token by token with an unpreempted run of the same
workload (16 requests of 40 prompt + 200 generated tokens; 16 device blocks of 32
tokens force about 25 preemptions). The engine's work is counted in scheduled tokens:
recompute = tokens scheduled beyond the unpreempted run's total.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.testkit import (
    FORCED_PREEMPTION_ENGINE,
    FORCED_PREEMPTION_WORKLOAD,
    SLIDING_WINDOW_ENGINE,
    WorkloadResult,
    compare_outputs,
    make_workload,
    requires_vllm,
    run_with,
)
from kvtier.testkit.faults import corrupted_restores, failing_copies

from .e2e_support import (
    ConnectorRun,
    multi,
    run_connector,
    standalone,
)

pytestmark = [pytest.mark.e2e, requires_vllm]

MIN_PREEMPTIONS = 10


def assert_identical(reference: WorkloadResult, run: ConnectorRun) -> None:
    comparison = compare_outputs(reference.outputs, run.result.outputs)
    assert comparison.identical, comparison.report()


def assert_pool_empty(run: ConnectorRun) -> None:
    assert run.host_blocks_in_use == 0, f"{run.host_blocks_in_use} host blocks still in use"
    assert run.preempted_left == 0 and run.in_flight_left == 0


@pytest.mark.parametrize(
    ("role", "prefix_caching"),
    [("kv_consumer", True), ("kv_both", False)],
    ids=["kv_consumer-prefix_caching_on", "kv_both-prefix_caching_off"],
)
def test_standalone_outputs_identical_and_recompute_avoided(
    tiny_model: Path,
    reference: WorkloadResult,
    without_connector: WorkloadResult,
    role: str,
    prefix_caching: bool,
) -> None:
    run = run_connector(
        tiny_model,
        FORCED_PREEMPTION_WORKLOAD,
        standalone(role),
        enable_prefix_caching=prefix_caching,
        additional_config={"recompute_scheduler_enable": True},
    )
    assert run.result.preemptions >= MIN_PREEMPTIONS
    assert_identical(reference, run)
    assert run.counter("preemptions_offloaded") > 0
    assert run.counter("tokens_restored") > 0, "no token was restored"
    baseline = without_connector.scheduled_tokens - reference.scheduled_tokens
    ours = run.result.scheduled_tokens - reference.scheduled_tokens
    assert baseline > 0
    reduction = 1 - ours / baseline
    assert reduction >= 0.9, (
        f"recompute {ours} tokens with the connector vs {baseline} without: "
        f"only {reduction:.0%} less"
    )
    assert run.counter("transfer_bytes") > 0
    assert_pool_empty(run)


@pytest.mark.parametrize("recompute_first", [True, False], ids=["ours-first", "guide-order"])
def test_inside_multiconnector_outputs_identical(
    tiny_model: Path, reference: WorkloadResult, tmp_path: Path, recompute_first: bool
) -> None:
    run = run_connector(
        tiny_model,
        FORCED_PREEMPTION_WORKLOAD,
        multi(str(tmp_path), recompute_first=recompute_first),
        additional_config={"recompute_scheduler_enable": True},
    )
    assert run.result.preemptions >= MIN_PREEMPTIONS
    assert_identical(reference, run)
    if recompute_first:
        # In the guide's order the example P/D child answers first for the prompt part
        # it saved itself; ours restores whatever that child does not claim.
        assert run.counter("tokens_restored") > 0
    assert_pool_empty(run)


def test_budget_too_small_for_any_request_falls_back_cleanly(
    tiny_model: Path, reference: WorkloadResult
) -> None:
    config = standalone()
    config["kv_connector_extra_config"]["cpu_bytes_to_use_per_rank"] = 65536  # one host block
    run = run_connector(tiny_model, FORCED_PREEMPTION_WORKLOAD, config)
    assert run.result.preemptions >= MIN_PREEMPTIONS
    assert_identical(reference, run)
    assert run.counter("tokens_restored") == 0
    fallbacks = run.fallbacks()
    assert fallbacks.get("capacity", 0) >= MIN_PREEMPTIONS, fallbacks
    assert_pool_empty(run)


def test_corrupted_restores_are_caught(tiny_model: Path, reference: WorkloadResult) -> None:
    """The harness is sharp: the same run with restored KV flipped must differ."""
    with corrupted_restores() as flipped:
        run = run_connector(tiny_model, FORCED_PREEMPTION_WORKLOAD, standalone())
    assert flipped["restore"] > 0
    assert run.counter("tokens_restored") > 0
    comparison = compare_outputs(reference.outputs, run.result.outputs)
    assert len(comparison.mismatches) >= 8, (
        f"corrupted KV changed only {len(comparison.mismatches)} of 16 outputs"
    )


def test_failed_restores_are_recomputed(tiny_model: Path, reference: WorkloadResult) -> None:
    # No kv_load_failure_policy: standalone, the connector makes vLLM recompute.
    with failing_copies(loads=True) as refused:
        run = run_connector(tiny_model, FORCED_PREEMPTION_WORKLOAD, standalone())
    assert refused["load"] > 0
    assert_identical(reference, run)
    assert run.fallbacks().get("load_failed", 0) > 0
    assert run.counter("tokens_restored") == 0
    assert_pool_empty(run)


def test_requests_aborted_while_preempted_leave_the_host_pool_empty(tiny_model: Path) -> None:
    from kvtier.testkit import greedy_params, kv_transfer_config, llm_session

    from .e2e_support import recompute_connector

    with llm_session(
        tiny_model,
        kv_transfer_config=kv_transfer_config(standalone()),
        **FORCED_PREEMPTION_ENGINE,
    ) as llm:
        engine = llm.llm_engine
        sched = recompute_connector(llm).scheduler
        params = greedy_params(FORCED_PREEMPTION_WORKLOAD.max_tokens)
        for i, prompt in enumerate(FORCED_PREEMPTION_WORKLOAD.prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": list(prompt)}, params)
        aborted: set[str] = set()
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            engine.step()
            held = [r for r in sched.preempted if r.split("-")[0] not in aborted]
            if len(aborted) < 4 and held:
                external = held[0].split("-")[0]
                engine.abort_request([external])
                aborted.add(external)
        assert not engine.has_unfinished_requests(), "the engine did not drain"
        assert len(aborted) >= 2, f"only {len(aborted)} requests were held when aborted"
        sched.check_invariants()
        assert sched.host_blocks_in_use == 0, f"{sched.host_blocks_in_use} host blocks leaked"
        assert not sched.preempted and sched.num_in_flight == 0


def test_sliding_window_model_identical_and_null_blocks_never_copied(
    tiny_sliding_window_model: Path,
) -> None:
    # Prompts longer than the 64-token window, so preempted requests hold null blocks
    # (measured: 2 preemptions, one of them with a null block in its table).
    workload = make_workload(8, 100, 80)
    engine = {**SLIDING_WINDOW_ENGINE, "num_gpu_blocks_override": 12}
    ref, _ = run_with(
        tiny_sliding_window_model, workload, **{**engine, "num_gpu_blocks_override": 64}
    )
    assert ref.preemptions == 0
    run = run_connector(tiny_sliding_window_model, workload, standalone(), engine=engine)
    assert run.result.preemptions > 0
    comparison = compare_outputs(ref.outputs, run.result.outputs)
    assert comparison.identical, comparison.report()
    assert run.counter("tokens_restored") > 0
    assert run.null_positions_kept > 0, "no preemption had null blocks: window path untested"
    copied = [b for job in run.stored_device_blocks for b in job]
    assert 0 not in copied, "the null block was copied"
    assert_pool_empty(run)
