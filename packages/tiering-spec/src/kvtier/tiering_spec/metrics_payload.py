"""kvtier's metrics on vLLM releases without a route for a spec's own metrics (vLLM 0.23):
a connector stats payload of plain data (no vLLM import)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# -- stats payload for vLLM releases without offloading metric definitions ---------------
#
# vLLM 0.23 has no route for a spec's own metrics: kvtier then carries them (and vLLM's
# transfer records) in a connector stats payload of plain data, which survives the trip
# from the engine to the metrics process:
#
#     {"transfers": {"GPU_to_CPU": [[bytes, seconds], ...], ...},
#      "metrics": {name: [kind, {label key: value}]}}
#
# A label key is the label values joined by LABEL_SEP. Counters add up, gauges keep the
# latest value and histograms keep every observation.

LABEL_SEP = "\x1f"


def new_payload() -> dict[str, Any]:
    return {"transfers": {}, "metrics": {}}


def payload_is_empty(payload: Mapping[str, Any]) -> bool:
    return not payload.get("transfers") and not payload.get("metrics")


def add_transfer(payload: dict[str, Any], transfer_type: str, nbytes: int, seconds: float) -> None:
    payload["transfers"].setdefault(transfer_type, []).append([int(nbytes), float(seconds)])


def add_metric(
    payload: dict[str, Any], kind: str, name: str, value: Any, labels: tuple[str, ...]
) -> None:
    """Record ``value`` (a number, or a list of observations of a histogram)."""
    entry = payload["metrics"].setdefault(name, [kind, {}])
    values: dict[str, Any] = entry[1]
    key = LABEL_SEP.join(labels)
    if kind == "counter":
        values[key] = values.get(key, 0) + value
    elif kind == "gauge":
        values[key] = value
    else:
        values.setdefault(key, []).extend(value if isinstance(value, list) else [value])


def label_values(key: str) -> tuple[str, ...]:
    return tuple(key.split(LABEL_SEP)) if key else ()


def merge_payload(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Add ``other`` to ``into`` (which it returns)."""
    for transfer_type, ops in other.get("transfers", {}).items():
        into["transfers"].setdefault(transfer_type, []).extend(list(op) for op in ops)
    for name, (kind, values) in other.get("metrics", {}).items():
        for key, value in values.items():
            add_metric(
                into, kind, name, list(value) if kind == "histogram" else value, label_values(key)
            )
    return into


def reduce_payload(payload: Mapping[str, Any]) -> dict[str, int | float]:
    """One number per series, for vLLM's periodic log line."""
    out: dict[str, int | float] = {}
    for transfer_type, ops in payload.get("transfers", {}).items():
        out[f"{transfer_type}_total_bytes"] = sum(int(op[0]) for op in ops)
        out[f"{transfer_type}_total_time"] = sum(float(op[1]) for op in ops)
    for name, (kind, values) in payload.get("metrics", {}).items():
        for key, value in values.items():
            series = f"{name}:{','.join(label_values(key))}" if key else name
            if kind == "histogram":
                out[f"{series}_count"] = len(value)
                out[f"{series}_sum"] = sum(value)
            else:
                out[series] = value
    return out
