"""store_planning's candidate filter against a planner that sees every request.

A request whose whole prompt is stored (only prompts offloaded) is not looked at again
until it finishes or one of vLLM's methods moves its store index back. Here a stand-in
scheduler (no vLLM needed) runs random steps of arrivals, prefill, decode, lookups and
allocations that move the index back, cache resets and finishes, twice: once behind
the filter and once with every scheduled request handed to its planner. The planner
(vLLM's rule: store the chunks past ``next_stored_chunk_idx`` that the prompt's
computed tokens fill) must plan the same stores, step for step.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.vllm_port import admissions, store_planning

CHUNK = 4


class RequestStatus(enum.Enum):  # read by store_planning from the scheduler's module
    RUNNING = 1
    FINISHED = 2

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status is RequestStatus.FINISHED


@dataclass
class Group:
    next_stored_chunk_idx: int = 0


@dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    num_tokens: int = 0
    status: RequestStatus = RequestStatus.RUNNING


@dataclass
class Status:
    req: Req
    group_states: tuple[Group, ...] = field(default_factory=lambda: (Group(),))


class Scheduler:
    """vLLM's offloading scheduler, reduced to what the filter and its planner touch."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(
            kv_group_configs=[SimpleNamespace(tokens_per_chunk=CHUNK)], offload_prompt_only=True
        )
        self._req_status: dict[str, Status] = {}
        self.stored: list[tuple[str, int, int]] = []

    def _calc_num_offloadable_tokens(self, status: Status, computed: int) -> int:
        req = status.req
        return min(computed, req.num_tokens, req.num_prompt_tokens)

    def _build_store_jobs(self, output: Any) -> dict[int, str]:
        jobs: dict[int, str] = {}
        for req_id in [*output.num_scheduled_tokens, *output.finished_req_ids]:
            status = self._req_status.get(req_id)
            if status is None:
                continue
            req = status.req
            after = req.num_computed_tokens + output.num_scheduled_tokens.get(req_id, 0)
            chunks = self._calc_num_offloadable_tokens(status, after) // CHUNK
            group = status.group_states[0]
            if chunks > group.next_stored_chunk_idx:
                self.stored.append((req_id, group.next_stored_chunk_idx, chunks))
                jobs[len(self.stored)] = req_id
                group.next_stored_chunk_idx = chunks
        return jobs

    # vLLM's methods that may move a store index back.
    def on_new_request(self, request: Req) -> None:
        self._req_status[request.request_id] = Status(request)

    def get_num_new_matched_tokens(self, request: Req, num_computed_tokens: int) -> None:
        self._req_status[request.request_id].group_states[0].next_stored_chunk_idx = 0

    def update_state_after_alloc(self, request: Req, blocks: Any, num_external: int) -> None:
        group = self._req_status[request.request_id].group_states[0]
        group.next_stored_chunk_idx = min(group.next_stored_chunk_idx, num_external // CHUNK)

    def reset_cache(self) -> None:
        for status in self._req_status.values():
            status.group_states[0].next_stored_chunk_idx = 0


class OwnAdmissions:
    """kvtier's admission calls, as store_planning sees them: installed on the
    scheduler as bound methods of ``_kvtier_admissions``, each calling ``forget`` with
    the request's id first (as :class:`admissions.Admissions` does)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.forget: Any = None

    def matched(self, request: Req, num_computed_tokens: int) -> None:
        if self.forget is not None:
            self.forget(request.request_id)
        Scheduler.get_num_new_matched_tokens(self.sched, request, num_computed_tokens)

    def allocated(self, request: Req, blocks: Any, num_external: int) -> None:
        if self.forget is not None:
            self.forget(request.request_id)
        Scheduler.update_state_after_alloc(self.sched, request, blocks, num_external)


def _run(seed: int, filtered: bool, own: bool = False) -> list[tuple[str, int, int]]:
    rng = random.Random(seed)
    sched = Scheduler()
    if own:
        admit = sched._kvtier_admissions = OwnAdmissions(sched)  # type: ignore[attr-defined]
        sched.get_num_new_matched_tokens = admit.matched  # type: ignore[method-assign]
        sched.update_state_after_alloc = admit.allocated  # type: ignore[method-assign]
    if filtered:
        store_planning.plan_stores_for_candidates(sched)
    running: list[Req] = []
    count = 0
    for _ in range(300):
        finished: set[str] = set()
        op = rng.random()
        if op < 0.15 or not running:
            count += 1
            req = Req(f"r{count}", rng.randint(1, 20))
            req.num_tokens = req.num_prompt_tokens
            sched.on_new_request(req)
            running.append(req)
        elif op < 0.22:
            req = rng.choice(running)
            if rng.random() < 0.5:
                sched.get_num_new_matched_tokens(req, 0)
            else:
                sched.update_state_after_alloc(req, None, rng.randint(0, req.num_prompt_tokens))
        elif op < 0.25:
            sched.reset_cache()
        elif op < 0.35:
            req = running.pop(rng.randrange(len(running)))
            req.status = RequestStatus.FINISHED
            finished.add(req.request_id)
        scheduled: dict[str, int] = {}
        for req in running:
            left = req.num_prompt_tokens - req.num_computed_tokens
            scheduled[req.request_id] = min(left, rng.randint(1, 8)) if left > 0 else 1
        sched._build_store_jobs(
            SimpleNamespace(num_scheduled_tokens=scheduled, finished_req_ids=finished)
        )
        for req in running:  # the step ran: decode tokens join the request
            req.num_computed_tokens += scheduled[req.request_id]
            req.num_tokens = max(req.num_tokens, req.num_computed_tokens)
        for req_id in finished:
            del sched._req_status[req_id]
    return sched.stored


@pytest.mark.parametrize("seed", range(20))
def test_the_filter_plans_what_a_planner_of_every_request_plans(seed: int) -> None:
    assert _run(seed, filtered=True) == _run(seed, filtered=False)
    assert _run(seed, filtered=False), "the run must store"


@pytest.mark.parametrize("seed", range(20))
def test_kvtiers_own_admission_calls_forget_instead_of_a_wrapper(seed: int) -> None:
    """Where kvtier's admission calls are installed, the filter hands them its
    ``forget`` rather than wrapping them: the same stores as a planner of every
    request."""
    assert _run(seed, filtered=True, own=True) == _run(seed, filtered=False)


def test_the_admission_calls_forget_the_request_first() -> None:
    """kvtier's ``Admissions.matched`` and ``allocated`` call ``forget`` with the
    request's id before anything else (no vLLM needed: the call stops right after)."""
    made = admissions.Admissions.__new__(admissions.Admissions)
    made.scheduler = SimpleNamespace()
    made.statuses = {}  # the lookup's first read fails: nothing after forget runs
    forgotten: list[str] = []
    made.forget = forgotten.append
    request = SimpleNamespace(request_id="r7")
    with pytest.raises(KeyError):
        made.matched(request, 0)
    made.allocated(request, None, 0)  # nothing to load: it returns after forget
    assert forgotten == ["r7", "r7"]


class Recording(Scheduler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[set[str]] = []
        self.seen_finished: list[list[str]] = []

    def _build_store_jobs(self, output: Any) -> dict[int, str]:
        self.seen.append(set(output.num_scheduled_tokens))
        self.seen_finished.append(list(output.finished_req_ids))
        return super()._build_store_jobs(output)


def test_decoding_requests_with_their_prompt_stored_are_not_looked_at() -> None:
    sched = Recording()
    store_planning.plan_stores_for_candidates(sched)
    reqs = [Req(f"r{i}", 8, num_tokens=8) for i in range(3)]
    for req in reqs:
        sched.on_new_request(req)

    def step(tokens: int) -> None:
        scheduled = {r.request_id: tokens for r in reqs}
        sched._build_store_jobs(
            SimpleNamespace(num_scheduled_tokens=scheduled, finished_req_ids=set())
        )
        for req in reqs:
            req.num_computed_tokens += tokens
            req.num_tokens = max(req.num_tokens, req.num_computed_tokens)

    step(8)  # prefill: each stores its prompt's two chunks
    for _ in range(5):
        step(1)  # decode: nothing to store, and nothing handed to the planner
    assert sched.seen == [{"r0", "r1", "r2"}]
    assert len(sched.stored) == 3
    sched.get_num_new_matched_tokens(reqs[1], 0)  # r1's index goes back
    step(1)
    assert sched.seen[-1] == {"r1"} and sched.stored[-1] == ("r1", 0, 2)


def test_settled_requests_are_not_keyed_until_they_leave_the_set() -> None:
    """update_keys_when_new adds no key to a settled request (nothing reads its keys)
    but records its new blocks, keys every other request as vLLM's update does, and
    keys a settled one once it leaves the set, all its lacking keys in one call
    (vLLM's ``RequestOffloadState`` and request-data walk)."""
    mod = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
    config = SimpleNamespace(
        kv_group_configs=(SimpleNamespace(group_idx=0, tokens_per_chunk=32, hashes_per_chunk=2),)
    )

    def state(req_id: str) -> Any:
        req = SimpleNamespace(
            request_id=req_id, block_hashes=[], kv_transfer_params=None, kv_hints=None
        )
        return mod.RequestOffloadState(
            config=config,
            req=req,
            req_context=mod._create_req_context(req),
            offloading_context=None,
        )

    sched: Any = object.__new__(mod.OffloadingConnectorScheduler)
    sched.config = config
    sched._req_status = {r: state(r) for r in ("a", "b")}
    sched._current_batch_allocated_block_ids = set()
    settled = {"a"}
    store_planning.update_keys_when_new(sched, settled)

    def step(new_blocks: dict[str, Any]) -> None:
        for status in sched._req_status.values():  # a chunk's worth of new hashes
            n = len(status.req.block_hashes)
            status.req.block_hashes += [
                b"%s%d" % (status.req.request_id.encode(), n + i) for i in range(2)
            ]
        ids = list(sched._req_status)
        cached = SimpleNamespace(
            req_ids=ids, new_block_ids=[new_blocks.get(r) for r in ids], resumed_req_ids=set()
        )
        sched._update_req_states(
            SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached)
        )

    def keys(req_id: str) -> int:
        return len(sched._req_status[req_id].group_states[0].offload_keys)

    step({})
    step({})
    assert (keys("a"), keys("b")) == (0, 2), "a settled request was keyed"
    step({"a": ([5],), "b": ([6],)})  # new blocks: recorded, a still not keyed
    assert (keys("a"), keys("b")) == (0, 3)
    assert sched._current_batch_allocated_block_ids == {5, 6}
    step({})
    settled.discard("a")  # its store index went back (a lookup, an allocation)
    step({})
    assert (keys("a"), keys("b")) == (5, 5), "the chunks it lacks, together"
    assert sched._req_status["a"].group_states[0].block_ids == [5]
    # A settled request's new blocks with the null block among them (as vLLM's walk
    # records them: in its table, never among the step's allocated blocks), beside
    # a request that is not settled.
    settled.add("a")
    sched._current_batch_allocated_block_ids = set()
    step({"a": ([0, 7],), "b": ([0, 8],)})
    assert sched._current_batch_allocated_block_ids == {7, 8}
    assert sched._req_status["a"].group_states[0].block_ids == [5, 0, 7]
    assert sched._req_status["b"].group_states[0].block_ids == [6, 0, 8]


def test_finished_requests_with_their_prompt_stored_are_not_planned() -> None:
    """A request that finishes with its whole prompt stored has nothing to store: it
    is not handed to the planner. One that finishes with chunks left (its store index
    went back) is, and stores them; vLLM's order of the others is kept."""
    sched = Recording()
    store_planning.plan_stores_for_candidates(sched)
    reqs = {r: Req(r, 8, num_tokens=8) for r in ("r0", "r1", "r2", "r3")}
    for req in reqs.values():
        sched.on_new_request(req)

    def step(running: list[str], finished: list[str]) -> None:
        for req_id in finished:
            reqs[req_id].status = RequestStatus.FINISHED
        scheduled = {r: 8 if reqs[r].num_computed_tokens == 0 else 1 for r in running}
        sched._build_store_jobs(
            SimpleNamespace(num_scheduled_tokens=scheduled, finished_req_ids=finished)
        )
        for req_id in running:
            reqs[req_id].num_computed_tokens += scheduled[req_id]
        for req_id in finished:
            del sched._req_status[req_id]

    step(["r0", "r1", "r2", "r3"], [])  # prefill: every prompt stored
    step(["r0", "r1", "r2", "r3"], [])  # decode: all settled
    sched.get_num_new_matched_tokens(reqs["r1"], 0)  # r1's index goes back
    stored = len(sched.stored)
    step(["r0"], ["r3", "r1", "r2"])
    assert sched.seen_finished[-1] == ["r1"], "a settled request was planned at its end"
    assert sched.stored[stored:] == [("r1", 0, 2)], "r1's chunks are stored as it ends"
