"""The convention both of kvtier's vLLM plugins follow.

Nothing here imports vLLM: a plugin passes vLLM's version string and factory classes in.

* **Version gate.** A plugin supports the vLLM range its distribution declares as the
  ``vllm`` extra (``pip install kvtier-...[vllm]``), read from the installed metadata,
  so the range is written once. A vLLM outside it gets one log line and no
  registration. Local builds (``0.32.0+cpu``) and pre-releases of a supported minor
  release count as that release.
* **Switches** are ``KVTIER_...`` variables read with :func:`env_switch`:
  ``1/true/yes/on`` or ``0/false/no/off``; anything else is one warning and the default.
* **Upstream names.** kvtier always registers its own names (``Kvtier...``). It answers
  the names of the guides (``CPUOffloadingSpec``, ``TieringOffloadingSpec``,
  ``OffloadingConnector``, ``RecomputeCPUOffloadConnector``) only where nothing else
  provides a working class under them, and one switch, :data:`UPSTREAM_SWITCH`, turns
  that on (``1``) or off (``0``) everywhere (:func:`upstream_names`).
* **Manners.** A name is registered through the factory's own ``register_...`` method
  (:func:`register_name`). An upstream name another plugin registered before kvtier is
  replaced the way vllm-ascend replaces vLLM's own names (the entry is removed, then
  registered); a name a plugin still to run will register is never taken, because vLLM
  stops on a duplicate registration. A vLLM factory is never patched.

The version gate needs ``packaging``, this package's one dependency.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")

UPSTREAM_SWITCH = "KVTIER_UPSTREAM_NAMES"

# What each registration did (the values :func:`register_name` returns).
REGISTERED = "registered"  # the name was free
REPLACED = "replaced"  # another plugin's entry was replaced
KEPT = "kept"  # already kvtier's
LEFT = "left"  # not taken: another's entry, or none, left as it is

# (factory, name) -> the registry entry kvtier's registration made, to recognise it.
_OURS: dict[tuple[int, str], Any] = {}
_WARNED: set[str] = set()


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


def upstream_names(
    default: bool,
    log: logging.Logger,
    *,
    deprecated: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Whether kvtier answers the guides' upstream names in this process.

    :data:`UPSTREAM_SWITCH` decides when set; else ``deprecated`` (a plugin's switch of
    an earlier release, honoured with one warning naming the new one); else ``default``
    (the plugin's answer to "does anything else provide a working class here?").
    """
    env = os.environ if environ is None else environ
    if (env.get(UPSTREAM_SWITCH) or "").strip():
        return env_switch(UPSTREAM_SWITCH, default, log, env)
    if deprecated is not None and (env.get(deprecated) or "").strip():
        if deprecated not in _WARNED:
            _WARNED.add(deprecated)
            log.warning(
                "kvtier: %s is deprecated and will be removed in the release after next; "
                "use %s (same values)",
                deprecated,
                UPSTREAM_SWITCH,
            )
        return env_switch(deprecated, default, log, env)
    return default


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def registry_of(factory: Any) -> dict[str, Any]:
    """The name registry of one of vLLM's factories (``KVConnectorFactory``,
    ``OffloadingSpecFactory``): read here only, never assigned to."""
    registry = getattr(factory, "_registry", None)
    if not isinstance(registry, dict):
        raise TypeError(f"{getattr(factory, '__name__', factory)!r} has no name registry")
    return registry


def is_registered(factory: Any, name: str) -> bool:
    return name in registry_of(factory)


def is_ours(factory: Any, name: str) -> bool:
    """Whether ``factory``'s entry for ``name`` is the one kvtier registered."""
    entry = registry_of(factory).get(name)
    return entry is not None and _OURS.get((id(factory), name)) is entry


def register_name(
    factory: Any,
    method: str,
    name: str,
    module_path: str,
    class_name: str,
    *,
    take: bool,
) -> str:
    """Register ``module_path.class_name`` as ``name`` with ``factory.<method>`` (vLLM's
    ``register_connector`` or ``register_spec``) when ``take``; never patches ``factory``.

    Returns :data:`REGISTERED`, :data:`REPLACED` (another entry was there: it is removed
    first, as vllm-ascend replaces vLLM's names), :data:`KEPT` or :data:`LEFT`.
    """
    registry = registry_of(factory)
    if is_ours(factory, name):
        return KEPT
    if not take:
        return LEFT
    outcome = REGISTERED
    if name in registry:
        registry.pop(name)
        outcome = REPLACED
    getattr(factory, method)(name, module_path, class_name)
    _OURS[(id(factory), name)] = registry.get(name)
    return outcome
