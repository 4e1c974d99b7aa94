"""Fault injection for kvtier's copy paths, from the tests: nothing in shipped code.

Each helper is a context manager that wraps a class of kvtier's for as long as it is
open, so it reaches every engine built in this process (the engines of the testkit run
in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

* :func:`failing_copies`: kvtier-npu-copy's ``TransferEngine`` refuses loads and/or
  stores (the worker then records a failed job, as for a real copy error);
* :func:`corrupted_restores`: the recompute connector's worker flips the bits of the
  host blocks each restore reads, just before it runs (where a restore carries a
  recurrent state, only the state's blocks), so wrong KV reaches the device: the check
  that a test comparing outputs can see it.

Each yields a :class:`FaultCounts` of what it did, so a test can assert the fault
happened. Importing this module imports neither vLLM nor kvtier's packages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FaultCounts:
    """How many times each fault was injected, by kind."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int = 1) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + n

    def __getitem__(self, kind: str) -> int:
        return self.counts.get(kind, 0)


@contextlib.contextmanager
def _patched(owner: type, name: str, replacement: Any) -> Iterator[None]:
    original = owner.__dict__[name]
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def failing_copies(*, loads: bool = False, stores: bool = False) -> Iterator[FaultCounts]:
    """Every ``TransferEngine.load`` (``loads``) and/or ``store`` (``stores``) raises
    instead of copying, while the block is open."""
    from kvtier.npu_copy import TransferEngine

    counts = FaultCounts()

    def refuse(kind: str) -> Any:
        def copy(self: Any, *args: Any, **kwargs: Any) -> Any:
            counts.add(kind)
            raise RuntimeError(f"{kind} refused (kvtier.testkit.faults)")

        return copy

    with contextlib.ExitStack() as stack:
        if loads:
            stack.enter_context(_patched(TransferEngine, "load", refuse("load")))
        if stores:
            stack.enter_context(_patched(TransferEngine, "store", refuse("store")))
        yield counts


@contextlib.contextmanager
def corrupted_restores() -> Iterator[FaultCounts]:
    """The recompute connector's worker flips the bits of the host blocks every
    restore reads, just before the restore runs, while the block is open."""
    from kvtier.recompute_connector.worker import RecomputeOffloadWorker

    counts = FaultCounts()
    real = RecomputeOffloadWorker.run_loads

    def run_loads(self: Any, plan: Any) -> None:
        region = self.region
        for job in plan.loads:
            hosts = sorted(set(job.state_host_block_ids or job.host_block_ids))
            if region is not None and hosts:
                for h in hosts:
                    region.blocks[h].bitwise_not_()
                counts.add("restore")
        real(self, plan)

    with _patched(RecomputeOffloadWorker, "run_loads", run_loads):
        yield counts
