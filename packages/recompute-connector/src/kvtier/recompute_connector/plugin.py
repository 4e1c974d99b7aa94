"""vLLM plugin entry point (group ``vllm.general_plugins``): registers the connector.

vLLM calls :func:`register` in every one of its processes. It must never raise (an
exception in a general plugin stops vLLM), must be idempotent, and imports vLLM only
inside the function. It follows kvtier's plugin convention
(:mod:`kvtier.blockpool.plugin_glue`):

* the supported vLLM range is the ``vllm`` extra of this distribution;
* ``KvtierRecomputeCPUOffloadConnector`` is always kvtier's connector;
* the guide's name ``RecomputeCPUOffloadConnector`` is kvtier's too, unless
  ``KVTIER_OVERRIDE_RECOMPUTE_CONNECTOR=0``. vllm-ascend registers its own connector
  under that name: whichever plugin loads first, kvtier's entry replaces or keeps the
  name and vllm-ascend's registration is skipped with one log line (it would raise on
  the duplicate otherwise). With the switch at 0 the name is left to vllm-ascend.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm.kvtier.recompute_connector")

DISTRIBUTION = "kvtier-recompute-connector"
CONNECTOR_NAME = "RecomputeCPUOffloadConnector"
ALIAS = "KvtierRecomputeCPUOffloadConnector"
CONNECTOR_MODULE = "kvtier.recompute_connector.connector"
ENV_OVERRIDE = "KVTIER_OVERRIDE_RECOMPUTE_CONNECTOR"

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

    from kvtier.blockpool.plugin_glue import (
        claim_name,
        env_switch,
        guard_registrations,
        kvtier_loader,
        version_gate,
    )

    version = str(getattr(vllm, "__version__", ""))
    if not version_gate(DISTRIBUTION, version, logger):
        return False
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = KVConnectorFactory._registry
    loader = kvtier_loader(CONNECTOR_MODULE, CONNECTOR_NAME)
    claim_name(registry, ALIAS, loader, take=True)
    take = env_switch(ENV_OVERRIDE, True, logger)
    outcome = claim_name(registry, CONNECTOR_NAME, loader, take=take)
    if take:
        guard_registrations(
            KVConnectorFactory, "register_connector", registry, {CONNECTOR_NAME}, logger,
            ENV_OVERRIDE,
        )  # fmt: skip
    if outcome == "replaced":
        logger.info(
            "kvtier: %s is kvtier's connector (it replaced another plugin's; set %s=0 to "
            "keep that one); also registered as %s",
            CONNECTOR_NAME,
            ENV_OVERRIDE,
            ALIAS,
        )
    elif outcome == "left":
        logger.info(
            "kvtier: %s=0: %s left to other plugins; kvtier's connector is %s",
            ENV_OVERRIDE,
            CONNECTOR_NAME,
            ALIAS,
        )
    else:
        logger.debug("kvtier: registered %s and %s", CONNECTOR_NAME, ALIAS)
    return True
