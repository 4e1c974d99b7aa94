"""The promotions' room, and promotions ahead of vLLM's lookup for requests waiting
in vLLM's queue. No vLLM import.

Promoting and promoted-not-loaded blocks take half the host tier at most (the room);
a request's promotions are its share of it, the oldest holder first.

A request whose prefix only a secondary tier holds is promoted when vLLM first looks
it up: the lookup reads ``HIT_PENDING``, vLLM skips the request for that step and
admits the next one in its place. Where vLLM runs a few requests at a time, the
skipped request then waits for a running one to finish, many steps for a read of
milliseconds.

So kvtier's connector hands the manager each request's offload keys when vLLM adds it
(:meth:`TierPromotions.ahead`). At the end of each step, the oldest request vLLM has
not admitted yet (the next one it admits) has what only a secondary tier holds of its
prefix promoted, in prefix order up to the first key no tier's index holds (what the
tiers know without asking: no store is probed, and only a key promoted counts, as the
tier's hit its lookup would have been), with the same holds and pins as a lookup's
promotions: all of it, where it fits in the promotions' room, or nothing. When vLLM
looks the request up, the blocks are in the host tier: a hit that loads in the step
that admits it. A request leaves the queue when vLLM admits it or when it finishes (a
lookup that read "ask again" leaves it the next one vLLM admits: vLLM skips it and
looks up every request behind it as well). One request at a time: promoted further
ahead, blocks would take the room and the host tier from requests vLLM admits before
them.

:class:`TierPromotions` is a part of :class:`~kvtier.tiering_spec.manager.TierManager`,
on the manager's own state (declared below).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

from kvtier.blockpool import Hold, HostBlockPool
from kvtier.tiering_spec.tier_flow import TierCounters
from kvtier.tiering_spec.tiers.base import SecondaryTier

# Promotions' sources remembered (the oldest are forgotten first).
_MAX_LOAD_SOURCES = 100_000
# Requests waiting for admission remembered at most (more are not).
MAX_AHEAD = 4096


class TierPromotions:
    """The promotions' room, and promoting the prefixes of requests that wait for
    vLLM to admit them."""

    # The manager's state these methods use (see TierManager.__init__).
    pool: HostBlockPool
    secondary_tiers: list[SecondaryTier]
    counters: TierCounters
    max_promoting: int
    _queued: dict[tuple[int, str, str], list[tuple[bytes, bytes, int]]]
    _promoting: dict[bytes, int]
    _fresh: OrderedDict[bytes, int]
    _room_owner: dict[bytes, str]
    _room_reqs: dict[str, int]
    _load_sources: OrderedDict[bytes, str]
    _ahead: OrderedDict[str, tuple[Sequence[bytes], Literal[True] | Sequence[bool]]]
    _ahead_seen: tuple[object, ...]
    _refused: OrderedDict[bytes, int]
    _reserved: dict[bytes, int]

    def _digest(self, key: bytes) -> bytes:
        raise NotImplementedError

    def _room_used(self) -> int:
        """Blocks in the promotions' room: promoting, and promoted but not loaded."""
        return len(self._promoting) + len(self._fresh)

    def _room_full(self, req_id: str) -> bool:
        """Whether ``req_id`` must wait for the promotions' room. The oldest holder goes
        on (as the host tier allows): waiting, it would wait on its own pins, or on a
        request that waits on it."""
        return self._room_used() >= self.max_promoting and (
            next(iter(self._room_reqs), None) != req_id
        )

    def _promote(self, idx: int, key: bytes, digest: bytes, req_id: str) -> bool:
        """Reserve a host block for ``key`` and queue its read from secondary tier
        ``idx`` (submitted when the pass or step ends), in ``req_id``'s share of the
        promotions' room; False where the host tier has no block to give."""
        block = self._reserved.pop(key, None) if self._reserved else None
        if block is None:
            plan = self.pool.prepare_store([key])
            if plan is None or not plan.keys:
                return False
            block = plan.block_ids[0]
        self._queued.setdefault((idx, "read", req_id), []).append((key, digest, block))
        self._promoting[key] = idx
        self._room_owner[key] = req_id
        self._room_reqs[req_id] = self._room_reqs.get(req_id, 0) + 1
        self._load_sources[key] = self.secondary_tiers[idx].name
        if len(self._load_sources) > _MAX_LOAD_SOURCES:
            self._load_sources.popitem(last=False)
        return True

    def _reserve_ahead(
        self, keys: Sequence[bytes], start: int, idx: int, tiers: bool | Sequence[bool]
    ) -> bool:
        """A prefix lookup just promoted a key from secondary tier ``idx``: reserve host
        blocks at once for the keys from ``keys[start]`` on that its own lookups will
        promote from the same tier (in order, up to the first that is cached, stored,
        refused, held by an earlier tier or by none, and within the promotions' room),
        so that each takes its block without a reservation and an eviction of its own.
        Only where every tier up to ``idx`` answers lookups from its index (an fs tier;
        a store tier asks in the background). Nothing is reserved for fewer than two.
        False where no later promotion of the lookup can reserve either."""
        tier_list = self.secondary_tiers
        room = self.max_promoting - self._room_used()
        if room < 2 or any(t.lookup_version is None for t in tier_list[: idx + 1]):
            return False
        pool, refused, digest_of = self.pool, self._refused, self._digest
        before = [t for i, t in enumerate(tier_list[:idx]) if tiers is True or (tiers and tiers[i])]
        tier = tier_list[idx]
        run: list[bytes] = []
        seen: set[bytes] = set()
        for key in itertools.islice(keys, start, None):
            if len(run) == room or key in seen or pool.contains(key) or pool.is_storing(key):
                break
            if refused and key in refused:
                break
            digest = digest_of(key)
            if not tier.indexed(digest) or (before and any(t.indexed(digest) for t in before)):
                break
            run.append(key)
            seen.add(key)
        if len(run) < 2:
            return True
        plan = pool.prepare_store(run)
        if plan is None:
            return False  # (each key's own reservation may still find a block)
        self._reserved = dict(zip(plan.keys, plan.block_ids))
        return True

    def _leave_room(self, key: bytes) -> None:
        """``key`` left the promotions' room (loaded, failed, refused or expired)."""
        req = self._room_owner.pop(key, None)
        if req is not None:
            left = self._room_reqs[req] - 1
            if left:
                self._room_reqs[req] = left
            else:
                del self._room_reqs[req]

    def ahead(
        self, req_id: str, keys: Sequence[bytes], secondary: bool | Sequence[bool] = True
    ) -> None:
        """vLLM added request ``req_id`` whose prompt's offload keys are ``keys``, in
        prefix order: promote what only a secondary tier holds while it waits.
        ``secondary``: the tiers it may load from, as :meth:`TierManager.lookup` takes
        them. ``keys`` is kept as given: a list of the caller's own, which nobody changes
        after."""
        if not self.secondary_tiers or not keys or secondary is False:
            return
        queue = self._ahead
        if len(queue) < MAX_AHEAD:  # (beyond, vLLM admits many before these)
            queue[req_id] = (keys, secondary)

    def forget_ahead(self, req_id: str) -> None:
        """vLLM admitted ``req_id``, or it finished."""
        if self._ahead:
            self._ahead.pop(req_id, None)

    def _promote_ahead(self) -> bool:
        """At the end of a step: promote what only a secondary tier holds of the prefix
        of the oldest request vLLM has not admitted (the next one it admits), in prefix
        order up to the first key no tier holds. All of it or nothing: a part would
        leave the rest to its lookup, which waits for it all the same, and these pins
        last until vLLM admits the request, so they stay within the room (never beyond
        it, as the oldest holder of a lookup may go: stores need the rest). Looked at
        again each step: its cached keys may have been evicted since, and the keys of a
        prefix another request computes written. Whether it tried to promote (else it
        changed nothing but what it remembers of this look)."""
        req_id, (keys, tiers) = next(iter(self._ahead.items()))
        pool = self.pool
        # What the last look found holds while nothing it read changed (most steps).
        seen = (
            req_id,
            pool,
            pool.key_changes,
            self._room_used(),
            len(self._refused),
            [tier.index_size for tier in self.secondary_tiers],
        )
        if seen == self._ahead_seen:
            return False
        self._ahead_seen = seen
        wanted: list[tuple[bytes, bytes, int]] = []  # key, digest, tier index
        end = index = pool.lookup(keys)  # (the leading keys the host tier holds)
        for key in itertools.islice(keys, index, None):
            index += 1
            if pool.contains(key) or pool.is_storing(key):  # (or promoting)
                if pool.holds(key, Hold.LATE_READ):
                    break  # a read that timed out: vLLM's lookup misses it
                continue
            if self._refused and key in self._refused:
                break
            digest = self._digest(key)
            source = next(
                (
                    i
                    for i, tier in enumerate(self.secondary_tiers)
                    if (tiers is True or tiers[i]) and tier.indexed(digest)
                ),
                None,
            )
            if source is None:
                break
            wanted.append((key, digest, source))
            end = index
        if not wanted or self._room_used() + len(wanted) > self.max_promoting:
            return False
        # Its own promotions must not evict the keys it will hit first.
        held = [k for k in keys[:end] if pool.contains(k)]
        pool.hold(held, Hold.LOOKUP_PASS)
        try:
            for key, digest, source in wanted:
                if not self._promote(source, key, digest, req_id):
                    break
                self.counters.promoted_ahead += 1
                self.secondary_tiers[source].served_ahead()  # (its metrics count it)
        finally:
            pool.release(held, Hold.LOOKUP_PASS)
        return True
