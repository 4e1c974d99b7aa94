"""vLLM plugin entry point (group ``vllm.general_plugins``): registers the connector.

vLLM calls :func:`register` in every one of its processes. It must never raise (an
exception in a general plugin stops vLLM), must be idempotent, and imports vLLM only
inside the function.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger("vllm.kvtier.recompute_connector")

CONNECTOR_NAME = "RecomputeCPUOffloadConnector"
CONNECTOR_MODULE = "kvtier.recompute_connector.connector"
MIN_VLLM = (0, 32)

_registered = False


def parse_version(text: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``0.32.0+cpu``, or None."""
    match = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def register() -> bool:
    """Register ``RecomputeCPUOffloadConnector`` with vLLM's KV connector factory.

    Returns True when the connector is registered (now or before). Never raises: an
    unsupported vLLM or any error is one log line and no registration.
    """
    global _registered
    if _registered:
        return True
    try:
        import vllm

        version = str(getattr(vllm, "__version__", ""))
        parsed = parse_version(version)
        if parsed is None or parsed < MIN_VLLM:
            logger.warning(
                "kvtier-recompute-connector: vLLM %s is not supported (needs >= %d.%d); "
                "%s is not registered",
                version or "(unknown version)",
                *MIN_VLLM,
                CONNECTOR_NAME,
            )
            return False
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        registry = getattr(KVConnectorFactory, "_registry", {})
        if CONNECTOR_NAME not in registry:
            try:
                KVConnectorFactory.register_connector(
                    CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME
                )
            except ValueError:
                pass  # registered meanwhile (the factory refuses duplicate names)
        _registered = True
        return True
    except Exception as exc:  # never take vLLM's plugin loader down
        logger.warning(
            "kvtier-recompute-connector: could not register %s: %s: %s",
            CONNECTOR_NAME,
            type(exc).__name__,
            exc,
        )
        return False
