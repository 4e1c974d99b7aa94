"""vLLM general plugin: make the upstream spec names resolve to kvtier's specs.

vLLM loads every ``vllm.general_plugins`` entry point in every process, and an
exception there kills the process, so :func:`register` never raises. It is
idempotent and imports vLLM only inside the function.

vLLM's ``OffloadingSpecFactory.get_spec_cls`` looks ``spec_name`` up in its registry
first and uses ``spec_module_path`` only for names not registered, and
``register_spec`` refuses a name that exists. So kvtier:

* always registers ``KvtierCPUOffloadingSpec`` and ``KvtierTieringOffloadingSpec``;
* replaces the registry entries ``CPUOffloadingSpec`` and ``TieringOffloadingSpec``
  on platforms where vLLM's own specs refuse to run (anything but CUDA, ROCm and
  XPU: Ascend NPU, vLLM's CPU platform), and on CUDA/ROCm/XPU only when
  ``KVTIER_OVERRIDE_UPSTREAM_SPECS=1``. ``KVTIER_OVERRIDE_UPSTREAM_SPECS=0``
  leaves vLLM's names alone everywhere.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("kvtier.tiering_spec")

MODULE = "kvtier.tiering_spec.vllm_adapter"
UPSTREAM_NAMES = ("CPUOffloadingSpec", "TieringOffloadingSpec")
KVTIER_NAMES = {
    "KvtierCPUOffloadingSpec": "CPUOffloadingSpec",
    "KvtierTieringOffloadingSpec": "TieringOffloadingSpec",
}
SUPPORTED = ((0, 32), (0, 33))  # [min, max) of vLLM's (major, minor)
ENV_OVERRIDE = "KVTIER_OVERRIDE_UPSTREAM_SPECS"

_state: dict[str, Any] = {"done": False, "overridden": False}


def _loader(class_name: str) -> Callable[[], type]:
    def load() -> type:
        cls: type = getattr(importlib.import_module(MODULE), class_name)
        return cls

    load.kvtier = True  # type: ignore[attr-defined]
    return load


def parse_version(text: str) -> tuple[int, int] | None:
    parts = text.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "x")
    except (IndexError, ValueError):
        return None


def should_override(platform: Any, env: str | None) -> bool:
    """Whether the upstream names should resolve to kvtier on ``platform``."""
    if env is not None and env.strip() in ("0", "false", "False", "no"):
        return False
    if env is not None and env.strip() in ("1", "true", "True", "yes"):
        return True
    try:
        upstream_runs = bool(platform.is_cuda_alike() or platform.is_xpu())
    except Exception:
        upstream_runs = False
    return not upstream_runs


def register() -> None:
    """Entry point of ``vllm.general_plugins``. Idempotent; never raises."""
    if _state["done"]:
        return
    try:
        _register()
    except Exception as exc:  # a general plugin must never take vLLM down
        logger.warning("kvtier-tiering-spec: not registered (%s: %s)", type(exc).__name__, exc)
    _state["done"] = True


def _register() -> None:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    parsed = parse_version(str(version))
    if parsed is None or not (SUPPORTED[0] <= parsed < SUPPORTED[1]):
        logger.warning(
            "kvtier-tiering-spec supports vLLM 0.32.x; this is vLLM %s, so kvtier's specs are "
            "not registered (vLLM's own spec names are unchanged)",
            version,
        )
        return
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    registry = getattr(OffloadingSpecFactory, "_registry", None)
    if not isinstance(registry, dict):
        logger.warning(
            "kvtier-tiering-spec: vLLM %s has no OffloadingSpecFactory registry; not registered",
            version,
        )
        return
    for name, cls in KVTIER_NAMES.items():
        if name not in registry:
            OffloadingSpecFactory.register_spec(name, MODULE, cls)
    from vllm.platforms import current_platform

    env = os.environ.get(ENV_OVERRIDE)
    if should_override(current_platform, env):
        for name in UPSTREAM_NAMES:
            registry[name] = _loader(name)
        _state["overridden"] = True
        logger.info(
            "kvtier-tiering-spec: spec names %s resolve to kvtier's implementations on this "
            "%s platform",
            ", ".join(UPSTREAM_NAMES),
            getattr(current_platform, "device_type", "?") or "?",
        )
    else:
        logger.info(
            "kvtier-tiering-spec: registered KvtierCPUOffloadingSpec, KvtierTieringOffloadingSpec; "
            "vLLM's own CPUOffloadingSpec/TieringOffloadingSpec kept (set %s=1 to use kvtier's)",
            ENV_OVERRIDE,
        )


def overridden() -> bool:
    """Whether this process's ``register()`` pointed the upstream names at kvtier."""
    return bool(_state["overridden"])
