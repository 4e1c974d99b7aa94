"""kvtier's manager asked for a step's stores together (``prepare_store_many``, what
kvtier's store planner calls) answers and records what asking request by request does."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from .test_vllm_scenarios import key, manager

base = pytest.importorskip("vllm.v1.kv_offload.base")


@pytest.fixture(scope="module")
def model() -> Path:
    testkit = pytest.importorskip("kvtier.testkit")
    return testkit.make_tiny_llama()  # type: ignore[no-any-return]


def _answer(out: Any) -> Any:
    if out is None:
        return None
    return (
        list(out.keys_to_store),
        [int(b) for b in out.store_spec.chunk_ids],
        list(out.evicted_keys),
    )


@pytest.mark.parametrize("policy", ["lru", "frecency"])
def test_a_step_asked_together_answers_as_one_by_one(model: Path, policy: str) -> None:
    """Two managers over the same steps: requests that reuse cached keys, share keys
    with an earlier request of the step, or find the host tier full (the batch is then
    asked one by one). Answers, what each request reused (its finish moves its keys
    as such), lookups and the final eviction order are the same."""
    rng = random.Random(7)
    together, alone = manager(model, 96, policy), manager(model, 96, policy)
    batch = together.core.prepare_store_many
    answered: list[bool] = []  # per step: whether the host tier took it in one pass

    def counted(requests: Any) -> Any:
        plans = batch(requests)
        answered.append(plans is not None)
        return plans

    together.core.prepare_store_many = counted
    storing: list[Any] = []
    contexts: list[Any] = []
    for step in range(120):
        requests = []
        for i in range(rng.randrange(2, 5)):
            ctx = base.ReqContext(req_id=f"{step}-{i}")
            contexts.append(ctx)
            requests.append(([key(rng.randrange(150)) for _ in range(rng.randrange(1, 5))], ctx))
        got = together.prepare_store_many(requests)
        # The other manager's requests have contexts of their own (the same ids).
        twins = [(keys, base.ReqContext(req_id=ctx.req_id)) for keys, ctx in requests]
        want = [alone.prepare_store(keys, ctx) for keys, ctx in twins]
        assert [_answer(a) for a in got] == [_answer(b) for b in want]
        for out in got:
            if out is not None:
                storing += out.keys_to_store
        rng.shuffle(storing)
        done, storing = storing[: len(storing) // 2], storing[len(storing) // 2 :]
        together.complete_store(done, requests[0][1])
        alone.complete_store(done, twins[0][1])
        for (_, ctx), (_, twin) in zip(requests, twins):
            if rng.random() < 0.5:
                together.on_request_finished(ctx)
                alone.on_request_finished(twin)
        probe = [key(i) for i in range(150)]
        assert [together.lookup(k, requests[0][1]) for k in probe] == [
            alone.lookup(k, twins[0][1]) for k in probe
        ]
    assert together.core.pool.evict_all() == alone.core.pool.evict_all()
    assert sum(answered) > 10 and answered.count(False) > 10  # both ways taken


def test_the_first_request_reads_its_reuse_before_the_tiers_news(model: Path) -> None:
    """A key being stored (a promotion in flight) that lands in the poll the stores
    begin with: the first request offered it while it was not cached, so, one by one
    or together, it is not the request's reuse; a later request of the step finds it
    cached, and it is."""
    from kvtier.tiering_spec import vllm_compat as compat
    from kvtier.tiering_spec.vllm_manager import _RequestReuse

    def reused(mgr: Any, ctx: Any) -> set[Any]:
        state = compat.PORT.request_state(ctx, _RequestReuse)
        return set(state.reused) if state is not None else set()

    answers = []
    for together in (True, False):
        mgr = manager(model, 16)
        landing = key(1)
        assert mgr.prepare_store([landing], base.ReqContext(req_id="promotion")) is not None
        core = mgr.core

        def poll(pool: Any = core.pool, landing: Any = landing) -> bool:
            if pool.is_storing(landing):  # the promotion lands at the first poll
                pool.complete_store([landing])
                return True
            return False

        core.poll = poll
        first, second = base.ReqContext(req_id="a"), base.ReqContext(req_id="b")
        requests = [([landing, key(2)], first), ([landing, key(3)], second)]
        if together:
            got = mgr.prepare_store_many(requests)
        else:
            got = [mgr.prepare_store(keys, ctx) for keys, ctx in requests]
        answers.append([_answer(a) for a in got])
        assert reused(mgr, first) == set()
        assert reused(mgr, second) == {landing}
    assert answers[0] == answers[1]
