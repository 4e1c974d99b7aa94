"""lookup_memo answers a request's lookup again only when nothing the lookup reads has
changed, and counts it as asked (no vLLM needed here: the engine test of store
planning in kvtier-tiering-spec compares a real engine's plans and counters with and
without it)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.vllm_port import lookup_memo


class Manager:
    """A manager whose lookups count (queries, hits) and answer from ``cached``."""

    def __init__(self) -> None:
        self.changes = 0
        self.counts = [0, 0]
        self.memo_ok = True
        self.state_reads = 0

    def lookup_state(self) -> Any:
        self.state_reads += 1
        if not self.memo_ok:
            return None
        return ("pool", self.changes), tuple(self.counts)

    def recount_lookups(self, moves: Any) -> None:
        self.counts[0] += moves[0]
        self.counts[1] += moves[1]


@pytest.fixture(autouse=True, params=[False, True], ids=["state", "version-and-counts"])
def split_state(request: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test with a manager that answers ``lookup_state()`` alone, and with one that
    also gives its two parts apart (kvtier's: the memo then reads the version alone
    when it answers an ask)."""
    if not request.param:
        return

    def lookup_version(self: Manager) -> Any:
        self.state_reads += 1
        return ("pool", self.changes) if self.memo_ok else None

    def lookup_counts(self: Manager) -> Any:
        self.count_reads = getattr(self, "count_reads", 0) + 1
        return tuple(self.counts)

    monkeypatch.setattr(Manager, "lookup_version", lookup_version, raising=False)
    monkeypatch.setattr(Manager, "lookup_counts", lookup_counts, raising=False)


class Scheduler:
    """vLLM's offloading scheduler, as far as ``_lookup`` goes: it asks the manager
    about every offload key past what the device computed and answers the hit."""

    def __init__(self, manager: Manager | None = None) -> None:
        self.manager = manager or Manager()
        self._sliding_window_groups: tuple[int, ...] = ()
        self.config = SimpleNamespace(supports_partial_tail=False)
        self._chunks_being_loaded: set[Any] = set()
        self._events_tracker = SimpleNamespace(self_describing_enabled=False)
        self.hits = 2  # offload keys the manager holds, from the first
        self.asked = 0

    def _lookup(self, req_status: Any, max_num_new_tokens: int | None = None) -> int | None:
        self.asked += 1
        keys = len(req_status.group_states[0].offload_keys)
        start = req_status.num_locally_computed_tokens // 16
        looked = keys - start
        found = max(0, min(self.hits, keys) - start)
        self.manager.counts[0] += looked
        self.manager.counts[1] += found
        req_status.partial_tail_boundary = None
        if max_num_new_tokens is not None:
            return min(found * 16, max_num_new_tokens)
        return found * 16


def status(req_id: str = "r", keys: int = 4, computed: int = 0) -> Any:
    return SimpleNamespace(
        req=SimpleNamespace(request_id=req_id, num_tokens=keys * 16 + 3),
        num_locally_computed_tokens=computed,
        max_load_tokens=None,
        group_states=[SimpleNamespace(offload_keys=list(range(keys)))],
        partial_tail_boundary=None,
    )


def installed(**kwargs: Any) -> Scheduler:
    scheduler = Scheduler(**kwargs)
    assert lookup_memo.install(scheduler)
    return scheduler


def test_an_unchanged_lookup_is_answered_again_and_counted_as_asked() -> None:
    scheduler = installed()
    req = status()
    assert scheduler._lookup(req, None) == 32
    assert scheduler.manager.counts == [4, 2]
    assert scheduler._lookup(req, None) == 32  # the ask the memo keeps
    assert scheduler.asked == 2 and scheduler.manager.counts == [8, 4]
    req.partial_tail_boundary = 7  # (vLLM's lookup sets it: None without tails)
    assert scheduler._lookup(req, None) == 32
    assert scheduler.asked == 2 and scheduler.kvtier_repeated_lookups == 1
    assert scheduler.manager.counts == [12, 6]
    assert req.partial_tail_boundary is None


def test_a_first_ask_reads_nothing_more_than_vllms_lookup() -> None:
    """Most requests are asked about once (admitted at once): the memo reads no
    manager state for them and keeps nothing."""
    scheduler = installed()
    for req_id in ("a", "b", "c"):
        assert scheduler._lookup(status(req_id), None) == 32
    assert scheduler.asked == 3 and scheduler.manager.state_reads == 0
    assert scheduler.manager.counts == [12, 6]


def asked_twice(scheduler: Scheduler, req: Any, max_new: int | None = None) -> None:
    """Ask about ``req`` as the memo needs before it answers: a first ask, then the
    one it keeps."""
    for _ in range(2):
        scheduler._lookup(req, max_new)
    assert scheduler.asked == 2 and scheduler.kvtier_repeated_lookups == 0


@pytest.mark.parametrize(
    "change",
    [
        "cache",
        "computed",
        "keys",
        "tokens",
        "max_new",
        "max_load",
        "state_object",
        "loading",
        "events",
    ],
)
def test_any_change_to_what_it_reads_asks_again(change: str) -> None:
    scheduler = installed()
    req = status()
    max_new = None
    asked_twice(scheduler, req, max_new)
    if change == "cache":  # a store or an eviction: the manager's answers may differ
        scheduler.manager.changes += 1
        scheduler.hits = 3
    elif change == "computed":
        req.num_locally_computed_tokens = 16
    elif change == "keys":
        req.group_states[0].offload_keys.append(4)
        scheduler.hits = 5
    elif change == "tokens":
        req.req.num_tokens += 16
    elif change == "max_new":
        max_new = 16
    elif change == "max_load":
        req.max_load_tokens = 16
    elif change == "state_object":  # the request was forgotten and added again
        req = status()
    elif change == "loading":
        scheduler._chunks_being_loaded.add(0)
    elif change == "events":
        scheduler._events_tracker.self_describing_enabled = True
    scheduler._lookup(req, max_new)
    assert scheduler.asked == 3 and scheduler.kvtier_repeated_lookups == 0


def test_a_pending_answer_or_a_manager_that_cannot_tell_is_never_kept() -> None:
    answers = iter([None, None, 16])
    vllm_lookup = Scheduler._lookup

    def pending(req_status: Any, max_num_new_tokens: int | None = None) -> int | None:
        vllm_lookup(scheduler, req_status, max_num_new_tokens)
        return next(answers)

    scheduler = Scheduler()
    scheduler._lookup = pending  # type: ignore[method-assign]
    assert lookup_memo.install(scheduler)
    req = status()
    assert [scheduler._lookup(req, None) for _ in range(3)] == [None, None, 16]
    assert scheduler.kvtier_repeated_lookups == 0

    manager = Manager()
    manager.memo_ok = False  # (kvtier's manager with a secondary tier)
    other = installed(manager=manager)
    for _ in range(3):
        other._lookup(req, None)
    assert other.asked == 3 and other.kvtier_repeated_lookups == 0


def test_a_lookup_that_changes_the_cache_is_asked_again() -> None:
    # (kvtier's promotions reserve host blocks during a lookup.)
    vllm_lookup = Scheduler._lookup

    def promoting(req_status: Any, max_num_new_tokens: int | None = None) -> int | None:
        scheduler.manager.changes += 1
        return vllm_lookup(scheduler, req_status, max_num_new_tokens)

    scheduler = Scheduler()
    scheduler._lookup = promoting  # type: ignore[method-assign]
    assert lookup_memo.install(scheduler)
    req = status()
    for _ in range(3):
        scheduler._lookup(req, None)
    assert scheduler.kvtier_repeated_lookups == 0


def test_requests_are_remembered_apart() -> None:
    scheduler = installed()
    a, b = status("a"), status("b", keys=6)
    for _ in range(3):
        assert scheduler._lookup(a, None) == 32
        assert scheduler._lookup(b, None) == 32
    assert scheduler.asked == 4 and scheduler.kvtier_repeated_lookups == 2
    assert scheduler.manager.counts == [30, 12]


@pytest.mark.parametrize("shape", ["windows", "tails", "params", "manager"])
def test_a_scheduler_of_another_shape_keeps_its_lookup(shape: str) -> None:
    scheduler: Any = Scheduler()
    if shape == "windows":
        scheduler._sliding_window_groups = (1,)
    elif shape == "tails":
        scheduler.config.supports_partial_tail = True
    elif shape == "params":

        class Other(Scheduler):
            def _lookup(self, req_status: Any) -> int | None:  # type: ignore[override]
                return 0

        scheduler = Other()
    elif shape == "manager":
        scheduler.manager = SimpleNamespace()
    assert not lookup_memo.install(scheduler)
    assert "_lookup" not in vars(scheduler)


def test_an_answer_from_the_memo_reads_no_counters(split_state: None) -> None:
    """With a manager that gives its version and counters apart, an ask the memo answers
    reads the version alone."""
    scheduler = installed()
    if not hasattr(scheduler.manager, "lookup_counts"):
        pytest.skip("the manager answers lookup_state() alone")
    req = status()
    asked_twice(scheduler, req)
    reads = scheduler.manager.count_reads
    for _ in range(3):
        assert scheduler._lookup(req, None) == 32
    assert scheduler.kvtier_repeated_lookups == 3
    assert scheduler.manager.count_reads == reads
