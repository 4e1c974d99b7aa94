"""sync_loads.idle: a worker step with nothing to flush, submit or start, read from
vLLM's metadata and worker state (no vLLM needed: plain objects of the same shape)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.vllm_port import sync_loads


def _meta(**changed: object) -> SimpleNamespace:
    fields: dict[str, object] = {"jobs_to_flush": set(), "load_jobs": {}, "store_jobs": {}}
    fields.update(changed)
    return SimpleNamespace(**fields)


def test_a_step_without_jobs_is_idle() -> None:
    worker = SimpleNamespace(_unsubmitted_store_jobs=[])
    assert sync_loads.idle(worker, _meta())
    # Stores planned this step are deferred by vLLM to the next step: still idle now.
    assert sync_loads.idle(worker, _meta(store_jobs={1: object()}))


@pytest.mark.parametrize(
    ("meta", "deferred"),
    [
        (_meta(jobs_to_flush={3}), []),
        (_meta(load_jobs={4: object()}), []),
        (_meta(**{sync_loads.META_FIELD: frozenset({5})}), []),
        (_meta(), [(6, object(), object())]),
    ],
    ids=["flush", "load", "sync-load", "deferred-store"],
)
def test_any_job_makes_a_step_busy(meta: SimpleNamespace, deferred: list[object]) -> None:
    assert not sync_loads.idle(SimpleNamespace(_unsubmitted_store_jobs=deferred), meta)


def test_a_shape_it_does_not_know_is_never_idle() -> None:
    assert not sync_loads.idle(SimpleNamespace(), _meta())  # no deferred-store list
    assert not sync_loads.idle(SimpleNamespace(_unsubmitted_store_jobs=[]), SimpleNamespace())
    assert not sync_loads.idle(SimpleNamespace(_unsubmitted_store_jobs=[]), None)


def test_planned_stores_are_read_from_the_metadata_and_assumed_where_unknown() -> None:
    from kvtier.vllm_port import store_planning

    assert not store_planning.plans_stores(SimpleNamespace(store_jobs={}))
    assert store_planning.plans_stores(SimpleNamespace(store_jobs={1: object()}))
    assert store_planning.plans_stores(SimpleNamespace())  # no such field: assume some
    assert store_planning.plans_stores(None)


def test_completions_not_yet_sent_are_read_from_the_worker_and_assumed_where_unknown() -> None:
    from kvtier.vllm_port import store_planning

    waiting = SimpleNamespace(completed_jobs={3})
    assert store_planning.worker_meta_waiting(SimpleNamespace(_connector_worker_meta=waiting))
    sent = SimpleNamespace(completed_jobs=set())
    assert not store_planning.worker_meta_waiting(SimpleNamespace(_connector_worker_meta=sent))
    assert store_planning.worker_meta_waiting(SimpleNamespace())  # no such record: assume some
    assert store_planning.worker_meta_waiting(None)
