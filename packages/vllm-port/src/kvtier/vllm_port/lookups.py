"""A request's prefix looked up in one call, for vLLM's offloading connector.

vLLM's ``OffloadingConnectorScheduler`` looks an arriving request's offloaded prefix up
key by key (``_maximal_prefix_lookup`` calls the manager's ``lookup`` once a key), and
splits its loaded tokens by tier by asking the manager for every loaded key's source
and sweeping their ranges (``get_external_cache_hit_sources``). Each costs a few Python
calls per key on the scheduler's thread, for every request it admits.

:func:`speed_up` changes two things on one scheduler instance, and nothing else:

* **One lookup call per prefix.** Where the manager has ``lookup_prefix(keys,
  req_context)``, ``_maximal_prefix_lookup`` asks it once: it returns how many keys lead
  up to the first miss, and ``None`` when all of them are hits, else a flag per key
  (True: a hit; False: pending). That is vLLM's loop for a manager that never answers
  ``RETRY`` (kvtier's managers never do). The events tracker records what vLLM's loop
  records: vLLM 0.32 records hits, 0.33 hits and pending keys; which one runs here is
  asked of vLLM's own method once, on a probe.
* **One source for a hit served by one tier.** Where every loaded range of the
  request, clipped to the hit, comes from one tier, and the ranges cover the hit in
  order, the answer is that tier for every token, which is what vLLM's sweep finds; any
  other hit goes through vLLM's own method. A manager with ``sole_load_source(keys,
  req_context)`` (the one source of all of ``keys``, or None where they come from
  several) is asked once for the hit's keys; any other is asked key by key
  (``get_load_source``).

Where vLLM's scheduler lacks what these read, nothing changes.

:func:`sliding_window_scans` puts kvtier's own scan of a sliding-window group's keys in
place of vLLM's ``_sliding_window_lookup`` (the last run of a window's worth of hits,
found from the end): it asks the manager's ``lookup_answers`` (one generator for a
scan) where the manager has it, else ``lookup`` key by key, and stops where vLLM's
stops, so the manager is asked about the same keys. It is installed only where the
scheduler's own method gives the same answer on every short answer pattern
(:func:`_same_window_answers`, asked once per scheduler class).
"""

from __future__ import annotations

import inspect
import itertools
import sys
from collections.abc import Callable, Iterator
from typing import Any

from kvtier.vllm_port.store_planning import _fields

_PREFIX_PARAMS = ["self", "keys", "req_context", "req", "group_config", "start_chunk_idx"]
_SOURCES_PARAMS = ["self", "request", "num_external_tokens"]


def _params(cls: type, name: str) -> list[str] | None:
    method = getattr(cls, name, None)
    if not callable(method):
        return None
    try:
        return list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return None


def speed_up(scheduler: Any) -> tuple[bool, bool]:
    """Apply both changes (see the module) to ``scheduler`` where it has their shape;
    returns whether each was applied (prefix lookups, hit sources)."""
    return batch_prefix_lookups(scheduler), single_source_hits(scheduler)


class _Probe:
    """A manager with one answer and a tracker that keeps what it is told."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.recorded: list[Any] = []
        self.self_describing_enabled = True

    def lookup(self, key: Any, req_context: Any) -> Any:
        return self.answer

    def record_lookup(self, req: Any, group_config: Any, chunk_idx: int, key: Any) -> None:
        self.recorded.append(key)


def _records(cls: type, answer: Any) -> bool | None:
    """Whether vLLM's ``_maximal_prefix_lookup`` of ``cls`` records a KV event for a key
    the manager answers ``answer``; None where it cannot be asked."""
    probe = _Probe(answer)
    try:
        scheduler: Any = object.__new__(cls)
        scheduler.manager = probe
        scheduler._events_tracker = probe
        cls._maximal_prefix_lookup(scheduler, ["probe"], None, None, None, 0)  # type: ignore[attr-defined]
    except Exception:
        return None
    return bool(probe.recorded)


def batch_prefix_lookups(scheduler: Any) -> bool:
    """``_maximal_prefix_lookup`` through the manager's ``lookup_prefix``."""
    cls = type(scheduler)
    lookup_prefix = getattr(getattr(scheduler, "manager", None), "lookup_prefix", None)
    tracker = getattr(scheduler, "_events_tracker", None)
    record = getattr(tracker, "record_lookup", None)
    answers = getattr(sys.modules.get(cls.__module__), "LookupResult", None)
    if (
        lookup_prefix is None
        or answers is None
        or not callable(record)
        or _params(cls, "_maximal_prefix_lookup") != _PREFIX_PARAMS
    ):
        return False
    hits, pending = _records(cls, answers.HIT), _records(cls, answers.HIT_PENDING)
    if hits is not True or pending is None:
        return False  # a loop this module does not know

    def _maximal_prefix_lookup(
        keys: Any, req_context: Any, req: Any, group_config: Any, start_chunk_idx: int
    ) -> int | None:
        keys = keys if isinstance(keys, list) else list(keys)
        found, ready = lookup_prefix(keys, req_context)
        # (vLLM's tracker records nothing unless its events describe themselves.)
        if found and getattr(tracker, "self_describing_enabled", True):
            for i in range(found):
                if ready is None or pending or ready[i]:
                    record(req, group_config, start_chunk_idx + i, keys[i])
        return found if ready is None else None

    scheduler._maximal_prefix_lookup = _maximal_prefix_lookup
    return True


def single_source_hits(scheduler: Any) -> bool:
    """``get_external_cache_hit_sources`` answered at once for a one-tier hit."""
    cls = type(scheduler)
    module = sys.modules.get(cls.__module__)
    source_type = getattr(module, "CacheHitSource", None)
    statuses = getattr(scheduler, "_req_status", None)
    manager = getattr(scheduler, "manager", None)
    get_load_source = getattr(manager, "get_load_source", None)
    if (
        source_type is None
        or not isinstance(statuses, dict)
        or not callable(get_load_source)
        or _params(cls, "get_external_cache_hit_sources") != _SOURCES_PARAMS
        or not {"load_key_ranges", "num_locally_computed_tokens", "req_context"}
        <= _fields(getattr(module, "RequestOffloadState", None))
    ):
        return False
    sweep: Callable[[Any, int], Any] = scheduler.get_external_cache_hit_sources
    # A manager that names the one source of several keys in one call (kvtier's), else
    # None: its get_load_source is asked key by key.
    sole_source: Callable[[list[Any], Any], Any] | None = getattr(manager, "sole_load_source", None)

    def get_external_cache_hit_sources(request: Any, num_external_tokens: int) -> Any:
        if num_external_tokens == 0:
            return {}
        status = statuses[request.request_id]
        start = status.num_locally_computed_tokens
        end = start + num_external_tokens
        context = status.req_context
        source = None
        covered = start  # the hit is covered from start up to here
        keys: list[Any] = []
        # (Comparisons, not min and max: this runs for every loaded key.)
        for lo, hi, key in status.load_key_ranges:
            if lo < start:
                lo = start
            if hi > end:
                hi = end
            if lo >= hi:
                continue
            if lo > covered:  # a gap, or ranges out of order: vLLM's sweep decides
                return sweep(request, num_external_tokens)
            if sole_source is not None:
                keys.append(key)
            else:
                tier = get_load_source(key, context)
                if source is None:
                    source = tier
                elif tier != source:
                    return sweep(request, num_external_tokens)
            if hi > covered:
                covered = hi
        if keys:
            source = sole_source(keys, context)  # type: ignore[misc]
        if source is None or covered < end:
            return sweep(request, num_external_tokens)
        return {source_type(source): num_external_tokens}

    scheduler.get_external_cache_hit_sources = get_external_cache_hit_sources
    return True


def arrival_keys(scheduler: Any, request_id: str) -> list[Any] | None:
    """The offload keys of a request vLLM's ``on_new_request`` just added: its prompt's
    complete chunks in prefix order, as its lookup will ask for them, made by vLLM's own
    ``RequestOffloadState.update_offload_keys`` (which the lookup calls again, adding
    only keys it lacks), or kvtier's where :mod:`kvtier.vllm_port.admissions` admits the
    scheduler's requests. None where the request state has another shape, or the model
    several KV cache groups (their keys are looked up group by group)."""
    statuses = getattr(scheduler, "_req_status", None)
    status = statuses.get(request_id) if isinstance(statuses, dict) else None
    update = getattr(status, "update_offload_keys", None)
    groups = getattr(status, "group_states", None)
    if not callable(update) or not isinstance(groups, tuple) or len(groups) != 1:
        return None
    admissions = getattr(scheduler, "_kvtier_admissions", None)
    if admissions is not None:
        admissions.update_keys(status)  # (the same keys, without a call per key)
    else:
        update()
    keys = getattr(groups[0], "offload_keys", None)
    return list(keys) if isinstance(keys, list) else None


_WINDOW_PARAMS = ["self", "keys", "sliding_window_size", "req_context", "initial_window_size"]


def window_end(
    answers: Iterator[Any],
    num_keys: int,
    window: int,
    first_window: int | None,
    hit: Any,
    pending: Any,
    retry: Any,
) -> int | None:
    """Where the last run of ``window`` hits ends, from the lookups of ``num_keys`` keys
    taken last key first (``answers``, read only as far as needed).

    A pending hit counts as a hit; the run nearest the end may need ``first_window``
    hits instead (a partial last chunk) until a miss or retry breaks it. Returns the
    index just past the run, or, with no full run, the length of the run that reaches
    the first key (0 after a miss); None where a retry was seen, or the run it returns
    has a pending hit (the caller looks again later)."""
    need = first_window or window
    run = 0
    in_run_pending = False
    retried = False
    index = num_keys
    for answer in answers:
        index -= 1
        if answer is hit or answer is pending:
            run += 1
            in_run_pending = in_run_pending or answer is pending
        else:  # a miss or a retry ends the run, and the partial window's claim
            retried = retried or answer is retry
            run, in_run_pending, need = 0, False, window
        if run == need:
            return None if retried or in_run_pending else index + need
    return None if retried or in_run_pending else run


class _Pattern:
    """A manager whose answer for key ``i`` is ``answers[i]``."""

    answers: tuple[Any, ...] = ()

    def lookup(self, key: int, req_context: Any) -> Any:
        return self.answers[key]


_WINDOW_VERDICTS: dict[type, bool] = {}


def _same_window_answers(cls: type, answer_type: Any) -> bool:
    """Whether ``cls``'s ``_sliding_window_lookup`` answers as :func:`window_end` on every
    pattern of up to four answers, for windows of 1 and 2 with and without a larger
    first window (asked once per class)."""
    verdict = _WINDOW_VERDICTS.get(cls)
    if verdict is not None:
        return verdict
    kinds = (answer_type.HIT, answer_type.HIT_PENDING, answer_type.RETRY, answer_type.MISS)
    patterns = [p for n in range(5) for p in itertools.product(kinds, repeat=n)]
    probe = _Pattern()
    scheduler: Any = object.__new__(cls)
    scheduler.manager = probe
    verdict = True
    try:
        for pattern in patterns:
            keys = list(range(len(pattern)))
            probe.answers = pattern
            for window, first in ((1, None), (1, 2), (2, None), (2, 3)):
                theirs = cls._sliding_window_lookup(scheduler, keys, window, None, first)  # type: ignore[attr-defined]
                ours = window_end(reversed(pattern), len(pattern), window, first, *kinds[:3])
                if theirs != ours:
                    verdict = False
                    break
            if not verdict:
                break
    except Exception:
        verdict = False
    _WINDOW_VERDICTS[cls] = verdict
    return verdict


def window_scan(cls: type) -> Callable[..., int | None] | None:
    """kvtier's scan as a method for ``cls`` (see the module), or None where ``cls``'s
    own ``_sliding_window_lookup`` has another shape or answers otherwise."""
    answers = getattr(sys.modules.get(cls.__module__), "LookupResult", None)
    if (
        answers is None
        or _params(cls, "_sliding_window_lookup") != _WINDOW_PARAMS
        or not _same_window_answers(cls, answers)
    ):
        return None
    hit, pending, retry = answers.HIT, answers.HIT_PENDING, answers.RETRY

    def _sliding_window_lookup(
        self: Any,
        keys: Any,
        sliding_window_size: int,
        req_context: Any,
        initial_window_size: int | None = None,
    ) -> int | None:
        n = len(keys)
        backwards = (keys[i] for i in range(n - 1, -1, -1))
        manager = self.manager
        # (Asked of the class: a test's mock manager has every attribute.)
        batch = getattr(type(manager), "lookup_answers", None)
        if batch is not None:
            found = batch(manager, backwards, req_context)
        else:
            lookup = manager.lookup
            found = (lookup(key, req_context) for key in backwards)
        return window_end(found, n, sliding_window_size, initial_window_size, hit, pending, retry)

    _sliding_window_lookup.__qualname__ = f"{cls.__qualname__}._sliding_window_lookup"
    return _sliding_window_lookup


def sliding_window_scans(scheduler: Any) -> bool:
    """kvtier's scan in place of ``scheduler``'s ``_sliding_window_lookup`` (see the
    module); whether it was put there."""
    scan = window_scan(type(scheduler))
    if scan is None:
        return False
    scheduler._sliding_window_lookup = scan.__get__(scheduler)
    return True


__all__ = [
    "batch_prefix_lookups",
    "single_source_hits",
    "sliding_window_scans",
    "speed_up",
    "window_end",
    "window_scan",
]
