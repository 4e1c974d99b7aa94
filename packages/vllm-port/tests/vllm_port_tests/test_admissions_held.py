"""The delay samples of lookups the memo answered are held while the stats carry
nothing else, and none is lost: each is observed once, with the next stats that carry
something, after ``HOLD_STEPS`` stats, or when a request finishes (no vLLM needed: the
engine test of the admission path in kvtier-tiering-spec checks each call's samples
against vLLM's)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvtier.vllm_port import admissions


class Stats:
    """vLLM's connector stats, as far as the admission path uses them."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.counters = 0

    def is_empty(self) -> bool:
        return not self.samples and not self.counters

    def observe_histogram(self, name: str, value: float) -> None:
        assert name == "sync"
        self.samples.append(value)


def admit() -> Any:
    made = admissions.Admissions.__new__(admissions.Admissions)
    made.scheduler = SimpleNamespace(_connector_stats=Stats())
    made.sync_delay = "sync"
    made.held, made.held_steps = [], 0
    return made


def test_held_samples_wait_for_stats_that_carry_something() -> None:
    a = admit()
    a.held += [0.1, 0.2]
    a.release_held()  # the stats carry nothing: still held
    assert a.held == [0.1, 0.2] and a.scheduler._connector_stats.samples == []
    a.scheduler._connector_stats.counters = 1  # a step that reports something anyway
    a.release_held()
    assert a.held == [] and a.scheduler._connector_stats.samples == [0.1, 0.2]
    a.release_held()  # nothing held: nothing observed again
    assert a.scheduler._connector_stats.samples == [0.1, 0.2]


def test_held_samples_wait_at_most_hold_steps_stats() -> None:
    a = admit()
    a.held.append(0.5)
    for _ in range(admissions.HOLD_STEPS - 1):
        a.release_held()
    assert a.held == [0.5] and not a.scheduler._connector_stats.samples
    a.release_held()
    assert a.held == [] and a.scheduler._connector_stats.samples == [0.5]
    a.scheduler._connector_stats = Stats()  # vLLM took them and starts new ones
    a.held.append(0.7)  # the count starts again with the next sample held
    a.release_held()
    assert a.held == [0.7]


def test_a_finished_request_releases_the_held_samples_at_once() -> None:
    a = admit()
    a.held += [0.3, 0.4]
    a.release_held(now=True)
    assert a.held == [] and a.scheduler._connector_stats.samples == [0.3, 0.4]
