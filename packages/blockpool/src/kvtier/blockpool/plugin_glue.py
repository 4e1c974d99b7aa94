"""What kvtier's two vLLM plugins share: the version gate, environment switches and
registry claims, so both follow one convention.

Nothing here imports vLLM: a plugin passes vLLM's version string and registry objects
in. The convention:

* **Version gate.** A plugin supports the vLLM range its distribution declares as the
  ``vllm`` extra (``pip install kvtier-...[vllm]``), read from the installed metadata,
  so the range is written once. A vLLM outside it gets one log line and no
  registration. Local builds (``0.32.0+cpu``) and pre-releases of a supported minor
  release count as that release.
* **Environment switches** are ``KVTIER_...`` variables read with :func:`env_switch`:
  ``1/true/yes/on`` or ``0/false/no/off``; anything else is one warning and the default.
* **Registry claims.** A name in a vLLM factory registry is claimed with
  :func:`claim_name` (a registry entry that loads kvtier's class is marked, so it is
  recognised later), and :func:`guard_registrations` keeps a claimed name when another
  plugin registers it afterwards: that plugin's registration is skipped with one log
  line instead of raising (vLLM's factories raise on a duplicate name, and an exception
  in a general plugin stops vLLM).

The version gate needs ``packaging``, which the vLLM-facing packages declare.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

# ``packaging`` is imported where the version gate runs: the vLLM-facing packages
# depend on it, kvtier-blockpool itself needs torch only.

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def declared_vllm_range(distribution: str) -> SpecifierSet | None:
    """The version range of ``vllm`` in the ``vllm`` extra of an installed distribution,
    or None when the distribution is not installed or declares none."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirements = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name == "vllm" and req.marker is not None and req.marker.evaluate({"extra": "vllm"}):
            return req.specifier
    return None


def vllm_supported(version: str, supported: SpecifierSet) -> bool:
    """Whether vLLM ``version`` (e.g. ``0.32.0+cpu``, ``0.33.0rc1``) is in ``supported``,
    comparing its release numbers only."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(Version(version).base_version)
    except InvalidVersion:
        return False
    return supported.contains(release, prereleases=True)


def version_gate(distribution: str, vllm_version: str, log: logging.Logger) -> bool:
    """True when ``vllm_version`` is in the range ``distribution`` declares; else one
    warning naming the distribution, the version and the range."""
    supported = declared_vllm_range(distribution)
    if supported is None:
        log.warning(
            "%s: cannot read the supported vLLM range from its metadata (is it installed "
            "with pip?); not registered",
            distribution,
        )
        return False
    if not vllm_supported(vllm_version, supported):
        log.warning(
            "%s supports vLLM %s; this is vLLM %s, so nothing is registered",
            distribution,
            supported,
            vllm_version or "(unknown version)",
        )
        return False
    return True


def env_switch(
    name: str,
    default: bool,
    log: logging.Logger,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """A ``KVTIER_...`` on/off switch: ``1/true/yes/on`` or ``0/false/no/off`` (any case);
    unset or empty gives ``default``; any other value is one warning and ``default``."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    log.warning(
        "kvtier: %s=%r is not a switch (use 1 or 0); using the default, %d", name, raw, default
    )
    return default


def kvtier_loader(module: str, attribute: str) -> Callable[[], type]:
    """A registry entry as vLLM's factories keep them (a callable returning the class),
    marked as kvtier's."""

    def load() -> type:
        cls: type = getattr(importlib.import_module(module), attribute)
        return cls

    load.kvtier = True  # type: ignore[attr-defined]
    return load


def is_kvtier_entry(entry: Any) -> bool:
    """Whether a registry entry was made by :func:`kvtier_loader`."""
    return bool(getattr(entry, "kvtier", False))


def claim_name(
    registry: MutableMapping[str, Any], name: str, loader: Callable[[], type], *, take: bool
) -> str:
    """Point ``registry[name]`` at kvtier's class when ``take``; never raises.

    Returns what happened: ``"registered"`` (the name was free), ``"replaced"`` (another
    plugin's entry was replaced), ``"kept"`` (already kvtier's), or, when not ``take``,
    ``"left"`` (another's entry, or none, left as it is).
    """
    current = registry.get(name)
    if is_kvtier_entry(current):
        return "kept"
    if not take:
        return "left"
    registry[name] = loader
    return "replaced" if current is not None else "registered"


def guard_registrations(
    factory: Any,
    method: str,
    registry: Mapping[str, Any],
    claimed: set[str],
    log: logging.Logger,
    switch: str,
) -> None:
    """Make ``factory.<method>(name, module_path, class_name)`` skip a name in ``claimed``
    while the registry entry is kvtier's (one info line naming ``switch``), instead of
    raising on the duplicate. Idempotent; other names pass through unchanged."""
    original = getattr(factory, method)
    guarded: set[str] | None = getattr(original, "kvtier_claimed", None)
    if guarded is not None:
        guarded.update(claimed)
        return
    names = set(claimed)

    def register(name: str, module_path: str, class_name: str) -> Any:
        if name in names and is_kvtier_entry(registry.get(name)):
            log.info(
                "kvtier: %s.%s from %s not registered: %s is kvtier's (set %s=0 to leave "
                "the name to other plugins)",
                module_path,
                class_name,
                getattr(factory, "__name__", "registry"),
                name,
                switch,
            )
            return None
        return original(name, module_path, class_name)

    register.kvtier_claimed = names  # type: ignore[attr-defined]
    setattr(factory, method, staticmethod(register))
