"""A stand-in for vllm-ascend 0.23's ``ascend_kv_connector`` general plugin: it registers
the same connector names the same way (``MultiConnector`` popped and replaced by a
subclass; the others through ``register_connector``, which raises on a duplicate)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

HERE = __name__


class AscendMultiConnector(MultiConnector):
    """vllm-ascend's MultiConnector subclass."""


class StandInConnector:
    """Any of vllm-ascend's other connectors (never built in these tests)."""


RecomputeCPUOffloadConnectorV1 = StandInConnector
MooncakeConnectorV1 = StandInConnector


def register() -> None:
    if "MultiConnector" in KVConnectorFactory._registry:
        KVConnectorFactory._registry.pop("MultiConnector")
    KVConnectorFactory.register_connector("MultiConnector", HERE, "AscendMultiConnector")
    KVConnectorFactory.register_connector("MooncakeConnectorV1", HERE, "MooncakeConnectorV1")
    KVConnectorFactory.register_connector(
        "RecomputeCPUOffloadConnector", HERE, "RecomputeCPUOffloadConnectorV1"
    )
