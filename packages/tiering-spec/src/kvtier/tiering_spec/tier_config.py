"""What a secondary tier type declares, and how one ``secondary_tiers`` entry is checked.

A tier type is a :class:`TierType`: its schema (the keys, written once:
:func:`tier_schema`), its config type generated from that schema (a subclass of
:class:`TierConfig`, a frozen dataclass whose attributes are the keys), what it checks
across keys once they are parsed, and its builder, which makes the tier on the
:class:`TierSite` the engine offers. The registry (``tiers.registry``) keeps them by
``type``; the keys several tier types share (``enable_kv_events``, ``locality``,
``auth_key_file``) and the checks behind them are here.

Plain Python, no vLLM import, and no import of the tiers: every tier's folder and the
registry import this module.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvtier.tiering_spec.auth import load_auth_key
from kvtier.tiering_spec.errors import ConfigError
from kvtier.tiering_spec.private_dirs import make_private_dirs
from kvtier.vllm_port.schema import REQUIRED, Bool, Choice, Int, Key, Kind, Schema, Text

LOCALITIES = ("LOCAL", "REMOTE")

ENABLE_KV_EVENTS = Key(
    "enable_kv_events", Bool(), "publish KV events for this tier (when KV events are on)", True
)

_AUTH_KEY_FILE_WORDS = (
    "path of a regular file of this user, not a symlink, mode 0600 (no group or other "
    "bits), ≥ 32 bytes (e.g. `head -c 64 /dev/urandom > FILE; chmod 600 FILE`)"
)


def locality_key(default: str) -> Key:
    """The ``locality`` key (``LOCAL`` or ``REMOTE``, any case), reported in KV events and
    matched by a request's ``kv_load_tiers``."""
    return Key(
        "locality",
        Choice(LOCALITIES, fold_case=True),
        "reported in KV events; matched by a request's `kv_load_tiers`",
        default,
    )


def auth_key_file_key(meaning: str) -> Key:
    """The ``auth_key_file`` key: a file of this user, mode 0600, holding the secret every
    engine of the tier shares (checked by :func:`auth_key_file_path`)."""
    return Key(
        "auth_key_file",
        Text(
            words="the path (string) of a file of this user, mode 0600, holding the secret "
            "shared by every engine of the tier"
        ),
        meaning,
        allowed_words=_AUTH_KEY_FILE_WORDS,
        default_words="none",
    )


def shared_keys(locality: str, auth_meaning: str) -> tuple[Key, Key, Key]:
    """The keys kvtier's own tiers share, in their tables' order: ``enable_kv_events``,
    ``locality`` (default ``locality``) and ``auth_key_file`` (meaning ``auth_meaning``)."""
    return ENABLE_KV_EVENTS, locality_key(locality), auth_key_file_key(auth_meaning)


def tier_schema(type_name: str, keys: Sequence[Key]) -> Schema:
    """The schema of one ``{"type": type_name, ...}`` entry: its ``type`` key, then
    ``keys``. Its README table is marked ``<!-- schema:TYPE-tier -->``."""
    type_key = Key("type", Choice((type_name,)), "tier type", REQUIRED)
    return Schema(f"{type_name}-tier", (type_key, *keys), error=ConfigError)


def _annotation(key: Key) -> str:
    kinds: dict[type[Kind], str] = {Int: "int", Bool: "bool", Choice: "str", Text: "str"}
    name = kinds.get(type(key.kind), "Any")
    return f"{name} | None" if key.default is None else name


class TierConfig:
    """The validated settings of one ``secondary_tiers`` entry; a tier type's config type
    is a subclass that names its schema, and is generated from it::

        class MemoryTierConfig(TierConfig, schema=MEMORY_SCHEMA):
            pass  # a docstring that says what the tier is

    The subclass becomes a frozen dataclass with one keyword-only attribute per key, in
    the schema's order: a required key is a required argument (``type`` excepted: it
    defaults to the tier's type), any other defaults to the key's default.
    """

    schema: ClassVar[Schema]
    type: str
    # What the engine reads of every tier's config, for a schema without these keys:
    # no KV events of its own, reported as a local tier.
    enable_kv_events: bool = False
    locality: str = "LOCAL"

    if TYPE_CHECKING:  # the attributes are made from the schema, at run time

        def __init__(self, **values: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...

    def __init_subclass__(cls, *, schema: Schema, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.schema = schema
        type_key = next((k for k in schema.keys if k.name == "type"), None)
        if type_key is None or not isinstance(type_key.kind, Choice):
            raise TypeError(f"schema {schema.name} has no 'type' key (see tier_schema)")
        annotations: dict[str, Any] = {}
        for key in schema.keys:
            annotations[key.name] = _annotation(key)
            if key.name == "type":
                setattr(cls, key.name, type_key.kind.values[0])
            elif key.default is not REQUIRED:
                setattr(cls, key.name, key.default)
        cls.__annotations__ = annotations
        dataclass(frozen=True, kw_only=True)(cls)


TierBuilder = Callable[[Any, str, str, bool, "TierSite"], Any]
"""Makes the tier of a validated entry: ``(cfg, where, name, events, site)`` to a
``SecondaryTier`` (``where`` names the entry in errors, ``name`` labels the tier in
metrics and logs, ``events``: whether it publishes KV events)."""

TierCheck = Callable[[dict[str, Any], str, bool], dict[str, Any]]
"""What a tier type checks once its keys are parsed: ``(values, where, check_paths)``
to the values its config is made of (paths made absolute, a directory created when
``check_paths``, what depends on several keys)."""


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


def _no_check(values: dict[str, Any], where: str, check_paths: bool) -> dict[str, Any]:
    return values


@dataclass(frozen=True)
class TierType:
    """One type of ``secondary_tiers`` entry, as the registry keeps it.

    Attributes:
        schema: its keys (:func:`tier_schema`); ``schema``'s ``type`` key names it.
        config: its config type (a :class:`TierConfig` subclass on ``schema``).
        builder: makes the tier of a validated entry.
        check: what it checks once the keys are parsed (none by default).
        described: the words errors name an entry of it by (``"an fs tier"``).
        own_dir: the key of a directory no two entries of this type may share, if any.
    """

    schema: Schema
    config: type[TierConfig]
    builder: TierBuilder
    check: TierCheck = _no_check
    described: str = ""
    own_dir: str | None = None

    @property
    def name(self) -> str:
        """The ``type`` of its entries."""
        return str(self.config.type)

    def parse(self, raw: Any, where: str, *, check_paths: bool = True) -> Any:
        """Validate one entry of this type (its ``type`` may be left out); ``where``
        names it in errors. Unknown keys are refused, naming the allowed ones."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} must be a dict with a 'type' key, got {raw!r}")
        raw = {"type": self.name, **raw}
        unknown = self.schema.unknown(raw)
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {unknown} for {self.described or f'a {self.name} tier'}"
                f"; allowed: {', '.join(k.name for k in self.schema.keys)}"
            )
        values = self.check(self.schema.parse(raw, where), where, check_paths)
        return self.config(**values)


def auth_key_file_path(value: str | None, where: str, *, check_paths: bool) -> str | None:
    """The validated ``auth_key_file`` of a tier entry (an absolute path), or None.
    With ``check_paths`` the file is read and checked as the tier will (see
    ``kvtier.tiering_spec.auth.load_auth_key``); the key itself is not kept here."""
    if value is None:
        return None
    path = os.path.abspath(os.path.expanduser(value))
    if check_paths:
        load_auth_key(path, f"{where}.auth_key_file")
    return path


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
