"""The stats of a step where nothing changed: made once for the same gauge rows, then
copied, each copy vLLM's own ``OffloadingConnectorStats`` holding what ``set_gauge``
would, and none shared with another step's (vLLM aggregates into what it is handed)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
metrics = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
    reason="vLLM before 0.26 has no offloading stats of its own",
)

from kvtier.tiering_spec import vllm_compat as compat  # noqa: E402

ROWS = (("vllm:cpu_cache_usage_perc", 0.25), ("vllm:cpu_cache_write_usage_perc", 0.0))


def test_copies_hold_what_set_gauge_writes_and_share_nothing() -> None:
    quiet = compat.QuietGauges()
    first, second = quiet(ROWS), quiet(ROWS)
    reference = compat.gauge_stats(ROWS)
    assert type(first) is type(reference) is metrics.OffloadingConnectorStats
    assert first.data == second.data == reference.data
    assert first is not second
    # vLLM aggregates another step's stats into the first it holds: the next copies
    # keep their own values.
    later = compat.gauge_stats((("vllm:cpu_cache_usage_perc", 0.75),))
    first.aggregate(later)
    first.increase_counter("vllm:kvtier_host_queries", 3)
    assert first.data != reference.data
    assert second.data == quiet(ROWS).data == reference.data
    assert first.reduce()["vllm:cpu_cache_usage_perc"] == 0.75


def test_new_rows_make_new_stats() -> None:
    quiet = compat.QuietGauges()
    assert quiet(ROWS).data == compat.gauge_stats(ROWS).data
    rows = (("vllm:cpu_cache_usage_perc", 0.5),)
    assert quiet(rows).data == compat.gauge_stats(rows).data
    # The same values in a new tuple (the emitter writes new rows when something moved).
    again = tuple(list(ROWS))
    assert quiet(again).data == compat.gauge_stats(ROWS).data
