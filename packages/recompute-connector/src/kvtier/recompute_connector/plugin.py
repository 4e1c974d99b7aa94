"""vLLM plugin entry point (group ``vllm.general_plugins``): registers the connector.

vLLM calls :func:`register` in every one of its processes. It must never raise (an
exception in a general plugin stops vLLM), must be idempotent, and imports vLLM only
inside the function. It follows kvtier's plugin convention
(:mod:`kvtier.vllm_port.plugins`):

* the supported vLLM range is the ``vllm`` extra of this distribution;
* ``KvtierRecomputeCPUOffloadConnector`` is always kvtier's connector;
* the guide's name ``RecomputeCPUOffloadConnector`` is kvtier's too where nothing else
  provides a connector under it. vllm-ascend registers its own under that name, so
  where vllm-ascend is installed the name is left to it; ``KVTIER_UPSTREAM_NAMES=1``
  takes it (replacing vllm-ascend's entry when vllm-ascend registered first; when
  vllm-ascend's plugin is still to run, vLLM would stop on its duplicate registration,
  so the name is left and one warning says so), ``=0`` leaves it everywhere.
  ``KVTIER_OVERRIDE_RECOMPUTE_CONNECTOR``, this switch's earlier name, still counts.

vLLM's factory is used through ``register_connector`` only; it is never patched.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm.kvtier.recompute_connector")

DISTRIBUTION = "kvtier-recompute-connector"
CONNECTOR_NAME = "RecomputeCPUOffloadConnector"
ALIAS = "KvtierRecomputeCPUOffloadConnector"
CONNECTOR_MODULE = "kvtier.recompute_connector.connector"
# This plugin's switch before KVTIER_UPSTREAM_NAMES (deprecated).
OLD_SWITCH = "KVTIER_OVERRIDE_RECOMPUTE_CONNECTOR"
# Plugins (by top-level module) that register a connector of their own under the
# guide's name.
OTHER_PROVIDERS = ("vllm_ascend",)

_state: dict[str, Any] = {"registered": False}


def register() -> bool:
    """Register kvtier's connector with vLLM's KV connector factory.

    Returns True when it is registered (now or before), at least under its alias.
    Never raises: an unsupported vLLM or any error is one log line and no registration.
    """
    if _state["registered"]:
        return True
    try:
        _state["registered"] = _register()
    except Exception as exc:  # never take vLLM's plugin loader down
        logger.warning(
            "kvtier-recompute-connector: could not register %s: %s: %s",
            CONNECTOR_NAME,
            type(exc).__name__,
            exc,
        )
    return bool(_state["registered"])


def _register() -> bool:
    import vllm

    from kvtier.vllm_port.plugins import (
        REPLACED,
        UPSTREAM_SWITCH,
        installed,
        is_registered,
        register_name,
        upstream_names,
        version_gate,
    )

    version = str(getattr(vllm, "__version__", ""))
    if not version_gate(DISTRIBUTION, version, logger):
        return False
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F

    from kvtier.vllm_port.port import select

    select()  # the one vLLM interface generation this process speaks

    register_name(F, "register_connector", ALIAS, CONNECTOR_MODULE, CONNECTOR_NAME, take=True)
    other = next((m for m in OTHER_PROVIDERS if installed(m)), None)
    take = upstream_names(other is None, logger, deprecated=OLD_SWITCH)
    if take and other is not None and not is_registered(F, CONNECTOR_NAME):
        logger.warning(
            "kvtier: %s left to %s, whose plugin registers it after kvtier's in this "
            "process (vLLM stops on a duplicate name); select %s to use kvtier's connector",
            CONNECTOR_NAME,
            other,
            ALIAS,
        )
        return True
    outcome = register_name(
        F, "register_connector", CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME, take=take
    )
    if not take:
        logger.info(
            "kvtier: %s left to %s (%s); kvtier's connector is %s",
            CONNECTOR_NAME,
            other or "other plugins",
            f"{UPSTREAM_SWITCH}=1 takes it" if other else f"{UPSTREAM_SWITCH}=0",
            ALIAS,
        )
    elif outcome == REPLACED:
        logger.info(
            "kvtier: %s is kvtier's connector (it replaced %s's; %s=0 keeps that one); "
            "also registered as %s",
            CONNECTOR_NAME,
            other or "another plugin",
            UPSTREAM_SWITCH,
            ALIAS,
        )
    else:
        logger.debug("kvtier: registered %s and %s", CONNECTOR_NAME, ALIAS)
    return True
