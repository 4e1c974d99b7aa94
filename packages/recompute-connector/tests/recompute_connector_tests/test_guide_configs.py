"""The user guide's configurations, copied as they are, start vLLM and do their job.

Only the P/D child of the guide's MultiConnector example is replaced (MooncakeConnectorV1
needs a Mooncake deployment): by a stand-in that, like Mooncake on a decode node, claims
no tokens for requests without remote-prefill parameters. The budget stays the guide's
16 GiB per rank: the host region is allocated but only the blocks used are touched.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from kvtier.testkit import (
    FORCED_PREEMPTION_WORKLOAD,
    WorkloadResult,
    compare_outputs,
    requires_vllm,
)
from kvtier.testkit.faults import failing_copies

from .e2e_support import run_connector

pytestmark = [pytest.mark.e2e, requires_vllm]

# "Standalone Connector Example" of the guide, verbatim.
GUIDE_STANDALONE: dict[str, Any] = {
    "kv_connector": "RecomputeCPUOffloadConnector",
    "kv_role": "kv_consumer",
    "kv_connector_extra_config": {
        "cpu_bytes_to_use_per_rank": 17179869184,
        "enable_offload_prefix_caching": False,
    },
}

# "Usage with P/D Disaggregation" of the guide; the Mooncake child replaced.
GUIDE_MULTI: dict[str, Any] = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_consumer",
    "kv_connector_extra_config": {
        "connectors": [
            {
                "kv_connector": "PDStandInConnector",
                "kv_connector_module_path": "recompute_connector_tests.e2e_support",
                "kv_role": "kv_consumer",
            },
            {
                "kv_connector": "RecomputeCPUOffloadConnector",
                "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"cpu_bytes_to_use_per_rank": 17179869184},
            },
        ]
    },
}


@pytest.mark.parametrize("config", [GUIDE_STANDALONE, GUIDE_MULTI], ids=["standalone", "multi"])
def test_guide_configuration_starts_and_restores(
    tiny_model: Path, reference: WorkloadResult, config: dict[str, Any]
) -> None:
    run = run_connector(
        tiny_model,
        FORCED_PREEMPTION_WORKLOAD,
        config,
        additional_config={"recompute_scheduler_enable": True},
    )
    comparison = compare_outputs(reference.outputs, run.result.outputs)
    assert comparison.identical, comparison.report()
    assert run.counter("tokens_restored") > 0, "the guide's configuration restored nothing"


def test_guide_pd_configuration_recomputes_failed_restores(
    tiny_model: Path, reference: WorkloadResult
) -> None:
    """The guide's P/D example with the policy where the guide puts it, on the top-level
    MultiConnector configuration (vLLM's default, ``fail``, would end a request whose
    load failed): with every restore failing, outputs must still match."""
    config = copy.deepcopy(GUIDE_MULTI)
    config["kv_load_failure_policy"] = "recompute"
    with failing_copies(loads=True) as refused:
        run = run_connector(
            tiny_model,
            FORCED_PREEMPTION_WORKLOAD,
            config,
            additional_config={"recompute_scheduler_enable": True},
        )
    assert refused["load"] > 0
    comparison = compare_outputs(reference.outputs, run.result.outputs)
    assert comparison.identical, comparison.report()
    assert len(run.result.outputs) == len(FORCED_PREEMPTION_WORKLOAD.prompts)
    assert run.fallbacks().get("load_failed", 0) > 0, run.fallbacks()
    assert run.counter("tokens_restored") == 0
