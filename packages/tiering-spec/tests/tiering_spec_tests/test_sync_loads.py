"""Restores inside the step that finds them (``sync_load_budget_bytes``).

A hit within the step's budget is loaded before the step's forward pass and its
request runs in that step; a larger one waits a step, as in vLLM's connector. Real
engines (vLLM's CPU platform) run the prefix workload with the budget at kvtier's
default, at one chunk (smaller than any hit) and at 0, and with failing loads; the
outputs are always those of an engine with room for everything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.tiering_spec.config import ConfigError, parse_config

from .e2e_support import CHUNK_BYTES, ENGINE, ROOMY, offload_config, prefix_prompts


def test_the_budget_defaults_on_and_is_checked() -> None:
    base = {"cpu_bytes_to_use": 1 << 30}
    assert parse_config(base, tiering=False).sync_load_budget_bytes == 256 << 20
    assert (
        parse_config({**base, "sync_load_budget_bytes": 0}, tiering=False).sync_load_budget_bytes
        == 0
    )
    for bad in (-1, "1GB", 1.5, True):
        with pytest.raises(ConfigError, match="sync_load_budget_bytes"):
            parse_config({**base, "sync_load_budget_bytes": bad}, tiering=False)


pytest.importorskip("vllm")

import kvtier.testkit as testkit  # noqa: E402
from kvtier.testkit import Workload, compare_outputs, free_llm, make_llm, run_workload  # noqa: E402
from kvtier.testkit.engine import kv_connector_of, scheduler_of  # noqa: E402
from kvtier.testkit.faults import failing_copies  # noqa: E402

WORKLOAD = Workload(prefix_prompts(), 8)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Any:
    result, _ = testkit.run_with(tiny_model, WORKLOAD, **ROOMY)
    return result


def _run(model: Path, budget: int | None) -> tuple[Any, dict[str, Any]]:
    """The prefix workload with the host tier; what each step's scheduler output and
    the connector's synchronous-load state said."""
    kv = offload_config("CPUOffloadingSpec", host_chunks=64)
    if budget is not None:
        kv["kv_connector_extra_config"]["sync_load_budget_bytes"] = budget
    llm = make_llm(model, **ENGINE, kv_transfer_config=testkit.kv_transfer_config(kv))
    seen: dict[str, Any] = {"sync_steps": 0, "lookups": []}
    try:
        scheduler = scheduler_of(llm)
        connector = kv_connector_of(llm)
        state = getattr(connector.connector_scheduler, "_kvtier_sync_loads", None)
        schedule = scheduler.schedule
        lookup = connector.get_num_new_matched_tokens

        def scheduled(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            seen["sync_steps"] += bool(getattr(out, "has_sync_kv_loads", False))
            return out

        def looked_up(*args: Any, **kwargs: Any) -> Any:
            hit, load_async = lookup(*args, **kwargs)
            if hit:
                seen["lookups"].append(load_async)
            return hit, load_async

        scheduler.schedule = scheduled
        connector.get_num_new_matched_tokens = looked_up
        # The per-layer hooks (no-ops of vLLM's), counted where vLLM would call them.
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()
        seen["layer_calls"] = 0

        def counted(*args: Any, **kwargs: Any) -> None:
            seen["layer_calls"] += 1

        worker.wait_for_layer_load = worker.save_kv_layer = counted
        result = run_workload(llm, WORKLOAD)
        seen["state"] = state
        seen["loads"] = state.loads if state is not None else 0
    finally:
        free_llm(llm)
    return result, seen


def _applies(seen: dict[str, Any]) -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as vllm_sched

    native = "is_sync_load" in getattr(vllm_sched.TransferJobStatus, "__dataclass_fields__", {})
    return native or seen["state"] is not None


@pytest.mark.e2e
def test_hits_load_inside_the_step_and_outputs_match(tiny_model: Path, reference: Any) -> None:
    result, seen = _run(tiny_model, None)
    if not _applies(seen):
        pytest.skip("this vLLM's offloading scheduler is not the shape kvtier extends")
    assert result.metrics.get("vllm:external_prefix_cache_hits", 0) > 0
    assert seen["loads"] > 0 and seen["sync_steps"] > 0, seen
    # Every hit of this workload fits the default budget: none waits a step.
    assert seen["lookups"] and not any(seen["lookups"]), seen["lookups"]
    # No layer called the offloading connector's idle per-layer hooks.
    assert seen["layer_calls"] == 0, seen["layer_calls"]
    cmp = compare_outputs(reference.outputs, result.outputs)
    assert cmp.identical, cmp.report()


@pytest.mark.e2e
@pytest.mark.parametrize("budget", [0, CHUNK_BYTES], ids=["off", "below-one-hit"])
def test_hits_over_the_budget_load_between_steps(
    tiny_model: Path, reference: Any, budget: int
) -> None:
    result, seen = _run(tiny_model, budget)
    assert result.metrics.get("vllm:external_prefix_cache_hits", 0) > 0
    assert seen["loads"] == 0 and seen["sync_steps"] == 0, seen
    assert seen["lookups"] and all(seen["lookups"]), seen["lookups"]
    cmp = compare_outputs(reference.outputs, result.outputs)
    assert cmp.identical, cmp.report()


@pytest.mark.e2e
def test_a_failed_load_inside_the_step_is_recomputed(tiny_model: Path, reference: Any) -> None:
    with failing_copies(loads=True) as refused:
        result, seen = _run(tiny_model, None)
    if not _applies(seen):
        pytest.skip("this vLLM's offloading scheduler is not the shape kvtier extends")
    assert refused["load"] > 0 and seen["sync_steps"] > 0, (refused.counts, seen)
    cmp = compare_outputs(reference.outputs, result.outputs)
    assert cmp.identical, cmp.report()
