"""The scheduler-side state machine, driven the way the vLLM adapter drives it (no engine)."""

from __future__ import annotations

import logging

import pytest

from kvtier.recompute_connector import (
    Fallback,
    KVGroup,
    Phase,
    RecomputeOffloadScheduler,
    TransferJob,
    WorkerReport,
)

BS = 4  # tokens per device block in these tests


def make(num_host_blocks: int = 32, *, world_size: int = 1, window: int | None = None):
    groups = [KVGroup(BS, window)]
    return RecomputeOffloadScheduler(
        num_host_blocks=num_host_blocks, groups=groups, world_size=world_size
    )


def report(kind: str, job_id: int, *, ok: int = 1, failed: int = 0) -> WorkerReport:
    r = WorkerReport()
    table = r.stores if kind == "store" else r.loads
    table[job_id] = [ok, failed]
    return r


def preempt_and_store(s: RecomputeOffloadScheduler, req: str, blocks: list[int], tokens: int):
    s.observe_scheduled(req, [blocks], tokens - 1, 1)
    job = s.on_preempted(req)
    assert job is not None, "the store was not planned"
    plan = s.build_step_plan()
    assert plan.stores == [job]
    s.on_worker_report(report("store", job.job_id))
    return job


def test_preempt_store_resume_load_frees_host_blocks() -> None:
    s = make()
    store = preempt_and_store(s, "r", [7, 8, 9], tokens=12)
    assert store.device_block_ids == [7, 8, 9] and len(store.host_block_ids) == 3
    assert s.phase_of("r") == Phase.RESTORABLE
    # resumed with 13 tokens (12 with KV + the last sampled one), nothing in the prefix cache
    assert s.restorable_tokens("r", 13, 0) == 12
    load = s.on_allocated("r", [[3, 4, 5, 6]], 0, 12)
    assert load is not None
    assert load.device_block_ids == [3, 4, 5] and load.host_block_ids == store.host_block_ids
    assert s.build_step_plan().loads == [load]
    assert s.host_blocks_in_use == 3, "host blocks must stay reserved until the load is done"
    s.on_worker_report(report("load", load.job_id))
    assert s.host_blocks_in_use == 0 and s.phase_of("r") is None
    stats = s.take_stats()
    assert (stats.preemptions_offloaded, stats.restores, stats.tokens_restored) == (1, 1, 12)
    s.check_invariants()


def test_restorable_tokens_never_include_the_last_token() -> None:
    s = make()
    preempt_and_store(s, "r", [1, 2, 3], tokens=12)
    assert s.restorable_tokens("r", 12, 0) == 11, (
        "the last token's KV is computed by the next forward"
    )


def test_device_prefix_cache_hit_is_subtracted_and_not_reloaded() -> None:
    s = make()
    store = preempt_and_store(s, "r", [1, 2, 3], tokens=12)
    assert s.restorable_tokens("r", 13, 8) == 4
    load = s.on_allocated("r", [[1, 2, 5]], 8, 4)
    assert load is not None
    assert load.device_block_ids == [5] and load.host_block_ids == store.host_block_ids[2:]


def test_prefix_cache_holding_everything_drops_the_copy() -> None:
    s = make()
    preempt_and_store(s, "r", [1, 2, 3], tokens=12)
    assert s.restorable_tokens("r", 13, 12) == 0
    assert s.on_allocated("r", [[1, 2, 3, 4]], 12, 0) is None
    assert s.host_blocks_in_use == 0
    s.check_invariants()


def test_partial_last_block_is_stored_and_restored() -> None:
    s = make()
    store = preempt_and_store(s, "r", [10, 11, 12], tokens=10)  # 2.5 blocks of KV
    assert store.device_block_ids == [10, 11, 12] and store.num_tokens == 10
    assert s.restorable_tokens("r", 11, 0) == 10
    load = s.on_allocated("r", [[20, 21, 22]], 0, 10)
    assert load is not None and load.device_block_ids == [20, 21, 22]


def test_spec_decode_lookahead_blocks_are_clipped() -> None:
    s = make()
    # 8 tokens of KV, but vLLM allocated two lookahead blocks for draft tokens
    s.observe_scheduled("r", [[1, 2, 3, 4]], 6, 2)
    job = s.on_preempted("r")
    assert job is not None and job.device_block_ids == [1, 2], "lookahead blocks hold no KV"
    s.on_worker_report(report("store", job.job_id))
    # drafts were rejected: fewer tokens exist than were scheduled
    assert s.restorable_tokens("r", 7, 0) == 6
    load = s.on_allocated("r", [[5]], 0, 6)  # the restore is clipped to what is allocated
    assert load is not None and load.device_block_ids == [5]


def test_sliding_window_null_blocks_keep_their_logical_position() -> None:
    s = make(window=8)
    s.observe_scheduled("r", [[0, 0, 20, 21]], 15, 1)  # blocks 0-1 left the window
    job = s.on_preempted("r")
    assert job is not None
    assert job.device_block_ids == [20, 21], "null blocks are never copied"
    state = s.preempted["r"]
    assert state.host_blocks[0][:2] == [None, None] and None not in state.host_blocks[0][2:]
    s.on_worker_report(report("store", job.job_id))
    assert s.restorable_tokens("r", 17, 0) == 16
    load = s.on_allocated("r", [[0, 0, 30, 31]], 0, 16)
    assert load is not None
    assert load.device_block_ids == [30, 31]
    assert load.host_block_ids == [state.host_blocks[0][2], state.host_blocks[0][3]]
    assert not s.build_step_plan().unrestorable_device_blocks


def test_sliding_window_gap_falls_back_instead_of_claiming_missing_blocks() -> None:
    s = make(window=8)
    s.observe_scheduled("r", [[0, 0, 20, 21]], 15, 1)
    job = s.on_preempted("r")
    assert job is not None
    s.on_worker_report(report("store", job.job_id))
    # rejected drafts: fewer tokens now, so the window reaches back into a null block
    assert s.restorable_tokens("r", 9, 0) == 0
    assert s.take_stats().fallbacks[Fallback.WINDOW_GAP.value] == 1
    assert s.host_blocks_in_use == 0


def test_capacity_short_skips_the_offload_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    s = make(num_host_blocks=2)
    s.observe_scheduled("r", [[1, 2, 3]], 11, 1)
    with caplog.at_level(logging.WARNING, "kvtier.recompute_connector"):
        assert s.on_preempted("r") is None
    assert "CPU cache free blocks are insufficient" in caplog.text
    assert s.restorable_tokens("r", 13, 0) == 0
    assert s.take_stats().fallbacks[Fallback.CAPACITY.value] == 1
    assert s.host_blocks_in_use == 0
    s.check_invariants()


def test_capacity_never_evicts_other_requests_copies() -> None:
    s = make(num_host_blocks=4)
    preempt_and_store(s, "a", [1, 2, 3], tokens=12)
    s.observe_scheduled("b", [[4, 5]], 7, 1)
    assert s.on_preempted("b") is None
    assert s.phase_of("a") == Phase.RESTORABLE


def test_unconfirmed_store_is_not_restorable_yet() -> None:
    s = make()
    s.observe_scheduled("r", [[1, 2]], 7, 1)
    job = s.on_preempted("r")
    assert job is not None
    assert s.restorable_tokens("r", 9, 0) is None, "ask again once the workers reported"
    s.on_worker_report(report("store", job.job_id))
    assert s.restorable_tokens("r", 9, 0) == 8


def test_restorable_only_after_every_rank_stored() -> None:
    s = make(world_size=2)
    s.observe_scheduled("r", [[1, 2]], 7, 1)
    job = s.on_preempted("r")
    assert job is not None
    s.on_worker_report(report("store", job.job_id, ok=1))
    assert s.restorable_tokens("r", 9, 0) is None, "one rank of two has stored"
    s.on_worker_report(report("store", job.job_id, ok=1))
    assert s.restorable_tokens("r", 9, 0) == 8


def test_failed_store_on_any_rank_falls_back_and_frees() -> None:
    s = make(world_size=2)
    s.observe_scheduled("r", [[1, 2]], 7, 1)
    job = s.on_preempted("r")
    assert job is not None
    s.on_worker_report(report("store", job.job_id, ok=1, failed=1))
    assert s.restorable_tokens("r", 9, 0) == 0
    assert s.host_blocks_in_use == 0
    assert s.take_stats().fallbacks[Fallback.STORE_FAILED.value] == 1
    s.check_invariants()


def test_failed_load_is_counted_and_frees_the_copy() -> None:
    s = make()
    preempt_and_store(s, "r", [1, 2], tokens=8)
    load = s.on_allocated("r", [[3, 4]], 0, 8)
    assert load is not None
    s.on_worker_report(report("load", load.job_id, ok=0, failed=1))
    stats = s.take_stats()
    assert stats.fallbacks[Fallback.LOAD_FAILED.value] == 1 and stats.tokens_restored == 0
    assert s.host_blocks_in_use == 0


def test_abort_while_preempted_frees_at_once() -> None:
    s = make()
    preempt_and_store(s, "r", [1, 2, 3], tokens=12)
    s.on_finished("r")
    assert s.host_blocks_in_use == 0 and s.phase_of("r") is None
    s.check_invariants()


def test_abort_while_storing_frees_when_the_store_ends() -> None:
    s = make()
    s.observe_scheduled("r", [[1, 2]], 7, 1)
    job = s.on_preempted("r")
    assert job is not None
    s.on_finished("r")
    assert s.host_blocks_in_use == 2, "the workers may still be writing those blocks"
    s.check_invariants()
    s.on_worker_report(report("store", job.job_id))
    assert s.host_blocks_in_use == 0
    s.check_invariants()


def test_finish_while_loading_frees_when_the_load_ends() -> None:
    s = make()
    preempt_and_store(s, "r", [1, 2], tokens=8)
    load = s.on_allocated("r", [[3, 4]], 0, 8)
    assert load is not None
    s.on_finished("r")
    assert s.host_blocks_in_use == 2
    s.on_worker_report(report("load", load.job_id))
    assert s.host_blocks_in_use == 0
    s.check_invariants()


def test_finished_running_request_leaves_nothing_behind() -> None:
    s = make()
    s.observe_scheduled("r", [[1, 2]], 7, 1)
    s.on_finished("r")
    assert not s.running and s.host_blocks_in_use == 0


def test_preempted_again_during_its_load_keeps_both_copies_apart() -> None:
    s = make()
    preempt_and_store(s, "r", [1, 2], tokens=8)
    load = s.on_allocated("r", [[3, 4]], 0, 8)
    assert load is not None
    s.observe_scheduled("r", [[3, 4, 5]], 8, 1)
    again = s.on_preempted("r")
    assert again is not None and set(again.host_block_ids).isdisjoint(load.host_block_ids)
    s.on_worker_report(report("load", load.job_id))
    s.on_worker_report(report("store", again.job_id))
    assert s.phase_of("r") == Phase.RESTORABLE and s.host_blocks_in_use == 3
    s.check_invariants()


def test_request_that_never_ran_has_nothing_to_store() -> None:
    s = make()
    assert s.on_preempted("never-ran") is None
    assert not s.take_stats().fallbacks


def test_unsupported_kv_cache_group_falls_back() -> None:
    s = RecomputeOffloadScheduler(
        num_host_blocks=8, groups=[KVGroup(BS), KVGroup(BS, supported=False)]
    )
    s.observe_scheduled("r", [[1], [2]], 3, 1)
    assert s.on_preempted("r") is None
    assert s.take_stats().fallbacks[Fallback.UNSUPPORTED.value] == 1


def test_two_groups_map_block_by_block() -> None:
    s = RecomputeOffloadScheduler(num_host_blocks=8, groups=[KVGroup(BS), KVGroup(BS, 4)])
    s.observe_scheduled("r", [[1, 2], [0, 3]], 7, 1)
    job = s.on_preempted("r")
    assert job is not None and job.device_block_ids == [1, 2, 3]
    s.on_worker_report(report("store", job.job_id))
    assert s.restorable_tokens("r", 9, 0) == 8
    load = s.on_allocated("r", [[5, 6], [0, 7]], 0, 8)
    assert load is not None and load.device_block_ids == [5, 6, 7]
    assert load.host_block_ids == job.host_block_ids


def hybrid() -> RecomputeOffloadScheduler:
    """A linear-attention state group beside a full-attention group (vLLM's order)."""
    return RecomputeOffloadScheduler(
        num_host_blocks=8, groups=[KVGroup(BS, state=True), KVGroup(BS)]
    )


def stored_hybrid(
    blocks: list[list[int]], tokens: int
) -> tuple[RecomputeOffloadScheduler, TransferJob]:
    """A hybrid scheduler whose request "r" ran to ``tokens`` tokens on ``blocks`` (per
    group) and was preempted and stored."""
    s = hybrid()
    s.observe_scheduled("r", blocks, tokens - 1, 1)
    job = s.on_preempted("r")
    assert job is not None, "the store was not planned"
    s.on_worker_report(report("store", job.job_id))
    return s, job


def test_state_group_keeps_only_the_block_of_the_last_token() -> None:
    # 10 tokens computed: the state after token 10 is in block 2 of the state group.
    s, job = stored_hybrid([[0, 4, 5], [1, 2, 3]], 10)
    assert job.device_block_ids == [5, 1, 2, 3]
    assert s.restorable_tokens("r", 11, 0) == 10
    # vLLM gives the resumed request null blocks before the state block.
    load = s.on_allocated("r", [[0, 0, 6], [7, 8, 9]], 0, 10)
    assert load is not None and load.device_block_ids == [6, 7, 8, 9]
    assert load.host_block_ids == job.host_block_ids
    assert load.state_host_block_ids == [job.host_block_ids[0]]
    s.check_invariants()


def test_state_is_restored_only_at_the_token_it_was_kept_at() -> None:
    s, _ = stored_hybrid([[0, 4, 5], [1, 2, 3]], 10)
    # Resumed with fewer tokens than the state covers (a rejected token): no prefix of
    # a recurrent state exists, so nothing is claimed.
    assert s.restorable_tokens("r", 10, 0) == 0
    assert s.take_stats().fallbacks[Fallback.STATE_POSITION.value] == 1
    assert s.host_blocks_in_use == 0


def test_state_load_fills_every_block_vllm_may_read_it_from() -> None:
    s, job = stored_hybrid([[0, 5], [1, 2]], 8)  # 8 tokens: a block boundary
    assert s.uncounted_state_blocks(8, 9) == 1, "crossing into block 2 needs a block more"
    assert s.uncounted_state_blocks(9, 10) == 0
    assert s.restorable_tokens("r", 9, 0) == 8
    # vLLM copies the state from block 1 into block 2 before the load: both get it.
    load = s.on_allocated("r", [[0, 6, 7], [3, 4, 8]], 0, 8)
    assert load is not None and load.device_block_ids == [6, 7, 3, 4]
    state_host = job.host_block_ids[0]
    assert load.host_block_ids[:2] == [state_host, state_host]


def test_lost_state_block_falls_back() -> None:
    s = hybrid()
    s.observe_scheduled("r", [[0, 0], [1, 2]], 7, 1)
    assert s.on_preempted("r") is None
    assert s.take_stats().fallbacks[Fallback.STATE_POSITION.value] == 1


def test_lost_store_report_times_out_to_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.recompute_connector.state as state

    monkeypatch.setattr(state, "STORE_REPORT_TIMEOUT_STEPS", 3)
    s = make()
    s.observe_scheduled("r", [[1, 2]], 7, 1)
    job = s.on_preempted("r")
    assert job is not None
    for _ in range(3):
        s.build_step_plan()
    assert s.restorable_tokens("r", 9, 0) == 0
    s.on_allocated("r", [[3, 4, 5]], 0, 0)  # admitted and recomputed
    assert s.host_blocks_in_use == 2, "blocks stay reserved while a copy may still run"
    s.on_worker_report(report("store", job.job_id))
    assert s.host_blocks_in_use == 0
    assert s.take_stats().fallbacks[Fallback.STORE_TIMEOUT.value] == 1
