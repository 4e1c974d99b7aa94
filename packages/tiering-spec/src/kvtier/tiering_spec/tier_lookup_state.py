"""What the tier manager's lookups read and count, for a caller that asks about the
same keys again (kvtier-vllm-port's lookup memo: vLLM asks about a waiting request every
step until the device has room for it). No vLLM import.

:class:`TierLookupState` is a part of :class:`~kvtier.tiering_spec.manager.TierManager`,
on the manager's own state (declared below).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.blockpool import HostBlockPool
from kvtier.tiering_spec.tier_flow import TierCounters, TierFlow
from kvtier.tiering_spec.tiers.base import SecondaryTier


class TierLookupState:
    """A version of what lookups answer from, and the counters they move."""

    # The manager's state these methods use (see TierManager.__init__).
    pool: HostBlockPool
    secondary_tiers: list[SecondaryTier]
    counters: TierCounters
    flows: list[TierFlow]
    _refused: OrderedDict[bytes, int]
    _asking: dict[tuple[int, bytes], float]

    def lookup_version(self) -> tuple[object, ...] | None:
        """A value equal exactly when :meth:`lookup` answers the same for every key and
        changes nothing but :meth:`lookup_counts` (the host tier's keys, each secondary
        tier's ``lookup_version``); None where a lookup may answer otherwise when asked
        again: a tier that cannot tell, a key refused for a while, a probe pending."""
        versions: list[object] = []
        for tier in self.secondary_tiers:
            version = getattr(tier, "lookup_version", None)
            if version is None:
                return None
            versions.append(version)
        if self._refused or self._asking:
            return None
        pool = self.pool
        return pool, pool.key_changes, *versions

    def lookup_counts(self) -> tuple[int, ...]:
        """The counters lookups move: the host tier's queries and hits, then each
        secondary tier's queries, hits and lookups timed."""
        c = self.counters
        counts = [c.host_queries, c.host_hits]
        for tier, flow in zip(self.secondary_tiers, self.flows):
            stats = tier.stats
            counts += (stats.queries, stats.hits, flow.lookups)
        return tuple(counts)

    def recount_lookups(self, moves: Sequence[int]) -> None:
        """Move :meth:`lookup_counts` by ``moves``: lookups answered again without
        asking (the state :meth:`lookup_version` names unchanged), counted as asked;
        each tier's lookups timed again at its last delay."""
        c = self.counters
        c.host_queries += moves[0]
        c.host_hits += moves[1]
        for i, (tier, flow) in enumerate(zip(self.secondary_tiers, self.flows)):
            queries, hits, timed = moves[2 + 3 * i : 5 + 3 * i]
            tier.stats.queries += queries
            tier.stats.hits += hits
            for _ in range(timed):
                flow.looked_up(flow.last_sync, None, 0.0)
