"""Promotions ahead of vLLM's lookup (TierManager.ahead): the prefix of the request next
in vLLM's queue comes up from the fs tier while it waits."""

from __future__ import annotations

import random
import time

import pytest

from kvtier.blockpool import Hold
from kvtier.tiering_spec.manager import FRESH_STEPS, TierManager
from kvtier.tiering_spec.metrics_emitter import MetricsEmitter

from .test_manager import fs_only, settle


def waits(mgr: TierManager, *requests: tuple[str, list[bytes]]) -> None:
    """vLLM added ``requests`` (id, offload keys), in this order."""
    for req_id, keys in requests:
        mgr.ahead(req_id, keys)


def test_the_next_requests_prefix_is_a_host_hit_when_vllm_first_asks(make_tier) -> None:
    prefix = [b"a", b"b", b"c"]
    mgr = fs_only(make_tier, 8, prefix)
    waits(mgr, ("r", [*prefix, b"tail"]))  # its tail is stored nowhere
    mgr.end_step()
    settle(mgr)
    assert mgr.counters.promoted_ahead == 3, "up to the key no tier holds"
    stats = mgr.secondary_tiers[0].stats
    assert (stats.queries, stats.hits) == (3, 3), "counted as the lookups that found them"
    mgr.end_step()
    assert (stats.queries, stats.hits) == (3, 3), "a look that promotes nothing counts none"
    assert mgr.lookup_prefix([*prefix, b"tail"], "r") == (3, None), "hits, nothing pending"
    assert mgr.pool.held(Hold.PROMOTION) == 3, "pinned until vLLM loads them"
    mgr.prepare_load(prefix)
    mgr.complete_load(prefix)
    assert mgr.pool.held(Hold.PROMOTION) == 0
    mgr.pool.check_invariants()


def test_only_the_oldest_waiting_request_is_promoted(make_tier) -> None:
    p, q = [b"p0", b"p1"], [b"q0", b"q1"]
    mgr = fs_only(make_tier, 8, p + q)
    waits(mgr, ("p", p), ("q", q))
    mgr.end_step()
    settle(mgr)
    assert all(mgr.pool.contains(k) for k in p)
    assert not any(mgr.pool.contains(k) or mgr.pool.is_storing(k) for k in q), "q waits"
    assert mgr.lookup_prefix(p, "p") == (2, None)
    mgr.end_step()
    settle(mgr)
    assert not any(mgr.pool.contains(k) for k in q), "p is still the next one vLLM admits"
    mgr.forget_ahead("p")  # vLLM admitted it: q is next
    mgr.end_step()
    settle(mgr)
    assert all(mgr.pool.contains(k) for k in q)
    assert mgr.counters.promoted_ahead == 4


def test_a_finished_request_leaves_the_queue(make_tier) -> None:
    p, q = [b"p0"], [b"q0"]
    mgr = fs_only(make_tier, 4, p + q)
    waits(mgr, ("p", p), ("q", q))
    mgr.forget_ahead("p")  # aborted before its turn
    mgr.end_step()
    settle(mgr)
    assert not mgr.pool.contains(b"p0") and mgr.pool.contains(b"q0")


def test_a_prefix_larger_than_the_room_is_left_to_its_lookup(make_tier) -> None:
    """All or nothing: a part would leave its lookup waiting for the rest all the same,
    and pin host blocks stores need until vLLM admits it."""
    prefix = [b"a", b"b", b"c"]
    mgr = fs_only(make_tier, 4, prefix)
    assert mgr.max_promoting == 2
    waits(mgr, ("r", prefix))
    for _ in range(3):
        mgr.end_step()
        settle(mgr)
    assert mgr.counters.promotions == mgr.counters.promoted_ahead == 0
    assert mgr.lookup_prefix(prefix, "r") == (3, [False] * 3), "the lookup promotes"


def test_only_what_the_host_tier_lacks_is_read(make_tier) -> None:
    prefix = [b"a", b"b", b"c"]
    mgr = fs_only(make_tier, 4, prefix)
    assert mgr.lookup_prefix([b"a"], "s") == (1, [False])  # another request brings a up
    mgr.end_step()
    settle(mgr)
    assert mgr.lookup_prefix([b"a"], "s") == (1, None)
    mgr.prepare_load([b"a"])
    mgr.complete_load([b"a"])
    waits(mgr, ("r", prefix))
    mgr.end_step()
    settle(mgr)
    assert all(mgr.pool.contains(k) for k in prefix), "its cached head is kept"
    assert mgr.counters.promoted_ahead == 2
    assert mgr.pool.held(Hold.LOOKUP_PASS) == 0
    mgr.pool.check_invariants()


def test_an_evicted_head_is_promoted_again_while_the_request_waits(make_tier) -> None:
    """Looked at again each step: pins end after FRESH_STEPS, and what is evicted
    since comes up again before its turn."""
    prefix = [b"a", b"b"]
    mgr = fs_only(make_tier, 4, prefix)
    waits(mgr, ("r", prefix))
    mgr.end_step()
    settle(mgr)
    for _ in range(FRESH_STEPS):
        mgr.end_step()
    assert mgr.pool.held(Hold.PROMOTION) == 0
    mgr.pool.evict_all()
    mgr.end_step()
    settle(mgr)
    assert all(mgr.pool.contains(k) for k in prefix)
    assert mgr.counters.promoted_ahead == 4


def test_a_request_that_loads_from_no_secondary_tier_is_neither_promoted_nor_hit(
    make_tier,
) -> None:
    """vLLM 0.32's per-request ``kv_load_tiers``: a tier the request leaves out is not
    read for it, ahead of its lookup or in it; another request still reads it."""
    prefix = [b"a", b"b"]
    mgr = fs_only(make_tier, 8, prefix)
    mgr.ahead("kept-to-the-host-tier", prefix, False)  # (a request with a LoRA adapter)
    mgr.ahead("host-only", prefix, (False,))
    mgr.end_step()
    settle(mgr)
    mgr.forget_ahead("kept-to-the-host-tier")
    mgr.end_step()
    settle(mgr)
    assert mgr.counters.promoted_ahead == 0
    assert mgr.lookup_prefix(prefix, "host-only", secondary=(False,)) == (0, None)
    assert mgr.lookup(b"a", "host-only", secondary=False).name == "MISS"
    assert mgr.counters.promotions == 0, "nothing read from the tier it left out"
    mgr.forget_ahead("host-only")
    mgr.ahead("any", prefix, (True,))
    mgr.end_step()
    settle(mgr)
    assert mgr.counters.promoted_ahead == 2
    assert mgr.lookup_prefix(prefix, "any", secondary=(True,)) == (2, None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_step_end_that_says_it_did_nothing_moved_no_metric(make_tier, seed: int) -> None:
    """``end_step`` is False only where nothing the metrics read changed (the vLLM
    manager then answers its stats as settled): over random steps of requests waiting
    with prefixes on the fs tier, lookups, stores, loads and admissions, with the fs
    tier's jobs finishing between steps or not."""
    keys = [b"k%d" % i for i in range(24)]
    mgr = fs_only(make_tier, 8, keys)
    emitter = MetricsEmitter(mgr, tiering=True)
    rng = random.Random(seed)
    waiting: list[str] = []
    loads: list[list[bytes]] = []
    fresh = 0
    idle = 0
    for step in range(400):
        what = rng.random()
        if what < 0.08:
            req = f"r{step}"
            start = rng.randrange(len(keys) - 3)
            mgr.ahead(req, keys[start : start + rng.randrange(1, 4)])
            waiting.append(req)
        elif what < 0.14 and waiting:
            mgr.forget_ahead(waiting.pop(0))  # admitted, or finished while waiting
        elif what < 0.2:
            start = rng.randrange(len(keys) - 3)
            found, _ = mgr.lookup_prefix(keys[start : start + 3], f"q{step}")
            hits = [k for k in keys[start : start + found] if mgr.pool.contains(k)]
            if hits:
                mgr.prepare_load(hits)
                loads.append(hits)
        elif what < 0.25 and loads:
            mgr.complete_load(loads.pop(0))
        elif what < 0.3:
            plan = mgr.prepare_store([b"new%d" % (fresh + i) for i in range(2)])
            if plan is not None:  # (None: the host tier is pinned full now)
                mgr.complete_store(plan[0])
            fresh += 2
        if rng.random() < 0.3:
            time.sleep(0.003)  # the fs tier's reads and writes land meanwhile
        before = (emitter._signature(), emitter._samples_waiting())
        if not mgr.end_step():
            idle += 1
            assert (emitter._signature(), emitter._samples_waiting()) == before
    assert idle > 100, "most steps have nothing to do"
    settle(mgr)
