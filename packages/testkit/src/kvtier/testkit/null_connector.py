"""A KV connector that does nothing: what vLLM's connector plumbing alone costs.

Benchmarks run it beside kvtier, so a slowdown can be told apart from the price of
having any connector at all. Use it with
``kv_connector="NullConnector"`` and
``kv_connector_module_path="kvtier.testkit.null_connector"`` (see
:data:`NULL_CONNECTOR`). Imports vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

NULL_CONNECTOR: dict[str, Any] = {
    "kv_connector": "NullConnector",
    "kv_connector_module_path": "kvtier.testkit.null_connector",
    "kv_role": "kv_both",
}


class NullConnectorMetadata(KVConnectorMetadata):
    """Nothing to send from scheduler to workers."""


class NullConnector(KVConnectorBase_V1):
    """Never has external KV, never moves a byte."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return NullConnectorMetadata()
