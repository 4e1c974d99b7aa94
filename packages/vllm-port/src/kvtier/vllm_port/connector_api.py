"""What vLLM's KV connector interface offers, probed once for both of kvtier's plugins.

Every answer is read from vLLM's own classes, never from its version number, and kept
for the process (vLLM's classes do not change under it). vLLM is imported only when a
function is called, so this module imports without vLLM.

* **Block tables.** vLLM 0.32 hands a scheduler-side connector the scheduler's
  ``KVCacheManager`` (``bind_kv_cache_manager``); older releases (0.23) only hand it
  the block pool. The same release asks a connector for its stats every step; older
  ones ask only in steps where a worker reported stats.
* **Failed loads as failed requests.** vLLM 0.32 takes a failed load as a failed
  request (``get_transfer_results`` returning ``KVConnectorTransferResults`` with
  ``failed_recving``): the only failure report it accepts for a model with several KV
  cache groups, whose block ids are unique only within a group. Older releases take
  block-level reports only.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def binds_kv_cache_manager() -> bool:
    """Whether vLLM calls ``bind_kv_cache_manager`` on scheduler-side connectors (and
    asks them for stats every step)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "bind_kv_cache_manager")


@functools.cache
def request_level_load_failures() -> bool:
    """Whether vLLM takes a failed load as a failed request (``failed_recving``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "get_transfer_results")


def transfer_results(finished_recving: set[str], failed_recving: set[str]) -> Any:
    """vLLM's ``KVConnectorTransferResults`` of finished (and failed) receives (only
    where :func:`request_level_load_failures`)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults(
        finished_recving=set(finished_recving), failed_recving=set(failed_recving)
    )
