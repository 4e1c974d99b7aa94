"""vLLM's ``MooncakeConnector`` on a machine without an accelerator, for the P/D test.

Loaded by vLLM through ``"kv_connector_module_path"``; the connector keeps vLLM's name.
Two vLLM 0.32 bugs stand between it and vLLM's CPU platform, and this module steps
around exactly those two:

* the Mooncake worker asks ``torch.accelerator.current_device_index()`` when it is
  built, which raises where no accelerator exists (the KV it registers is host memory
  on the CPU platform, so device 0 is as good as any);
* the connector reports stats but declares no Prometheus metrics, so ``MultiConnector``
  asserts on its first stats report and the server stops (vLLM issue 43828).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc


@contextlib.contextmanager
def _device_zero_without_accelerator() -> Iterator[None]:
    if torch.accelerator.is_available():
        yield
        return
    real = torch.accelerator.current_device_index
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.accelerator.current_device_index = real  # type: ignore[assignment]


class _Worker(mc.MooncakeConnectorWorker):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _device_zero_without_accelerator():
            super().__init__(*args, **kwargs)


mc.MooncakeConnectorWorker = _Worker  # the connector builds its worker by this name


class _NoPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def observe(self, transfer_stats_data: Any, engine_idx: int = 0) -> None:
        return


class MooncakeConnector(mc.MooncakeConnector):  # type: ignore[misc]
    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        return _NoPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
