"""vLLM's ``OffloadingManager`` over kvtier's :class:`~kvtier.tiering_spec.manager.
TierManager`, and what it keeps per request (the keys a request stored or reused, and
which tiers it may use)."""

from __future__ import annotations

import logging
import operator
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any, cast

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvtier.tiering_spec import metrics as m
from kvtier.tiering_spec import vllm_compat as compat
from kvtier.tiering_spec.build import SchedulerSide
from kvtier.tiering_spec.manager import Lookup
from kvtier.tiering_spec.metrics_emitter import MetricsEmitter

logger = logging.getLogger("kvtier.tiering_spec")

# A (position, key) pair's position: the sort key of a finished request's keys (a C
# callable: no Python call a key).
_FIRST = operator.itemgetter(0)


class _RequestReuse:
    """The keys one request stored or reused (loaded, or offered for storing again
    while cached), in the order first seen, and which of them it reused: vLLM 0.32 and
    later never call ``touch`` and leave recency to the manager when the request
    finishes; older releases touch keys themselves, after each store."""

    __slots__ = ("finished", "generation", "keys", "reused", "stored")

    def __init__(self, generation: int) -> None:
        self.keys: dict[OffloadKey, None] = {}
        self.reused: set[OffloadKey] = set()
        self.stored: set[OffloadKey] = set()
        self.finished = False
        self.generation = generation  # the manager's resets before it began

    def note(self, keys: Iterable[OffloadKey], *, reused: bool) -> None:
        """Record ``keys`` as reused by the request, or as stored by it. Reading back
        a key the request stored (a cascade between tiers) is not a reuse."""
        keys = list(keys)
        # (dict.update keeps a key seen before where it was, as setdefault does.)
        self.keys.update(dict.fromkeys(keys))
        if not reused:
            self.stored.update(keys)
        else:
            self.reused.update(set(keys) - self.stored)


class _RequestTiers:
    """Which tiers one request may use: the host tier always, the secondary (persistent)
    tiers unless the request runs with a LoRA adapter or kvtier cannot tell."""

    __slots__ = ("secondary",)

    def __init__(self, secondary: bool) -> None:
        self.secondary = secondary


class KvtierOffloadingManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` over :class:`TierManager`.

    A request with a LoRA adapter uses the host tier only: vLLM's block hashes name the
    adapter (0.23: its name; 0.32: its name and path), never its weights, so a file or
    object in a persistent tier could outlive the adapter it was computed with. kvtier's
    connector tells the manager which requests carry one (:meth:`note_lora`);
    a request it did not announce uses the secondary tiers only where vLLM's config
    shows LoRA off.
    """

    def __init__(self, side: SchedulerSide) -> None:
        self.side = side
        self._logged: set[str] = set()
        self._pass_context: ReqContext | None = None
        self._pass_secondary: bool | Sequence[bool] = True
        self._localities = [tier.locality for tier in side.core.secondary_tiers]
        self.core = side.core
        self._regions = side.regions
        self._metrics = MetricsEmitter(
            self.core, tiering=side.offload.tiering, traffic=side.traffic
        )
        self._quiet_stats = compat.QuietGauges()  # a quiet step's stats, copied
        # The last get_stats found nothing changed and nothing waiting, and no call that
        # may change a metric came since (each such call clears it): get_stats then
        # answers the same gauges without reading the state they come from. Never set
        # while the traffic is recorded (its thread counts what it drops).
        self._stats_settled = False
        self._may_settle = side.traffic is None
        self._hit_sources: dict[str, Any] = {}  # a tier's name -> vLLM's CacheHitSource
        self._failed_stores: list[list[OffloadKey]] = []  # for metadata-only removals
        self._resets = 0  # reset_cache calls: what a request noted before one is stale

    def config_info(self) -> list[dict[str, Any]]:
        """vLLM 0.33's info labels: the host tier's sizing; with secondary tiers, a row
        for each tier labelled as in the tiering metrics (``CPU``, then the tiers')."""
        host = self.side.info_row
        if not self.side.offload.tiering:
            return [host]
        label = m.TIER_LABEL
        return [{**host, label: m.HOST_TIER}] + [{label: t.name} for t in self.core.secondary_tiers]

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> Any:
        self._stats_settled = False
        if self.side.offload.no_loads_reason is not None:
            return compat.lookup_result(Lookup.MISS)
        return compat.lookup_result(
            self.core.lookup(key, req_context.req_id, secondary=self._pass_tiers(req_context))
        )

    def lookup_answers(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> Iterator[Any]:
        """:meth:`lookup` of each of ``keys``, lazily: one generator for a scan that stops
        where it has its answer (kvtier-vllm-port's sliding-window scan)."""
        self._stats_settled = False
        miss = self.side.offload.no_loads_reason is not None
        secondary = miss or self._pass_tiers(req_context)
        lookup, convert, req_id = self.core.lookup, compat.lookup_result, req_context.req_id
        for key in keys:
            yield convert(Lookup.MISS if miss else lookup(key, req_id, secondary=secondary))

    def _pass_tiers(self, req_context: ReqContext) -> bool | Sequence[bool]:
        """The secondary tiers the request being looked up may load from
        (:meth:`_load_tiers`), read once a pass (vLLM looks a request's keys up one by
        one)."""
        if req_context is not self._pass_context:
            self._pass_context = req_context
            self._pass_secondary = self._load_tiers(req_context)
        return self._pass_secondary

    def _load_tiers(self, req_context: ReqContext) -> bool | Sequence[bool]:
        """The secondary tiers the request may load from: all (True), none (False), or
        whether each, where its ``kv_load_tiers`` leaves some out (vLLM 0.32 on)."""
        if not self._secondary(req_context):
            return False
        if not self.core.secondary_tiers:
            return True
        tiers = compat.PORT.load_tiers(req_context, self._localities)
        if tiers is None or all(tiers):
            return True
        return tiers if any(tiers) else False

    def lookup_prefix(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> tuple[int, list[bool] | None]:
        """:meth:`lookup` of ``keys`` in order up to the first miss, in one call (see
        :mod:`kvtier.vllm_port.lookups`): how many keys lead up to it, and None when all
        are hits, else whether each is a hit (False: pending). Never "retry"."""
        self._stats_settled = False
        if self.side.offload.no_loads_reason is not None:
            return 0, None
        core = self.core
        return core.lookup_prefix(
            keys,  # type: ignore[arg-type]
            req_context.req_id,
            # (With the host tier alone there is no tier to choose.)
            secondary=self._pass_tiers(req_context) if core.secondary_tiers else True,
        )

    def lookup_state(self) -> tuple[object, tuple[int, ...]] | None:
        """For kvtier-vllm-port's lookup memo: a value equal exactly when lookups answer
        the same, and the counters a lookup moves (:meth:`TierManager.lookup_version`,
        :meth:`TierManager.lookup_counts`); None where a lookup may answer otherwise when
        asked again (a store tier, a refused key, a probe pending)."""
        version = self.lookup_version()
        return None if version is None else (version, self.core.lookup_counts())

    def lookup_version(self) -> object | None:
        """:meth:`lookup_state`'s first part alone (the memo's check of an ask)."""
        version = self.core.lookup_version()
        return None if version is None else (version, self.side.offload.no_loads_reason)

    def lookup_counts(self) -> tuple[int, ...]:
        """:meth:`lookup_state`'s second part alone."""
        return self.core.lookup_counts()

    def recount_lookups(self, moves: Sequence[int]) -> None:
        """Lookups answered again without asking, counted as asked."""
        self._stats_settled = False
        self.core.recount_lookups(moves)

    def note_lora(self, req_context: ReqContext, has_lora: bool) -> None:
        """Called by kvtier's connector once vLLM added the request of ``req_context``
        (only the connector sees vLLM's ``Request``): whether it runs with a LoRA
        adapter. Such a request keeps to the host tier."""
        compat.PORT.set_request_state(req_context, _RequestTiers(secondary=not has_lora))
        if has_lora and self.core.secondary_tiers:
            self._log_once(
                "lora",
                "kvtier: requests with a LoRA adapter use the host tier only, never the "
                "fs or mooncake tiers: vLLM's block hashes name an adapter, not its "
                "weights, so KV kept across restarts could outlive a retrained adapter",
            )

    def promote_ahead(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        """Called by kvtier's connector when vLLM adds a request, with its prompt's
        offload keys: what only a secondary tier holds of them is promoted while the
        request waits (see :mod:`kvtier.tiering_spec.tier_promotions`)."""
        self._stats_settled = False
        if self.side.offload.no_loads_reason is None:
            tiers = self._load_tiers(req_context)
            self.core.ahead(req_context.req_id, cast(Sequence[bytes], keys), tiers)

    def _secondary(self, req_context: ReqContext) -> bool:
        """Whether the request may read and write the secondary (persistent) tiers."""
        if not self.core.secondary_tiers:
            return True
        mark = compat.PORT.request_state(req_context, _RequestTiers)
        if mark is not None:
            return mark.secondary
        if self.side.offload.lora_enabled is False:
            return True  # vLLM refuses LoRA requests when LoRA is off
        self._log_once(
            "unknown",
            "kvtier: a request reached the manager without kvtier's connector in front, and "
            "LoRA may be on (vLLM's config %s), so kvtier cannot tell whether its blocks "
            "were computed with an adapter: such requests use the host tier only, never "
            "the fs or mooncake tiers",
            "enables it" if self.side.offload.lora_enabled else "was not found",
        )
        return False

    def _log_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._logged:
            self._logged.add(what)
            logger.warning(msg, *args)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        # vLLM asks once per loaded key of a hit split over several tiers (kvtier's
        # port asks sole_load_source for a hit served by one).
        return self._hit_source(self.core.load_source(key))

    def sole_load_source(self, keys: list[OffloadKey], req_context: ReqContext) -> Any:
        """What :meth:`get_load_source` answers for every key of ``keys``, where it answers
        the same for all; else None. One call for a hit's keys (see
        :mod:`kvtier.vllm_port.lookups`)."""
        source = self.core.sole_load_source(keys)
        return None if source is None else self._hit_source(source)

    def _hit_source(self, source: str) -> Any:
        """vLLM's hit source for the tier named ``source`` (made once per tier)."""
        hit_source = self._hit_sources.get(source)
        if hit_source is None:
            hit_source = self._hit_sources[source] = compat.PORT.cache_hit_source(source)
        return hit_source

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        self._stats_settled = False
        blocks = self.core.prepare_load(list(keys))
        state = self._request_reuse(req_context)
        if state is not None:
            state.note(keys, reused=True)
        return CPULoadStoreSpec(blocks)

    def _request_reuse(self, req_context: ReqContext) -> _RequestReuse | None:
        """The request's record for :meth:`on_request_finished`; None before vLLM 0.32
        (no request state: the connector calls touch itself) or once it finished. A
        record begun before :meth:`reset_cache` is dropped: the keys it says the request
        stored are gone, and reading them again once stored anew is a reuse."""
        kept, state = compat.PORT.kept_request_state(req_context, _RequestReuse)
        if not kept:
            return None
        if state is None or (state.generation != self._resets and not state.finished):
            state = _RequestReuse(self._resets)
            compat.PORT.set_request_state(req_context, state)
        return None if state.finished else state

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Order every key the request stored or reused so that its prefix's tail goes
        first and its head last (as vLLM 0.32 does); only reused keys count as a use."""
        self._stats_settled = False
        core = self.core
        if core.secondary_tiers:  # (only they promote ahead)
            core.forget_ahead(req_context.req_id)
        self._metrics.emit_next()
        _, state = compat.PORT.kept_request_state(req_context, _RequestReuse)
        if state is None or state.finished:
            return
        state.finished = True
        if state.generation != self._resets:
            return  # all it noted was before a reset_cache
        keys = list(state.keys)
        ends = compat.PORT.key_positions(req_context, keys)
        # Each key's place in the prompt (most requests noted them in that order).
        if ends is not None and None not in ends and ends != sorted(ends):
            keys = [k for _, k in sorted(zip(ends, keys), key=_FIRST)]
        if keys:
            core.finish_request(keys, state.reused)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._stats_settled = False
        self.core.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._stats_settled = False
        self.core.complete_load(list(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        return self._prepare_store(list(keys), req_context)

    def _prepare_store(
        self,
        keys: list[OffloadKey],
        req_context: ReqContext,
        cached: list[OffloadKey] | None = None,
    ) -> PrepareStoreOutput | None:
        """:meth:`prepare_store`; ``cached``: which of ``keys`` were cached when the
        request offered them, where read already."""
        self._stats_settled = False
        state = self._request_reuse(req_context)
        if state is not None:
            if cached is None:
                contains = self.core.pool.contains  # cached keys offered again are a use
                cached = [k for k in keys if contains(k)]
            if cached:
                state.note(cached, reused=True)
        # What the request loaded or reused stays: its recency is refreshed only when it
        # finishes, and its own stores would otherwise evict the head they follow.
        plan = self.core.prepare_store(keys, () if state is None else state.reused)
        return None if plan is None else self._planned(state, plan)

    @staticmethod
    def _planned(
        state: _RequestReuse | None, plan: tuple[list[bytes], list[int], list[bytes]]
    ) -> PrepareStoreOutput:
        """vLLM's answer for the store ``plan`` (keys to store, their blocks, keys
        evicted) of a request (its record ``state``, which notes the keys it stores)."""
        to_store, blocks, evicted = plan
        if state is not None:
            state.note(to_store, reused=False)
        # (No typing.cast here: a call per store of every request.)
        return PrepareStoreOutput(
            keys_to_store=to_store,  # type: ignore[arg-type]
            store_spec=CPULoadStoreSpec(blocks),
            evicted_keys=evicted,  # type: ignore[arg-type]
        )

    def prepare_store_many(
        self, requests: Sequence[tuple[Collection[OffloadKey], ReqContext]]
    ) -> list[PrepareStoreOutput | None]:
        """:meth:`prepare_store` of each of ``requests`` (keys, request context) in
        turn: the same answers and records, in one pass where the host tier has the room
        for all without evicting (most steps: a step's new prompts planned together).
        The tiers are polled once for all of them (one by one: once each)."""
        self._stats_settled = False
        lists = [list(keys) for keys, _ in requests]
        if not lists:
            return []
        # The first request reads what is cached before the tiers' news are applied,
        # as prepare_store does; the others read it after, as they would in turn.
        contains = self.core.pool.contains
        first = [k for k in lists[0] if contains(k)]
        plans = self.core.prepare_store_many(lists)
        out: list[PrepareStoreOutput | None] = []
        if plans is None:  # one by one
            for i, (keys, (_, req_context)) in enumerate(zip(lists, requests)):
                out.append(self._prepare_store(keys, req_context, first if i == 0 else None))
            return out
        # (Nothing evicted: a key cached before each store is cached after all of them.)
        for i, (keys, (_, req_context), plan) in enumerate(zip(lists, requests, plans)):
            state = self._request_reuse(req_context)
            if state is not None:
                cached = first if i == 0 else [k for k in keys if contains(k)]
                if cached:
                    state.note(cached, reused=True)
            out.append(self._planned(state, plan))
        return out

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self._stats_settled = False
        if not success:
            self._note_failed_store(keys)
        self.core.complete_store(list(keys), success, secondary=self._secondary(req_context))

    def fail_store(self, keys: Collection[OffloadKey]) -> None:
        """A store a worker could not copy: its keys are dropped now, never loaded
        (vLLM's own completion of the job then finds nothing stored)."""
        self._stats_settled = False
        self._note_failed_store(keys)
        self.core.complete_store(list(keys), False)

    def _note_failed_store(self, keys: Collection[OffloadKey]) -> None:
        """Keep the keys of a failed store that were being stored, for a metadata-only
        removal event (vLLM 0.33's manager sends one; see :meth:`take_events`)."""
        pool = self.core.pool
        if pool.enable_events and compat.PORT.metadata_only_events:
            failed = [key for key in keys if pool.is_storing(key)]
            if failed:
                self._failed_stores.append(failed)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The events since the last call, all taken now (as vLLM's manager does): a
        caller that stops early leaves none of them for the next call."""
        events: list[OffloadingEvent] = []
        if self._failed_stores:
            # Removals of keys never stored, so vLLM's tracker forgets what it noted for
            # them; a key stored again since (a retry) keeps it.
            failed, self._failed_stores = self._failed_stores, []
            pool = self.core.pool
            for keys in failed:
                gone = [k for k in keys if not (pool.contains(k) or pool.is_storing(k))]
                if gone:
                    events.append(compat.PORT.offloading_event(gone, True, metadata_only=True))
        for event in self.core.pool.take_events():
            events.append(compat.PORT.offloading_event(list(event.keys), event.kind == "removed"))
        for tier in self.core.secondary_tiers:
            for removed, keys in tier.take_events():
                events.append(
                    compat.PORT.offloading_event(
                        list(keys), removed, tier=tier.name, locality=tier.locality
                    )
                )
        return events

    def on_schedule_end(self, context: Any = None) -> None:
        self._pass_context = None
        if self.core.end_step():
            self._stats_settled = False

    def has_pending_work(self) -> bool:
        return self.core.has_pending_work()

    def reset_cache(self) -> None:
        self._stats_settled = False
        self._resets += 1
        self._metrics.emit_next()
        self.core.reset(self.side.new_pool())

    def emit_metrics_next(self) -> None:
        """A request finished (the connector sees it before vLLM's scheduler tells the
        manager): the next stats carry every change, lookups' too."""
        self._stats_settled = False
        self._metrics.emit_next()

    def collect_metrics(self) -> Iterator[tuple[str, str, Any, tuple[str, ...]]]:
        """(kind, name, value, label values) of kvtier's metrics since the last call."""
        return self._metrics.collect()

    def forget_ahead(self, req_id: str) -> None:
        """vLLM admitted the request ``req_id``: nothing is promoted ahead for it now
        (no metric reads what waits to be promoted ahead: the stats stay settled)."""
        self.core.forget_ahead(req_id)

    def get_stats(self) -> Any:
        metrics = self._metrics
        settled = metrics.settled_rows
        if self._stats_settled and settled is not None:  # nothing changed (most steps)
            return self._quiet_stats(settled)
        quiet = metrics.quiet_gauges(defer=True)
        if quiet is not None:  # most steps: only the gauges vLLM's manager always sends
            self._stats_settled = self._may_settle and metrics.settled_rows is quiet
            return self._quiet_stats(quiet)
        stats = compat.new_stats()
        metrics.write_changed(stats)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        if self.side.traffic is not None:
            self.side.traffic.close()
        if not self.core.shutdown():
            # An I/O thread stuck in a read may still write into these mappings.
            logger.warning("kvtier: host regions left mapped until the process ends")
            return
        if self._regions is not None:
            self._regions.close()
