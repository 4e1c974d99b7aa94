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

from kvtier.blockpool import DEFAULT_MAX_TRACKER_SIZE, PER_RANK_KEY, TOTAL_KEY
from kvtier.blockpool.policies import POLICIES
from kvtier.tiering_spec.auth import load_auth_key
from kvtier.tiering_spec.errors import ConfigError
from kvtier.tiering_spec.private_dirs import make_private_dirs
from kvtier.tiering_spec.vllm_policy import resolve_vllm_policy
from kvtier.vllm_port.schema import REQUIRED, Bool, Check, Choice, Int, Key, Schema, Text, accept

logger = logging.getLogger("kvtier.tiering_spec")

EVICTION_POLICIES = tuple(POLICIES)  # kvtier-blockpool's: lru, arc, frecency
TIER_TYPES = ("fs", "mooncake")
DEFAULT_IO_THREADS = 16  # vLLM's fs tier default, so a copied configuration behaves alike
MAX_IO_THREADS = 256

# A worker copies this much from host DRAM to an NPU or GPU in about 10 ms (25 GB/s),
# well under a step of a busy engine; a larger hit is loaded between steps instead.
DEFAULT_SYNC_LOAD_BUDGET_BYTES = 256 << 20

LOCALITIES = ("LOCAL", "REMOTE")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")


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


def _false_only(key: str, value: Any) -> bool:
    if Bool().parse(key, value):
        raise ConfigError(
            f"{key} is not supported by kvtier's offloading specs; remove it (allowed: false)"
        )
    return False


def _host_port(key: str, value: Any) -> str:
    host, _, port = str(value).rpartition(":") if isinstance(value, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"{key} must be 'HOST:PORT' (the mooncake_master RPC address, for example "
            f"'10.0.0.1:50051'), got {value!r}"
        )
    return str(value)


def _metadata_server(key: str, value: Any) -> str:
    if not isinstance(value, str) or not (
        value == "P2PHANDSHAKE" or value.startswith(("http://", "https://"))
    ):
        raise ConfigError(
            f"{key} must be 'http://HOST:PORT/metadata' (for example the master's, started "
            f"with --enable_http_metadata_server=true) or 'P2PHANDSHAKE', got {value!r}"
        )
    return value


_AUTH_KEY_FILE_WORDS = (
    "path of a regular file of this user, not a symlink, mode 0600 (no group or other "
    "bits), ≥ 32 bytes (e.g. `head -c 64 /dev/urandom > FILE; chmod 600 FILE`)"
)
_AUTH_KEY_FILE = Text(
    words="the path (string) of a file of this user, mode 0600, holding the secret shared "
    "by every engine of the tier"
)

_ENABLE_KV_EVENTS = Key(
    "enable_kv_events", Bool(), "publish KV events for this tier (when KV events are on)", True
)

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

# One {"type": "fs", ...} entry of secondary_tiers.
FS_TIER_SCHEMA = Schema(
    "fs-tier",
    (
        Key("type", Choice(("fs",)), "tier type", REQUIRED),
        Key(
            "root_dir",
            Text(words="a directory path (string) for the tier's files"),
            "directory for the block files; created with mode 0700",
            REQUIRED,
            allowed_words="creatable, writable directory",
        ),
        Key(
            "n_read_threads",
            Int(1, MAX_IO_THREADS),
            "I/O threads for promotions",
            DEFAULT_IO_THREADS,
        ),
        Key(
            "n_write_threads", Int(1, MAX_IO_THREADS), "I/O threads for writes", DEFAULT_IO_THREADS
        ),
        Key(
            "capacity_bytes",
            Int(1),
            "bytes of files this engine keeps; the eviction policy picks which go first",
            allowed_words="integer ≥ one entry (a 4096-byte header plus one chunk, per rank)",
            default_words="half of the filesystem's free space at start, plus what this "
            "tier's files already hold (logged)",
        ),
        Key(
            "eviction_policy",
            Choice(EVICTION_POLICIES),
            "which files go first when the tier is full: the host tier's policies, applied "
            "to the files. The tier counts as uses the blocks requests stored and those it "
            "served itself, not the host tier's hits, so a copy the host tier serves goes "
            "before a block the host tier has dropped",
            "frecency",
        ),
        _ENABLE_KV_EVENTS,
        Key("locality", Choice(LOCALITIES, fold_case=True), "reported in KV events", "LOCAL"),
        Key(
            "auth_key_file",
            _AUTH_KEY_FILE,
            "a file holding a secret shared by every engine of the folder: each file then "
            "carries a MAC over its header and payload, and only files with a valid MAC are "
            'loaded (others: a miss, `kind="unauthenticated"`, removed). For a shared '
            "filesystem where the uid does not prove who wrote a file (NFS without Kerberos "
            "trusts the uid a client asserts); files must still be this user's",
            allowed_words=_AUTH_KEY_FILE_WORDS,
            default_words="none",
        ),
        Key(
            "backpressure",
            Check(accept, "—"),
            "vLLM's tiering key: accepted so that a configuration written for vLLM's fs tier "
            "starts, not needed by kvtier's",
        ),
        Key(
            "module_path",
            Check(accept, "—"),
            "vLLM's tiering key: accepted so that a configuration written for vLLM's fs tier "
            "starts, not needed by kvtier's",
        ),
    ),
    error=ConfigError,
)

# One {"type": "mooncake", ...} entry of secondary_tiers.
MOONCAKE_TIER_SCHEMA = Schema(
    "mooncake-tier",
    (
        Key("type", Choice(("mooncake",)), "tier type", REQUIRED),
        Key(
            "master_server_address",
            Check(_host_port, "`HOST:PORT`"),
            "the `mooncake_master` RPC address",
            REQUIRED,
        ),
        Key(
            "metadata_server",
            Check(
                _metadata_server,
                "`http://HOST:PORT/metadata` (the master's, with "
                "`--enable_http_metadata_server=true`) or `P2PHANDSHAKE`",
            ),
            "the transfer engine's metadata service",
            REQUIRED,
        ),
        Key("protocol", Choice(MOONCAKE_PROTOCOLS), "transport", "tcp"),
        Key(
            "device_name",
            Text(nonempty=False, words="a string naming the RDMA device(s) (e.g. `mlx5_0`)"),
            "RDMA device(s); required with `rdma`",
            "",
            default_words='`""`',
        ),
        Key(
            "local_hostname",
            Text(nonempty=False, words="this machine's address as other clients reach it"),
            "this machine's address as the other clients reach it",
            "",
            allowed_words="string",
            default_words="the host name",
        ),
        Key(
            "global_segment_size",
            Int(0),
            "bytes of the engine's memory lent to the store (objects put there vanish with the "
            "engine; `0` lends none)",
            1 << 30,
            default_words="1 GiB",
        ),
        Key(
            "local_buffer_size",
            Int(0),
            "bytes of the client's own transfer buffer",
            64 << 20,
            default_words="64 MiB",
        ),
        _ENABLE_KV_EVENTS,
        Key("locality", Choice(LOCALITIES, fold_case=True), "reported in KV events", "REMOTE"),
        Key(
            "auth_key_file",
            _AUTH_KEY_FILE,
            "a file holding the secret every engine of the store shares: each object then "
            "carries a MAC over its header and payload, and only objects with a valid MAC are "
            "loaded; without it every client of the master is trusted",
            allowed_words=_AUTH_KEY_FILE_WORDS,
            default_words="none",
        ),
    ),
    error=ConfigError,
)


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
        sync_load_budget_bytes: KV bytes per step a worker loads before the step's
            forward pass (0: every load waits a step).
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
    sync_load_budget_bytes: int = 0


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
    roots = [os.path.realpath(t.root_dir) for t in tiers if isinstance(t, FsTierConfig)]
    if len(set(roots)) != len(roots):
        raise ConfigError(f"secondary_tiers: two fs tiers share one root_dir ({roots})")
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
    )


def parse_tier(
    raw: Any, where: str, *, check_paths: bool = True
) -> FsTierConfig | MooncakeTierConfig:
    """Validate one ``secondary_tiers`` entry by its ``type``; ``where`` names it in
    errors."""
    if _tier_type(raw, where) == "mooncake":
        return parse_mooncake_tier(raw, where, check_paths=check_paths)
    return parse_fs_tier(raw, where, check_paths=check_paths)


def _tier_type(raw: Any, where: str) -> str:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a dict with a 'type' key, got {raw!r}")
    kind = raw.get("type")
    if kind not in TIER_TYPES:
        raise ConfigError(
            f"{where}.type must be one of {', '.join(TIER_TYPES)} (kvtier's tiers), got {kind!r}"
        )
    return str(kind)


def _entry(schema: Schema, raw: Mapping[str, Any], where: str, tier: str) -> dict[str, Any]:
    unknown = schema.unknown(raw)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown} for {tier} tier; allowed: "
            f"{', '.join(k.name for k in schema.keys)}"
        )
    return schema.parse(raw, where)


def parse_fs_tier(raw: Any, where: str, *, check_paths: bool = True) -> FsTierConfig:
    """Validate one ``{"type": "fs", ...}`` entry; ``where`` names it in errors."""
    _tier_type(raw, where)
    values = _entry(FS_TIER_SCHEMA, raw, where, "an fs")
    cfg = FsTierConfig(
        root_dir=os.path.abspath(os.path.expanduser(values["root_dir"])),
        n_read_threads=values["n_read_threads"],
        n_write_threads=values["n_write_threads"],
        capacity_bytes=values["capacity_bytes"],
        eviction_policy=values["eviction_policy"],
        enable_kv_events=values["enable_kv_events"],
        locality=values["locality"],
        auth_key_file=_auth_key_file(values["auth_key_file"], where, check_paths=check_paths),
    )
    if check_paths:
        check_directory(cfg.root_dir, f"{where}.root_dir")
    return cfg


def _auth_key_file(value: str | None, where: str, *, check_paths: bool) -> str | None:
    """The validated ``auth_key_file`` of a tier entry (an absolute path), or None.
    With ``check_paths`` the file is read and checked as the tier will (see
    ``kvtier.tiering_spec.auth.load_auth_key``); the key itself is not kept here."""
    if value is None:
        return None
    path = os.path.abspath(os.path.expanduser(value))
    if check_paths:
        load_auth_key(path, f"{where}.auth_key_file")
    return path


def parse_mooncake_tier(
    raw: Mapping[str, Any], where: str, *, check_paths: bool = True
) -> MooncakeTierConfig:
    """Validate one ``{"type": "mooncake", ...}`` entry; ``where`` names it in errors.
    ``check_paths`` reads and checks the ``auth_key_file``, if any."""
    values = _entry(MOONCAKE_TIER_SCHEMA, {"type": "mooncake", **raw}, where, "a mooncake")
    device = values["device_name"]
    if values["protocol"] == "rdma" and not device.strip():
        raise ConfigError(
            f"{where}.device_name must be a string naming the RDMA device(s) (for example "
            f"'mlx5_0'); required with protocol 'rdma', got {device!r}"
        )
    return MooncakeTierConfig(
        master_server_address=values["master_server_address"],
        metadata_server=values["metadata_server"],
        protocol=values["protocol"],
        local_hostname=values["local_hostname"].strip() or socket.gethostname(),
        global_segment_size=values["global_segment_size"],
        local_buffer_size=values["local_buffer_size"],
        device_name=device.strip(),
        enable_kv_events=values["enable_kv_events"],
        locality=values["locality"],
        auth_key_file=_auth_key_file(values["auth_key_file"], where, check_paths=check_paths),
    )


def check_directory(path: str, key: str) -> None:
    """Create ``path`` and its missing parents (mode 0700) and check it is a writable
    directory of this user that no other user can change (see ``tiers.fs.dirs``)."""
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
