"""vLLM general plugin: kvtier's spec and connector names, and the guides' names where
vLLM's own classes cannot run.

vLLM loads every ``vllm.general_plugins`` entry point in every process, and an
exception there kills the process, so :func:`register` never raises. It is
idempotent and imports vLLM only inside the function.

vLLM's ``OffloadingSpecFactory.get_spec_cls`` looks ``spec_name`` up in its registry
first and uses ``spec_module_path`` only for names not registered. kvtier:

* always registers ``KvtierCPUOffloadingSpec``, ``KvtierTieringOffloadingSpec`` and
  the connector ``KvtierOffloadingConnector``
  (:class:`kvtier.tiering_spec.connector.OffloadingConnector`: vLLM's connector,
  which with a kvtier spec recomputes a failed transfer instead of failing vLLM's
  assertion and, on releases whose offloading specs cannot declare metrics, also
  reports the metrics of kvtier's manager; with any other spec it is vLLM's);
* answers the upstream names ``CPUOffloadingSpec``, ``TieringOffloadingSpec`` and
  ``OffloadingConnector`` where vLLM's own specs refuse to run (anything but CUDA,
  ROCm and XPU: Ascend NPU, vLLM's CPU platform), so the guides' configurations work
  unchanged there. ``KVTIER_UPSTREAM_NAMES=1`` answers them everywhere, ``=0``
  nowhere (``KVTIER_OVERRIDE_UPSTREAM_SPECS``, its earlier name, still counts).

Names are registered through the factories' own ``register_...`` methods; an upstream
name is replaced the way vllm-ascend replaces vLLM's (its entry removed, then
registered). vLLM's factories are never patched. The convention is
:mod:`kvtier.vllm_port.plugins`: the supported vLLM range is this distribution's
``vllm`` extra.
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
# This plugin's switch before KVTIER_UPSTREAM_NAMES (deprecated).
OLD_SWITCH = "KVTIER_OVERRIDE_UPSTREAM_SPECS"
CONNECTOR = "OffloadingConnector"
CONNECTOR_ALIAS = "KvtierOffloadingConnector"
CONNECTOR_MODULE = "kvtier.tiering_spec.connector"

_state: dict[str, Any] = {"done": False, "overridden": False}


def should_override(platform: Any, environ: dict[str, str] | None = None) -> bool:
    """Whether the upstream names should resolve to kvtier on ``platform`` (``environ``:
    the switches, or None for this process's environment)."""
    from kvtier.vllm_port.plugins import upstream_names

    try:
        upstream_runs = bool(platform.is_cuda_alike() or platform.is_xpu())
    except Exception:
        upstream_runs = False
    return upstream_names(not upstream_runs, logger, deprecated=OLD_SWITCH, environ=environ)


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

    from kvtier.vllm_port.plugins import UPSTREAM_SWITCH, register_name, version_gate

    version = str(getattr(vllm, "__version__", ""))
    if not version_gate(DISTRIBUTION, version, logger):
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.platforms import current_platform
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvtier.vllm_port.port import select

    port = select()  # the one vLLM interface generation this process speaks

    for name, cls in KVTIER_NAMES.items():
        register_name(OffloadingSpecFactory, "register_spec", name, MODULE, cls, take=True)
    register_name(
        KVConnectorFactory, "register_connector", CONNECTOR_ALIAS, CONNECTOR_MODULE, CONNECTOR,
        take=True,
    )  # fmt: skip
    take = should_override(current_platform)
    for name in UPSTREAM_NAMES:
        register_name(OffloadingSpecFactory, "register_spec", name, MODULE, name, take=take)
    outcome = register_name(
        KVConnectorFactory, "register_connector", CONNECTOR, CONNECTOR_MODULE, CONNECTOR,
        take=take,
    )  # fmt: skip
    _state["overridden"] = take
    platform = getattr(current_platform, "device_type", "?") or "?"
    if take:
        logger.info(
            "kvtier-tiering-spec: on this %s platform %s and %s resolve to kvtier's (%s), "
            "as do the Kvtier... names; vLLM %s%s",
            platform,
            ", ".join(UPSTREAM_NAMES),
            CONNECTOR,
            outcome,
            version,
            "" if port.spec_metrics else ": the connector reports kvtier's metrics",
        )
    else:
        logger.info(
            "kvtier-tiering-spec: registered KvtierCPUOffloadingSpec, "
            "KvtierTieringOffloadingSpec and %s; vLLM's own %s and %s kept on this %s "
            "platform (%s=1 answers them with kvtier's)",
            CONNECTOR_ALIAS,
            ", ".join(UPSTREAM_NAMES),
            CONNECTOR,
            platform,
            UPSTREAM_SWITCH,
        )


def overridden() -> bool:
    """Whether this process's ``register()`` pointed the upstream names at kvtier."""
    return bool(_state["overridden"])
