"""Validation of ``kv_connector_extra_config`` for kvtier's offloading specs.

The spec's own keys (the host tier's, and vLLM's that kvtier reads) are declared and
checked here; each ``secondary_tiers`` entry is checked by the schema of its ``type``,
which this module asks the registry for (``tiers.registry``; a tier type declares its
keys in its own folder, see ``kvtier.tiering_spec.tier_config``).

Plain Python, no vLLM import: every error is a ``ConfigError`` (a ``ValueError``)
whose message names the key, the value given and what is allowed, and it is raised
when the spec is built, at engine start-up, never later.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.blockpool import DEFAULT_MAX_TRACKER_SIZE, PER_RANK_KEY, TOTAL_KEY
from kvtier.blockpool.policies import POLICIES
from kvtier.tiering_spec.errors import ConfigError
from kvtier.tiering_spec.tier_config import TierConfig
from kvtier.tiering_spec.tiers import registry

# The built-in tiers' names that callers import from here; their folders define them.
from kvtier.tiering_spec.tiers.fs.schema import FS_TIER_SCHEMA, FsTierConfig, parse_fs_tier
from kvtier.tiering_spec.tiers.store.schema import (
    MOONCAKE_TIER_SCHEMA,
    MooncakeTierConfig,
    parse_mooncake_tier,
)
from kvtier.tiering_spec.vllm_policy import resolve_vllm_policy
from kvtier.vllm_port.schema import Bool, Check, Int, Key, Schema, accept

__all__ = [
    "DEFAULT_SYNC_LOAD_BUDGET_BYTES",
    "EVICTION_POLICIES",
    "FS_TIER_SCHEMA",
    "KNOWN_KEYS",
    "MOONCAKE_TIER_SCHEMA",
    "SPEC_SCHEMA",
    "ConfigError",
    "FsTierConfig",
    "MooncakeTierConfig",
    "OffloadConfig",
    "parse_config",
    "parse_fs_tier",
    "parse_mooncake_tier",
    "parse_tier",
]

logger = logging.getLogger("kvtier.tiering_spec")

EVICTION_POLICIES = tuple(POLICIES)  # kvtier-blockpool's: lru, arc, frecency

# A worker copies this much from host DRAM to an NPU or GPU in about 10 ms (25 GB/s),
# well under a step of a busy engine; a larger hit is loaded between steps instead.
DEFAULT_SYNC_LOAD_BUDGET_BYTES = 256 << 20
# A recorded traffic file is closed and the next begun past this size.
DEFAULT_RECORD_MAX_BYTES = 64 << 20


def _policy_module(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"{key} must be 'package.module:Class' (or vLLM's 'package.module' with the class "
            f"in eviction_policy), got {value!r}"
        )
    return value


def _tier_list(key: str, value: Any) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"{key} must be a list of tier dicts like "
            f'{{"type": "fs", "root_dir": "/path"}}, got {type(value).__name__}'
        )
    return tuple(value)


def _model_identity(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{key} must be a non-empty string that changes whenever the model's weights "
            f"change (for example 'llama3-8b@2026-11-02'), got {value!r}"
        )
    return value


def _folder(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key} must be a folder's path (a non-empty string), got {value!r}")
    return os.path.abspath(os.path.expanduser(value))


def _false_only(key: str, value: Any) -> bool:
    if Bool().parse(key, value):
        raise ConfigError(
            f"{key} is not supported by kvtier's offloading specs; remove it (allowed: false)"
        )
    return False


# kv_connector_extra_config of kvtier's specs: the keys they or vLLM's OffloadingConnector
# read; any other is warned about by name.
SPEC_SCHEMA = Schema(
    "spec",
    (
        Key(
            TOTAL_KEY,
            Int(1),
            "host bytes for all ranks together (divided by the world size; all of it for "
            "the one copy of KV replicated across ranks)",
            default_words="**required** (or the next key)",
        ),
        Key(PER_RANK_KEY, Int(1), "host bytes per rank; wins over the total"),
        Key(
            "blocks_per_chunk",
            Int(1),
            "device blocks per offloaded chunk (one host block, one file)",
            default_words="`1`",
        ),
        Key(
            "block_size",
            Int(1),
            "the chunk in tokens instead; a multiple of the device block size",
            allowed_words="integer ≥ 1; not with `blocks_per_chunk`",
        ),
        Key(
            "eviction_policy",
            Check(accept, ""),
            "host tier eviction",
            "frecency",
            allowed_words="`frecency`, `lru`, `arc`; a name registered with vLLM's "
            "`CachePolicyFactory`; with `cache_policy_module_path` set to a module, the "
            "class's name in it (vLLM's convention)",
        ),
        Key(
            "cache_policy_module_path",
            Check(_policy_module, "importable class"),
            "your own policy: a kvtier policy class (`insert`, `touch`, `remove`, `evict`) "
            "or a vLLM `CachePolicy` subclass, as `pkg.module:Class`, or vLLM's `pkg.module` "
            "with the class in `eviction_policy`",
        ),
        Key(
            "store_threshold",
            Int(0),
            "offers a chunk needs before it is stored (CPU spec only, as in vLLM)",
            0,
            allowed_words="integer ≥ 0; below 2 disables",
        ),
        Key(
            "max_tracker_size",
            Int(1),
            "chunks the admission filter remembers",
            DEFAULT_MAX_TRACKER_SIZE,
        ),
        Key("offload_prompt_only", Bool(), "vLLM's: offload prompt blocks only", True),
        Key(
            "sync_load_budget_bytes",
            Int(0),
            "KV bytes per engine step (per worker) loaded inside the step that finds them, "
            "before its forward pass, so the request runs at once; larger hits load "
            "between steps (vLLM 0.33's key, which kvtier also honours on 0.32)",
            DEFAULT_SYNC_LOAD_BUDGET_BYTES,
            allowed_words="integer ≥ 0; 0 loads every hit between steps",
        ),
        Key(
            "secondary_tiers",
            Check(_tier_list, "list of tier dicts"),
            "tiers behind the host tier (`TieringOffloadingSpec`)",
            (),
            default_words="`[]`",
        ),
        Key(
            "model_identity",
            Check(_model_identity, "non-empty string"),
            "a name for the model's weights that you change whenever they change; replaces "
            "kvtier's digest of the weight files in the fs tier's fingerprint (for weights "
            "kvtier cannot read, such as a remote loader's)",
            default_words="digest of the files",
        ),
        Key(
            "record_traffic_dir",
            Check(_folder, "a folder's path"),
            "record the requests the engine serves into this folder, as a trace for "
            "`python -m kvtier.tiering_spec.plan` (created 0700 and checked as an fs tier's "
            "`root_dir`; files 0600; see [Size it from your own "
            "traffic](#size-it-from-your-own-traffic))",
            default_words="off",
        ),
        Key(
            "record_traffic_max_bytes",
            Int(4096),
            "a recorded file is closed and the next begun past this size",
            DEFAULT_RECORD_MAX_BYTES,
        ),
        Key(
            "spec_name",
            Check(accept, "a registered spec name"),
            "vLLM's: which spec the `OffloadingConnector` builds (see "
            "[Which class a spec name gets](#which-class-a-spec-name-gets))",
            default_words="`CPUOffloadingSpec`",
        ),
        Key(
            "spec_module_path",
            Check(accept, "an importable module"),
            "vLLM's: the module of a spec that is not registered",
        ),
        Key(
            "self_describing_kv_events",
            Bool(),
            "vLLM's `OffloadingConnector` option for the payload of its `BlockStored` events "
            "(when KV events are on), left to vLLM; kvtier checks it is a boolean",
            False,
        ),
        Key(
            "canonical_layout",
            Check(_false_only, "`false`"),
            "vLLM's canonical KV layout; kvtier's specs refuse it at start-up (see "
            "[Compatibility](#compatibility))",
            False,
        ),
    ),
    error=ConfigError,
)
KNOWN_KEYS = SPEC_SCHEMA.names()


@dataclass(frozen=True)
class OffloadConfig:
    """The validated settings of a kvtier offloading spec.

    Attributes:
        budget: the ``cpu_bytes_to_use`` / ``cpu_bytes_to_use_per_rank`` keys, for
            ``kvtier.blockpool.resolve_budget`` (bytes).
        blocks_per_chunk: device blocks per host block, if given.
        block_size: tokens per host block, if given (mutually exclusive with the above).
        eviction_policy / cache_policy_module_path: the host tier's eviction policy.
        store_threshold: offers a block needs before it is stored (below 2: off).
        max_tracker_size: keys the admission filter remembers.
        secondary_tiers: validated secondary tiers, in order.
        model_identity: a name the user gives the model's weights; when set it stands
            in for kvtier's digest of the weight files in the fs tier's fingerprint.
        sync_load_budget_bytes: KV bytes per step a worker loads before the step's
            forward pass (0: every load waits a step).
        record_traffic_dir: where the scheduler records the requests it serves (None:
            off); record_traffic_max_bytes: the size past which a file is rotated.
    """

    budget: dict[str, int]
    blocks_per_chunk: int | None = None
    block_size: int | None = None
    eviction_policy: str = "frecency"
    cache_policy_module_path: str | None = None
    store_threshold: int = 0
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE
    secondary_tiers: tuple[TierConfig, ...] = field(default_factory=tuple)
    model_identity: str | None = None
    sync_load_budget_bytes: int = 0
    record_traffic_dir: str | None = None
    record_traffic_max_bytes: int = DEFAULT_RECORD_MAX_BYTES


def parse_config(
    extra: Mapping[str, Any], *, tiering: bool, check_paths: bool = True
) -> OffloadConfig:
    """Validate ``kv_connector_extra_config`` for ``CPUOffloadingSpec`` (``tiering=False``)
    or ``TieringOffloadingSpec`` (``tiering=True``). Raises ``ConfigError``.

    ``check_paths`` lets each tier check its paths as it will use them (an fs tier
    creates and probes its ``root_dir``, a tier reads its ``auth_key_file``).
    """
    if not isinstance(extra, Mapping):
        raise ConfigError(f"kv_connector_extra_config must be a dict, got {type(extra).__name__}")
    spec = "TieringOffloadingSpec" if tiering else "CPUOffloadingSpec"
    unknown = SPEC_SCHEMA.unknown(extra)
    if unknown:
        logger.warning(
            "kvtier %s ignores unknown kv_connector_extra_config key(s) %s; known keys: %s",
            spec,
            unknown,
            ", ".join(sorted(KNOWN_KEYS)),
        )
    values = SPEC_SCHEMA.parse(extra)
    budget = {k: values[k] for k in (PER_RANK_KEY, TOTAL_KEY) if values[k] is not None}
    if not budget:
        raise ConfigError(
            f"{TOTAL_KEY} is required by {spec}: set it in kv_connector_extra_config to the "
            "bytes of host memory for all ranks together (for example 8 * (1 << 30)), or set "
            f"{PER_RANK_KEY} to the bytes for each rank"
        )
    if values["blocks_per_chunk"] is not None and values["block_size"] is not None:
        raise ConfigError(
            "blocks_per_chunk and block_size are mutually exclusive: set blocks_per_chunk "
            "(device blocks per offloaded chunk) or block_size (tokens), got "
            f"{values['blocks_per_chunk']!r} and {values['block_size']!r}"
        )
    module_path = values["cache_policy_module_path"]
    policy = values["eviction_policy"]
    if module_path is None and policy not in EVICTION_POLICIES:
        resolve_vllm_policy(policy, None)  # a name vLLM's CachePolicyFactory knows, or an error
    store_threshold = values["store_threshold"]
    if tiering and store_threshold >= 2:
        raise ConfigError(
            f"store_threshold={store_threshold} is not supported by TieringOffloadingSpec "
            "(as in vLLM): every stored block is written through to the secondary tiers. "
            "Allowed: 0 or 1 (no filter); use CPUOffloadingSpec for an admission filter"
        )
    tiers_raw = values["secondary_tiers"]
    if tiers_raw and not tiering:
        raise ConfigError(
            "secondary_tiers is only used by TieringOffloadingSpec; set spec_name to "
            "TieringOffloadingSpec or remove secondary_tiers"
        )
    tiers = tuple(
        parse_tier(t, f"secondary_tiers[{i}]", check_paths=check_paths)
        for i, t in enumerate(tiers_raw)
    )
    _check_own_dirs(tiers)
    record_dir = values["record_traffic_dir"]  # checked where it is used (the scheduler)
    return OffloadConfig(
        budget=budget,
        blocks_per_chunk=values["blocks_per_chunk"],
        block_size=values["block_size"],
        eviction_policy=str(policy),
        cache_policy_module_path=module_path,
        store_threshold=store_threshold,
        max_tracker_size=values["max_tracker_size"],
        secondary_tiers=tiers,
        model_identity=values["model_identity"],
        sync_load_budget_bytes=values["sync_load_budget_bytes"],
        record_traffic_dir=record_dir,
        record_traffic_max_bytes=values["record_traffic_max_bytes"],
    )


def parse_tier(raw: Any, where: str, *, check_paths: bool = True) -> TierConfig:
    """Validate one ``secondary_tiers`` entry by the schema registered for its ``type``;
    ``where`` names it in errors."""
    parsed: TierConfig = registry.tier_type(raw, where).parse(raw, where, check_paths=check_paths)
    return parsed


def _check_own_dirs(tiers: tuple[TierConfig, ...]) -> None:
    """No two entries of a type share the directory the type keeps for itself."""
    for name in dict.fromkeys(t.type for t in tiers):
        key = registry.tier_type({"type": name}, "secondary_tiers").own_dir
        if key is None:
            continue
        dirs = [os.path.realpath(getattr(t, key)) for t in tiers if t.type == name]
        if len(set(dirs)) != len(dirs):
            raise ConfigError(f"secondary_tiers: two {name} tiers share one {key} ({dirs})")
