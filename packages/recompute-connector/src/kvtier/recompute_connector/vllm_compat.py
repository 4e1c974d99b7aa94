"""What differs between the vLLM releases the connector supports, in one place.

Every difference is detected from vLLM's own classes, not from version numbers:

* **Block tables.** vLLM 0.32 hands a connector the scheduler's ``KVCacheManager``
  (``bind_kv_cache_manager``), from which the connector reads each request's device
  blocks. Older releases (0.23) only hand it the block pool (``bind_gpu_block_pool``);
  the tables are then rebuilt from the scheduler's outputs (``block_tables``).
* **Failed restores of models with several KV cache groups.** Block ids are unique only
  within a group there, and vLLM refuses block-level load failures for such a model
  (0.32 raises; 0.23 cannot unpack the block table). vLLM 0.32 takes a failed load as
  a failed request instead, for a load it waits for asynchronously: such a model's
  restores are asynchronous there. Older releases have no such report, so such a
  model's preempted requests are recomputed.
* **Stats polling.** vLLM 0.32's scheduler asks the connector for its stats every step.
  Older releases ask only in steps where a worker reported stats, so the worker side
  reports an empty stats object every step there (the scheduler side's fallbacks and
  gauges would otherwise wait for the next copy).
"""

from __future__ import annotations

from typing import Any


def binds_kv_cache_manager() -> bool:
    """Whether this vLLM calls ``bind_kv_cache_manager`` on scheduler-side connectors."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "bind_kv_cache_manager")


def request_level_load_failures() -> bool:
    """Whether this vLLM takes a failed load as a failed request
    (``KVConnectorTransferResults.failed_recving``, vLLM 0.32): the only failure report
    it accepts for a model with several KV cache groups."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "get_transfer_results")


def transfer_results(finished_recving: set[str], failed_recving: set[str]) -> Any:
    """vLLM's ``KVConnectorTransferResults`` of finished (and failed) receives."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults(
        finished_recving=set(finished_recving), failed_recving=set(failed_recving)
    )
