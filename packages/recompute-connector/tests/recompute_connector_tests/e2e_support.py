"""Shared pieces of the end-to-end tests: configurations and a run that collects the
connector's own view (host pool, stores, stats) alongside the outputs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kvtier.testkit import (
    FORCED_PREEMPTION_ENGINE,
    Workload,
    WorkloadResult,
    free_llm,
    kv_connector_of,
    kv_transfer_config,
    make_llm,
    run_workload,
)

CONNECTOR = "RecomputeCPUOffloadConnector"
PER_RANK = 1 << 30  # 1 GiB per rank: room for every preempted request


def standalone(role: str = "kv_consumer", **extra: Any) -> dict[str, Any]:
    """The guide's standalone configuration (budget lowered to fit a test machine)."""
    return {
        "kv_connector": CONNECTOR,
        "kv_role": role,
        "kv_connector_extra_config": {
            "cpu_bytes_to_use_per_rank": PER_RANK,
            "enable_offload_prefix_caching": False,
            **extra,
        },
    }


def multi(storage: str, *, recompute_first: bool, role: str = "kv_consumer") -> dict[str, Any]:
    """The guide's MultiConnector configuration with a P/D child that runs here.

    In the guide's order (P/D child first) the child is :class:`PDStandInConnector`, which
    like MooncakeConnectorV1 on a decode node claims no tokens for requests without
    remote-prefill parameters. With ours first, the child is vLLM's ExampleConnector
    (which saves every prompt's KV to ``storage``; on the CPU platform its own loads do
    not work, so it must not be asked first).
    """
    if recompute_first:
        pd_child = {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": storage},
        }
    else:
        pd_child = {
            "kv_connector": "PDStandInConnector",
            "kv_connector_module_path": __name__,
            "kv_role": role,
        }
    ours = {
        "kv_connector": CONNECTOR,
        "kv_role": role,
        "kv_connector_extra_config": {"cpu_bytes_to_use_per_rank": PER_RANK},
    }
    children = [ours, pd_child] if recompute_first else [pd_child, ours]
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": children},
    }


def recompute_connector(llm: Any) -> Any:
    """Our scheduler-side connector, standalone or inside MultiConnector."""
    top = kv_connector_of(llm)
    for c in [top, *getattr(top, "sub_connectors", getattr(top, "_connectors", []))]:
        if type(c).__name__ == CONNECTOR:
            return c
    raise AssertionError(f"{CONNECTOR} not found in {type(top).__name__}")


def worker_connector(llm: Any) -> Any:
    """Our worker-side connector of an in-process engine (uniprocess executor)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    top = get_kv_transfer_group()
    for c in [top, *getattr(top, "sub_connectors", getattr(top, "_connectors", []))]:
        if type(c).__name__ == CONNECTOR:
            return c
    raise AssertionError(f"{CONNECTOR} not found among the worker connectors")


@dataclass
class ConnectorRun:
    result: WorkloadResult
    host_blocks_in_use: int
    preempted_left: int
    in_flight_left: int
    stored_device_blocks: list[list[int]] = field(default_factory=list)
    null_positions_kept: int = 0
    peak_host_blocks: int = 0

    def counter(self, name: str) -> float:
        return self.result.metrics.get("vllm:kvtier_recompute_" + name, 0.0)

    def fallbacks(self) -> dict[str, float]:
        from kvtier.testkit import labelled_metric_values

        return labelled_metric_values(
            self.result.raw_metrics, "vllm:kvtier_recompute_fallbacks", "reason"
        )


def run_connector(
    model: os.PathLike[str] | str,
    workload: Workload,
    kv_config: dict[str, Any],
    engine: dict[str, Any] | None = None,
    **engine_args: Any,
) -> ConnectorRun:
    """Run ``workload`` with ``kv_config``; record what the worker stored."""
    args = {**(engine or FORCED_PREEMPTION_ENGINE), **engine_args}
    llm = make_llm(model, kv_transfer_config=kv_transfer_config(kv_config), **args)
    try:
        sched = recompute_connector(llm).scheduler
        worker = worker_connector(llm).worker
        stored: list[list[int]] = []
        nulls = [0]
        peak = [0]
        original_stores = worker.run_stores
        original_preempted = sched.on_preempted

        def run_stores(jobs: Any) -> None:
            stored.extend(list(j.device_block_ids) for j in jobs)
            original_stores(jobs)

        def on_preempted(req_id: str, *args: Any, **kwargs: Any) -> Any:
            job = original_preempted(req_id, *args, **kwargs)
            peak[0] = max(peak[0], sched.host_blocks_in_use)
            state = sched.preempted.get(req_id)
            if job is not None and state is not None:
                nulls[0] += sum(h is None for g in state.host_blocks for h in g)
            return job

        worker.run_stores = run_stores
        sched.on_preempted = on_preempted
        result = run_workload(llm, workload)
        sched.check_invariants()
        return ConnectorRun(
            result,
            sched.host_blocks_in_use,
            len(sched.preempted),
            sched.num_in_flight,
            stored,
            nulls[0],
            peak[0],
        )
    finally:
        free_llm(llm)


def _stand_in_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )

    class PDStandInConnector(KVConnectorBase_V1):
        """A P/D connector on a decode node, for requests that carry no remote-prefill
        parameters: it loads nothing, saves nothing, and claims no tokens."""

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            return

        def wait_for_layer_load(self, layer_name: str) -> None:
            return

        def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
            return

        def wait_for_save(self) -> None:
            return

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            return 0, False

        def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None:
            return

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return KVConnectorMetadata()

    return PDStandInConnector


def __getattr__(name: str) -> Any:
    # Built on first use, so importing this module does not import vLLM.
    if name == "PDStandInConnector":
        cls = _stand_in_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
