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
  leaves vLLM's names alone everywhere. A plugin that registers those names after
  kvtier took them is skipped with one log line.

The connector name ``OffloadingConnector`` resolves to
:class:`kvtier.tiering_spec.connector.OffloadingConnector`: vLLM's connector, which
with a kvtier spec recomputes a failed transfer instead of failing vLLM's assertion,
and, on releases whose offloading specs cannot declare metrics (0.23 up to the
interfaces of 0.32), also reports the metrics of kvtier's manager. With any other
spec it is vLLM's connector.

It follows kvtier's plugin convention (:mod:`kvtier.blockpool.plugin_glue`): the
supported vLLM range is this distribution's ``vllm`` extra.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("kvtier.tiering_spec")

DISTRIBUTION = "kvtier-tiering-spec"
MODULE = "kvtier.tiering_spec.vllm_adapter"
UPSTREAM_NAMES = ("CPUOffloadingSpec", "TieringOffloadingSpec")
KVTIER_NAMES = {
    "KvtierCPUOffloadingSpec": "CPUOffloadingSpec",
    "KvtierTieringOffloadingSpec": "TieringOffloadingSpec",
}
ENV_OVERRIDE = "KVTIER_OVERRIDE_UPSTREAM_SPECS"
CONNECTOR = "OffloadingConnector"

_state: dict[str, Any] = {"done": False, "overridden": False}


def should_override(platform: Any, env: str | None) -> bool:
    """Whether the upstream names should resolve to kvtier on ``platform`` (``env``: the
    value of ``KVTIER_OVERRIDE_UPSTREAM_SPECS``, or None when unset)."""
    from kvtier.blockpool.plugin_glue import env_switch

    try:
        upstream_runs = bool(platform.is_cuda_alike() or platform.is_xpu())
    except Exception:
        upstream_runs = False
    environ = {} if env is None else {ENV_OVERRIDE: env}
    return env_switch(ENV_OVERRIDE, not upstream_runs, logger, environ)


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
    import os

    import vllm

    from kvtier.blockpool.plugin_glue import (
        claim_name,
        guard_registrations,
        kvtier_loader,
        version_gate,
    )

    version = str(getattr(vllm, "__version__", ""))
    if not version_gate(DISTRIBUTION, version, logger):
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
        claim_name(registry, name, kvtier_loader(MODULE, cls), take=True)
    from kvtier.tiering_spec import vllm_compat

    _claim_connector(version, vllm_compat.SPEC_METRICS)
    from vllm.platforms import current_platform

    if should_override(current_platform, os.environ.get(ENV_OVERRIDE)):
        for name in UPSTREAM_NAMES:
            claim_name(registry, name, kvtier_loader(MODULE, name), take=True)
        guard_registrations(
            OffloadingSpecFactory, "register_spec", registry, set(UPSTREAM_NAMES), logger,
            ENV_OVERRIDE,
        )  # fmt: skip
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


def _claim_connector(version: str, spec_metrics: bool) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtier.blockpool.plugin_glue import claim_name, kvtier_loader

    registry = getattr(KVConnectorFactory, "_registry", None)
    if not isinstance(registry, dict):
        logger.warning("kvtier-tiering-spec: vLLM %s has no connector registry", version)
        return
    loader = kvtier_loader("kvtier.tiering_spec.connector", CONNECTOR)
    outcome = claim_name(registry, CONNECTOR, loader, take=True)
    logger.info(
        "kvtier-tiering-spec: vLLM %s: %s is vLLM's connector that, with a kvtier spec, "
        "recomputes failed transfers%s (%s)",
        version,
        CONNECTOR,
        "" if spec_metrics else " and reports kvtier's metrics",
        outcome,
    )


def overridden() -> bool:
    """Whether this process's ``register()`` pointed the upstream names at kvtier."""
    return bool(_state["overridden"])
