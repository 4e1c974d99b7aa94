"""A waiting request's lookup answered again from its last answer, when nothing it
read has changed.

vLLM's scheduler asks the connector about the request at the head of its waiting queue
on every step until it can admit it (``get_num_new_matched_tokens``), and gives up on
the step when the device has no room for it. Under memory pressure, with preempted
requests waiting for room, that is a large share of all steps (about a third in the
``preempt-8`` workload of ``bench-step``), and each ask walks the request's offload keys
again and asks the manager about them (vLLM's ``_lookup``), though neither the request
nor the manager's cache changed since the last ask.

:func:`install` puts a memo in front of vLLM's ``_lookup`` on one scheduler instance.
The answer is taken from the memo, and the counters the manager's lookup moves are
moved again (the same metrics as asking), when all of these are as they were after the
last ask for the same request:

* the request's state object, the tokens it has and has computed on the device, the
  cap on new tokens asked with, its cap on tokens to load and its count of offload keys
  per KV cache group (vLLM's lookup reads nothing else of the request);
* the manager's answer to ``lookup_state()`` (or its first part alone, from
  ``lookup_version()`` where the manager has it and ``lookup_counts()``), a value that
  is equal exactly when its lookups answer the same (kvtier's: the host pool's and
  each fs index's change counts; a lookup that promotes changes the pool, so the next
  ask goes to vLLM's). A manager that answers None (kvtier's with a mooncake tier,
  whose answers come from background probes, or with a key refused for a while) is
  asked every time, and so is one without the method.

A request's first ask goes to vLLM's lookup with nothing read or kept (most requests
are admitted on their first ask); the memo keeps its second ask's answer and answers
the third on. vLLM's lookup is called as before when its hit chunks may be loading
(``_chunks_being_loaded``), when its events tracker records lookups (self-describing KV
events), and whenever the last answer was "ask again later" (None). It is installed only
where vLLM's ``_lookup`` takes ``(req_status, max_num_new_tokens)``, the model has no
sliding-window groups and no partial recurrent tails (where ``_lookup`` reads more).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

_PARAMS = ["self", "req_status", "max_num_new_tokens"]
# Requests remembered at once: the waiting queue's head is one request; more only
# when vLLM asks about several in one step. Beyond, the memo starts over.
MAX_MEMOS = 256


def _params(method: Any) -> list[str] | None:
    try:
        return list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return None


def _state_parts(
    manager: Any,
) -> tuple[Callable[[], object | None], Callable[[], tuple[int, ...]]]:
    """The manager's lookup version and its lookup counters, each read alone: its own
    ``lookup_version()`` and ``lookup_counts()`` where it has both (an answer from the
    memo then reads the version alone), else the two parts of its ``lookup_state()``."""
    version_of = getattr(manager, "lookup_version", None)
    counts_of = getattr(manager, "lookup_counts", None)
    if callable(version_of) and callable(counts_of):
        return version_of, counts_of
    state = manager.lookup_state

    def version() -> object | None:
        whole = state()
        return None if whole is None else whole[0]

    def counts() -> tuple[int, ...]:
        whole = state()
        assert whole is not None  # (read right after a version that was not None)
        return whole[1]

    return version, counts


def install(scheduler: Any) -> bool:
    """Put the memo (see the module) in front of ``scheduler._lookup``; whether it was
    installed."""
    cls = type(scheduler)
    manager = getattr(scheduler, "manager", None)
    state = getattr(manager, "lookup_state", None)
    recount = getattr(manager, "recount_lookups", None)
    method = getattr(cls, "_lookup", None)
    if (
        not callable(state)
        or not callable(recount)
        or not callable(method)
        or _params(method) != _PARAMS
        or getattr(scheduler, "_sliding_window_groups", None) != ()
        or getattr(getattr(scheduler, "config", None), "supports_partial_tail", None) is not False
        or not hasattr(scheduler, "_chunks_being_loaded")
    ):
        return False
    vllm_lookup = scheduler._lookup
    # (The counters are read only around a lookup handed to vLLM's.)
    version_of, counts_of = _state_parts(manager)
    tracker = getattr(scheduler, "_events_tracker", None)
    # request id -> (its state object, what the lookup read, the answer, counter moves)
    memos: dict[str, tuple[Any, tuple[Any, ...], int, tuple[int, ...]]] = {}
    asked: set[str] = set()  # requests asked about once (whose next ask is remembered)

    def _lookup(req_status: Any, max_num_new_tokens: int | None = None) -> int | None:
        if scheduler._chunks_being_loaded or getattr(tracker, "self_describing_enabled", True):
            return vllm_lookup(req_status, max_num_new_tokens)
        req_id = req_status.req.request_id
        if req_id not in asked:
            # A first ask (most requests are admitted on it): nothing to answer it from,
            # and nothing kept; the memo starts with the second.
            if len(asked) >= MAX_MEMOS:
                asked.clear()
            asked.add(req_id)
            return vllm_lookup(req_status, max_num_new_tokens)
        version = version_of()
        if version is None:
            return vllm_lookup(req_status, max_num_new_tokens)
        req = req_status.req
        read = (
            max_num_new_tokens,
            req_status.num_locally_computed_tokens,
            req.num_tokens,
            req_status.max_load_tokens,
            [len(group.offload_keys) for group in req_status.group_states],
            version,
        )
        memo = memos.get(req_id)
        if memo is not None and memo[0] is req_status and memo[1] == read:
            recount(memo[3])
            req_status.partial_tail_boundary = None  # (as vLLM's sets it without tails)
            scheduler.kvtier_repeated_lookups += 1
            return memo[2]
        counts = counts_of()
        hit = vllm_lookup(req_status, max_num_new_tokens)
        after = None if version_of() is None else counts_of()
        if hit is None or after is None:
            memos.pop(req_id, None)  # pending: ask again
            return hit
        # (A lookup that changed the cache, a promotion, left another state: the next
        # ask reads that one and goes to vLLM's lookup.)
        if len(memos) >= MAX_MEMOS:
            memos.clear()
        memos[req_id] = (req_status, read, hit, tuple(a - b for a, b in zip(after, counts)))
        return hit

    scheduler._lookup = _lookup
    scheduler.kvtier_repeated_lookups = 0  # lookups answered from the memo (for tests)
    return True
