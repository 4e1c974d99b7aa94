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
  other hit goes through vLLM's own method.

Where vLLM's scheduler lacks what these read, nothing changes.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
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

    def get_external_cache_hit_sources(request: Any, num_external_tokens: int) -> Any:
        if num_external_tokens == 0:
            return {}
        status = statuses[request.request_id]
        start = status.num_locally_computed_tokens
        end = start + num_external_tokens
        context = status.req_context
        source = None
        covered = start  # the hit is covered from start up to here
        for lo, hi, key in status.load_key_ranges:
            lo, hi = max(start, lo), min(end, hi)
            if lo >= hi:
                continue
            if lo > covered:  # a gap, or ranges out of order: vLLM's sweep decides
                return sweep(request, num_external_tokens)
            tier = get_load_source(key, context)
            if source is None:
                source = tier
            elif tier != source:
                return sweep(request, num_external_tokens)
            covered = max(covered, hi)
        if source is None or covered < end:
            return sweep(request, num_external_tokens)
        return {source_type(source): num_external_tokens}

    scheduler.get_external_cache_hit_sources = get_external_cache_hit_sources
    return True


__all__ = ["batch_prefix_lookups", "single_source_hits", "speed_up"]
