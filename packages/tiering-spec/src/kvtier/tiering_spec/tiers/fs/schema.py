"""The fs tier's configuration: its keys (written once, here), the config type made from
them (:class:`FsTierConfig`), what is checked across them, and its builder.

The builder imports the tier's module when called, so a configuration without an fs
tier never loads it.
"""

from __future__ import annotations

import os
from typing import Any

from kvtier.blockpool.policies import POLICIES
from kvtier.tiering_spec.tier_config import (
    TierConfig,
    TierSite,
    TierType,
    auth_key_file_path,
    check_directory,
    shared_keys,
    tier_schema,
)
from kvtier.vllm_port.schema import REQUIRED, Check, Choice, Int, Key, Text, accept

DEFAULT_IO_THREADS = 16  # vLLM's fs tier default, so a copied configuration behaves alike
MAX_IO_THREADS = 256

_VLLM_ONLY = (
    "vLLM's tiering key: accepted so that a configuration written for vLLM's fs tier "
    "starts, not needed by kvtier's"
)

# One {"type": "fs", ...} entry of secondary_tiers.
FS_TIER_SCHEMA = tier_schema(
    "fs",
    (
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
            Choice(tuple(POLICIES)),
            "which files go first when the tier is full: the host tier's policies, applied "
            "to the files. The tier counts as uses the blocks requests stored and those it "
            "served itself, not the host tier's hits, so a copy the host tier serves goes "
            "before a block the host tier has dropped",
            "frecency",
        ),
        *shared_keys(
            "LOCAL",
            "a file holding a secret shared by every engine of the folder: each file then "
            "carries a MAC over its header and payload, and only files with a valid MAC are "
            'loaded (others: a miss, `kind="unauthenticated"`, removed). For a shared '
            "filesystem where the uid does not prove who wrote a file (NFS without Kerberos "
            "trusts the uid a client asserts); files must still be this user's",
        ),
        Key("backpressure", Check(accept, "—"), _VLLM_ONLY),
        Key("module_path", Check(accept, "—"), _VLLM_ONLY),
    ),
)


class FsTierConfig(TierConfig, schema=FS_TIER_SCHEMA):
    """One ``{"type": "fs", ...}`` entry of ``secondary_tiers``: block files in a folder
    (``root_dir``, created 0700 if missing). The attributes are :data:`FS_TIER_SCHEMA`'s
    keys; ``capacity_bytes`` None: the tier sizes itself at start, ``auth_key_file``
    None: no MAC."""


def _check(values: dict[str, Any], where: str, check_paths: bool) -> dict[str, Any]:
    """``root_dir`` and ``auth_key_file`` made absolute and, with ``check_paths``, the key
    file read and the folder created and probed, as the tier will use them."""
    root_dir = os.path.abspath(os.path.expanduser(values["root_dir"]))
    auth = auth_key_file_path(values["auth_key_file"], where, check_paths=check_paths)
    if check_paths:
        check_directory(root_dir, f"{where}.root_dir")
    return {**values, "root_dir": root_dir, "auth_key_file": auth}


def _build(cfg: FsTierConfig, where: str, name: str, events: bool, site: TierSite) -> Any:
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


FS_TIER = TierType(
    FS_TIER_SCHEMA, FsTierConfig, _build, _check, described="an fs tier", own_dir="root_dir"
)


def parse_fs_tier(raw: Any, where: str, *, check_paths: bool = True) -> FsTierConfig:
    """Validate one ``{"type": "fs", ...}`` entry; ``where`` names it in errors.
    ``check_paths`` creates and probes ``root_dir`` and reads the ``auth_key_file``."""
    cfg: FsTierConfig = FS_TIER.parse(raw, where, check_paths=check_paths)
    return cfg
