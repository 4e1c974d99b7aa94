"""The one list of secondary tier types: each ``secondary_tiers`` entry is validated by
the schema and built by the builder registered for its ``type``, as vLLM's tiering
connector does with its tier factory.

kvtier's own types (``fs``, ``mooncake``) are registered here, from their folders'
``schema`` modules. A tier from outside the package registers with
:func:`register_tier_type` (its schema, config type and builder; see
``kvtier.tiering_spec.tier_config``) before the engine builds its spec::

    register_tier_type(TierType(MEMORY_SCHEMA, MemoryTierConfig, build_memory_tier))

A builder takes the validated entry, where it sits in the configuration (for error
messages), the tier's name, whether it publishes KV events, and the :class:`TierSite`
(what the engine offers every tier); it returns a :class:`SecondaryTier`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.tiering_spec.errors import ConfigError
from kvtier.tiering_spec.tier_config import TierBuilder, TierSite, TierType
from kvtier.tiering_spec.tiers.base import SecondaryTier
from kvtier.tiering_spec.tiers.fs.schema import FS_TIER
from kvtier.tiering_spec.tiers.store.schema import MOONCAKE_TIER

__all__ = [
    "TierBuilder",
    "TierSite",
    "TierType",
    "build_tier",
    "register_tier_type",
    "tier_type",
    "tier_types",
]

_TYPES: dict[str, TierType] = {}


def register_tier_type(tier: TierType) -> TierType:
    """Register a type of ``secondary_tiers`` entry, named by its schema's ``type``.
    Raises ``ValueError`` if that type is registered already."""
    if tier.name in _TYPES:
        raise ValueError(f"secondary tier type {tier.name!r} is registered already")
    _TYPES[tier.name] = tier
    return tier


def tier_types() -> list[str]:
    """The types a ``secondary_tiers`` entry may have, in the order registered."""
    return list(_TYPES)


def tier_type(raw: Any, where: str) -> TierType:
    """The registered type of the entry ``raw``; ``where`` names it in errors."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a dict with a 'type' key, got {raw!r}")
    kind = raw.get("type")
    found = _TYPES.get(kind) if isinstance(kind, str) else None
    if found is None:
        raise ConfigError(
            f"{where}.type must be one of {', '.join(_TYPES)} (kvtier's tiers), got {kind!r}"
        )
    return found


def build_tier(cfg: Any, where: str, name: str, events: bool, site: TierSite) -> SecondaryTier:
    """Build the tier ``cfg`` (a validated entry) describes."""
    tier = tier_type({"type": cfg.type}, where)
    built: SecondaryTier = tier.builder(cfg, where, name, events, site)
    return built


for _builtin in (FS_TIER, MOONCAKE_TIER):
    register_tier_type(_builtin)
