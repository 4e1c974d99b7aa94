"""End-to-end benchmark: seconds on a realistic-shaped model, kvtier against vLLM alone.

    python -m kvtier.demo.bench_e2e [--json out.json] [--png out.png] [--only NAME ...]

A random-weight Llama of 16 layers, hidden 1024, 16 heads / 4 KV heads, head_dim 64,
float32 (about 550 MB, 32 KiB of KV per token), made offline by kvtier-testkit. Each
workload runs, one engine after another in this process:

* ``reference``: room for every request's KV on the device (what kvtier aims at);
* ``vLLM alone``: the constrained device cache, nothing else;
* ``null connector``: the same with a KV connector that does nothing (the price of
  vLLM's connector plumbing alone);
* ``kvtier ...``: the same with kvtier.

Workloads:

* ``preemption``: a decode node tuned as the recompute guide says
  (``max_num_batched_tokens`` = ``max_num_seqs`` = 16): 16 requests x (896 prompt +
  128 generated tokens), 60 device blocks of 32 tokens. Older requests' decode growth
  preempts newer ones right after their prefill; kvtier's
  ``RecomputeCPUOffloadConnector`` restores what vLLM alone recomputes 16 tokens a
  step. Run without vLLM's device prefix cache (every preempted token is recomputed)
  and, as two more rows, with it (it keeps freed blocks until other requests reuse
  them, so vLLM alone recomputes less);
* ``prefix``: 4 prefixes of 768 tokens asked 3 times round-robin (own 32-token suffix,
  16 generated), 60 device blocks (two requests fit, the prefixes do not stay):
  ``CPUOffloadingSpec`` with 1 GiB, and a 48 MiB host tier plus an fs tier; and the
  host tier restoring every hit between steps (``sync_load_budget_bytes`` 0), as
  vLLM's own connector does;
* ``prefix-long``: 3 prefixes of 960 tokens asked 3 times, a prefill in chunks of 256
  tokens, one request at a time, 40 device blocks; the host tier, with and without
  restores inside the step;
* ``roomy``: the prefix workload with room for everything (400 blocks): what kvtier
  costs when it is not needed;
* ``chat``: multi-turn chat through ``vllm serve`` and the ``openai`` client (see
  :mod:`kvtier.demo.bench_chat`): 6 users arriving 1 s apart, each with a 512-token
  first message and 3 follow-ups of 64 tokens, 32-token replies, 2 s between a reply
  and the next message; every turn resends the conversation. 64 device blocks (two
  conversations; the six need about 150); ``CPUOffloadingSpec`` with 1 GiB. Measures
  time to first token (p50, p90) and output tokens per second.

Prints a table (wall seconds, ratio to vLLM alone, preemptions, tokens scheduled,
tokens served by kvtier, identical outputs; for chat: TTFT and output tokens/s), the
restore timeline of each offloading run (:mod:`kvtier.demo.timeline`: looked up, load
submitted, loaded, scheduled; the restore's wall time beside what its bytes cost at
the copy engine's rate, measured at start) and the goals with their measured values;
writes JSON and a PNG chart. ``--repeat N`` runs each engine N times, taking turns,
and keeps the fastest. Exits 1 if any output differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_SHAPE: dict[str, int] = {
    "layers": 16,
    "hidden": 1024,
    "heads": 16,
    "kv_heads": 4,
    "head_dim": 64,
}
BASE_ENGINE: dict[str, Any] = {
    "block_size": 32,
    "enforce_eager": True,
    "dtype": "float32",
    "disable_log_stats": False,
    "max_model_len": 1024,
    # On vLLM's CPU platform: the share of host memory vLLM checks is free at start.
    "gpu_memory_utilization": 0.3,
}
HOST_BYTES = 1 << 30
# Half of the 4 prefixes (96 chunks of 1 MiB): too small for the workload, and room for
# a prefix to come up from the fs tier (promotions take half the host tier at most)
# while the prompts before it are stored. At 24 MiB, one prefix filled the host tier:
# a promotion could never complete before its request's turn, and it waited a seat.
SMALL_HOST_BYTES = 48 << 20


@dataclass
class Run:
    """One engine run of a workload."""

    label: str
    role: str  # "reference", "alone", "null", "kvtier" or "variant" (kvtier, another setting)
    engine: dict[str, Any]
    kv: dict[str, Any] | None = None
    baseline: str | None = None  # label of the run "x alone" divides by (default: first alone)


@dataclass
class Scenario:
    name: str
    description: str
    workload: Any
    runs: list[Run]
    results: list[dict[str, Any]] = field(default_factory=list)
    served: bool = False  # True: through ``vllm serve`` (a ChatWorkload)


def _recompute_kv() -> dict[str, Any]:
    return {
        "kv_connector": "RecomputeCPUOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use_per_rank": HOST_BYTES},
    }


def _offload_kv(
    spec: str, host_bytes: int, fs_root: str | None = None, **more: Any
) -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu_bytes_to_use": host_bytes, "spec_name": spec, **more}
    if fs_root is not None:
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": fs_root}]
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def _fresh_tiers(kv: dict[str, Any]) -> dict[str, Any]:
    """``kv`` with each fs tier in a new folder under its ``root_dir``: every run of an
    engine starts with an empty fs tier (a repeat would otherwise find the files of the
    run before it and serve even the first pass from them)."""
    extra = kv.get("kv_connector_extra_config", {})
    tiers = extra.get("secondary_tiers")
    if not tiers:
        return kv
    fresh = [
        {**t, "root_dir": tempfile.mkdtemp(prefix="run-", dir=t["root_dir"])}
        if t.get("type") == "fs"
        else t
        for t in tiers
    ]
    return {**kv, "kv_connector_extra_config": {**extra, "secondary_tiers": fresh}}


def server_args(engine: dict[str, Any], kv: dict[str, Any] | None) -> list[str]:
    """``vllm serve`` arguments for an engine configuration of this module."""
    from kvtier.testkit.server import kv_transfer_arg

    args: list[str] = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if key == "disable_log_stats":
            continue  # the server logs stats unless told not to
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args + (kv_transfer_arg(kv) if kv is not None else [])


CHAT_ENGINE: dict[str, Any] = {
    **BASE_ENGINE,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 512,
    "seed": 0,
}


def scenarios(fs_root: str) -> list[Scenario]:
    from kvtier.demo.bench_chat import ChatWorkload
    from kvtier.testkit import make_prefix_workload, make_workload
    from kvtier.testkit.null_connector import NULL_CONNECTOR

    # A decode node as the recompute guide tunes it: max_num_batched_tokens sized to
    # max_num_seqs (one new token per request per step), so a preempted request's
    # prompt is recomputed 16 tokens at a time. Admission reserves a request's whole
    # prompt (vLLM's default), so requests are preempted by the decode growth of
    # older ones, right after their 896-token prefill.
    preempt = {**BASE_ENGINE, "max_num_seqs": 16, "max_num_batched_tokens": 16}
    # vLLM's device prefix cache keeps a preempted request's freed blocks until other
    # requests reuse them; without it, every preempted token is recomputed.
    no_prefix_cache = {**preempt, "enable_prefix_caching": False}
    prefix = {**BASE_ENGINE, "max_num_seqs": 2, "max_num_batched_tokens": 512}
    prefix_workload = make_prefix_workload(4, 768, 32, 3, max_tokens=16)
    tight_prefix = {**prefix, "num_gpu_blocks_override": 60}
    roomy_prefix = {**prefix, "num_gpu_blocks_override": 400}
    # Longer prefixes, a prefill in chunks of 256 tokens, one request at a time: a
    # request's prefix (30 blocks) and the next one's do not fit together.
    long_workload = make_prefix_workload(3, 960, 32, 3, max_tokens=16)
    long_prefix = {**BASE_ENGINE, "max_num_seqs": 1, "max_num_batched_tokens": 256}
    tight_long = {**long_prefix, "num_gpu_blocks_override": 40}
    roomy_long = {**long_prefix, "num_gpu_blocks_override": 400}
    tight_preempt = {**no_prefix_cache, "num_gpu_blocks_override": 60}
    tight_cached = {**preempt, "num_gpu_blocks_override": 60}
    chat_tight = {**CHAT_ENGINE, "num_gpu_blocks_override": 64}
    chat_roomy = {**CHAT_ENGINE, "num_gpu_blocks_override": 400}
    return [
        Scenario(
            "preemption",
            "decode node: 16 requests x (896 + 128 tokens), 60 device blocks, "
            "max_num_seqs = max_num_batched_tokens = 16",
            make_workload(16, 896, 128),
            [
                Run(
                    "reference (room for all)",
                    "reference",
                    {**preempt, "num_gpu_blocks_override": 600},
                ),
                Run("vLLM alone (recompute)", "alone", tight_preempt),
                Run("null connector", "null", tight_preempt, NULL_CONNECTOR),
                Run("kvtier recompute connector", "kvtier", tight_preempt, _recompute_kv()),
                Run("vLLM alone + device prefix cache", "alone", tight_cached),
                Run(
                    "kvtier + device prefix cache",
                    "kvtier",
                    tight_cached,
                    _recompute_kv(),
                    baseline="vLLM alone + device prefix cache",
                ),
            ],
        ),
        Scenario(
            "prefix",
            "4 prefixes x 768 tokens asked 3 times (+32, 16 generated), 60 device blocks",
            prefix_workload,
            [
                Run("reference (room for all)", "reference", roomy_prefix),
                Run("vLLM alone (device cache)", "alone", tight_prefix),
                Run("null connector", "null", tight_prefix, NULL_CONNECTOR),
                Run(
                    "kvtier host tier (1 GiB)",
                    "kvtier",
                    tight_prefix,
                    _offload_kv("CPUOffloadingSpec", HOST_BYTES),
                ),
                Run(
                    "kvtier host 48 MiB + fs tier",
                    "kvtier",
                    tight_prefix,
                    _offload_kv("TieringOffloadingSpec", SMALL_HOST_BYTES, fs_root),
                ),
                Run(
                    "kvtier host tier, restores between steps",
                    "variant",
                    tight_prefix,
                    _offload_kv("CPUOffloadingSpec", HOST_BYTES, sync_load_budget_bytes=0),
                ),
            ],
        ),
        Scenario(
            "prefix-long",
            "3 prefixes x 960 tokens asked 3 times (+32, 16 generated), chunked prefill of "
            "256 tokens, one request at a time, 40 device blocks",
            long_workload,
            [
                Run("reference (room for all)", "reference", roomy_long),
                Run("vLLM alone (device cache)", "alone", tight_long),
                Run(
                    "kvtier host tier (1 GiB)",
                    "kvtier",
                    tight_long,
                    _offload_kv("CPUOffloadingSpec", HOST_BYTES),
                ),
                Run(
                    "kvtier host tier, restores between steps",
                    "variant",
                    tight_long,
                    _offload_kv("CPUOffloadingSpec", HOST_BYTES, sync_load_budget_bytes=0),
                ),
            ],
        ),
        Scenario(
            "roomy",
            "the prefix workload with room for everything (400 device blocks)",
            prefix_workload,
            [
                Run("vLLM alone (room for all)", "reference", roomy_prefix),
                Run("null connector", "null", roomy_prefix, NULL_CONNECTOR),
                Run(
                    "kvtier host tier (1 GiB)",
                    "kvtier",
                    roomy_prefix,
                    _offload_kv("CPUOffloadingSpec", HOST_BYTES),
                ),
            ],
        ),
        Scenario(
            "chat",
            "6 users x 4 turns through vllm serve (512-token first message, +64 per turn, "
            "32-token replies), 64 device blocks",
            ChatWorkload(),
            [
                Run("reference (room for all)", "reference", chat_roomy),
                Run("vLLM alone (device cache)", "alone", chat_tight),
                Run("null connector", "null", chat_tight, NULL_CONNECTOR),
                Run(
                    "kvtier host tier (1 GiB)",
                    "kvtier",
                    chat_tight,
                    _offload_kv("CPUOffloadingSpec", HOST_BYTES),
                ),
            ],
            served=True,
        ),
    ]


def run_chat_scenario(model: Path, sc: Scenario, progress: Any, log_dir: Path) -> None:
    """Each run: start ``vllm serve``, play the chat, stop it; TTFT is the measure."""
    from kvtier.demo.bench_chat import serve_chat
    from kvtier.testkit.server import prometheus_values

    replies: dict[str, list[list[int]]] = {}
    for i, run in enumerate(sc.runs):
        progress.set_description(f"{sc.name}: {run.label}")
        result, metrics = serve_chat(
            model,
            server_args(run.engine, run.kv),
            sc.workload,
            log_path=log_dir / f"chat-{i}-{run.role}.log",
        )
        if result.errors:
            raise RuntimeError(f"chat run {run.label!r} failed: {result.errors[0]}")
        replies[run.label] = result.replies()
        hits = prometheus_values(metrics, "vllm:external_prefix_cache_hits_total")
        sc.results.append(
            {
                "run": run.label,
                "role": run.role,
                "wall_s": round(result.wall_s, 2),
                "ttft_p50_s": round(result.ttft_percentile(50), 3),
                "ttft_p90_s": round(result.ttft_percentile(90), 3),
                "output_tok_s": round(result.output_tokens_per_s(), 1),
                "served_tokens": int(sum(hits.values())),
            }
        )
        progress.update(1)
    # For chat the user-felt figure is the time to first token.
    _compare_runs(sc, replies, lambda a, b: a == b, "ttft_p50_s")


def kv_bytes_per_token() -> int:
    """KV bytes per token of the benchmark's model (K and V, every layer, float32)."""
    s = MODEL_SHAPE
    return s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * 4


def measured_copy_gbps() -> float:
    """The copy engine's load rate for the model's KV blocks (GB/s; see ``copy_rate``)."""
    from kvtier.demo.timeline import copy_rate

    per_layer = kv_bytes_per_token() // MODEL_SHAPE["layers"] * BASE_ENGINE["block_size"]
    return copy_rate(MODEL_SHAPE["layers"], per_layer)


def run_scenario(
    model: Path, sc: Scenario, progress: Any, copy_gbps: float | None = None, repeat: int = 1
) -> None:
    """Run each of ``sc``'s engines ``repeat`` times, the runs of the scenario taking
    turns; each keeps its fastest repetition (a shared 2-core machine varies by 5-15%
    from one identical run to the next). Outputs are compared on every repetition."""
    from kvtier.testkit import compare_outputs

    outputs: dict[str, Any] = {}
    best: dict[str, dict[str, Any]] = {}
    identical = True
    for _ in range(max(1, repeat)):
        for run in sc.runs:
            progress.set_description(f"{sc.name}: {run.label}")
            row, out = _run_once(model, sc, run, copy_gbps)
            if run.label in outputs:
                identical = identical and compare_outputs(outputs[run.label], out).identical
            outputs.setdefault(run.label, out)
            if run.label not in best or row["wall_s"] < best[run.label]["wall_s"]:
                best[run.label] = row
            progress.update(1)
    sc.results.extend(best[run.label] for run in sc.runs)
    _compare_runs(sc, outputs, lambda a, b: identical and compare_outputs(a, b).identical, "wall_s")


def _run_once(
    model: Path, sc: Scenario, run: Run, copy_gbps: float | None
) -> tuple[dict[str, Any], Any]:
    """One engine run of ``run``: its result row and its outputs."""
    from kvtier.demo.timeline import RestoreTimeline
    from kvtier.testkit import free_llm, kv_transfer_config, make_llm, run_workload

    engine = dict(run.engine)
    offloading = run.kv is not None and run.kv["kv_connector"] == "OffloadingConnector"
    if run.kv is not None:
        engine["kv_transfer_config"] = kv_transfer_config(_fresh_tiers(run.kv))
    llm = make_llm(model, **engine)
    timeline = None
    try:
        timeline = RestoreTimeline(llm) if offloading else None
        result = run_workload(llm, sc.workload)
    finally:
        if timeline is not None:
            timeline.close()
        free_llm(llm)
    m = result.metrics
    row: dict[str, Any] = {
        "run": run.label,
        "role": run.role,
        "wall_s": round(result.wall_s, 2),
        "preemptions": result.preemptions,
        "scheduled_tokens": result.scheduled_tokens,
        "served_tokens": int(
            m.get("vllm:kvtier_recompute_tokens_restored", 0)
            + m.get("vllm:external_prefix_cache_hits", 0)
        ),
    }
    if timeline is not None and copy_gbps:
        row["restores"] = timeline.summary(kv_bytes_per_token(), copy_gbps)
    return row, result.outputs


def _compare_runs(
    sc: Scenario, outputs: dict[str, Any], same: Callable[[Any, Any], bool], key: str
) -> None:
    """Set each result's ``identical`` (its outputs against the reference run's) and
    ``vs_alone`` (its ``key`` over its baseline's: ``Run.baseline``, else the first
    vLLM-alone run, else the reference)."""
    ref = next(r for r in sc.results if r["role"] == "reference")
    alone = next((r for r in sc.results if r["role"] == "alone"), ref)
    by_label = {r["run"]: r for r in sc.results}
    for run, r in zip(sc.runs, sc.results):
        r["identical"] = same(outputs[ref["run"]], outputs[r["run"]])
        base = by_label[run.baseline] if run.baseline else alone
        r["vs_alone"] = round(r[key] / base[key], 3) if base[key] else None


def _goal(goal: str, value: float | None, limit: float, *, at_most: bool) -> dict[str, Any]:
    met = value is not None and (value <= limit if at_most else value >= limit)
    return {
        "goal": goal,
        "value": value,
        "target": f"{'<=' if at_most else '>='} {limit}",
        "met": met,
    }


def goals(done: dict[str, Scenario]) -> list[dict[str, Any]]:
    """The goals kvtier is held to, each with its measured value (None: not measured)."""

    def wall(name: str, role: str, index: int = 0) -> float | None:
        runs = done[name].results if name in done else []
        found = [r["wall_s"] for r in runs if r["role"] == role]
        return found[index] if len(found) > index else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    # Where vLLM alone runs out of device memory; "roomy" has its own goal below.
    worst = [
        r["vs_alone"]
        for name, sc in done.items()
        if name != "roomy"
        for r in sc.results
        if r["role"] == "kvtier"
    ]
    out = [
        _goal(
            "kvtier never slower than vLLM alone (kvtier / alone, worst; chat: TTFT p50)",
            max(worst) if worst else None,
            1.0,
            at_most=True,
        ),
        _goal(
            "forced preemption: kvtier / vLLM alone wall time",
            ratio(wall("preemption", "kvtier"), wall("preemption", "alone")),
            0.85,
            at_most=True,
        ),
    ]
    for name, index, label, target in (
        ("prefix", 0, "host tier", 0.9),
        ("prefix", 1, "host too small + fs tier", 0.5),
        ("prefix-long", 0, "longer prefixes, chunked prefill, host tier", 0.9),
    ):
        ref, alone = wall(name, "reference"), wall(name, "alone")
        kv = wall(name, "kvtier", index)
        closed = None
        if ref is not None and alone is not None and kv is not None and alone > ref:
            closed = round((alone - kv) / (alone - ref), 3)
        out.append(
            _goal(
                f"{name}, {label}: share of the gap alone -> reference closed",
                closed,
                target,
                at_most=False,
            )
        )
    for name in ("prefix", "prefix-long"):
        runs = done[name].results if name in done else []
        over = [
            r["restores"]["wall_over_copy"]
            for r in runs
            if r["role"] == "kvtier" and r.get("restores", {}).get("wall_over_copy") is not None
        ]
        out.append(
            _goal(
                f"{name}: restore wall time / its bytes at the copy engine's rate (worst run)",
                max(over) if over else None,
                2.0,
                at_most=True,
            )
        )
    out.append(
        _goal(
            "room for everything: kvtier on / off",
            ratio(wall("roomy", "kvtier"), wall("roomy", "reference")),
            1.02,
            at_most=True,
        )
    )
    chat = {r["role"]: r for r in done["chat"].results} if "chat" in done else {}
    out.append(
        _goal(
            "multi-turn chat through vllm serve: TTFT p50, vLLM alone / kvtier",
            ratio(chat["alone"]["ttft_p50_s"], chat["kvtier"]["ttft_p50_s"])
            if "alone" in chat and "kvtier" in chat
            else None,
            2.0,
            at_most=False,
        )
    )
    return out


BATCH_COLUMNS = [
    ("run", "run"),
    ("wall s", "wall_s"),
    ("x alone", "vs_alone"),
    ("preempt", "preemptions"),
    ("scheduled tok", "scheduled_tokens"),
    ("kvtier tok", "served_tokens"),
    ("outputs", "identical"),
]
CHAT_COLUMNS = [
    ("run", "run"),
    ("TTFT p50 s", "ttft_p50_s"),
    ("TTFT p90 s", "ttft_p90_s"),
    ("x alone (p50)", "vs_alone"),
    ("out tok/s", "output_tok_s"),
    ("wall s", "wall_s"),
    ("kvtier tok", "served_tokens"),
    ("outputs", "identical"),
]


def print_table(done: dict[str, Scenario]) -> None:
    for sc in done.values():
        cols = CHAT_COLUMNS if sc.served else BATCH_COLUMNS
        print(f"\n== {sc.name}: {sc.description}")
        cells = [
            [("match" if r[k] else "DIFFER") if k == "identical" else str(r[k]) for _, k in cols]
            for r in sc.results
        ]
        _print_cells([h for h, _ in cols], cells)


def _print_cells(heads: list[str], cells: list[list[str]]) -> None:
    """A table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    for row in [heads, *cells]:
        cells_out = [v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))]
        print("  ".join(cells_out))


TIMELINE_COLUMNS = [
    ("run", "run"),
    ("restores", "restores"),
    ("in step", "sync"),
    ("MiB", "restored_mib"),
    ("lookup->submit ms", "lookup_to_submit_ms"),
    ("submit->loaded ms", "submit_to_loaded_ms"),
    ("of it: ->copy ms", "submit_to_copy_ms"),
    ("copy ms", "copy_ms"),
    ("loaded->scheduled ms", "loaded_to_scheduled_ms"),
    ("steps waited", "steps_waited_median"),
    ("restore ms (p50)", "restore_wall_ms"),
    ("restore s (sum)", "restore_wall_total_s"),
    ("copy s (sum)", "copy_cost_total_s"),
    ("x copy", "wall_over_copy"),
]


def print_timeline(done: dict[str, Scenario], copy_gbps: float) -> None:
    """Per run with restores: medians of the restore phases, and the wall time of
    restoring beside what its bytes cost at the copy engine's rate."""
    rows = [
        {"run": f"{sc.name}: {r['run']}", **r["restores"]}
        for sc in done.values()
        for r in sc.results
        if r.get("restores", {}).get("restores")
    ]
    if not rows:
        return
    print(
        f"\n== restores (per request: looked up -> load submitted -> loaded -> scheduled; "
        f"copy engine {copy_gbps:.1f} GB/s; 'in step': loaded before the step's forward, "
        f"its copy submitted by the worker '->copy' after the load was planned)"
    )
    _print_cells(
        [h for h, _ in TIMELINE_COLUMNS],
        [["-" if (v := r.get(k)) is None else str(v) for _, k in TIMELINE_COLUMNS] for r in rows],
    )


def warm_up(model: Path) -> None:
    """One short engine run first: the first engine of a process pays for imports and
    kernel set-up that later ones do not, and would skew whichever run came first."""
    from kvtier.testkit import Workload, run_with

    run_with(model, Workload(((5, 6, 7, 8) * 8,), 4), **BASE_ENGINE)


def plot(done: dict[str, Scenario], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(done), figsize=(5 * len(done), 4), squeeze=False)
    for ax, sc in zip(axes[0], done.values()):
        labels = [r["run"] for r in sc.results]
        key = "ttft_p50_s" if sc.served else "wall_s"
        values = [r[key] for r in sc.results]
        colors = [
            {"reference": "#999999", "alone": "#d62728", "null": "#ff9896"}.get(
                r["role"], "#1f77b4"
            )
            for r in sc.results
        ]
        ax.barh(labels[::-1], values[::-1], color=colors[::-1])
        ax.set_title(sc.name)
        ax.set_xlabel(
            "time to first token, p50 s (lower is better)"
            if sc.served
            else "wall seconds (lower is better)"
        )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--png", help="write a chart here (default: beside --json)")
    parser.add_argument(
        "--only",
        nargs="*",
        choices=("preemption", "prefix", "prefix-long", "roomy", "chat"),
        help="workloads to run",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each engine (not chat), taking turns; the fastest is kept (default 1)",
    )
    opts = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tqdm import tqdm

    from kvtier.testkit import make_tiny_llama

    model = make_tiny_llama(None, **MODEL_SHAPE)
    log_dir = Path(opts.json).parent if opts.json else Path(tempfile.gettempdir())
    copy_gbps = measured_copy_gbps()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-fs-") as fs_root:
        chosen = [s for s in scenarios(fs_root) if not opts.only or s.name in opts.only]
        done: dict[str, Scenario] = {}
        if any(not sc.served for sc in chosen):
            warm_up(model)
        total = sum(len(s.runs) * (1 if s.served else max(1, opts.repeat)) for s in chosen)
        with tqdm(total=total, unit="run") as progress:
            for sc in chosen:
                if sc.served:
                    run_chat_scenario(model, sc, progress, log_dir)
                else:
                    run_scenario(model, sc, progress, copy_gbps, opts.repeat)
                done[sc.name] = sc
    print_table(done)
    print_timeline(done, copy_gbps)
    results = goals(done)
    print("\n== goals")
    for g in results:
        value = "not measured" if g["value"] is None else g["value"]
        print(f"  {'met ' if g['met'] else 'MISS'}  {g['goal']}: {value} (target {g['target']})")
    if opts.json:
        out = {
            "model": MODEL_SHAPE,
            "workloads": {
                name: {"description": sc.description, "runs": sc.results}
                for name, sc in done.items()
            },
            "copy_gbps": round(copy_gbps, 2),
            "goals": results,
        }
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {opts.json}")
    png = opts.png or (str(Path(opts.json).with_suffix(".png")) if opts.json else None)
    if png:
        plot(done, Path(png))
        print(f"wrote {png}")
    identical = all(r["identical"] for sc in done.values() for r in sc.results)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
