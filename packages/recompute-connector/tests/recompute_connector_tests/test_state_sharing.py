"""Prefix sharing of host blocks (``enable_offload_prefix_caching``) in the scheduler's
state machine: full hashed blocks kept once per hash, shared by reference count."""

from __future__ import annotations

from kvtier.recompute_connector import (
    Fallback,
    KVGroup,
    Phase,
    RecomputeOffloadScheduler,
    WorkerReport,
)

BS = 4


def make(num_host_blocks: int = 32, *, share: bool = True) -> RecomputeOffloadScheduler:
    return RecomputeOffloadScheduler(
        num_host_blocks=num_host_blocks, groups=[KVGroup(BS)], share_prefix=share
    )


def report(kind: str, job_id: int, *, ok: int = 1, failed: int = 0) -> WorkerReport:
    r = WorkerReport()
    (r.stores if kind == "store" else r.loads)[job_id] = [ok, failed]
    return r


def hashes(*names: str) -> list[list[bytes]]:
    return [[n.encode() for n in names]]


def preempt(s: RecomputeOffloadScheduler, req: str, blocks: list[int], tokens: int, h: list):
    s.observe_scheduled(req, [blocks], tokens - 1, 1)
    # The request has one more token than its KV (the last sampled one).
    return s.on_preempted(req, h, num_tokens=tokens + 1)


def test_a_second_request_with_the_same_prefix_adds_references_instead_of_copying() -> None:
    s = make()
    # A: 3 full blocks (12 tokens) + a partial one (14 tokens in all).
    a = preempt(s, "a", [1, 2, 3, 4], 14, hashes("p0", "p1", "a2"))
    assert a is not None and a.device_block_ids == [1, 2, 3, 4]
    s.on_worker_report(report("store", a.job_id))
    assert s.phase_of("a") == Phase.RESTORABLE
    # B shares the first two blocks: only its own two are copied.
    b = preempt(s, "b", [5, 6, 7, 8], 14, hashes("p0", "p1", "b2"))
    assert b is not None and b.device_block_ids == [7, 8]
    assert s.host_blocks_in_use == 6, "4 for A, 2 more for B"
    s.on_worker_report(report("store", b.job_id))
    assert s.phase_of("b") == Phase.RESTORABLE
    s.check_invariants()
    # B restores its shared blocks from A's copies.
    assert s.restorable_tokens("b", 15, 0) == 14
    load = s.on_allocated("b", [[9, 10, 11, 12]], 0, 14)
    assert load is not None and load.device_block_ids == [9, 10, 11, 12]
    assert load.host_block_ids[:2] == a.host_block_ids[:2]
    s.on_worker_report(report("load", load.job_id))
    assert s.host_blocks_in_use == 4, "A's blocks stay: A still references them"
    s.check_invariants()
    s.on_finished("a")
    assert s.host_blocks_in_use == 0 and not s.shared, "freeing follows the references"
    s.check_invariants()


def test_a_request_whose_blocks_are_all_on_host_copies_nothing() -> None:
    s = make()
    a = preempt(s, "a", [1, 2], 8, hashes("p0", "p1"))
    assert a is not None and s.build_step_plan().stores == [a]
    s.on_worker_report(report("store", a.job_id))
    assert preempt(s, "b", [3, 4], 8, hashes("p0", "p1")) is None
    assert s.phase_of("b") == Phase.RESTORABLE and s.host_blocks_in_use == 2
    assert s.build_step_plan().stores == []
    s.check_invariants()


def test_a_request_sharing_blocks_still_being_stored_waits_for_that_store() -> None:
    s = make()
    a = preempt(s, "a", [1, 2, 3], 12, hashes("p0", "p1", "p2"))
    assert a is not None
    b = preempt(s, "b", [4, 5, 6], 12, hashes("p0", "p1", "q2"))
    assert b is not None and b.device_block_ids == [6]
    s.on_worker_report(report("store", b.job_id))
    assert s.phase_of("b") == Phase.STORING and s.restorable_tokens("b", 13, 0) is None
    s.on_worker_report(report("store", a.job_id))
    assert s.phase_of("b") == Phase.RESTORABLE and s.phase_of("a") == Phase.RESTORABLE
    s.check_invariants()


def test_a_failed_store_of_a_shared_block_recomputes_every_request_sharing_it() -> None:
    s = make()
    a = preempt(s, "a", [1, 2, 3], 12, hashes("p0", "p1", "p2"))
    b = preempt(s, "b", [4, 5, 6], 12, hashes("p0", "p1", "q2"))
    assert a is not None and b is not None
    s.on_worker_report(report("store", b.job_id))
    s.on_worker_report(report("store", a.job_id, ok=0, failed=1))
    assert s.phase_of("a") is None and s.phase_of("b") is None
    assert s.take_stats().fallbacks[Fallback.STORE_FAILED.value] == 2
    assert s.host_blocks_in_use == 0 and not s.shared
    s.check_invariants()
    # The hash is free again: a later request stores it anew.
    c = preempt(s, "c", [7, 8], 8, hashes("p0", "p1"))
    assert c is not None and c.device_block_ids == [7, 8]


def test_partial_unhashed_and_last_token_blocks_stay_private() -> None:
    s = make()
    # 8 tokens of KV but the request has only 8 tokens: the last token's KV is not
    # valid yet, so block 1 (tokens 4-7) is not shared; block 2 is partial.
    s.observe_scheduled("a", [[1, 2, 3]], 9, 1)
    a = s.on_preempted("a", hashes("p0", "p1"), num_tokens=8)
    assert a is not None
    s.on_worker_report(report("store", a.job_id))
    assert set(s.shared) == {(0, b"p0")}
    b = preempt(s, "b", [4, 5], 8, hashes("p0", "p1"))
    assert b is not None and b.device_block_ids == [5], "only p0 was shared"
    s.check_invariants()


def test_aborts_while_storing_leak_nothing() -> None:
    s = make()
    a = preempt(s, "a", [1, 2], 8, hashes("p0", "p1"))
    b = preempt(s, "b", [3, 4], 8, hashes("p0", "p1"))
    assert a is not None and b is None
    s.on_finished("a")  # aborted while its copy is in flight: B still needs the blocks
    s.on_worker_report(report("store", a.job_id))
    assert s.phase_of("b") == Phase.RESTORABLE and s.host_blocks_in_use == 2
    s.on_finished("b")
    assert s.host_blocks_in_use == 0 and not s.shared
    s.check_invariants()


def test_with_sharing_off_every_request_copies_its_own_blocks() -> None:
    s = make(share=False)
    a = preempt(s, "a", [1, 2], 8, hashes("p0", "p1"))
    b = preempt(s, "b", [3, 4], 8, hashes("p0", "p1"))
    assert a is not None and b is not None and b.device_block_ids == [3, 4]
    assert s.host_blocks_in_use == 4 and not s.shared
    s.check_invariants()


def test_capacity_counts_only_the_blocks_to_copy() -> None:
    s = make(num_host_blocks=3)
    a = preempt(s, "a", [1, 2], 8, hashes("p0", "p1"))
    assert a is not None
    s.on_worker_report(report("store", a.job_id))
    # B needs 3 blocks, 2 of them shared: 1 new fits in the 1 free block.
    b = preempt(s, "b", [3, 4, 5], 12, hashes("p0", "p1", "b2"))
    assert b is not None and b.device_block_ids == [5]
    c = preempt(s, "c", [6, 7, 8], 12, hashes("x0", "x1", "x2"))
    assert c is None and s.take_stats().fallbacks[Fallback.CAPACITY.value] == 1
    s.check_invariants()
