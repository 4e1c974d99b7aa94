"""Random sequences of scheduler events keep the host pool consistent and leak nothing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.recompute_connector import KVGroup, RecomputeOffloadScheduler, WorkerReport

REQS = ["a", "b", "c", "d"]
op = st.tuples(
    st.sampled_from(["run", "preempt", "report", "resume", "finish", "step"]),
    st.sampled_from(REQS),
    st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=60), st.integers(min_value=1, max_value=2), st.booleans())
def test_random_event_sequences_keep_invariants_and_free_everything(ops, world_size, share) -> None:
    s = RecomputeOffloadScheduler(
        num_host_blocks=10, groups=[KVGroup(4)], world_size=world_size, share_prefix=share
    )
    tokens = dict.fromkeys(REQS, 0)
    jobs: list[tuple[str, int]] = []
    next_block = iter(range(1, 10_000))
    for kind, req, flag in ops:
        if kind == "run":
            tokens[req] += 5
            blocks = [next(next_block) for _ in range(-(-tokens[req] // 4))]
            s.observe_scheduled(req, [blocks], tokens[req] - 5, 5)
        elif kind == "preempt":
            # Every request has the same prefix: with sharing, its full blocks are shared.
            hashes = [[f"h{i}".encode() for i in range(tokens[req] // 4)]]
            job = s.on_preempted(req, hashes, num_tokens=tokens[req] + 1)
            if job is not None:
                jobs.append(("store", job.job_id))
        elif kind == "report" and jobs:
            what, job_id = jobs.pop(0)
            r = WorkerReport()
            for _ in range(world_size):
                r.record(what, job_id, flag)
            s.on_worker_report(r)
        elif kind == "resume" and req not in s.running:
            n = s.restorable_tokens(req, tokens[req] + 1, 0)
            if n is not None:
                blocks = [next(next_block) for _ in range(-(-(tokens[req] + 1) // 4))]
                job = s.on_allocated(req, [blocks], 0, n)
                if job is not None:
                    jobs.append(("load", job.job_id))
                s.observe_scheduled(req, [blocks], n, tokens[req] + 1 - n)
        elif kind == "finish":
            s.on_finished(req)
            tokens[req] = 0
        elif kind == "step":
            s.build_step_plan()
        s.check_invariants()
    for req in REQS:
        s.on_finished(req)
    for what, job_id in jobs:
        r = WorkerReport()
        for _ in range(world_size):
            r.record(what, job_id, True)
        s.on_worker_report(r)
    s.check_invariants()
    assert s.host_blocks_in_use == 0, "host blocks leaked"
    assert not s.preempted and s.num_in_flight == 0
