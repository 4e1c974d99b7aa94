"""A poll's successful writes applied in one pass (``TierJobs._writes_applied``, and
``TierFlow.write_each_completed``) end the same write holds and move the store latency
EMA the same as the results applied one at a time."""

from __future__ import annotations

import random

import pytest

from kvtier.blockpool import Hold, HostBlockPool
from kvtier.tiering_spec.manager import TierManager
from kvtier.tiering_spec.tier_flow import EMA_ALPHA, EMA_WARMUP, MIB, TierFlow
from kvtier.tiering_spec.tiers.base import TierResult

from .test_manager import CountingTier


def _flow_state(flow: TierFlow) -> tuple[object, ...]:
    return (flow.store_latency_ema, flow.writes_completed, list(flow._warmup))


def _ema_of(writes: list[tuple[float, int]]) -> tuple[object, ...]:
    """The flow's state after ``writes``, by the EMA's definition: seconds per MiB of
    the writes of some bytes, the first ``EMA_WARMUP`` averaged, then each moving it by
    ``EMA_ALPHA``; 0 until the warm-up ends."""
    per = [seconds / (nbytes / MIB) for seconds, nbytes in writes if nbytes > 0]
    if len(per) < EMA_WARMUP:
        return (0.0, len(per), per)
    ema = sum(per[:EMA_WARMUP]) / EMA_WARMUP
    for value in per[EMA_WARMUP:]:
        ema = EMA_ALPHA * value + (1 - EMA_ALPHA) * ema
    return (ema, len(per), [])


@pytest.mark.parametrize("seed", range(6))
def test_each_write_completed_at_once_moves_the_ema_as_one_at_a_time(seed: int) -> None:
    rng = random.Random(seed)
    one, batched = TierFlow(), TierFlow()
    everything: list[tuple[float, int]] = []
    for _ in range(40):
        # Runs across the warm-up's end, and writes of no bytes (not counted).
        writes = [
            (rng.random() * 0.01, rng.choice([0, 4096, 65536, 1 << 20]))
            for _ in range(rng.randint(0, EMA_WARMUP + 3))
        ]
        for seconds, nbytes in writes:
            one.write_completed(seconds, nbytes)
        batched.write_each_completed(writes)
        everything += writes
        assert _flow_state(batched) == _flow_state(one) == _ema_of(everything)
    assert one.writes_completed > EMA_WARMUP and one.store_latency_ema > 0


@pytest.mark.parametrize("seed", range(6))
def test_a_polls_writes_end_the_holds_one_at_a_time_would(seed: int) -> None:
    """Keys held for writing once, twice or not at all (a write of the pool before a
    reset), some written twice in one poll: the batched pass and the per-result loop
    (forced by a trailing result of another kind, which moves nothing) end the same
    holds and leave the same EMA."""
    rng = random.Random(100 + seed)
    keys = [bytes([i]) * 8 for i in range(24)]

    def run(batched: bool) -> tuple[dict[bytes, int], tuple[object, ...], list[int]]:
        mgr = TierManager(HostBlockPool(32), [CountingTier()])
        r = random.Random(seed)
        plan = mgr.prepare_store(keys)
        assert plan is not None
        mgr.pool.complete_store(keys)
        held = [k for k in keys if r.random() < 0.8]
        mgr.pool.hold(held, Hold.TIER_WRITE)
        mgr.pool.hold([k for k in held if r.random() < 0.3], Hold.TIER_WRITE)
        results = [
            TierResult("write", rng_key, -1, True, None, 65536, r.random() * 0.01)
            for rng_key in r.choices(keys, k=30)
        ]
        if not batched:  # (a late read's release of a key never read: changes nothing)
            results.append(TierResult("release", b"never-read", -1, True))
        written: dict[bytes, int] = {}
        flow = mgr.flows[0]
        mgr._apply(results, written, flow)
        return written, _flow_state(flow), [mgr.pool.holds(k, Hold.TIER_WRITE) for k in keys]

    rng.random()
    fast, slow = run(True), run(False)
    assert fast == slow
    assert fast[0] and any(n > 1 for n in fast[0].values()), "some key ends two holds"
    assert len(fast[0]) < len(set(keys)), "some keys held nothing"
