"""Workloads, output comparison and metric flattening (no engine)."""

from dataclasses import dataclass, field

import pytest

from kvtier.testkit import compare_outputs, make_workload, metric_values


def test_identical_outputs_compare_identical() -> None:
    result = compare_outputs([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]])
    assert result.identical
    assert result.report() == "all 2 requests identical"


def test_first_differing_token_is_reported_per_request() -> None:
    result = compare_outputs([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 3], [4, 9, 6], [7, 8]])
    assert result.mismatched_requests == [1, 2]
    assert [m.position for m in result.mismatches] == [1, 1]
    assert "request 1: first differing token at position 1" in result.report()


def test_different_request_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        compare_outputs([[1]], [[1], [2]])


def test_workload_is_deterministic_and_avoids_special_tokens() -> None:
    a = make_workload(4, 10, 5, seed=3)
    assert a == make_workload(4, 10, 5, seed=3)
    assert len(a) == 4 and a.prompt_tokens == 40 and a.max_tokens == 5
    assert all(t not in (0, 1, 2) and 0 <= t < 512 for p in a.prompts for t in p)


def test_shared_prefix_is_shared() -> None:
    w = make_workload(3, 10, 5, shared_prefix_tokens=6)
    assert len({p[:6] for p in w.prompts}) == 1
    assert len({p for p in w.prompts}) == 3


@dataclass
class _Counter:
    name: str
    value: float
    labels: dict = field(default_factory=dict)


@dataclass
class _Histogram:
    name: str
    count: int
    sum: float
    labels: dict = field(default_factory=dict)


def test_metric_values_sum_label_sets() -> None:
    metrics = [
        _Counter("vllm:num_preemptions", 3, {"engine": "0"}),
        _Counter("vllm:num_preemptions", 2, {"engine": "1"}),
        _Histogram("vllm:ttft", 4, 1.5),
    ]
    flat = metric_values(metrics)
    assert flat["vllm:num_preemptions"] == 5
    assert flat["vllm:ttft:count"] == 4 and flat["vllm:ttft:sum"] == 1.5
