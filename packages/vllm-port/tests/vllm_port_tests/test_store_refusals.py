"""Stores a manager refuses for lack of room: vLLM's warning once, then debug lines,
and at most one summing-up warning per interval (kvtier.vllm_port.store_jobs)."""

from __future__ import annotations

import logging

import pytest

from kvtier.vllm_port import store_jobs


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_refusal_warns_and_the_rest_are_summed_up_once_an_interval(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(store_jobs.time, "monotonic", clock)
    # (A logger of its own: vLLM's logging config, once imported, sets its loggers' level.)
    vllm_logger = logging.getLogger("kvtier_tests.vllm_scheduler")
    refusals = store_jobs.Refusals(vllm_logger)
    caplog.set_level(logging.DEBUG, logger=vllm_logger.name)
    caplog.set_level(logging.DEBUG, logger=store_jobs.logger.name)

    refusals.refused("r0")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings[:1]] == ["Request r0: cannot store chunks"]
    assert warnings[0].name == vllm_logger.name
    assert len(warnings) == 2 and "debug level" in warnings[1].getMessage()

    caplog.clear()
    for i in range(1, 6):  # within the interval: debug lines only
        clock.now += 1.0
        refusals.refused(f"r{i}")
    assert [r.levelno for r in caplog.records] == [logging.DEBUG] * 5
    assert caplog.records[0].getMessage() == "Request r1: cannot store chunks"

    caplog.clear()
    clock.now = 100.0 + store_jobs.REFUSALS_LOG_INTERVAL_S
    refusals.refused("r6")
    summary = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(summary) == 1 and summary[0].startswith("kvtier: 6 stores refused")
    assert refusals.count == 0

    caplog.clear()
    clock.now += 1.0
    refusals.refused("r7")  # a new interval begins: no warning yet
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
