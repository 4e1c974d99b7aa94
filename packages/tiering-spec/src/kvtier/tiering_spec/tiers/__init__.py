"""The tiers behind the host tier, as one family: :class:`SecondaryTier` (what the
manager calls), :class:`TierJob` and :class:`TierResult` and :class:`TierStats`, and the builders by
``type`` in :mod:`~kvtier.tiering_spec.tiers.registry`. The fs tier is
:mod:`~kvtier.tiering_spec.tiers.fs_tier`, split by concern: its index, with no I/O
(``fs_index``), the file I/O as plain functions (``fs_io``), the file format
(``fs_format``), its folders (``fs_dirs``), its start-up scan and the look for other
engines' files (``fs_scan``). The Mooncake Store tier is
:mod:`~kvtier.tiering_spec.tiers.store_tier`."""

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
