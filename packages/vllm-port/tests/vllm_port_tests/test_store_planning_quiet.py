"""store_planning's quiet-step path is put in front of vLLM's step planning only where
that method reads exactly what 0.32's or 0.33's reads (no vLLM needed here: the engine
tests in kvtier-tiering-spec and vLLM 0.33's own scheduler tests, run by ``nox -s
conformance``, check the plans)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvtier.vllm_port import store_planning


class OffloadingConnectorMetadata(SimpleNamespace):
    pass


class ScheduleEndContext(SimpleNamespace):
    pass


class Planner:
    """vLLM 0.32's step planning, as far as the names it reads go (its code object is
    given 0.32's names: it is asked, never run)."""

    def __init__(self) -> None:
        self._sliding_window_groups: tuple[int, ...] = ()
        self.manager = SimpleNamespace(on_schedule_end=lambda end: None)
        self.planned = 0

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self.planned += 1
        return OffloadingConnectorMetadata(load_jobs={}, store_jobs={}, jobs_to_flush=set())


# The names 0.32's method reads, as its code object lists them.
Planner.build_connector_meta.__code__ = Planner.build_connector_meta.__code__.replace(
    co_names=tuple(sorted(store_planning._STEP_NAMES.split()))
)


class Newer(Planner):
    def build_connector_meta(self, scheduler_output: Any) -> Any:  # reads one name more
        self.planned += 1
        return self.something_new


def test_a_planner_that_reads_what_032s_reads_gets_the_quiet_path() -> None:
    assert store_planning._meta_shape(Planner) == ("build_connector_meta", True)
    planner = Planner()
    assert store_planning.quiet_steps(planner)
    assert "build_connector_meta" in vars(planner) and planner.kvtier_quiet_steps == 0


def test_another_planner_keeps_its_own_method() -> None:
    assert store_planning._meta_shape(Newer) is None
    planner = Newer()
    assert not store_planning.quiet_steps(planner)
    assert "build_connector_meta" not in vars(planner)


def test_a_model_with_sliding_window_groups_keeps_vllms_method() -> None:
    planner = Planner()
    planner._sliding_window_groups = (1,)
    assert not store_planning.quiet_steps(planner)
    assert "build_connector_meta" not in vars(planner)


def test_a_step_with_an_event_goes_to_vllms_method() -> None:
    planner = Planner()
    for name in (
        "_current_batch_load_jobs",
        "_current_batch_jobs_to_flush",
        "_current_batch_allocated_block_ids",
        "_block_id_to_pending_jobs",
    ):
        setattr(planner, name, {} if "jobs" in name and "flush" not in name else set())
    planner._build_store_jobs = lambda output: {}
    planner._update_req_states = lambda output: None

    def vllm_plan(output: Any) -> str:
        planner.planned += 1
        return "vLLM's plan"

    planner.build_connector_meta = vllm_plan  # type: ignore[method-assign]
    assert store_planning.quiet_steps(planner)
    quiet = SimpleNamespace(
        scheduled_new_reqs=[],
        preempted_req_ids=set(),
        finished_req_ids=set(),
        kv_connector_block_state=None,
    )
    meta = planner.build_connector_meta(quiet)
    assert planner.kvtier_quiet_steps == 1 and planner.planned == 0
    assert meta.load_jobs == {} and meta.store_jobs == {} and meta.jobs_to_flush == set()
    for event in ({"scheduled_new_reqs": ["r"]}, {"finished_req_ids": {"r"}}):
        got = planner.build_connector_meta(SimpleNamespace(**{**vars(quiet), **event}))
        assert got == "vLLM's plan"
    planner._current_batch_load_jobs = {7: "a load admitted this step"}
    assert planner.build_connector_meta(quiet) == "vLLM's plan"
    assert planner.kvtier_quiet_steps == 1 and planner.planned == 3
