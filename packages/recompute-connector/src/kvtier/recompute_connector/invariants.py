"""Consistency checks of the scheduler side's bookkeeping, for tests.

:func:`check` reads a scheduler's host pool, preempted requests, copies in flight and
shared entries (``RecomputeOffloadScheduler.check_invariants`` hands them over) and
raises ``AssertionError`` where they disagree: a shared entry's references against the
requests holding it, the pool's owners against the live states, a phase against its
copy in flight.
"""

from __future__ import annotations

from collections import Counter

from kvtier.blockpool import HostBlockPool
from kvtier.recompute_connector.state_types import Phase, PreemptedRequestState, SharedBlock


def check(
    pool: HostBlockPool,
    preempted: dict[str, PreemptedRequestState],
    in_flight: dict[int, PreemptedRequestState],
    shared: dict[tuple[int, bytes], SharedBlock],
) -> None:
    """Raise ``AssertionError`` if the bookkeeping is inconsistent."""
    pool.check_invariants()
    live = {s.owner: s for s in preempted.values()}
    live.update({s.owner: s for s in in_flight.values()})
    refs: Counter[int] = Counter()
    entries: dict[int, SharedBlock] = {}
    for state in live.values():
        for e in state.shared:
            refs[id(e)] += 1
            entries[id(e)] = e
    for key, e in shared.items():
        assert e.key == key and not e.failed and id(e) in entries, f"{key}: stale entry"
    for i, e in entries.items():
        assert e.refs == refs[i], f"{e.key}: {e.refs} references counted, {refs[i]} held"
        assert pool.owned_blocks(e.owner) == [e.host], f"{e.key}: host block lost"
    owners: set[object] = {o for o, s in live.items() if pool.owned_blocks(o)}
    owners |= {e.owner for e in entries.values()}
    owned = set(pool.owners())
    assert owned == owners, f"owners differ: pool {owned}, states {owners}"
    for owner, state in live.items():
        shared_hosts = {e.host for e in state.shared}
        private = [h for h in state.all_host_blocks if h not in shared_hosts]
        assert sorted(private) == sorted(pool.owned_blocks(owner))
    for state in preempted.values():
        assert not state.free_when_done, "a dropped state is still listed as preempted"
        copying = state.job_id in in_flight
        if state.phase == Phase.RESTORABLE:
            assert not copying and state.stored, f"{state.req_id}: restorable too early"
            assert all(e.ready for e in state.shared), f"{state.req_id}: shares unstored"
        elif state.phase == Phase.LOADING:
            assert copying, f"{state.req_id}: load job lost"
        else:
            assert copying != state.stored, f"{state.req_id}: store job lost"


__all__ = ["check"]
