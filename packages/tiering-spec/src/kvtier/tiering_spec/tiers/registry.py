"""Secondary tiers by ``type``: each ``secondary_tiers`` entry is built by the builder
registered for its type, as vLLM's tiering connector does with its tier factory.

A builder takes the validated entry, where it sits in the configuration (for error
messages), the tier's name, whether it publishes KV events, and the :class:`TierSite`
(what the engine offers every tier); it returns a :class:`SecondaryTier`. Builders
import their tier's module when called, so a type that is not configured costs
nothing (the Mooncake tier needs Mooncake's client).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvtier.tiering_spec.auth import load_auth_key
from kvtier.tiering_spec.config import ConfigError, FsTierConfig, MooncakeTierConfig
from kvtier.tiering_spec.tiers.base import SecondaryTier

if TYPE_CHECKING:
    from kvtier.tiering_spec.tiers.store.tier import StoreClient


@dataclass(frozen=True)
class TierSite:
    """What the engine offers each of its secondary tiers.

    Attributes:
        layouts: one layout description per rank (the files' fingerprints).
        payload_bytes: bytes of one rank's host block.
        region_views: one memoryview per rank over the host region, or None while it
            cannot be mapped yet.
        persistent: the fingerprint identifies the weights, so files outlive the engine.
    """

    layouts: Sequence[dict[str, Any]]
    payload_bytes: int
    region_views: Callable[[], Sequence[memoryview] | None]
    persistent: bool


TierBuilder = Callable[[Any, str, str, bool, TierSite], SecondaryTier]
_BUILDERS: dict[str, TierBuilder] = {}


def register_tier_type(type_name: str) -> Callable[[TierBuilder], TierBuilder]:
    """Register the builder of the ``secondary_tiers`` entries of ``type_name``."""

    def register(builder: TierBuilder) -> TierBuilder:
        if type_name in _BUILDERS:
            raise ValueError(f"secondary tier type {type_name!r} is registered already")
        _BUILDERS[type_name] = builder
        return builder

    return register


def tier_types() -> list[str]:
    """The types a ``secondary_tiers`` entry may have."""
    return list(_BUILDERS)


def build_tier(cfg: Any, where: str, name: str, events: bool, site: TierSite) -> SecondaryTier:
    """Build the tier ``cfg`` (a validated entry) describes."""
    builder = _BUILDERS.get(cfg.type)
    if builder is None:
        raise ConfigError(f"{where}.type must be one of {', '.join(_BUILDERS)}, got {cfg.type!r}")
    return builder(cfg, where, name, events, site)


@register_tier_type("fs")
def _fs_tier(cfg: FsTierConfig, where: str, name: str, events: bool, site: TierSite) -> Any:
    from kvtier.tiering_spec.tiers.fs.tier import FileSystemTier

    return FileSystemTier(
        cfg,
        site.layouts,
        site.payload_bytes,
        site.region_views,
        name=name,
        enable_events=events,
        ephemeral=not site.persistent,
    )


@register_tier_type("mooncake")
def _mooncake_tier(
    cfg: MooncakeTierConfig, where: str, name: str, events: bool, site: TierSite
) -> Any:
    from kvtier.tiering_spec.tiers.store.tier import StoreTier, StoreTierSettings

    auth_key = (
        load_auth_key(cfg.auth_key_file, f"{where}.auth_key_file") if cfg.auth_key_file else None
    )
    return StoreTier(
        mooncake_connector(cfg, where),
        site.layouts,
        site.payload_bytes,
        site.region_views,
        StoreTierSettings(name, cfg.locality, events, auth_key=auth_key),
    )


def mooncake_connector(cfg: MooncakeTierConfig, where: str) -> Callable[[], StoreClient]:
    """A function that connects a Mooncake Store client as ``cfg`` says. Raises
    ``ConfigError`` at once when Mooncake's client is not installed."""
    try:
        store_cls = importlib.import_module("mooncake.store").MooncakeDistributedStore
    except ImportError as exc:
        raise ConfigError(
            f"{where}.type 'mooncake' needs Mooncake's store client, which did not import "
            f"({exc}): pip install mooncake-transfer-engine (CUDA), "
            "mooncake-transfer-engine-npu (Ascend) or mooncake-transfer-engine-non-cuda "
            "(CPU only); it also needs libibverbs (Debian: apt-get install libibverbs1)"
        ) from None

    def connect() -> StoreClient:
        store = store_cls()
        rc = store.setup(
            cfg.local_hostname,
            cfg.metadata_server,
            cfg.global_segment_size,
            cfg.local_buffer_size,
            cfg.protocol,
            cfg.device_name,
            cfg.master_server_address,
        )
        if rc != 0:
            raise ConnectionError(
                f"Mooncake Store setup with master {cfg.master_server_address} returned {rc}"
            )
        return cast("StoreClient", store)

    return connect
