"""The tiers behind the host tier, as one family: :class:`SecondaryTier` (what the
manager calls), :class:`TierResult` and :class:`TierStats`, and the builders by
``type`` in :mod:`kvtier.tiering_spec.tiers.registry`. The fs tier lives in
:mod:`kvtier.tiering_spec.fstier` (its index, with no I/O, in
:mod:`kvtier.tiering_spec.tiers.fs_index`; its start-up scan and the look for other
engines' files in :mod:`kvtier.tiering_spec.tiers.fs_scan`), the Mooncake Store tier in
:mod:`kvtier.tiering_spec.storetier`."""

from kvtier.tiering_spec.tiers.base import (
    FAULT_KINDS,
    SecondaryTier,
    TierFault,
    TierResult,
    TierStats,
    count_down,
)

__all__ = [
    "FAULT_KINDS",
    "SecondaryTier",
    "TierFault",
    "TierResult",
    "TierStats",
    "count_down",
]
