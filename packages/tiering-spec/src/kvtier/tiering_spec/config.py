"""Validation of ``kv_connector_extra_config`` for kvtier's offloading specs.

Plain Python, no vLLM import: every error is a ``ConfigError`` (a ``ValueError``)
whose message names the key, the value given and what is allowed, and it is raised
when the spec is built, at engine start-up, never later.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.blockpool import (
    DEFAULT_MAX_TRACKER_SIZE,
    PER_RANK_KEY,
    TOTAL_KEY,
    require_bool,
    require_positive_int,
)

logger = logging.getLogger("kvtier.tiering_spec")

EVICTION_POLICIES = ("lru", "arc", "frecency")
TIER_TYPES = ("fs", "mooncake")
DEFAULT_IO_THREADS = 16  # vLLM's fs tier default, so a copied configuration behaves alike
MAX_IO_THREADS = 256
# Top-level keys of kv_connector_extra_config that kvtier's specs or vLLM's
# OffloadingConnector read; any other is warned about by name.
KNOWN_KEYS = frozenset(
    {
        PER_RANK_KEY,
        TOTAL_KEY,
        "blocks_per_chunk",
        "block_size",
        "eviction_policy",
        "cache_policy_module_path",
        "store_threshold",
        "max_tracker_size",
        "secondary_tiers",
        "model_identity",
        "spec_name",
        "spec_module_path",
        "offload_prompt_only",
        "canonical_layout",
        "self_describing_kv_events",
    }
)
_FS_KEYS = (
    "type",
    "root_dir",
    "n_read_threads",
    "n_write_threads",
    "capacity_bytes",
    "eviction_policy",
    "enable_kv_events",
    "locality",
    "auth_key_file",
    # vLLM's tiering keys that kvtier accepts and does not need.
    "backpressure",
    "module_path",
)
LOCALITIES = ("LOCAL", "REMOTE")
_MOONCAKE_KEYS = (
    "type",
    "master_server_address",
    "metadata_server",
    "protocol",
    "local_hostname",
    "global_segment_size",
    "local_buffer_size",
    "device_name",
    "enable_kv_events",
    "locality",
    "auth_key_file",
)
MOONCAKE_PROTOCOLS = ("tcp", "rdma")


class ConfigError(ValueError):
    """A bad ``kv_connector_extra_config`` value; the message names the key."""


def _int(key: str, value: Any, *, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``; integral floats (``8e9``) are
    accepted, strings are not (as in the recompute connector)."""
    try:
        number = require_positive_int(key, value, allow_zero=minimum <= 0)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if number < minimum or (maximum is not None and number > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ConfigError(f"{key} must be an integer >= {minimum}{upper}, got {value!r}")
    return number


def _bool(key: str, value: Any) -> bool:
    try:
        return require_bool(key, value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class FsTierConfig:
    """One ``{"type": "fs", ...}`` entry of ``secondary_tiers``.

    Attributes:
        root_dir: directory the tier keeps its files in (created 0700 if missing).
        n_read_threads / n_write_threads: I/O threads for promotions / writes.
        capacity_bytes: bytes of files this engine may keep; None means no limit.
        eviction_policy: which files go first when the tier is full (``lru``,
            ``arc`` or ``frecency``, as for the host tier).
        enable_kv_events: publish KV events for this tier (when events are on).
        locality: "LOCAL" or "REMOTE" (reported in events).
        auth_key_file: a file of this user (mode 0600) holding the secret that
            authenticates the tier's files (a keyed MAC in each header; for a folder that
            others can write, such as a shared filesystem); None: no MAC.
    """

    root_dir: str
    n_read_threads: int = DEFAULT_IO_THREADS
    n_write_threads: int = DEFAULT_IO_THREADS
    capacity_bytes: int | None = None
    eviction_policy: str = "frecency"
    enable_kv_events: bool = True
    locality: str = "LOCAL"
    auth_key_file: str | None = None
    type: str = "fs"


@dataclass(frozen=True)
class MooncakeTierConfig:
    """One ``{"type": "mooncake", ...}`` entry of ``secondary_tiers``: a Mooncake Store
    that engines on many machines share.

    Attributes:
        master_server_address: the ``mooncake_master`` RPC address, ``HOST:PORT``.
        metadata_server: the transfer engine's metadata service,
            ``http://HOST:PORT/metadata`` (the master's, with
            ``--enable_http_metadata_server``), or ``P2PHANDSHAKE``.
        protocol: ``tcp`` or ``rdma``.
        local_hostname: this machine's address as the other clients reach it.
        global_segment_size: bytes of this process's memory lent to the store (0: none;
            the objects then live in other clients' segments).
        local_buffer_size: bytes of the client's own transfer buffer.
        device_name: RDMA device(s), e.g. ``mlx5_0`` (required with ``rdma``).
        enable_kv_events / locality: as for the fs tier (``REMOTE`` by default).
        auth_key_file: a file of this user (mode 0600) holding the secret that
            authenticates objects (a keyed MAC in each header): only objects written
            with the same secret are loaded. None: every client of the master is trusted.
    """

    master_server_address: str
    metadata_server: str
    protocol: str = "tcp"
    local_hostname: str = ""
    global_segment_size: int = 1 << 30
    local_buffer_size: int = 64 << 20
    device_name: str = ""
    enable_kv_events: bool = True
    locality: str = "REMOTE"
    auth_key_file: str | None = None
    type: str = "mooncake"


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
    """

    budget: dict[str, int]
    blocks_per_chunk: int | None = None
    block_size: int | None = None
    eviction_policy: str = "frecency"
    cache_policy_module_path: str | None = None
    store_threshold: int = 0
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE
    secondary_tiers: tuple[FsTierConfig | MooncakeTierConfig, ...] = field(default_factory=tuple)
    model_identity: str | None = None


def parse_config(
    extra: Mapping[str, Any], *, tiering: bool, check_paths: bool = True
) -> OffloadConfig:
    """Validate ``kv_connector_extra_config`` for ``CPUOffloadingSpec`` (``tiering=False``)
    or ``TieringOffloadingSpec`` (``tiering=True``). Raises ``ConfigError``.

    ``check_paths`` creates and probes each fs tier's ``root_dir``.
    """
    if not isinstance(extra, Mapping):
        raise ConfigError(f"kv_connector_extra_config must be a dict, got {type(extra).__name__}")
    spec = "TieringOffloadingSpec" if tiering else "CPUOffloadingSpec"
    unknown = sorted(str(k) for k in extra if k not in KNOWN_KEYS)
    if unknown:
        logger.warning(
            "kvtier %s ignores unknown kv_connector_extra_config key(s) %s; known keys: %s",
            spec,
            unknown,
            ", ".join(sorted(KNOWN_KEYS)),
        )
    for key in ("offload_prompt_only", "self_describing_kv_events"):
        if key in extra:
            _bool(key, extra[key])  # vLLM reads these with bool(): "false" would be true
    budget: dict[str, int] = {}
    if extra.get(PER_RANK_KEY) is not None:
        budget[PER_RANK_KEY] = _int(PER_RANK_KEY, extra[PER_RANK_KEY], minimum=1)
    if extra.get(TOTAL_KEY) is not None:
        budget[TOTAL_KEY] = _int(TOTAL_KEY, extra[TOTAL_KEY], minimum=1)
    if not budget:
        raise ConfigError(
            f"{TOTAL_KEY} is required by {spec}: set it in kv_connector_extra_config to the "
            "bytes of host memory for all ranks together (for example 8 * (1 << 30)), or set "
            f"{PER_RANK_KEY} to the bytes for each rank"
        )

    bpc = extra.get("blocks_per_chunk")
    bsz = extra.get("block_size")
    if bpc is not None and bsz is not None:
        raise ConfigError(
            "blocks_per_chunk and block_size are mutually exclusive: set blocks_per_chunk "
            f"(device blocks per offloaded chunk) or block_size (tokens), got {bpc!r} and {bsz!r}"
        )
    blocks_per_chunk = _int("blocks_per_chunk", bpc, minimum=1) if bpc is not None else None
    block_size = _int("block_size", bsz, minimum=1) if bsz is not None else None

    module_path = extra.get("cache_policy_module_path")
    if module_path is not None and (not isinstance(module_path, str) or not module_path):
        raise ConfigError(
            "cache_policy_module_path must be 'package.module:Class' (or vLLM's 'package.module' "
            f"with the class in eviction_policy), got {module_path!r}"
        )
    policy = extra.get("eviction_policy", "frecency")
    if module_path is None and policy not in EVICTION_POLICIES:
        from kvtier.tiering_spec.vllm_policy import resolve_vllm_policy

        resolve_vllm_policy(policy, None)  # a name vLLM's CachePolicyFactory knows, or an error
    store_threshold = _int("store_threshold", extra.get("store_threshold", 0), minimum=0)
    if tiering and store_threshold >= 2:
        raise ConfigError(
            f"store_threshold={store_threshold} is not supported by TieringOffloadingSpec "
            "(as in vLLM): every stored block is written through to the secondary tiers. "
            "Allowed: 0 or 1 (no filter); use CPUOffloadingSpec for an admission filter"
        )
    max_tracker_size = _int(
        "max_tracker_size", extra.get("max_tracker_size", DEFAULT_MAX_TRACKER_SIZE), minimum=1
    )
    if _bool("canonical_layout", extra.get("canonical_layout", False)):
        raise ConfigError(
            "canonical_layout is not supported by kvtier's offloading specs; remove it "
            "(allowed: false)"
        )

    tiers_raw = extra.get("secondary_tiers", [])
    if tiers_raw is None:
        tiers_raw = []
    if not isinstance(tiers_raw, (list, tuple)):
        raise ConfigError(
            f"secondary_tiers must be a list of tier dicts like "
            f'{{"type": "fs", "root_dir": "/path"}}, got {type(tiers_raw).__name__}'
        )
    if tiers_raw and not tiering:
        raise ConfigError(
            "secondary_tiers is only used by TieringOffloadingSpec; set spec_name to "
            "TieringOffloadingSpec or remove secondary_tiers"
        )
    tiers = tuple(
        parse_mooncake_tier(t, f"secondary_tiers[{i}]", check_paths=check_paths)
        if isinstance(t, Mapping) and t.get("type") == "mooncake"
        else parse_fs_tier(t, f"secondary_tiers[{i}]", check_paths=check_paths)
        for i, t in enumerate(tiers_raw)
    )
    model_identity = extra.get("model_identity")
    if model_identity is not None and (
        not isinstance(model_identity, str) or not model_identity.strip()
    ):
        raise ConfigError(
            "model_identity must be a non-empty string that changes whenever the model's "
            f"weights change (for example 'llama3-8b@2026-11-02'), got {model_identity!r}"
        )
    roots = [os.path.realpath(t.root_dir) for t in tiers if isinstance(t, FsTierConfig)]
    if len(set(roots)) != len(roots):
        raise ConfigError(f"secondary_tiers: two fs tiers share one root_dir ({roots})")
    return OffloadConfig(
        budget=budget,
        blocks_per_chunk=blocks_per_chunk,
        block_size=block_size,
        eviction_policy=str(policy),
        cache_policy_module_path=module_path,
        store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
        secondary_tiers=tiers,
        model_identity=model_identity,
    )


def parse_fs_tier(raw: Any, where: str, *, check_paths: bool = True) -> FsTierConfig:
    """Validate one secondary tier entry; ``where`` names it in errors."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a dict with a 'type' key, got {raw!r}")
    kind = raw.get("type")
    if kind not in TIER_TYPES:
        raise ConfigError(
            f"{where}.type must be one of {', '.join(TIER_TYPES)} (kvtier's tiers), got {kind!r}"
        )
    unknown = sorted(set(raw) - set(_FS_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown} for an fs tier; allowed: {', '.join(_FS_KEYS)}"
        )
    root = raw.get("root_dir")
    if not isinstance(root, str) or not root.strip():
        raise ConfigError(
            f"{where}.root_dir is required: a directory path (string) for the tier's files, "
            f"got {root!r}"
        )
    root = os.path.abspath(os.path.expanduser(root))
    capacity = raw.get("capacity_bytes")
    locality = str(raw.get("locality") or "LOCAL").upper()
    if locality not in LOCALITIES:
        raise ConfigError(f"{where}.locality must be one of {LOCALITIES}, got {locality!r}")
    policy = raw.get("eviction_policy", "frecency")
    if policy not in EVICTION_POLICIES:
        raise ConfigError(
            f"{where}.eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}"
        )
    cfg = FsTierConfig(
        root_dir=root,
        n_read_threads=_int(
            f"{where}.n_read_threads",
            raw.get("n_read_threads", DEFAULT_IO_THREADS),
            minimum=1,
            maximum=MAX_IO_THREADS,
        ),
        n_write_threads=_int(
            f"{where}.n_write_threads",
            raw.get("n_write_threads", DEFAULT_IO_THREADS),
            minimum=1,
            maximum=MAX_IO_THREADS,
        ),
        capacity_bytes=(
            _int(f"{where}.capacity_bytes", capacity, minimum=1) if capacity is not None else None
        ),
        eviction_policy=policy,
        enable_kv_events=_bool(f"{where}.enable_kv_events", raw.get("enable_kv_events", True)),
        locality=locality,
        auth_key_file=_auth_key_file(raw, where, check_paths=check_paths),
    )
    if check_paths:
        check_directory(cfg.root_dir, f"{where}.root_dir")
    return cfg


def _auth_key_file(raw: Mapping[str, Any], where: str, *, check_paths: bool) -> str | None:
    """The validated ``auth_key_file`` of a tier entry (an absolute path), or None.
    With ``check_paths`` the file is read and checked as the tier will (see
    ``kvtier.tiering_spec.auth.load_auth_key``); the key itself is not kept here."""
    value = raw.get("auth_key_file")
    if value is None:
        return None
    key = f"{where}.auth_key_file"
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{key} must be the path (string) of a file of this user, mode 0600, holding "
            f"the secret shared by every engine of the tier, got {value!r}"
        )
    path = os.path.abspath(os.path.expanduser(value))
    if check_paths:
        from kvtier.tiering_spec.auth import load_auth_key  # auth imports this module

        load_auth_key(path, key)
    return path


def _host_port(where: str, value: Any) -> str:
    host, _, port = str(value).rpartition(":") if isinstance(value, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"{where} must be 'HOST:PORT' (the mooncake_master RPC address, for example "
            f"'10.0.0.1:50051'), got {value!r}"
        )
    return str(value)


def parse_mooncake_tier(
    raw: Mapping[str, Any], where: str, *, check_paths: bool = True
) -> MooncakeTierConfig:
    """Validate one ``{"type": "mooncake", ...}`` entry; ``where`` names it in errors.
    ``check_paths`` reads and checks the ``auth_key_file``, if any."""
    unknown = sorted(set(raw) - set(_MOONCAKE_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown} for a mooncake tier; allowed: "
            f"{', '.join(_MOONCAKE_KEYS)}"
        )
    if "master_server_address" not in raw:
        raise ConfigError(
            f"{where}.master_server_address is required: the mooncake_master RPC address "
            "'HOST:PORT'"
        )
    master = _host_port(f"{where}.master_server_address", raw["master_server_address"])
    metadata = raw.get("metadata_server")
    if not isinstance(metadata, str) or not (
        metadata == "P2PHANDSHAKE" or metadata.startswith(("http://", "https://"))
    ):
        raise ConfigError(
            f"{where}.metadata_server must be 'http://HOST:PORT/metadata' (for example the "
            "master's, started with --enable_http_metadata_server=true) or 'P2PHANDSHAKE', "
            f"got {metadata!r}"
        )
    protocol = raw.get("protocol", "tcp")
    if protocol not in MOONCAKE_PROTOCOLS:
        raise ConfigError(
            f"{where}.protocol must be one of {', '.join(MOONCAKE_PROTOCOLS)}, got {protocol!r}"
        )
    device = raw.get("device_name", "")
    if not isinstance(device, str) or (protocol == "rdma" and not device.strip()):
        raise ConfigError(
            f"{where}.device_name must be a string naming the RDMA device(s) (for example "
            f"'mlx5_0'); required with protocol 'rdma', got {device!r}"
        )
    hostname = raw.get("local_hostname", "")
    if not isinstance(hostname, str):
        raise ConfigError(
            f"{where}.local_hostname must be this machine's address as other clients reach "
            f"it (a string), got {hostname!r}"
        )
    locality = str(raw.get("locality") or "REMOTE").upper()
    if locality not in LOCALITIES:
        raise ConfigError(f"{where}.locality must be one of {LOCALITIES}, got {locality!r}")
    return MooncakeTierConfig(
        master_server_address=master,
        metadata_server=metadata,
        protocol=str(protocol),
        local_hostname=hostname.strip() or socket.gethostname(),
        global_segment_size=_int(
            f"{where}.global_segment_size", raw.get("global_segment_size", 1 << 30), minimum=0
        ),
        local_buffer_size=_int(
            f"{where}.local_buffer_size", raw.get("local_buffer_size", 64 << 20), minimum=0
        ),
        device_name=device.strip(),
        enable_kv_events=_bool(f"{where}.enable_kv_events", raw.get("enable_kv_events", True)),
        locality=locality,
        auth_key_file=_auth_key_file(raw, where, check_paths=check_paths),
    )


def check_directory(path: str, key: str) -> None:
    """Create ``path`` and its missing parents (mode 0700) and check it is a writable
    directory of this user that no other user can change (see ``fsdirs``)."""
    # fsdirs imports this module for ConfigError.
    from kvtier.tiering_spec.fsdirs import make_private_dirs

    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={path!r} exists and is not a directory")
    make_private_dirs(path, key)
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvtier-probe-", dir=path)
    except OSError as exc:
        raise ConfigError(
            f"{key}={path!r} is not writable by this process: {exc.strerror or exc}"
        ) from None
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass
