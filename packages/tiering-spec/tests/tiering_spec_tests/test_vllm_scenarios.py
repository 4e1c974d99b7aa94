"""vLLM's manager scenarios that its own tests cannot check against kvtier, checked here.

Each test mirrors the vLLM 0.32 test of the same name in
``tests/v1/kv_offload/cpu/test_manager.py`` (``nox -s conformance`` names these in its
deviations' ``mirror``): the same calls on kvtier's manager, the same outcomes (keys
stored, evicted and looked up, ``None`` where there is no room, and every KV event),
compared by key. The chunk (host block) ids are kvtier-blockpool's choice, so where vLLM
asserts its own ids these assert what any correct choice gives: distinct blocks in
range, a loaded key's block is the one it was stored in, and a store into a full tier
reuses the blocks of the keys it evicted.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from .vllm_configs import spec_without_engine as make_spec

vllm = pytest.importorskip("vllm")
base = pytest.importorskip("vllm.v1.kv_offload.base")
if not hasattr(base, "LookupResult") or not hasattr(base, "make_offload_key"):
    pytest.skip("vLLM before 0.32: no LookupResult nor offload keys", allow_module_level=True)

HIT, HIT_PENDING, MISS = (
    base.LookupResult.HIT,
    base.LookupResult.HIT_PENDING,
    base.LookupResult.MISS,
)
CHUNK = 65536  # one chunk of the tiny model's layout (vllm_configs)
CTX = base.ReqContext(req_id="")


@pytest.fixture(scope="module")
def model() -> Path:
    testkit = pytest.importorskip("kvtier.testkit")
    return testkit.make_tiny_llama()  # type: ignore[no-any-return]


def manager(model: Path, num_chunks: int, policy: str = "lru", events: bool = True) -> Any:
    from kvtier.tiering_spec import CPUOffloadingSpec

    extra = {"cpu_bytes_to_use": num_chunks * CHUNK, "eviction_policy": policy}
    spec = make_spec(CPUOffloadingSpec, model, extra, kv_events=events)
    assert spec.num_chunks == num_chunks
    return spec.get_manager()


def key(i: int) -> Any:
    return base.make_offload_key(str(i).encode(), 0)


def keys(ints: Iterable[int]) -> list[Any]:
    return [key(i) for i in ints]


class Blocks:
    """Which host block each stored key was given, checked as the scenario goes."""

    def __init__(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks
        self.of: dict[Any, int] = {}

    def stored(self, out: Any, to_store: list[int], evicted: list[int]) -> None:
        assert out is not None
        assert out.keys_to_store == keys(to_store)
        assert out.evicted_keys == keys(evicted)
        ids = [int(b) for b in out.store_spec.chunk_ids]
        assert len(ids) == len(to_store) and len(set(ids)) == len(ids)
        assert all(0 <= b < self.num_chunks for b in ids)
        freed = {self.of.pop(k) for k in out.evicted_keys}
        in_use = set(self.of.values())
        assert not in_use & set(ids), "a block still holding a key was given out again"
        if len(in_use) + len(ids) == self.num_chunks:  # full: the victims' blocks reused
            assert freed <= set(ids)
        self.of.update(zip(out.keys_to_store, ids))

    def loaded(self, spec: Any, ints: list[int]) -> None:
        assert [int(b) for b in spec.chunk_ids] == [self.of[k] for k in keys(ints)]

    def failed(self, ints: list[int]) -> None:
        for k in keys(ints):
            self.of.pop(k, None)


def events_of(mgr: Any) -> tuple[list[set[Any]], list[set[Any]]]:
    """(stores, evictions) of the events taken now, each a set of keys, in order."""
    stores: list[set[Any]] = []
    evictions: list[set[Any]] = []
    cpu = getattr(getattr(base, "Medium", None), "CPU", "CPU")
    for event in mgr.take_events():
        assert event.medium == cpu
        (evictions if event.removed else stores).append(set(event.keys))
    return stores, evictions


def key_sets(*ints: list[int]) -> list[set[Any]]:
    return [set(keys(i)) for i in ints]


def test_cpu_manager(model: Path) -> None:
    mgr = manager(model, 4)
    blocks = Blocks(4)
    blocks.stored(mgr.prepare_store(keys([1, 2]), CTX), [1, 2], [])
    assert mgr.lookup(key(1), CTX) is HIT_PENDING and mgr.lookup(key(2), CTX) is HIT_PENDING
    assert list(mgr.take_events()) == [], "no events before a store completes"
    mgr.complete_store(keys([1, 2]), CTX)
    assert events_of(mgr) == (key_sets([1, 2]), [])
    assert [mgr.lookup(key(i), CTX) for i in (1, 2, 3)] == [HIT, HIT, MISS]

    blocks.stored(mgr.prepare_store(keys([2, 3, 4, 5]), CTX), [3, 4, 5], [1])
    assert events_of(mgr) == ([], key_sets([1]))
    assert mgr.prepare_store(keys([1, 6]), CTX) is None, "no room: 3, 4, 5 are storing"
    mgr.complete_store(keys([2, 3, 4, 5]), CTX)
    assert [mgr.lookup(key(i), CTX) for i in (1, 2, 3, 4, 5, 0)] == [MISS] + [HIT] * 4 + [MISS]

    load_ctx = base.ReqContext(req_id="load-2-3")
    blocks.loaded(mgr.prepare_load(keys([2, 3]), load_ctx), [2, 3])
    assert mgr.prepare_store(keys([6, 7, 8]), CTX) is None, "no room: 2, 3 are loading"
    mgr.complete_load(keys([2, 3]), load_ctx)
    mgr.on_request_finished(load_ctx)
    # 2 and 3 are the newest, 3 (the reused prefix's tail) before 2.
    blocks.stored(mgr.prepare_store(keys([6, 7, 8]), CTX), [6, 7, 8], [4, 5, 3])
    mgr.complete_store(keys([6, 7, 8]), CTX)
    mgr.touch(keys([2, 6, 7]), CTX)
    blocks.stored(mgr.prepare_store(keys([9]), CTX), [9], [8])
    mgr.complete_store(keys([7, 9]), CTX, success=False)
    blocks.failed([9])
    assert mgr.lookup(key(7), CTX) is HIT, "a failed store leaves a stored key alone"
    assert mgr.lookup(key(9), CTX) is MISS
    assert events_of(mgr) == (key_sets([3, 4, 5], [6, 7, 8]), key_sets([4, 5, 3], [8]))
    mgr.shutdown()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_already_stored_chunk_not_evicted_during_prepare_store(model: Path, policy: str) -> None:
    mgr = manager(model, 4, policy)
    blocks = Blocks(4)
    blocks.stored(mgr.prepare_store(keys([1, 2]), CTX), [1, 2], [])
    mgr.complete_store(keys([1, 2]), CTX)
    mgr.touch(keys([1]), CTX)
    # 2 is the oldest, but it is one of the keys offered: 1 goes instead.
    blocks.stored(mgr.prepare_store(keys([2, 3, 4, 5]), CTX), [3, 4, 5], [1])
    mgr.complete_store(keys([2, 3, 4, 5]), CTX)
    assert mgr.lookup(key(2), CTX) is HIT
    mgr.shutdown()


def test_arc_basic(model: Path) -> None:
    # vLLM's TestARCPolicy.test_basic.
    mgr = manager(model, 4, "arc")
    blocks = Blocks(4)
    blocks.stored(mgr.prepare_store(keys([1, 2]), CTX), [1, 2], [])
    assert mgr.lookup(key(1), CTX) is HIT_PENDING and mgr.lookup(key(2), CTX) is HIT_PENDING
    assert list(mgr.take_events()) == []
    mgr.complete_store(keys([1, 2]), CTX)
    assert events_of(mgr) == (key_sets([1, 2]), [])
    assert [mgr.lookup(key(i), CTX) for i in (1, 2, 3)] == [HIT, HIT, MISS]
    arc = mgr.core.pool.policy
    assert (len(arc.t1), len(arc.t2)) == (2, 0), "stored once: both recent (T1)"
    mgr.shutdown()


def test_failed_store_records_access_once_and_uses_store_miss_hook(model: Path) -> None:
    # A store refused for want of room (the one resident key is being loaded) still
    # counts the resident key the request offered as reused, once: when the request
    # finishes, that key is a use (it moves to ARC's T2), the refused one is nothing.
    mgr = manager(model, 1, "arc", events=False)
    resident, candidate = keys([1, 2])
    seed = base.ReqContext(req_id="seed")
    assert mgr.prepare_store([resident], seed) is not None
    mgr.complete_store([resident], seed)
    pin = base.ReqContext(req_id="pin")
    mgr.prepare_load([resident], pin)
    ctx = base.ReqContext(req_id="failed-store")
    assert mgr.prepare_store([candidate, resident], ctx) is None
    assert mgr.prepare_store([candidate, resident], ctx) is None, "offered twice"
    mgr.on_request_finished(ctx)
    arc = mgr.core.pool.policy
    assert list(arc.t2) == [resident] and not arc.t1, "the resident key reused once"
    assert mgr.lookup(candidate, ctx) is MISS
    mgr.complete_load([resident], pin)
    mgr.shutdown()


def test_reset_discards_what_a_request_noted_before_it(model: Path) -> None:
    # vLLM's test_reset_discards_stale_request_access_classification (which the
    # conformance session runs against kvtier too): a request that stored a key before
    # reset_cache, then reads it once another request stored it anew, reused it.
    mgr = manager(model, 1, "arc", events=False)
    k = key(1)
    resumed = base.ReqContext(req_id="resumed")
    assert mgr.prepare_store([k], resumed) is not None
    mgr.complete_store([k], resumed)
    mgr.reset_cache()
    replacement = base.ReqContext(req_id="replacement")
    assert mgr.prepare_store([k], replacement) is not None
    mgr.complete_store([k], replacement)
    mgr.on_request_finished(replacement)
    arc = mgr.core.pool.policy
    assert list(arc.t1) == [k]
    mgr.prepare_load([k], resumed)
    mgr.complete_load([k], resumed)
    mgr.on_request_finished(resumed)
    assert list(arc.t2) == [k] and not arc.t1
    mgr.shutdown()


@pytest.mark.parametrize("placed", [True, False], ids=["placed", "unplaced"])
def test_a_finished_request_is_ordered_by_its_keys_places(model: Path, placed: bool) -> None:
    """A request's keys reach the eviction order at its end head first, by their place
    in the prompt where vLLM's context knows it, whatever order they were stored in;
    where it knows none, in the order they were noted."""
    mgr = manager(model, 4, "lru", events=False)
    ctx = base.ReqContext(req_id="r")
    k1, k2, k3 = keys([1, 2, 3])
    if placed:
        for place, k in enumerate((k1, k2, k3)):
            ctx.set_offload_key_position(k, 32 * (place + 1))
    for k in (k3, k1, k2):  # stored out of prompt order (a backfill)
        assert mgr.prepare_store([k], ctx) is not None
        mgr.complete_store([k], ctx)
    mgr.on_request_finished(ctx)
    evicted = mgr.core.pool.evict(3)  # (in the policy's order)
    # The tail first, the head last; unplaced: the last noted is the tail.
    assert evicted == ([k3, k2, k1] if placed else [k2, k1, k3])
    mgr.shutdown()


def test_a_key_a_request_stored_and_read_back_is_not_its_reuse(model: Path) -> None:
    # A request that loads back a key it stored (a cascade between tiers) did not reuse
    # it; a key another request stored, which it loads, it did.
    mgr = manager(model, 4, "arc", events=False)
    own, other = keys([1, 2])
    writer = base.ReqContext(req_id="writer")
    assert mgr.prepare_store([other], writer) is not None
    mgr.complete_store([other], writer)
    mgr.on_request_finished(writer)
    ctx = base.ReqContext(req_id="cascade")
    assert mgr.prepare_store([own], ctx) is not None
    mgr.complete_store([own], ctx)
    mgr.prepare_load([own, other], ctx)
    mgr.complete_load([own, other], ctx)
    mgr.on_request_finished(ctx)
    arc = mgr.core.pool.policy
    assert list(arc.t2) == [other] and list(arc.t1) == [own]
    mgr.shutdown()


def test_lookup_answers_are_lookups_taken_lazily(model: Path) -> None:
    # What kvtier-vllm-port's sliding-window scan asks of kvtier's manager.
    mgr = manager(model, 4, events=False)
    assert mgr.prepare_store(keys([1, 2, 3]), CTX) is not None
    mgr.complete_store(keys([1, 2]), CTX)
    wanted = keys([3, 2, 9, 1])
    assert list(mgr.lookup_answers(iter(wanted), CTX)) == [mgr.lookup(k, CTX) for k in wanted]
    assert list(mgr.lookup_answers(iter(wanted), CTX)) == [HIT_PENDING, HIT, MISS, HIT]
    asked: list[Any] = []
    answers = mgr.lookup_answers((asked.append(k) or k for k in wanted), CTX)
    assert next(answers) is HIT_PENDING and asked == wanted[:1], "not lazy"
    mgr.shutdown()
