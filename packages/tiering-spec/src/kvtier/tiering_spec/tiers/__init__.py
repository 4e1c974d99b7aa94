"""The tiers behind the host tier, as one family: :class:`SecondaryTier` (what the
manager calls), :class:`TierJob` and :class:`TierResult` and :class:`TierStats`, and the builders by
``type`` in :mod:`~kvtier.tiering_spec.tiers.registry`. Each tier is one folder: the fs
tier is :mod:`~kvtier.tiering_spec.tiers.fs`, the Mooncake Store tier
:mod:`~kvtier.tiering_spec.tiers.store`."""

from kvtier.tiering_spec.tiers.base import (
    FAULT_KINDS,
    SecondaryTier,
    TierFault,
    TierJob,
    TierResult,
    TierStats,
    count_down,
)

__all__ = [
    "FAULT_KINDS",
    "SecondaryTier",
    "TierFault",
    "TierJob",
    "TierResult",
    "TierStats",
    "count_down",
]
