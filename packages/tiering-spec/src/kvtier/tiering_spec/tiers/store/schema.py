"""The Mooncake Store tier's configuration: its keys (written once, here), the config type
made from them (:class:`MooncakeTierConfig`), what is checked across them, and its
builder, with the connection to a Mooncake Store that the builder hands the tier.

The builder imports the tier's module when called, and Mooncake's client when the tier
connects (it fails at start-up, naming the package, where the client is missing), so a
configuration without a store tier needs neither.
"""

from __future__ import annotations

import importlib
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from kvtier.tiering_spec.auth import load_auth_key
from kvtier.tiering_spec.errors import ConfigError
from kvtier.tiering_spec.tier_config import (
    TierConfig,
    TierSite,
    TierType,
    auth_key_file_path,
    shared_keys,
    tier_schema,
)
from kvtier.vllm_port.schema import REQUIRED, Check, Choice, Int, Key, Text

if TYPE_CHECKING:
    from kvtier.tiering_spec.tiers.store.tier import StoreClient

MOONCAKE_PROTOCOLS = ("tcp", "rdma")


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


# One {"type": "mooncake", ...} entry of secondary_tiers.
MOONCAKE_TIER_SCHEMA = tier_schema(
    "mooncake",
    (
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
        *shared_keys(
            "REMOTE",
            "a file holding the secret every engine of the store shares: each object then "
            "carries a MAC over its header and payload, and only objects with a valid MAC are "
            "loaded; without it every client of the master is trusted",
        ),
    ),
)


class MooncakeTierConfig(TierConfig, schema=MOONCAKE_TIER_SCHEMA):
    """One ``{"type": "mooncake", ...}`` entry of ``secondary_tiers``: a Mooncake Store
    that engines on many machines share. The attributes are
    :data:`MOONCAKE_TIER_SCHEMA`'s keys; ``local_hostname`` is this machine's name when
    not given, ``auth_key_file`` None: every client of the master is trusted."""


def _check(values: dict[str, Any], where: str, check_paths: bool) -> dict[str, Any]:
    """``device_name`` required with ``rdma``, the host name filled in, and the
    ``auth_key_file`` made absolute (and, with ``check_paths``, read and checked)."""
    device = values["device_name"]
    if values["protocol"] == "rdma" and not device.strip():
        raise ConfigError(
            f"{where}.device_name must be a string naming the RDMA device(s) (for example "
            f"'mlx5_0'); required with protocol 'rdma', got {device!r}"
        )
    return {
        **values,
        "local_hostname": values["local_hostname"].strip() or socket.gethostname(),
        "device_name": device.strip(),
        "auth_key_file": auth_key_file_path(
            values["auth_key_file"], where, check_paths=check_paths
        ),
    }


def _build(cfg: MooncakeTierConfig, where: str, name: str, events: bool, site: TierSite) -> Any:
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


MOONCAKE_TIER = TierType(
    MOONCAKE_TIER_SCHEMA, MooncakeTierConfig, _build, _check, described="a mooncake tier"
)


def parse_mooncake_tier(raw: Any, where: str, *, check_paths: bool = True) -> MooncakeTierConfig:
    """Validate one ``{"type": "mooncake", ...}`` entry; ``where`` names it in errors.
    ``check_paths`` reads and checks the ``auth_key_file``, if any."""
    cfg: MooncakeTierConfig = MOONCAKE_TIER.parse(raw, where, check_paths=check_paths)
    return cfg


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
