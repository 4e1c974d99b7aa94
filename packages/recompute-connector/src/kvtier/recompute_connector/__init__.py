"""kvtier-recompute-connector: keep preempted requests' KV in host DRAM, restore it on resume.

vLLM finds ``RecomputeCPUOffloadConnector`` through the ``vllm.general_plugins`` entry
point (:func:`register`). The logic lives in vLLM-free classes:
:class:`RecomputeOffloadScheduler` (scheduler side) and :class:`RecomputeOffloadWorker`
(worker side); ``kvtier.recompute_connector.connector`` is the thin vLLM adapter, and it
and its ``metrics`` (stats and Prometheus series) are the modules that import vLLM.
"""

from kvtier.recompute_connector.__about__ import __version__
from kvtier.recompute_connector.config import DEFAULT_TOTAL_BYTES, RecomputeOffloadConfig
from kvtier.recompute_connector.plugin import CONNECTOR_NAME, register
from kvtier.recompute_connector.protocol import StepPlan, TransferJob, WorkerReport
from kvtier.recompute_connector.state import (
    Fallback,
    KVGroup,
    Phase,
    PreemptedRequestState,
    RecomputeOffloadScheduler,
)
from kvtier.recompute_connector.worker import RecomputeOffloadWorker

__all__ = [
    "CONNECTOR_NAME",
    "DEFAULT_TOTAL_BYTES",
    "Fallback",
    "KVGroup",
    "Phase",
    "PreemptedRequestState",
    "RecomputeOffloadConfig",
    "RecomputeOffloadScheduler",
    "RecomputeOffloadWorker",
    "StepPlan",
    "TransferJob",
    "WorkerReport",
    "__version__",
    "register",
]
