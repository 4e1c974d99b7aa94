"""The scheduler-side manager: a host tier (kvtier-blockpool) in front of secondary tiers.

No vLLM import: ``vllm_manager`` maps vLLM's ``OffloadingManager`` calls onto this.
Keys are vLLM's offload keys (``bytes``); one key is one host block (an offloaded
chunk of ``blocks_per_chunk`` device blocks).

Flow:

* a device store: ``prepare_store`` reserves host blocks, the worker copies, then
  ``complete_store`` makes them readable and *writes them through* to each fs tier
  (the host blocks stay held, ``Hold.TIER_WRITE``, until their files are written);
* a lookup that misses the host tier but hits an fs tier reserves a host block and
  reads the file into it (a *promotion*); the key reads ``HIT_PENDING`` until the
  read finished, then ``HIT``, or ``MISS`` if the file was bad or the tier refused
  the read (for ``FRESH_STEPS`` steps). Promoting and promoted-not-loaded blocks
  (the promotions' room) take half the host tier at most; with the room full, the
  request that took room first goes on promoting as the host tier allows and the
  others wait (HIT_PENDING), so requests never wait on each other's pins or their
  own; a read that timed out
  (a store tier's call past its deadline) reads ``MISS`` at once, and its host block
  stays reserved (storing, held: ``Hold.LATE_READ``) until the tier's ``"release"``
  result: the late call may still write into it;
* a request waiting in vLLM's queue has what only a secondary tier holds of its
  prefix promoted before vLLM looks it up (:mod:`~kvtier.tiering_spec.tier_promotions`);
* host eviction needs no I/O: an evicted block is already on disk (write-through),
  so the pool may reuse it at once.

Reads and writes go to a tier as jobs (:class:`TierJob`): the promotions of one
request's lookup pass, and the write-through of one device store, each become one job
per tier, submitted when the pass ends (the next request's lookup, or the end of the
step) or at the end of the step (``end_step``, ``drain``). Their host blocks are
reserved or held at once, so nothing waits on the submission but the I/O. Submitting
and applying the jobs' results is :class:`~kvtier.tiering_spec.tier_jobs.TierJobs`.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvtier.blockpool import (
    DEFAULT_MAX_TRACKER_SIZE,
    Hold,
    HostBlockPool,
    PoolStats,
    StoreAdmissionFilter,
    StorePlan,
)
from kvtier.tiering_spec.tier_flow import TierCounters, TierFlow
from kvtier.tiering_spec.tier_jobs import TierJobs
from kvtier.tiering_spec.tier_lookup_state import TierLookupState
from kvtier.tiering_spec.tier_promotions import TierPromotions
from kvtier.tiering_spec.tiers.base import SecondaryTier
from kvtier.tiering_spec.tiers.fs.format import key_digest

logger = logging.getLogger("kvtier.tiering_spec")

# Lookups answered "not known yet" remembered for their async delay (then forgotten).
_MAX_ASKING = 16_384
# How long a reset waits for fs jobs in flight before it goes on without them.
DRAIN_TIMEOUT_S = 30.0
# A promoted block stays pinned in the host tier until vLLM loads it, or this many
# scheduler steps: else the promotions of requests waiting behind it evict it first.
FRESH_STEPS = 32


class DigestMemo:
    """The tiers' name of each key in use (``key_digest``), computed once: a lookup, a
    write-through, touches and the request's end all need it.

    At most ``size`` names are kept, in two generations of up to ``size // 2``: when
    the newer is full it becomes the older and a new one starts; a name found in the
    older moves to the newer, and each name computed drops two of the older's, so it is
    empty before the next turn. Nothing is dropped all at once: a dict of a million
    names freed in one call held the scheduler's thread for about 35 ms."""

    __slots__ = ("_half", "_new", "_old")

    def __init__(self, size: int) -> None:
        self._half = max(1, size // 2)
        self._new: dict[bytes, bytes] = {}
        self._old: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def get(self, key: bytes) -> bytes:
        """``key``'s digest."""
        digest = self._new.get(key)
        if digest is not None:
            return digest
        return self._miss(key)

    def _miss(self, key: bytes) -> bytes:
        new, old = self._new, self._old
        digest = old.pop(key, None)
        if digest is None:
            digest = key_digest(key)
            if old:
                old.popitem()
                if old:
                    old.popitem()
        if len(new) >= self._half:
            old.clear()  # (empty by now: each name computed dropped two of it)
            self._old, self._new = new, {}
            new = self._new
        new[key] = digest
        return digest

    def get_all(self, keys: Sequence[bytes]) -> list[bytes]:
        """:meth:`get` of each of ``keys`` in turn, in one call."""
        out: list[bytes] = []
        miss = self._miss
        for key in keys:
            digest = self._new.get(key)  # (the newer generation may turn over in a miss)
            out.append(digest if digest is not None else miss(key))
        return out


class Lookup(enum.Enum):
    MISS = 0
    HIT = 1
    HIT_PENDING = 2


class TierManager(TierPromotions, TierJobs, TierLookupState):
    """Host block pool plus secondary tiers (fs, Mooncake Store), for one engine's scheduler.

    Args:
        pool: the host tier's block pool (capacity = host blocks).
        secondary_tiers: secondary tiers, searched in order on a host miss.
        max_write_backlog: host blocks that may be pinned waiting for fs writes;
            beyond it new write-throughs are dropped (counted). Default: 3/4 of the pool.
        store_threshold: offers of a key before it is stored; 2 or more puts the
            pool behind a ``StoreAdmissionFilter`` (``admission``), below 2 stores all.
        max_tracker_size: keys the admission filter remembers.
    """

    def __init__(
        self,
        pool: HostBlockPool,
        secondary_tiers: Sequence[SecondaryTier] = (),
        *,
        max_write_backlog: int | None = None,
        store_threshold: int = 0,
        max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
    ) -> None:
        self.pool = pool
        self.admission = (
            StoreAdmissionFilter(pool, store_threshold, max_tracker_size)
            if store_threshold >= 2
            else None
        )
        self.secondary_tiers = list(secondary_tiers)
        self.max_write_backlog = (
            max_write_backlog if max_write_backlog is not None else max(1, pool.num_blocks * 3 // 4)
        )
        self.counters = TierCounters()
        # Per secondary tier: back-pressure and lookup delays (vLLM's tiering metrics);
        # lookups a tier answered "not known yet", by (tier index, digest) -> since when.
        self.flows = [TierFlow() for _ in self.secondary_tiers]
        self._asking: dict[tuple[int, bytes], float] = {}
        # Blocks a store's write-through dropped before its job, by (tier index, store).
        self._write_drops: dict[tuple[int, str], int] = {}
        self._promoting: dict[bytes, int] = {}  # key -> tier index
        self._load_sources: OrderedDict[bytes, str] = OrderedDict()
        # Keys a request's current lookup pass found; from its first promotion on, the
        # cached ones are held (Hold.LOOKUP_PASS) until the pass ends (else a long
        # prefix evicts its own head), released once rather than per promoted key.
        self._pass_req: str | None = None
        self._pass_keys: list[bytes] = []
        self._pass_held: list[bytes] | None = None
        # Host blocks a prefix lookup reserved at once for the promotions its next keys
        # will start (key -> block), taken by each key's own lookup (TierPromotions).
        self._reserved: dict[bytes, int] = {}
        # Promoted keys held until loaded (Hold.PROMOTION; key -> step of the promotion),
        # and a cap on promoting plus held blocks: half the host tier, the rest for stores.
        self._fresh: OrderedDict[bytes, int] = OrderedDict()
        # Who took the promotions' room (keys of _promoting and _fresh): key -> request,
        # and request -> keys it holds there, oldest holder first.
        self._room_owner: dict[bytes, str] = {}
        self._room_reqs: dict[str, int] = {}
        self._step = 0
        # Items waiting for the end of their pass or step, by (tier index, op, request);
        # keys a tier refused to read (-> the step: a MISS for FRESH_STEPS steps). Jobs
        # in flight are the tiers' to hold (SecondaryTier.jobs_in_flight).
        self._queued: dict[tuple[int, str, str], list[tuple[bytes, bytes, int]]] = {}
        self._refused: OrderedDict[bytes, int] = OrderedDict()
        self._job_ids = itertools.count(1)
        self._stores = 0
        self._cut_logged = False  # the first store cut to the host tier's room was logged
        self.max_promoting = max(1, pool.num_blocks // 2)
        self._digests = DigestMemo(max(1024, 2 * pool.num_blocks))
        # Requests vLLM has not admitted yet, oldest first: their keys and the tiers each
        # may load from (TierPromotions).
        self._ahead = OrderedDict()
        self._ahead_seen: tuple[object, ...] = ()

    # ------------------------------------------------------------------ lookups

    def lookup(
        self, key: bytes, req_id: str = "", *, secondary: bool | Sequence[bool] = True
    ) -> Lookup:
        """Whether ``key`` can be loaded now (HIT), soon (HIT_PENDING) or not (MISS).

        A host miss that an fs tier holds starts a promotion and reads HIT_PENDING.
        With ``secondary`` False (a request kept to the host tier) a host miss is a MISS;
        a sequence says, per secondary tier, whether the request may load from it.
        """
        if self._pass_req != req_id:
            self._begin_pass(req_id)
        pool = self.pool
        self.counters.host_queries += 1
        if pool.contains(key):
            self.counters.host_hits += 1
            self._pass_keys.append(key)
            if self._pass_held is not None:  # this pass promotes: keep it from evicting it
                pool.hold([key], Hold.LOOKUP_PASS)
                self._pass_held.append(key)
            return Lookup.HIT
        storing = self._storing_answer(key)
        if storing is not None:
            return storing
        if not self.secondary_tiers or secondary is False:
            return Lookup.MISS
        if self._refused and key in self._refused:
            return Lookup.MISS
        digest = self._digest(key)
        unknown = False
        clock = time.perf_counter
        for idx, tier in enumerate(self.secondary_tiers):
            if secondary is not True and not secondary[idx]:
                continue  # the request does not load from this tier
            start = clock()
            found = tier.contains(digest)
            if found is None:  # a store tier is asking its store: ask again next step
                if len(self._asking) >= _MAX_ASKING:
                    self._asking.clear()
                self._asking.setdefault((idx, digest), start)
                unknown = True
                continue
            now = clock()
            since = self._asking.pop((idx, digest), None) if self._asking else None
            self.flows[idx].looked_up(now - start, since, now)
            if not found:
                continue
            if self._room_full(req_id):
                # Wait for room instead of recomputing: promotions end in milliseconds
                # and pinned blocks are loaded or released within FRESH_STEPS.
                self.counters.promotions_deferred += 1
                return Lookup.HIT_PENDING
            if self._pass_held is None:
                # Only cached keys are held; a key still being stored cannot be evicted.
                protect = [k for k in self._pass_keys if pool.contains(k)]
                pool.hold(protect, Hold.LOOKUP_PASS)
                self._pass_held = protect
            if not self._promote(idx, key, digest, req_id):
                self.counters.promotion_allocation_failures += 1
                return Lookup.MISS
            self._pass_keys.append(key)
            return Lookup.HIT_PENDING
        return Lookup.HIT_PENDING if unknown else Lookup.MISS

    def _storing_answer(self, key: bytes) -> Lookup | None:
        """:meth:`lookup`'s answer for ``key`` (not cached) while the host tier stores
        it: HIT_PENDING, the key joining the pass, or MISS where a read that timed out
        holds it (never loaded). None where it is not being stored (or only reserved
        for a promotion of this pass)."""
        pool = self.pool
        if not pool.is_storing(key) or key in self._reserved:
            return None
        if pool.holds(key, Hold.LATE_READ):  # a read that timed out: never loaded
            return Lookup.MISS
        self._pass_keys.append(key)
        return Lookup.HIT_PENDING

    def lookup_prefix(
        self, keys: Sequence[bytes], req_id: str = "", *, secondary: bool | Sequence[bool] = True
    ) -> tuple[int, list[bool] | None]:
        """:meth:`lookup` of ``keys`` in order up to the first MISS: how many keys lead
        up to it, and None when all of them are HIT, else whether each is HIT (False:
        HIT_PENDING). Cached keys are answered here, without a call each."""
        if keys and self._pass_req != req_id:
            self._begin_pass(req_id)
        found = 0
        ready: list[bool] | None = None
        pool = self.pool
        counters = self.counters
        promoting = self._promoting
        tiers = self.secondary_tiers
        reserve = bool(tiers)  # (the first promotion reserves for the rest)
        num_keys = len(keys)
        after_run = False  # keys[found] ended a run of cached keys
        try:
            while found < num_keys:
                if not after_run and self._pass_held is None:
                    # lookup()'s answer for cached keys while the pass holds nothing (it
                    # has not promoted): HITs, taken as a run.
                    run = pool.lookup(keys[found:] if found else keys)
                    if run:
                        counters.host_queries += run
                        counters.host_hits += run
                        self._pass_keys += keys[found : found + run]
                        if ready is not None:
                            ready += [True] * run
                        found += run
                        after_run = True
                        continue
                after_run = False
                key = keys[found]
                if tiers or self._pass_held is not None:
                    answer = self.lookup(key, req_id, secondary=secondary)
                else:
                    # lookup()'s answer with the host tier alone, for a key the run
                    # stopped at (not cached): only a key being stored is not a MISS.
                    counters.host_queries += 1
                    storing = self._storing_answer(key)
                    answer = Lookup.MISS if storing is None else storing
                if answer is Lookup.MISS:
                    break
                hit = answer is Lookup.HIT
                if reserve and not hit and not self._reserved and key in promoting:
                    reserve = self._reserve_ahead(keys, found + 1, promoting[key], secondary)
                if ready is not None:
                    ready.append(hit)
                elif not hit:
                    ready = [True] * found + [False]
                found += 1
        finally:
            if self._reserved:  # (never expected: each reserved key is looked up)
                unused, self._reserved = list(self._reserved), {}
                pool.complete_store(unused, success=False)
        return found, ready

    def _digest(self, key: bytes) -> bytes:
        return self._digests.get(key)

    def _digest_all(self, keys: Sequence[bytes]) -> list[bytes]:
        return self._digests.get_all(keys)

    def load_source(self, key: bytes) -> str:
        """``"host"``, or the fs tier's name when the key was promoted from it."""
        return self._load_sources.get(key, "host")

    def sole_load_source(self, keys: Sequence[bytes]) -> str | None:
        """:meth:`load_source` of every key of ``keys`` (at least one), where it is the
        same for all; else None."""
        sources = self._load_sources
        if not sources:
            return "host"  # (nothing promoted: the host tier alone)
        first = sources.get(keys[0], "host")
        for key in keys:
            if sources.get(key, "host") != first:
                return None
        return first

    # ------------------------------------------------------------------ device loads

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Hold the host blocks of ``keys`` (all HIT) for a device load; their ids."""
        return self.pool.hold(keys, Hold.DEVICE_LOAD)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self.pool.release(keys, Hold.DEVICE_LOAD)
        if self._fresh:
            fresh = self._fresh
            loaded = [key for key in keys if fresh.pop(key, None) is not None]
            if loaded:
                self.pool.release(loaded, Hold.PROMOTION)  # loaded: their holds end
                for key in loaded:
                    self._leave_room(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        self.pool.touch(keys)
        if self.secondary_tiers:
            digests = [self._digest(k) for k in keys]
            for tier in self.secondary_tiers:
                tier.touch(digests)

    def finish_request(self, keys: Sequence[bytes], reused: Collection[bytes]) -> None:
        """A request is done with ``keys`` (all it stored or reused, head first): the
        host tier orders them so its tail goes first (only ``reused`` count as a use).

        Each secondary tier's policy is told of the keys the request stored and of
        those that tier served, not of the host tier's hits: a block the host tier
        serves gains nothing from a second copy, so a full secondary tier lets such
        copies go first and keeps what the host tier has dropped (a tier as large as
        the host tier with the same policy would otherwise keep the same blocks)."""
        self.pool.finish_request(keys, reused)
        sources = self._load_sources
        for tier in self.secondary_tiers:
            used = [k for k in keys if k not in reused or sources.get(k) == tier.name]
            if used:
                digests = [self._digest(k) for k in used]
                tier.finish_request(digests, {d for k, d in zip(used, digests) if k in reused})

    # ------------------------------------------------------------------ device stores

    def prepare_store(
        self, keys: Sequence[bytes], keep: Collection[bytes] = ()
    ) -> tuple[list[bytes], list[int], list[bytes]] | None:
        """Reserve host blocks for the new ``keys``: (keys to store, their blocks, evicted
        keys), or None when no room can be made. Nothing of ``keys`` or ``keep`` (what
        the storing request loaded or reused) is evicted for it."""
        self.poll()
        if self.admission is None:
            plan = self.pool.prepare_store(keys, keep)
        else:
            # vLLM 0.32 counts offers for storage, not lookups, toward store_threshold.
            self.admission.record(keys)
            plan = self.admission.prepare_store(keys, keep)
        if plan is None:
            # The allocation tried is sampled whether or not room was made, as vLLM's
            # manager does: under pressure the histogram would otherwise thin out.
            pool, admission = self.pool, self.admission
            wanted = {
                k
                for k in keys
                if pool.block_of(k) is None and (admission is None or admission.admits(k))
            }
            if wanted:
                self.counters.allocation_sizes.append(len(wanted))
            plan = self._store_leading(keys, wanted) if self.secondary_tiers else None
            if plan is None:
                return None
            return plan.keys, plan.block_ids, plan.evicted  # (sampled above, once)
        if plan.keys:
            self.counters.allocation_sizes.append(len(plan.keys))
        return plan.keys, plan.block_ids, plan.evicted

    def prepare_store_many(
        self, requests: Sequence[Sequence[bytes]]
    ) -> list[tuple[list[bytes], list[int], list[bytes]]] | None:
        """:meth:`prepare_store` of each of ``requests`` (its keys; nothing to keep) in
        turn, in one call, where the host tier's free blocks hold all their new keys and
        no admission filter counts offers: the same plans and counts. Otherwise
        ``None``, changing nothing but applying the tiers' completions (the caller asks
        request by request)."""
        if self.admission is not None:
            return None
        self.poll()
        plans = self.pool.prepare_store_many(requests)
        if plans is None:
            return None
        sizes = self.counters.allocation_sizes
        for plan in plans:
            if plan.keys:
                sizes.append(len(plan.keys))
        return [(plan.keys, plan.block_ids, plan.evicted) for plan in plans]

    def _store_leading(self, keys: Sequence[bytes], wanted: Collection[bytes]) -> StorePlan | None:
        """The store of ``keys`` (new ones: ``wanted``) found no room. If it could
        never fit (more new blocks than the host tier has: a prompt larger than the host
        tier), reserve its leading keys that fit now: they go through the host tier to
        the secondary tiers, and the rest is not stored. Else None: vLLM asks again
        next step, when the tiers' writes in flight may have released their blocks."""
        pool = self.pool
        room = pool.num_free + pool.num_evictable
        if room <= 0 or len(wanted) <= pool.num_blocks:
            return None
        lead: list[bytes] = []
        taken = 0
        for key in keys:
            if key in wanted:
                if taken == room:
                    break
                taken += 1
            elif pool.block_of(key) is None:
                continue  # (not admitted yet: the admission filter counted it)
            lead.append(key)
        plan = pool.prepare_store(lead)
        if plan is not None and plan.keys and not self._cut_logged:
            self._cut_logged = True
            logger.info(
                "kvtier: a store of %d blocks is larger than the host tier can hold for "
                "it; its first %d go through the host tier to the secondary tiers, the "
                "rest is recomputed when asked again",
                len(wanted),
                len(plan.keys),
            )
        return plan

    def complete_store(
        self, keys: Sequence[bytes], success: bool = True, *, secondary: bool = True
    ) -> None:
        """Finish a device store; on success write the new blocks through to each fs tier
        (unless ``secondary`` is False: a request kept to the host tier)."""
        if not success:
            self.counters.store_failures += sum(1 for k in keys if self.pool.is_storing(k))
        self.pool.complete_store(keys, success)
        if success and secondary and self.secondary_tiers:
            self._write_through(keys)

    def end_step(self) -> bool:
        """Once per scheduler step: apply completions, forget the lookup pass, release
        promoted blocks not loaded within ``FRESH_STEPS``, promote ahead for queued
        requests (:class:`TierPromotions`), submit what waits. False where it did none
        of these (most steps of a host tier alone, and of an fs tier between its
        writes' completions): then nothing the metrics read changed."""
        # (Each part is looked at before it is called: most steps have none to do.)
        busy = False
        if self._queued:
            self.flush()
            busy = True
        if self.secondary_tiers and self.poll():  # (it skips a tier without news)
            busy = True
        self._step += 1
        if self._refused:
            self._expire(self._refused)  # (no metric reads them)
        if self._fresh:
            expired = self._expire(self._fresh)
            if expired:
                busy = True
                # (one call for all: a burst of promotions ahead expires together)
                self.pool.release(expired, Hold.PROMOTION)
                for key in expired:
                    self._leave_room(key)
        if self._pass_req is not None or self._pass_held is not None or self._pass_keys:
            self._end_pass()
            busy = True
        if self._ahead:
            if self._promote_ahead():
                busy = True
            if self._queued:
                self.flush()  # their reads overlap the next step
                busy = True
        return busy

    def _begin_pass(self, req_id: str) -> None:
        """A lookup pass for the request ``req_id`` begins (see :meth:`lookup`)."""
        if self._pass_req is not None or self._pass_held is not None or self._pass_keys:
            self._end_pass()
        self._pass_req = req_id
        if self._queued:
            self.flush()  # the previous request's promotions
        if self.secondary_tiers:
            # Once a pass, not once a key: a read that ends during the pass is a
            # HIT_PENDING, which vLLM asks again next step.
            self.poll()

    def _end_pass(self) -> None:
        """Forget the lookup pass, releasing the keys it held for its promotions."""
        held, self._pass_held = self._pass_held, None
        if held:
            self.pool.release(held, Hold.LOOKUP_PASS)
        self._pass_req = None
        self._pass_keys = []

    def _expire(self, since: OrderedDict[bytes, int]) -> list[bytes]:
        """Remove and return the keys of ``since`` (key -> step, oldest first) that are
        ``FRESH_STEPS`` old."""
        gone: list[bytes] = []
        while since:
            key, step = next(iter(since.items()))
            if self._step - step < FRESH_STEPS:
                break
            del since[key]
            gone.append(key)
        return gone

    def reset(self, new_pool: HostBlockPool) -> None:
        """Drop the host tier; fs files are kept. If fs jobs outlive the drain timeout,
        the pool is kept and everything in it evicted but the blocks those jobs use:
        a late read must not land in a block handed out again."""
        self._end_pass()
        if not self.drain(DRAIN_TIMEOUT_S):
            dropped = self.pool.evict_all()
            logger.warning(
                "kvtier: cache reset with fs jobs still running: %d host blocks dropped, "
                "%d kept until their reads and writes finish",
                len(dropped),
                len(self._promoting)
                + self.pool.held(Hold.TIER_WRITE)
                + self.pool.held(Hold.LATE_READ),
            )
            self._load_sources.clear()
            return
        self.pool = new_pool
        if self.admission is not None:
            # As in vLLM, a reset keeps the offer counts (and stores_skipped grows on).
            self.admission.pool = new_pool
        self._fresh.clear()
        self._ahead.clear()
        self._promoting.clear()
        self._room_owner.clear()
        self._room_reqs.clear()
        self._load_sources.clear()
        self._refused.clear()
        self._asking.clear()
        self._write_drops.clear()

    def shutdown(self) -> bool:
        """Stop the secondary tiers; False if one still has an I/O call running (its host
        region must then stay mapped)."""
        clean = True
        for tier in self.secondary_tiers:
            try:
                clean = tier.shutdown() and clean
            except Exception:
                clean = False
                logger.exception("kvtier: shutting down fs tier %r failed", tier.name)
        return clean

    # ------------------------------------------------------------------ introspection

    def pool_stats(self) -> PoolStats:
        return self.pool.stats()

    def take_allocation_sizes(self) -> list[int]:
        sizes, self.counters.allocation_sizes = self.counters.allocation_sizes, []
        return sizes

    @property
    def write_pinned_blocks(self) -> int:
        """Host blocks held by secondary tiers' writes in flight."""
        return self.pool.held(Hold.TIER_WRITE)

    @property
    def promoting_blocks(self) -> int:
        return len(self._promoting)

    @property
    def jobs_in_flight(self) -> int:
        """Tier jobs submitted with items not yet back (each tier holds its own)."""
        return sum(tier.jobs_in_flight for tier in self.secondary_tiers)
