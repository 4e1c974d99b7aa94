"""Run workloads on an in-process vLLM engine and compare what it generated.

vLLM is imported inside functions only, so importing this module never needs it.
Engines made here run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): several can
be made one after another in one process; free each with ``del llm; gc.collect()``.
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# Engine settings that force preemption with the tiny model (measured on vLLM 0.32's
# CPU platform: about 25 preemptions for FORCED_PREEMPTION_WORKLOAD). Blocks are
# device KV blocks of ``block_size`` tokens; max_model_len must be at most
# (num_gpu_blocks_override - 1) * block_size.
FORCED_PREEMPTION_ENGINE: dict[str, Any] = {
    "block_size": 32,
    "num_gpu_blocks_override": 16,
    "max_num_seqs": 16,
    "max_model_len": 256,
    "enforce_eager": True,
    "dtype": "float32",
    "disable_log_stats": False,
    # On the CPU platform this is the fraction of host memory vLLM checks is free at
    # start-up; the KV cache itself is sized by num_gpu_blocks_override. Low, so tests
    # start on a machine shared with other work.
    "gpu_memory_utilization": 0.2,
}

# The same engine with room for every request at once: the unpreempted reference.
REFERENCE_ENGINE: dict[str, Any] = {**FORCED_PREEMPTION_ENGINE, "num_gpu_blocks_override": 160}

# Sliding-window recipe (Mistral, window 64 tokens): about 8-14 preemptions.
SLIDING_WINDOW_ENGINE: dict[str, Any] = {
    **FORCED_PREEMPTION_ENGINE,
    "num_gpu_blocks_override": 8,
    "max_model_len": 192,
}


# Hybrid recipe (make_tiny_hybrid: linear + full attention; vLLM's CPU kernels for it
# need bfloat16). vLLM picks the block size itself (128 tokens here, the attention page
# as large as the linear-attention state page); 10 device blocks preempt about 13 times
# with HYBRID_WORKLOAD.
HYBRID_ENGINE: dict[str, Any] = {
    "num_gpu_blocks_override": 10,
    "max_num_seqs": 16,
    "max_model_len": 512,
    "enforce_eager": True,
    "dtype": "bfloat16",
    "disable_log_stats": False,
    "gpu_memory_utilization": 0.2,
}
HYBRID_REFERENCE_ENGINE: dict[str, Any] = {**HYBRID_ENGINE, "num_gpu_blocks_override": 96}


@dataclass(frozen=True)
class Workload:
    """Prompts as token ids and how many tokens to generate for each (greedy, ignore_eos)."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(p) for p in self.prompts)


def make_workload(
    num_requests: int = 16,
    prompt_tokens: int = 40,
    max_tokens: int = 200,
    *,
    vocab: int = 512,
    exclude: Sequence[int] = (0, 1, 2),
    seed: int = 0,
    shared_prefix_tokens: int = 0,
) -> Workload:
    """Random prompts of ``prompt_tokens`` tokens each, ids drawn from ``[0, vocab)``
    minus ``exclude`` (special tokens). The first ``shared_prefix_tokens`` tokens are
    the same in every prompt (to exercise prefix caching)."""
    if not 0 <= shared_prefix_tokens <= prompt_tokens:
        raise ValueError("shared_prefix_tokens must be between 0 and prompt_tokens")
    rng = random.Random(seed)
    allowed = [t for t in range(vocab) if t not in set(exclude)]
    prefix = [rng.choice(allowed) for _ in range(shared_prefix_tokens)]
    prompts = tuple(
        tuple(prefix + [rng.choice(allowed) for _ in range(prompt_tokens - shared_prefix_tokens)])
        for _ in range(num_requests)
    )
    return Workload(prompts, max_tokens)


FORCED_PREEMPTION_WORKLOAD = make_workload()
SLIDING_WINDOW_WORKLOAD = make_workload(8, 40, 120)
HYBRID_WORKLOAD = make_workload(12, 190, 140)

# Prefix reuse: a device cache of 12 blocks of 32 tokens cannot keep the 8 prefixes of
# 4 blocks of PREFIX_WORKLOAD, and two requests run at a time, so a prefix is gone from
# the device by the time it is asked again.
PREFIX_ENGINE: dict[str, Any] = {
    **FORCED_PREEMPTION_ENGINE,
    "max_num_seqs": 2,
    "num_gpu_blocks_override": 12,
    "gpu_memory_utilization": 0.15,
}
PREFIX_REFERENCE_ENGINE: dict[str, Any] = {**PREFIX_ENGINE, "num_gpu_blocks_override": 200}


def make_prefix_workload(
    groups: int = 8,
    prefix_tokens: int = 128,
    suffix_tokens: int = 32,
    rounds: int = 2,
    *,
    max_tokens: int = 8,
    vocab: int = 512,
    exclude: Sequence[int] = (0, 1, 2),
    seed: int = 1,
) -> Workload:
    """``rounds`` passes over ``groups`` random prefixes of ``prefix_tokens`` tokens, each
    prompt with its own ``suffix_tokens``-token suffix; ids from ``[0, vocab)`` minus
    ``exclude``."""
    rng = random.Random(seed)
    skip = set(exclude)
    allowed = [t for t in range(vocab) if t not in skip]
    heads = [[rng.choice(allowed) for _ in range(prefix_tokens)] for _ in range(groups)]
    prompts = tuple(
        tuple(heads[g] + [rng.choice(allowed) for _ in range(suffix_tokens)])
        for _ in range(rounds)
        for g in range(groups)
    )
    return Workload(prompts, max_tokens)


PREFIX_WORKLOAD = make_prefix_workload()


def in_process_engines() -> None:
    """Make vLLM engines of this process run in-process (call before creating one)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _on_cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:
        return False


@contextmanager
def _no_collections() -> Iterator[None]:
    """On vLLM's CPU platform, make ``gc.collect()`` a no-op while an in-process engine
    shuts down (see :func:`free_llm`); elsewhere (an NPU or GPU, where vLLM's collections
    hand device memory back to its allocator) nothing changes."""
    if not _on_cpu_platform():
        yield
        return
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


def make_llm(model: str | os.PathLike[str], **engine_args: Any) -> Any:
    """A ``vllm.LLM`` for ``model``, in-process, with ``engine_args`` passed through.

    On vLLM's CPU platform the process's objects are collected once and frozen first
    (``gc.freeze``): vLLM collects garbage five times while an engine starts, each a
    full collection that otherwise goes over every object of torch's and vLLM's modules
    (about 680,000; 0.2-0.5 s each on a CI core). vLLM freezes the heap itself once the
    engine has started, and un-freezes all of it when the engine shuts down, so what is
    frozen here is collected again from then on."""
    in_process_engines()
    from vllm import LLM

    if _on_cpu_platform():
        gc.collect()
        gc.freeze()
    return LLM(model=str(model), **engine_args)


def free_llm(llm: Any) -> None:
    """Shut an engine down and collect it, so the next one can start in this process.

    On vLLM's CPU platform, vLLM's own collections during the shutdown (two, after it
    un-freezes the heap: full collections, about 0.5 s each on a CI core) are skipped:
    the engine is still referenced by its ``LLM`` then, so they free nothing that the
    one collection here, once the engine is let go, does not."""
    with _no_collections():
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        try:
            # The worker-side KV connector is a process global; an in-process engine's must
            # go with it, or the next engine in this process would reuse it.
            from vllm.distributed.kv_transfer.kv_transfer_state import (
                ensure_kv_transfer_shutdown,
            )

            ensure_kv_transfer_shutdown()
        except Exception:
            pass
    del llm
    gc.collect()


def engine_core(llm: Any) -> Any:
    """The ``EngineCore`` of an in-process ``LLM`` (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None or not hasattr(core, "scheduler"):
        raise RuntimeError(
            "the engine runs in another process; set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "before creating the LLM to count its scheduled tokens"
        )
    return core


def scheduler_of(llm: Any) -> Any:
    """The scheduler of an in-process ``LLM``."""
    return engine_core(llm).scheduler


def kv_connector_of(llm: Any) -> Any:
    """The scheduler-side KV connector of an in-process ``LLM`` (or None)."""
    return scheduler_of(llm).connector


class SchedulerTokenCounter:
    """Counts the engine's work: tokens its scheduler schedules, summed over steps.

    Wraps the scheduler's ``schedule`` of an in-process ``LLM`` and adds each
    output's ``total_num_scheduled_tokens`` (tokens, prompt and generated, that the
    model runs a forward over). A preempted request that recomputes its prefix
    shows up here, unlike in vLLM's own metrics.
    """

    def __init__(self, llm: Any) -> None:
        self.scheduler = scheduler_of(llm)
        self.total_tokens = 0
        self.steps = 0
        self.preempted: list[str] = []
        self._original = self.scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = self._original(*args, **kwargs)
            self.total_tokens += int(out.total_num_scheduled_tokens)
            self.steps += 1
            self.preempted.extend(sorted(out.preempted_req_ids or ()))
            return out

        self.scheduler.schedule = schedule

    def reset(self) -> None:
        self.total_tokens = 0
        self.steps = 0
        self.preempted = []

    def close(self) -> None:
        """Restore the scheduler's own ``schedule``."""
        self.scheduler.schedule = self._original


def metric_values(metrics: Sequence[Any]) -> dict[str, float]:
    """``llm.get_metrics()`` flattened to name -> value, summed over label sets.

    Counters and gauges give their value; histograms give ``name:count`` and
    ``name:sum``; vectors give their sum.
    """
    out: dict[str, float] = {}
    for m in metrics:
        name = m.name
        if hasattr(m, "count") and hasattr(m, "sum"):
            out[name + ":count"] = out.get(name + ":count", 0) + float(m.count)
            out[name + ":sum"] = out.get(name + ":sum", 0.0) + float(m.sum)
        elif hasattr(m, "values"):
            out[name] = out.get(name, 0.0) + float(sum(m.values))
        elif hasattr(m, "value"):
            out[name] = out.get(name, 0.0) + float(m.value)
    return out


def labelled_metric_values(metrics: Sequence[Any], name: str, label: str) -> dict[str, float]:
    """One metric's values by the value of one of its labels (summed over the others)."""
    out: dict[str, float] = {}
    for m in metrics:
        if m.name == name and hasattr(m, "value"):
            key = str(m.labels.get(label, ""))
            out[key] = out.get(key, 0.0) + float(m.value)
    return out


@dataclass
class WorkloadResult:
    """What one run produced.

    Attributes:
        outputs: generated token ids, one list per request, in workload order.
        metrics: ``llm.get_metrics()`` flattened by :func:`metric_values`.
        raw_metrics: ``llm.get_metrics()`` as returned.
        scheduled_tokens: tokens the scheduler scheduled during the run (the engine's work).
        wall_s: seconds the run took.
    """

    outputs: list[list[int]]
    metrics: dict[str, float] = field(default_factory=dict)
    raw_metrics: list[Any] = field(default_factory=list)
    scheduled_tokens: int = 0
    wall_s: float = 0.0

    @property
    def preemptions(self) -> int:
        return int(self.metrics.get("vllm:num_preemptions", 0))


def greedy_params(max_tokens: int) -> Any:
    """Greedy sampling that ignores EOS and generates exactly ``max_tokens`` tokens."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


def run_workload(llm: Any, workload: Workload, *, count_tokens: bool = True) -> WorkloadResult:
    """Generate for every prompt of ``workload`` in one batch; outputs in workload order.

    Metrics need the engine made with ``disable_log_stats=False``; the scheduled-token
    count needs an in-process engine (else pass ``count_tokens=False``).
    """
    counter = SchedulerTokenCounter(llm) if count_tokens else None
    prompts = [{"prompt_token_ids": list(p)} for p in workload.prompts]
    start = time.perf_counter()
    try:
        results = llm.generate(prompts, greedy_params(workload.max_tokens), use_tqdm=False)
    finally:
        if counter is not None:
            counter.close()
    wall = time.perf_counter() - start
    outputs = [list(r.outputs[0].token_ids) for r in results]
    try:
        raw = list(llm.get_metrics())
    except Exception:
        raw = []
    return WorkloadResult(
        outputs=outputs,
        metrics=metric_values(raw),
        raw_metrics=raw,
        scheduled_tokens=counter.total_tokens if counter is not None else 0,
        wall_s=wall,
    )


@dataclass(frozen=True)
class Mismatch:
    """Request ``index`` differs from the reference from token ``position`` on."""

    index: int
    position: int
    expected: tuple[int, ...]
    actual: tuple[int, ...]

    def describe(self) -> str:
        lo = max(0, self.position - 2)
        return (
            f"request {self.index}: first differing token at position {self.position} "
            f"(expected ...{list(self.expected[lo : self.position + 3])}, "
            f"got ...{list(self.actual[lo : self.position + 3])}; "
            f"lengths {len(self.expected)} vs {len(self.actual)})"
        )


@dataclass
class OutputComparison:
    """Token-by-token comparison of two runs of the same workload."""

    num_requests: int
    mismatches: list[Mismatch]

    @property
    def identical(self) -> bool:
        return not self.mismatches

    @property
    def mismatched_requests(self) -> list[int]:
        return [m.index for m in self.mismatches]

    def report(self) -> str:
        if self.identical:
            return f"all {self.num_requests} requests identical"
        lines = [f"{len(self.mismatches)} of {self.num_requests} requests differ:"]
        lines += ["  " + m.describe() for m in self.mismatches]
        return "\n".join(lines)


def compare_outputs(
    reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]
) -> OutputComparison:
    """Compare generated token ids request by request, token by token."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference outputs but {len(candidate)} candidates")
    mismatches = []
    for i, (ref, got) in enumerate(zip(reference, candidate)):
        ref_t, got_t = tuple(ref), tuple(got)
        if ref_t == got_t:
            continue
        pos = next(
            (j for j, (a, b) in enumerate(zip(ref_t, got_t)) if a != b),
            min(len(ref_t), len(got_t)),
        )
        mismatches.append(Mismatch(i, pos, ref_t, got_t))
    return OutputComparison(len(reference), mismatches)


def run_with(
    model: str | os.PathLike[str],
    workload: Workload,
    *,
    inspect: Callable[[Any], Any] | None = None,
    **engine_args: Any,
) -> tuple[WorkloadResult, Any]:
    """Make an engine, run ``workload``, call ``inspect(llm)`` (if given), free the engine.

    Returns the result and what ``inspect`` returned.
    """
    llm = make_llm(model, **engine_args)
    try:
        result = run_workload(llm, workload)
        seen = inspect(llm) if inspect is not None else None
    finally:
        free_llm(llm)
    return result, seen


@contextmanager
def llm_session(model: str | os.PathLike[str], **engine_args: Any) -> Iterator[Any]:
    """``with llm_session(model, ...) as llm:`` makes an engine and frees it afterwards."""
    llm = make_llm(model, **engine_args)
    try:
        yield llm
    finally:
        free_llm(llm)


def kv_transfer_config(config: Mapping[str, Any]) -> Any:
    """A ``vllm.config.KVTransferConfig`` from a dict (as in ``--kv-transfer-config``)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**dict(config))
