"""Step-cost benchmark: what each KV connector adds to every engine step, in CPU time.

    python -m kvtier.demo.bench_step [--json out.json] [--only WORKLOAD ...]
                                     [--connectors NAME ...] [--repeat N] [--breakdown]
                                     [--calls]

On an NPU or GPU a decode step lasts a few milliseconds, and a connector's Python work
is paid on that step's critical path: the scheduler side between two forwards, the
worker side around each forward. This program measures that work on vLLM's CPU
platform, where the forward is slow but the Python work is the same as on an
accelerator. Each engine runs in this process; every scheduler-side and worker-side
method of the connector is timed with the calling thread's CPU time
(``time.thread_time_ns``), so the figures hold on a busy machine; the block copies
themselves (an accelerator's DMA) are left out, including those kvtier's CPU copy
engine runs on the calling thread.

Per step it records vLLM's own scheduler cost (``schedule`` plus ``update_from_output``
less the connector's calls inside them), the connector's scheduler side and its worker
side, and gives the median and p90 over the steps that scheduled work. Beside them:
the scheduler side's p90 over the steps that admit no request ("steady": where a tier's
background work would show), its cost per admitted request over the steps that admit
some (lookups, load and store plans grow with the requests a step admits, for vLLM's
connector too), and the worker side's median over the steps in which nothing moves
("quiet": no transfer job in the step's metadata nor in the two before).

Each connector first runs once on a short workload (a process's first engine pays for
imports), and each engine then serves two short requests of its own (random tokens)
before its device prefix cache and its connector's are reset and it is timed: what an
engine does once (the first use of its objects' caches and allocations, its first log
lines) is no step's cost in an engine that serves for hours, and it weighed on the
per-admitted figure of workloads that admit every request in their first step (by
20-35% for ``room-8`` and ``room-64``, for every connector alike).

A step admits requests where it schedules new or resumed ones, or where the scheduler
allocates device blocks for a waiting request (``update_state_after_alloc``): a request
whose hit loads asynchronously is looked up and allocated in one step and scheduled in
a later one (vLLM's connector loads every hit so; kvtier's loads a hit within the
step's budget before the forward pass of the step that finds it). Both steps count
toward its admission, including a step that scheduled no token because every request
waited for its load.

Connectors (``--connectors``):

* ``none``: vLLM alone;
* ``vllm``: vLLM's own ``OffloadingConnector`` with vLLM's own ``CPUOffloadingManager``
  (the anchor); its worker completes every transfer at once and copies nothing (vLLM's
  copy worker runs only on CUDA and XPU; the scheduler side is vLLM's code unchanged);
* ``kvtier-host``: kvtier's ``CPUOffloadingSpec`` (host tier, room for every block);
* ``kvtier-fs``: kvtier's ``TieringOffloadingSpec``, a host tier that holds about a
  quarter of the workload's blocks in front of an ``fs`` tier;
* ``recompute``: kvtier's ``RecomputeCPUOffloadConnector``;
* ``kvtier-rec``: ``kvtier-host`` recording the traffic (``record_traffic_dir``); run
  only when named: beside ``kvtier-host`` it gives what recording adds to a step.

Workloads (``--only``): ``room-8``, ``room-64``, ``room-256`` (that many requests
running at once, room for all on the device: the cost when nothing needs moving),
``prefix-N`` (prefixes asked again after the device cache dropped them: lookups,
loads) and ``preempt-N`` (too few device blocks: preemptions), N in 8, 64, 256.

With ``--breakdown`` the manager's methods are timed too, and for each kvtier run it
prints where the steady p90 comes from: each method's µs per step over the costliest 15%
of the steps admitting nothing, beside the middle fifth of them (``steady_profile`` in
the JSON).

Prints a table per workload, the five costliest kvtier methods in µs per call, the goals
with their measured values, and the share of a 15 ms and a 30 ms accelerator step each
connector takes; writes JSON.

With ``--calls`` it counts instead of timing: the scheduler side's Python calls and calls
of builtins (``sys.setprofile`` around each outermost connector call), the median per
step and per request admitted, beside vLLM's own connector. A count does not move with
the machine's load, so a change of a few percent shows in one run, where the times of a
2-core VM move by more than that from run to run; the times of a counted run mean
nothing, and no goal is judged.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A tiny model: the forward is cheap, so the scheduler's work is what a step shows.
MODEL_SHAPE: dict[str, int] = {"layers": 2, "hidden": 128, "heads": 2, "head_dim": 64}
BLOCK_TOKENS = 32
ENGINE: dict[str, Any] = {
    "block_size": BLOCK_TOKENS,
    "enforce_eager": True,
    "dtype": "float32",
    "disable_log_stats": False,
    "gpu_memory_utilization": 0.2,
    "max_model_len": 1024,
    "max_num_batched_tokens": 8192,
    "seed": 0,
}
ACCELERATOR_STEPS_MS = (15.0, 30.0)
# Fewest steps of a kind (steps admitting nothing, steps moving nothing) a goal is read on.
MIN_STEPS = 10

# Scheduler-side and worker-side methods of vLLM's KV connector API (v1), as vLLM's
# scheduler and model runner call them. Calls nested inside another are not counted twice.
SCHEDULER_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "on_new_request",
    "has_pending_work",
    "get_finished_count",
    "get_external_cache_hit_sources",
    "get_loaded_kv_cache_group_ids",
    "has_pending_block_frees",
    "has_pending_push_work",
    "register_finished_partial_tail",
)
WORKER_METHODS = (
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "clear_connector_metadata",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
)
# The offloading manager's API (vLLM's OffloadingManager): timed in the breakdown only.
MANAGER_METHODS = (
    "lookup",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "take_events",
    "on_schedule_end",
    "on_request_finished",
    "on_new_request",
    "get_stats",
    "has_pending_work",
    "get_load_source",
)


# -- vLLM's own connector with its own manager (the anchor) -----------------------------


def _anchor_spec_class() -> type:
    """vLLM's ``CPUOffloadingSpec`` with a worker that copies nothing: vLLM's worker
    refuses to start on its CPU platform, and the anchor is its scheduler side."""
    from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    class InstantWorker(OffloadingWorker):
        def __init__(self) -> None:
            self._done: list[Any] = []

        def submit_store(self, job_id: int, *args: Any, **kwargs: Any) -> bool:
            self._done.append(TransferResult(job_id=job_id, success=True))
            return True

        def submit_load(self, job_id: int, *args: Any, **kwargs: Any) -> bool:
            self._done.append(TransferResult(job_id=job_id, success=True))
            return True

        def get_finished(self) -> list[Any]:
            done, self._done = self._done, []
            return done

        def wait(self, job_ids: set[int]) -> None:
            return None

    class VllmCPUOffloadingSpec(CPUOffloadingSpec):
        def get_worker(self, kv_caches: Any) -> Any:
            worker = self.__dict__.get("_instant_worker")
            if worker is None:
                worker = self.__dict__["_instant_worker"] = InstantWorker()
            return worker

    return VllmCPUOffloadingSpec


def __getattr__(name: str) -> Any:
    # vLLM's offloading factory loads the anchor's spec by module path and class name.
    if name == "VllmCPUOffloadingSpec":
        cls = _anchor_spec_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


ANCHOR_CONNECTOR = "VllmOffloadingConnector"


def _register_anchor_connector() -> None:
    """vLLM's own ``OffloadingConnector`` under a name of its own: kvtier's plugin puts
    its subclass under vLLM's name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if ANCHOR_CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            ANCHOR_CONNECTOR,
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
            "OffloadingConnector",
        )


# -- workloads and connectors --------------------------------------------------------


@dataclass(frozen=True)
class StepWorkload:
    """One workload: prompts, how many run at once, and the device blocks."""

    name: str
    description: str
    running: int
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    device_blocks: int

    @property
    def blocks_needed(self) -> int:
        """Device blocks every request's whole sequence takes (prompt + generated)."""
        per = [-(-(len(p) + self.max_tokens) // BLOCK_TOKENS) for p in self.prompts]
        return sum(per)


WARM_UP_SEED = 7_000_001  # (no workload's seed)


def workloads() -> list[StepWorkload]:
    from kvtier.testkit import make_prefix_workload, make_workload

    out: list[StepWorkload] = []
    for n in (8, 64, 256):
        # Room for all: n requests decode side by side for 128 steps after their prefill.
        w = make_workload(n, 96, 128, seed=n)
        blocks = n * -(-(96 + 128) // BLOCK_TOKENS) + 16
        out.append(
            StepWorkload(
                f"room-{n}",
                f"{n} requests x (96 + 128 tokens), room for all",
                n,
                w.prompts,
                w.max_tokens,
                blocks,
            )
        )
    for n in (8, 64, 256):
        # Prefix reuse: n prefixes of 256 tokens, asked 3 times round-robin, n/2 running;
        # the device holds about a quarter of the prefixes, so most come back from kvtier.
        groups = max(n, 4)
        w = make_prefix_workload(groups, 256, 32, 3, max_tokens=32, seed=n)
        per_request = -(-(256 + 32 + 32) // BLOCK_TOKENS)
        running = max(n // 2, 2)
        out.append(
            StepWorkload(
                f"prefix-{n}",
                f"{groups} prefixes x 256 tokens asked 3 times (+32, 32 generated), "
                f"{running} running, the device holds a quarter of the prefixes",
                running,
                w.prompts,
                w.max_tokens,
                max(running * per_request + 8, groups * 8 // 4 + running * 2),
            )
        )
    for n in (8, 64, 256):
        # Preemption: n requests x (64 + 160 tokens) on device blocks for 60% of them.
        w = make_workload(n, 64, 160, seed=100 + n)
        per_request = -(-(64 + 160) // BLOCK_TOKENS)
        out.append(
            StepWorkload(
                f"preempt-{n}",
                f"{n} requests x (64 + 160 tokens), device blocks for 60% of them",
                n,
                w.prompts,
                w.max_tokens,
                max(n * per_request * 6 // 10, per_request + 2),
            )
        )
    return out


def kv_bytes_per_block() -> int:
    s = MODEL_SHAPE
    return 2 * s["layers"] * s["heads"] * s["head_dim"] * 4 * BLOCK_TOKENS


def connector_config(name: str, wl: StepWorkload, fs_root: str) -> dict[str, Any] | None:
    """``kv_transfer_config`` of connector ``name`` for workload ``wl`` (None: no connector)."""
    total = wl.blocks_needed * kv_bytes_per_block()
    room = max(2 * total, 64 << 20)
    if name == "none":
        return None
    if name == "vllm":
        return {
            "kv_connector": ANCHOR_CONNECTOR,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": room,
                "spec_name": "VllmCPUOffloadingSpec",
                "spec_module_path": "kvtier.demo.bench_step",
            },
        }
    if name == "kvtier-host":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": room,
                "spec_name": "CPUOffloadingSpec",
            },
        }
    if name == "kvtier-fs":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": max(total // 4, 4 * kv_bytes_per_block()),
                "spec_name": "TieringOffloadingSpec",
                "secondary_tiers": [{"type": "fs", "root_dir": fs_root}],
            },
        }
    if name == "kvtier-rec":
        host = connector_config("kvtier-host", wl, fs_root)
        assert host is not None
        extra = host["kv_connector_extra_config"]
        extra["record_traffic_dir"] = os.path.join(fs_root, "traffic")
        return host
    if name == "recompute":
        return {
            "kv_connector": "RecomputeCPUOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use_per_rank": room},
        }
    raise ValueError(f"unknown connector {name!r}")


CONNECTORS = ("none", "vllm", "kvtier-host", "kvtier-fs", "recompute", "kvtier-rec")
# Run unless --connectors names others (kvtier-rec measures recording's cost only).
DEFAULT_CONNECTORS = CONNECTORS[:-1]


# -- timing ----------------------------------------------------------------------------


@dataclass
class MethodStats:
    calls: int = 0
    ns: int = 0


class _CopyClock(threading.local):
    """CPU time this thread spent in the copy engine's block copies (ns)."""

    ns = 0


COPY_CLOCK = _CopyClock()


class _CallCount:
    """``--calls``: the Python calls and the calls of builtins made inside the timed
    connector methods (``sys.setprofile`` around each outermost call; the timing
    wrappers' own calls are not counted). A count does not move with the machine's load,
    as CPU time does; the timings of a counted run mean nothing (the profile slows
    every call)."""

    on = False
    py = 0
    c = 0
    wrapper: Any = None  # the timing wrapper's code: its frames and their calls are not counted

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if frame.f_code is self.wrapper:
            return
        if event == "call":
            self.py += 1
        elif event == "c_call":
            self.c += 1


COUNTS = _CallCount()


@contextmanager
def copies_excluded() -> Iterator[None]:
    """Count the CPU backend's block copies on :data:`COPY_CLOCK`, so the connectors'
    figures leave them out: on an NPU or GPU they are DMA, not the calling thread's."""
    try:
        from kvtier.npu_copy.cpu_backend import CPUBackend
    except ImportError:  # no kvtier copy engine here: nothing to leave out
        yield
        return
    original = CPUBackend._copy
    clock = time.thread_time_ns

    def timed_copy(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return original(self, *args, **kwargs)
        finally:
            COPY_CLOCK.ns += clock() - t0

    CPUBackend._copy = timed_copy  # type: ignore[method-assign]
    try:
        yield
    finally:
        CPUBackend._copy = original  # type: ignore[method-assign]


@dataclass
class Side:
    """Accumulates one side's (scheduler or worker) CPU time of the outermost calls, less
    the timer's own cost (:data:`TIMER`): on a 2-layer model vLLM calls a connector about
    15 times a step, and a timed call costs about a microsecond more than a plain one."""

    acc: int = 0
    outer_calls: int = 0
    calls_acc: tuple[int, int] = (0, 0)  # --calls: (Python, builtin) calls of outer calls
    depth: threading.local = field(default_factory=threading.local)
    methods: dict[str, MethodStats] = field(default_factory=dict)
    # With --breakdown: each method's time in the current step (nested calls included).
    in_step: dict[str, int] | None = None

    def wrap(self, obj: Any, names: tuple[str, ...], prefix: str = "") -> None:
        for name in names:
            fn = getattr(obj, name, None)
            if fn is None or not callable(fn):
                continue
            setattr(obj, name, self._timed(prefix + name, fn))

    def _timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        stats = self.methods.setdefault(label, MethodStats())
        local = self.depth
        clock = time.thread_time_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(local, "d", 0)
            local.d = depth + 1
            calls = local.calls = getattr(local, "calls", 0) + 1
            counting = COUNTS.on and depth == 0
            if counting:
                counted = (COUNTS.py, COUNTS.c)
                sys.setprofile(COUNTS.profile)
            copied = COPY_CLOCK.ns
            t0 = clock()
            try:
                result = fn(*args, **kwargs)
                if hasattr(result, "__next__"):  # a generator: time it as it is drained
                    result = list(result)
                return result
            finally:
                spent = clock() - t0 - (COPY_CLOCK.ns - copied)
                if counting:
                    sys.setprofile(None)
                    py, c = self.calls_acc
                    self.calls_acc = (py + COUNTS.py - counted[0], c + COUNTS.c - counted[1])
                local.d = depth
                # This call's timer and those of the timed calls inside it.
                spent -= TIMER.own_ns + (local.calls - calls) * TIMER.nested_ns
                spent = max(spent, 0)
                stats.calls += 1
                stats.ns += spent
                if self.in_step is not None:
                    self.in_step[label] = self.in_step.get(label, 0) + spent
                if depth == 0:
                    self.acc += spent
                    self.outer_calls += 1

        COUNTS.wrapper = timed.__code__  # (the same code for every wrapper)
        return timed

    def take(self) -> int:
        spent, self.acc = self.acc, 0
        return spent

    def take_calls(self) -> tuple[int, int]:
        """The (Python, builtin) calls counted since the last call (``--calls``)."""
        counted, self.calls_acc = self.calls_acc, (0, 0)
        return counted


@dataclass
class TimerCost:
    """What timing a call adds: to its own figure (``own_ns``) and to the figure of a
    timed call around it (``nested_ns``). Measured by :func:`calibrate`."""

    own_ns: int = 0
    nested_ns: int = 0


TIMER = TimerCost()


def calibrate(rounds: int = 5, calls: int = 2000) -> TimerCost:
    """Measure :data:`TIMER` on this machine (the lowest of ``rounds`` means)."""

    def noop() -> None:
        return None

    class Probe:
        pass

    saved = TimerCost(TIMER.own_ns, TIMER.nested_ns)
    TIMER.own_ns = TIMER.nested_ns = 0
    probe = Probe()
    side = Side()
    probe.noop = noop  # type: ignore[attr-defined]
    side.wrap(probe, ("noop",))
    inner = probe.noop  # type: ignore[attr-defined]
    own, nested = [], []
    clock = time.thread_time_ns
    try:
        for _ in range(rounds):
            before = side.methods["noop"].ns
            for _ in range(calls):
                inner()
            own.append((side.methods["noop"].ns - before) // calls)
            t0 = clock()
            for _ in range(calls):
                inner()
            timed_loop = clock() - t0
            t0 = clock()
            for _ in range(calls):
                noop()
            plain_loop = clock() - t0
            nested.append(max(0, timed_loop - plain_loop) // calls)
    finally:
        TIMER.own_ns, TIMER.nested_ns = saved.own_ns, saved.nested_ns
    return TimerCost(min(own), min(nested))


@dataclass
class StepRecorder:
    """Per-step CPU time: vLLM's scheduler, the connector's scheduler side, its worker side."""

    scheduler: Side = field(default_factory=Side)
    worker: Side = field(default_factory=Side)
    manager: Side = field(default_factory=Side)
    schedule_calls: list[tuple[int, int, int]] = field(default_factory=list)  # total, conn, tokens
    update_calls: list[tuple[int, int]] = field(default_factory=list)
    # --calls: the scheduler side's (Python, builtin) calls per step, arrivals before it
    # included, as for its time.
    step_counts: list[tuple[int, int]] = field(default_factory=list)
    worker_steps: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)  # requests admitted or resumed, per step
    allocated: list[int] = field(default_factory=list)  # update_state_after_alloc calls, per step
    worker_jobs: list[int] = field(default_factory=list)  # transfer jobs in each step's metadata
    # With --breakdown: per scheduler step, each scheduler-side and manager method's
    # time (ns) from its schedule() to the next one (its schedule and update_from_output).
    step_methods: list[dict[str, int]] = field(default_factory=list)

    def attach(self, llm: Any, *, breakdown: bool) -> None:
        from kvtier.testkit import scheduler_of

        sched = scheduler_of(llm)
        conn = sched.connector
        if conn is not None:
            self.scheduler.wrap(conn, SCHEDULER_METHODS)
            if breakdown:
                manager = getattr(getattr(conn, "connector_scheduler", None), "manager", None)
                if manager is not None:
                    self.manager.wrap(manager, MANAGER_METHODS, "manager.")
        clock = time.thread_time_ns
        orig_schedule, orig_update = sched.schedule, sched.update_from_output

        side = self.scheduler
        if breakdown:
            side.in_step = self.manager.in_step = {}

        allocs = side.methods.get("update_state_after_alloc") or MethodStats()

        def schedule(*args: Any, **kwargs: Any) -> Any:
            if side.in_step is not None:
                if self.schedule_calls:  # (the previous step's calls)
                    self.step_methods.append(dict(side.in_step))
                side.in_step.clear()
            between = side.take()  # calls outside a step (request arrivals)
            timed_calls = side.outer_calls
            allocs_before = allocs.calls
            t0 = clock()
            out = orig_schedule(*args, **kwargs)
            total = clock() - t0 - (side.outer_calls - timed_calls) * TIMER.nested_ns
            conn_ns = side.take()
            if COUNTS.on:
                self.step_counts.append(side.take_calls())  # (arrivals' calls included)
            self.schedule_calls.append(
                (total + between, conn_ns + between, int(out.total_num_scheduled_tokens))
            )
            self.admitted.append(_admitted(out))
            self.allocated.append(allocs.calls - allocs_before)
            return out

        def update(*args: Any, **kwargs: Any) -> Any:
            timed_calls = side.outer_calls
            t0 = clock()
            out = orig_update(*args, **kwargs)
            total = clock() - t0 - (side.outer_calls - timed_calls) * TIMER.nested_ns
            self.update_calls.append((total, side.take()))
            if COUNTS.on and self.step_counts:
                (py, c), (upy, uc) = self.step_counts[-1], side.take_calls()
                self.step_counts[-1] = (py + upy, c + uc)
            return out

        sched.schedule, sched.update_from_output = schedule, update
        if conn is not None:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            wconn = get_kv_transfer_group()
            self.worker.wrap(wconn, WORKER_METHODS, "worker.")
            bind = wconn.bind_connector_metadata

            def bind_step(*args: Any, **kwargs: Any) -> Any:
                self.worker_steps.append(self.worker.take())  # the previous step's calls
                self.worker_jobs.append(_jobs_in(args[0] if args else None))
                return bind(*args, **kwargs)

            wconn.bind_connector_metadata = bind_step

    def steps(self, *, all_steps: bool = False) -> list[dict[str, int]]:
        """Per step that scheduled tokens (``all_steps``: every step): vLLM's scheduler,
        the connector's scheduler side (ns), the requests it admitted, whether it
        admitted or allocated for some (``admits``, see the module), and its place among
        all steps (``step``)."""
        out = []
        for step, ((total, conn, tokens), (utotal, uconn), admitted, allocated) in enumerate(
            zip(self.schedule_calls, self.update_calls, self.admitted, self.allocated)
        ):
            if tokens == 0 and not all_steps:
                continue
            out.append(
                {
                    "vllm": total + utotal - conn - uconn,
                    "sched": conn + uconn,
                    "admitted": admitted,
                    "admits": int(bool(admitted or allocated)),
                    "step": step,
                }
            )
        return out

    def worker_per_step(self) -> list[int]:
        # The first entry holds what ran before the first step; the last step's calls
        # are taken at the end.
        return [*self.worker_steps[1:], self.worker.take()]

    def quiet_worker_steps(self) -> list[int]:
        """Worker CPU time of the steps in which nothing moved: no transfer job in their
        metadata nor in the two steps' before (vLLM submits a store a step later, and a
        copy may end a step after that)."""
        per_step, jobs = self.worker_per_step(), self.worker_jobs
        return [
            ns
            for i, ns in enumerate(per_step)
            if i >= 2 and not (jobs[i] or jobs[i - 1] or jobs[i - 2])
        ]


def _admitted(output: Any) -> int:
    """Requests a scheduler output admits: new ones and resumed ones."""
    cached = getattr(output, "scheduled_cached_reqs", None)
    resumed = getattr(cached, "resumed_req_ids", None) or ()
    return len(getattr(output, "scheduled_new_reqs", None) or ()) + len(resumed)


def _jobs_in(meta: Any) -> int:
    """Transfer jobs a step's connector metadata carries (vLLM's offloading connector:
    loads, stores, flushes; the recompute connector: its plan's loads and stores)."""
    if meta is None:
        return 0
    plan = getattr(meta, "plan", None)
    if plan is not None:
        return len(getattr(plan, "loads", ()) or ()) + len(getattr(plan, "stores", ()) or ())
    return sum(
        len(getattr(meta, name, None) or ())
        for name in ("load_jobs", "store_jobs", "jobs_to_flush")
    )


def _pct(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k] / 1000.0


def _mean(values: list[int]) -> float:
    """The mean of ``values`` (ns) in µs; 0 for none."""
    return round(sum(values) / len(values) / 1000.0, 1) if values else 0.0


def summarize(rec: StepRecorder) -> dict[str, Any]:
    steps = rec.steps()
    vllm = [s["vllm"] for s in steps]
    sched = [s["sched"] for s in steps]
    worker = rec.worker_per_step() if rec.worker_steps else []
    quiet = rec.quiet_worker_steps() if rec.worker_steps else []
    # Steps that admit no request: what is left of a step's cost without admissions.
    steady = [s["sched"] for s in steps if not s["admits"]]
    # Admissions: every step that admits or allocates, scheduling tokens or not.
    admitting = [s for s in rec.steps(all_steps=True) if s["admits"]]
    admitted = sum(s["admitted"] for s in admitting)
    profile = steady_profile(rec) if rec.scheduler.in_step is not None else None
    return {
        "steps": len(steps),
        "vllm_sched_us": {
            "median": _pct(vllm, 0.5),
            "p90": _pct(vllm, 0.9),
            "mean": _mean(vllm),
        },
        "sched_us": {
            "median": _pct(sched, 0.5),
            "mean": _mean(sched),
            "p90": _pct(sched, 0.9),
            "max": _pct(sched, 1.0),
            "steady_steps": len(steady),
            "steady_median": _pct(steady, 0.5),
            "steady_p90": _pct(steady, 0.9),
            # The scheduler side of the steps that admit requests, per request admitted.
            "per_admitted": round(sum(s["sched"] for s in admitting) / admitted / 1000.0, 1)
            if admitted
            else 0.0,
        },
        "worker_us": {
            "median": _pct(worker, 0.5),
            "p90": _pct(worker, 0.9),
            "quiet_steps": len(quiet),
            "quiet_median": _pct(quiet, 0.5),
        },
        "methods": {
            name: {
                "calls": s.calls,
                "us_per_call": round(s.ns / s.calls / 1000.0, 2),
                "total_ms": round(s.ns / 1e6, 2),
            }
            for side in (rec.scheduler, rec.worker, rec.manager)
            for name, s in side.methods.items()
            if s.calls
        },
        **({"steady_profile": profile} if profile else {}),
        **({"calls": count_summary(rec)} if rec.step_counts else {}),
    }


def count_summary(rec: StepRecorder) -> dict[str, float]:
    """``--calls``: the scheduler side's Python and builtin calls, the median per step
    (the steps that scheduled tokens) and per request admitted (the steps that admit)."""
    counts = rec.step_counts
    steps = [s for s in rec.steps(all_steps=True) if s["step"] < len(counts)]
    scheduled = [counts[s["step"]] for s in rec.steps() if s["step"] < len(counts)]
    admitting = [s for s in steps if s["admits"]]
    admitted = sum(s["admitted"] for s in admitting)

    def per_admitted(part: int) -> float:
        total = sum(counts[s["step"]][part] for s in admitting)
        return round(total / admitted, 1) if admitted else 0.0

    def median(values: list[int]) -> float:
        return float(sorted(values)[len(values) // 2]) if values else 0.0

    return {
        "py_per_step": median([py for py, _ in scheduled]),
        "c_per_step": median([c for _, c in scheduled]),
        "py_per_admitted": per_admitted(0),
        "c_per_admitted": per_admitted(1),
    }


def print_counts(results: dict[str, dict[str, dict[str, Any]]]) -> None:
    """``--calls``: a table of the scheduler side's calls per workload."""
    cols = ("connector", "py/step", "builtin/step", "py/admitted", "builtin/admitted",
            "x vLLM conn")  # fmt: skip
    for wl, runs in results.items():
        print(f"\n== {wl}: the scheduler side's Python calls and calls of builtins (--calls)")
        anchor = runs.get("vllm", {}).get("calls")
        base = anchor["py_per_admitted"] + anchor["c_per_admitted"] if anchor else 0
        rows = []
        for name, r in runs.items():
            n = r["calls"]
            both = n["py_per_admitted"] + n["c_per_admitted"]
            rows.append([name, f"{n['py_per_step']:.0f}", f"{n['c_per_step']:.0f}",
                         f"{n['py_per_admitted']:.1f}", f"{n['c_per_admitted']:.1f}",
                         f"{both / base:.2f}" if base else "-"])  # fmt: skip
        _print_table(cols, rows)


STEADY_TOP, STEADY_MIDDLE = 0.85, (0.4, 0.6)


def steady_profile(rec: StepRecorder) -> dict[str, list[float]]:
    """With ``--breakdown``: where the steady p90 comes from. Each method's mean µs per
    step (nested calls included: a manager method is inside a connector method) over
    the costliest 15% of the steps that schedule tokens and admit nothing, beside the
    middle fifth of them: ``{method: [top, middle]}``, the methods with 1 µs or more."""
    per_step = [*rec.step_methods, dict(rec.scheduler.in_step or {})]
    # The steps the steady p90 is read on (summarize's), with their methods' times.
    rows = [(s["sched"], per_step[s["step"]]) for s in rec.steps() if not s["admits"]]
    if len(rows) < MIN_STEPS:
        return {}
    rows.sort(key=lambda row: row[0])
    n = len(rows)
    top = [m for _, m in rows[int(n * STEADY_TOP) :]]
    middle = [m for _, m in rows[int(n * STEADY_MIDDLE[0]) : int(n * STEADY_MIDDLE[1])]]
    out = {}
    for name in sorted({name for m in top + middle for name in m}):
        a = sum(m.get(name, 0) for m in top) / len(top) / 1000.0
        b = sum(m.get(name, 0) for m in middle) / len(middle) / 1000.0 if middle else 0.0
        if a >= 1.0 or b >= 1.0:
            out[name] = [round(a, 1), round(b, 1)]
    return out


@contextmanager
def _quiet_gc() -> Iterator[None]:
    """Collect before a run so one run's garbage is not collected in the next."""
    gc.collect()
    yield
    gc.collect()


def warm_up(llm: Any) -> None:
    """Serve two short requests of the engine's own, then empty its device prefix cache
    and its connector's: what an engine does once (the first use of its objects' caches
    and allocations, its first log lines) is then not counted as a step's cost, for any
    connector. Their tokens are random, so no workload prompt shares a block with them,
    and nothing they stored is left to hit or to evict."""
    from kvtier.testkit import greedy_params, make_workload

    warm = make_workload(2, 3 * BLOCK_TOKENS, 4, seed=WARM_UP_SEED)
    llm.generate(
        [{"prompt_token_ids": list(p)} for p in warm.prompts],
        greedy_params(warm.max_tokens),
        use_tqdm=False,
    )
    llm.reset_prefix_cache(reset_connector=True)


def run_one(
    model: Path, wl: StepWorkload, name: str, fs_root: str, *, breakdown: bool
) -> dict[str, Any]:
    from kvtier.testkit import free_llm, greedy_params, kv_transfer_config, make_llm

    engine = {
        **ENGINE,
        "max_num_seqs": wl.running,
        "num_gpu_blocks_override": wl.device_blocks,
    }
    kv = connector_config(name, wl, fs_root)
    if kv is not None:
        engine["kv_transfer_config"] = kv_transfer_config(kv)
    with _quiet_gc(), copies_excluded():
        llm = make_llm(model, **engine)
        try:
            warm_up(llm)
            rec = StepRecorder()
            rec.attach(llm, breakdown=breakdown)
            prompts = [{"prompt_token_ids": list(p)} for p in wl.prompts]
            t0 = time.perf_counter()
            llm.generate(prompts, greedy_params(wl.max_tokens), use_tqdm=False)
            wall = time.perf_counter() - t0
            result = summarize(rec)
            result["wall_s"] = round(wall, 2)
            try:
                from kvtier.testkit import metric_values

                m = metric_values(list(llm.get_metrics()))
            except Exception:
                m = {}
            result["preemptions"] = int(m.get("vllm:num_preemptions", 0))
            result["external_hits"] = int(m.get("vllm:external_prefix_cache_hits", 0))
        finally:
            free_llm(llm)
    return result


# -- report ----------------------------------------------------------------------------


def goals(results: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []

    def goal(text: str, value: float | None, target: float, at_most: bool = True) -> None:
        met = value is not None and (value <= target if at_most else value >= target)
        out.append({"goal": text, "value": value, "target": f"<= {target}", "met": met})

    for wl, runs in results.items():
        anchor = runs.get("vllm")
        for name in ("kvtier-host", "kvtier-fs"):
            r = runs.get(name)
            if r is None:
                continue
            if anchor is not None and anchor["sched_us"]["median"] > 0:
                goal(
                    f"{wl}: {name} scheduler side / vLLM's connector (median)",
                    round(r["sched_us"]["median"] / anchor["sched_us"]["median"], 3),
                    0.5,
                )
            sched = r["sched_us"]
            med = sched["median"]
            goal(
                f"{wl}: {name} scheduler side p90 / median",
                round(sched["p90"] / med, 2) if med else None,
                2.0,
            )
            # The same without the steps that admit requests (their cost is per request:
            # next line), where a tier's background work would show as spikes.
            if sched.get("steady_steps", 0) >= MIN_STEPS and sched["steady_median"]:
                goal(
                    f"{wl}: {name} scheduler side p90 / median, steps admitting nothing",
                    round(sched["steady_p90"] / sched["steady_median"], 2),
                    2.0,
                )
            if (
                anchor is not None
                and sched.get("per_admitted")
                and anchor["sched_us"].get("per_admitted")
            ):
                goal(
                    f"{wl}: {name} scheduler side per admitted request / vLLM's connector",
                    round(sched["per_admitted"] / anchor["sched_us"]["per_admitted"], 3),
                    0.5,
                )
        plain, rec = runs.get("kvtier-host"), runs.get("kvtier-rec")
        if plain is not None and rec is not None:
            goal(
                f"{wl}: recording the traffic adds to a scheduler step (share)",
                recording_share(plain, rec),
                0.02,
            )
        for name in ("kvtier-host", "kvtier-fs", "recompute"):
            r = runs.get(name)
            if r is not None and r["worker_us"].get("quiet_steps", 0) >= MIN_STEPS:
                goal(
                    f"{wl}: {name} worker side median when nothing moves (µs/step)",
                    r["worker_us"]["quiet_median"],
                    50.0,
                )
    return out


# The connector's methods that record the traffic (an arrival, a finish).
RECORDING_METHODS = ("on_new_request", "request_finished", "request_finished_all_groups")


def recording_share(plain: dict[str, Any], rec: dict[str, Any]) -> float | None:
    """What recording adds to a scheduler step, as a share of the whole step (vLLM's
    scheduler and the connector's side, means): the CPU time of the methods that record
    (:data:`RECORDING_METHODS`), with recording less without, per step. Whole-step
    means of two runs differ by more than that from the machine alone."""
    steps = plain["steps"] or 1
    step_us = plain["vllm_sched_us"]["mean"] + plain["sched_us"]["mean"]
    if not step_us:
        return None

    def total_ms(r: dict[str, Any]) -> float:
        return sum(r["methods"].get(m, {}).get("total_ms", 0.0) for m in RECORDING_METHODS)

    added_us = (total_ms(rec) - total_ms(plain)) * 1000.0 / steps
    return round(added_us / step_us, 4)


def costliest(results: dict[str, dict[str, dict[str, Any]]], n: int = 5) -> list[dict[str, Any]]:
    """The ``n`` kvtier methods with the most CPU time over every kvtier run."""
    total: dict[str, list[float]] = {}
    for runs in results.values():
        for name, r in runs.items():
            if not name.startswith("kvtier") and name != "recompute":
                continue
            for method, s in r["methods"].items():
                key = f"{name} {method}"
                t = total.setdefault(key, [0.0, 0.0])
                t[0] += s["total_ms"]
                t[1] += s["calls"]
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:n]
    return [
        {"method": k, "total_ms": round(v[0], 1), "us_per_call": round(v[0] * 1000 / v[1], 1)}
        for k, v in ranked
    ]


def _line(cells: list[str], widths: list[int]) -> str:
    return "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )


def _print_table(cols: tuple[str, ...], rows: list[list[str]]) -> None:
    """``cols`` and ``rows``, each column as wide as its widest cell."""
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    print(_line(list(cols), widths))
    for row in rows:
        print(_line(row, widths))


def print_report(
    results: dict[str, dict[str, dict[str, Any]]], descriptions: dict[str, str]
) -> None:
    cols = ("connector", "steps", "vLLM sched µs", "sched side µs", "p90", "x vLLM conn",
            "steady p90", "µs/admitted", "worker µs", "p90 ", "quiet", "15 ms step",
            "30 ms step", "wall s")  # fmt: skip
    for wl, runs in results.items():
        print(f"\n== {wl}: {descriptions[wl]}")
        anchor = runs.get("vllm")
        rows = []
        for name, r in runs.items():
            sched, worker = r["sched_us"], r["worker_us"]
            per_step = sched["median"] + worker["median"]
            ratio = (
                f"{sched['median'] / anchor['sched_us']['median']:.2f}"
                if anchor and anchor["sched_us"]["median"] and name != "none"
                else "-"
            )
            rows.append(
                [
                    name,
                    str(r["steps"]),
                    f"{r['vllm_sched_us']['median']:.0f}",
                    f"{sched['median']:.0f}",
                    f"{sched['p90']:.0f}",
                    ratio,
                    f"{sched['steady_p90']:.0f}" if sched.get("steady_steps") else "-",
                    f"{sched['per_admitted']:.1f}" if sched.get("per_admitted") else "-",
                    f"{worker['median']:.0f}",
                    f"{worker['p90']:.0f}",
                    f"{worker['quiet_median']:.0f}" if worker.get("quiet_steps") else "-",
                    f"{100 * per_step / (ACCELERATOR_STEPS_MS[0] * 1000):.1f}%",
                    f"{100 * per_step / (ACCELERATOR_STEPS_MS[1] * 1000):.1f}%",
                    f"{r['wall_s']:.1f}",
                ]
            )
        _print_table(cols, rows)


def print_steady_profiles(results: dict[str, dict[str, dict[str, Any]]]) -> None:
    """The kvtier runs' :func:`steady_profile` (``--breakdown``), the eight methods whose
    costliest steps exceed their middle ones most."""
    for wl_name, runs in results.items():
        for name, r in runs.items():
            profile: dict[str, list[float]] = r.get("steady_profile") or {}
            if not profile or not name.startswith("kvtier"):
                continue
            print(f"\n== {wl_name} {name}: steps admitting nothing, µs per step, costliest 15%")
            print("   and middle fifth (--breakdown; nested calls in their callers' figures too)")
            for method, (a, b) in sorted(profile.items(), key=lambda kv: kv[1][1] - kv[1][0])[:8]:
                print(f"  {method:<45} {a:>9.1f} {b:>9.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    names = [w.name for w in workloads()] if "--help" not in (argv or sys.argv) else []
    parser.add_argument("--only", nargs="*", help=f"workloads to run (of {', '.join(names)})")
    parser.add_argument("--connectors", nargs="*", choices=CONNECTORS, help="connectors to run")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each workload and connector; the one where vLLM's own scheduler cost "
        "least is kept (default 1)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the offloading manager's methods (adds a little to each call), and "
        "print each kvtier method's time in the costliest 15%% of the steps admitting "
        "nothing beside the middle fifth of them (where the steady p90 comes from)",
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="count the scheduler side's Python calls and calls of builtins per step and "
        "per admitted request instead of timing it (a count does not move with the "
        "machine's load; the times of such a run mean nothing, and no goal is judged)",
    )
    opts = parser.parse_args(argv)
    if opts.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {opts.repeat}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvtier.testkit import make_tiny_llama

    chosen = [w for w in workloads() if not opts.only or w.name in opts.only]
    unknown = set(opts.only or ()) - {w.name for w in workloads()}
    if unknown:
        parser.error(f"--only: unknown workloads {sorted(unknown)}; choose from {names}")
    connectors = opts.connectors or list(DEFAULT_CONNECTORS)
    model = make_tiny_llama(None, **MODEL_SHAPE)
    _register_anchor_connector()
    cost = calibrate()
    TIMER.own_ns, TIMER.nested_ns = cost.own_ns, cost.nested_ns
    print(
        f"timer cost, subtracted: {cost.own_ns} ns a call, {cost.nested_ns} ns a nested call",
        file=sys.stderr,
    )
    # A first engine of each kind pays for first use (imports, allocator growth):
    # run each connector once on a short workload, and keep nothing of it.
    warm = StepWorkload("warm-up", "", 8, workloads()[0].prompts, 8, 64)
    for name in connectors:
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-step-") as fs_root:
            print(f"warm-up: {name} ...", file=sys.stderr, flush=True)
            run_one(model, warm, name, fs_root, breakdown=False)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for wl in chosen:
        results[wl.name] = {}
        for name in connectors:
            runs = []
            for _ in range(opts.repeat):
                with tempfile.TemporaryDirectory(prefix="kvtier-bench-step-") as fs_root:
                    print(f"{wl.name}: {name} ...", file=sys.stderr, flush=True)
                    COUNTS.on = opts.calls
                    try:
                        runs.append(run_one(model, wl, name, fs_root, breakdown=opts.breakdown))
                    finally:
                        COUNTS.on = False
            # The run least disturbed by the machine: vLLM's own scheduler cost lowest.
            results[wl.name][name] = min(runs, key=lambda r: r["vllm_sched_us"]["median"])
    if opts.calls:
        print_counts(results)
        if opts.json:
            out = {
                "model": MODEL_SHAPE,
                "workloads": {w.name: w.description for w in chosen},
                "calls": {wl: {n: r["calls"] for n, r in rs.items()} for wl, rs in results.items()},
            }
            Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
            Path(opts.json).write_text(json.dumps(out, indent=2) + "\n")
            print(f"wrote {opts.json}")
        return 0
    print_report(results, {w.name: w.description for w in chosen})
    top = costliest(results)
    print("\n== the five costliest kvtier methods (CPU time over every run)")
    for t in top:
        print(f"  {t['method']:<60} {t['us_per_call']:>9.1f} µs/call  {t['total_ms']:>9.1f} ms")
    print_steady_profiles(results)
    results_goals = goals(results)
    print("\n== goals")
    for g in results_goals:
        mark = "met " if g["met"] else "MISS"
        print(f"  {mark}  {g['goal']}: {g['value']} (target {g['target']})")
    if opts.json:
        out = {
            "model": MODEL_SHAPE,
            "timer_ns": {"own": TIMER.own_ns, "nested": TIMER.nested_ns},
            "workloads": {w.name: w.description for w in chosen},
            "results": results,
            "costliest": top,
            "goals": results_goals,
        }
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
