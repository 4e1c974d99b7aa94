"""Per-request restore timeline of an in-process engine with an offloading connector.

For every load a KV connector makes, four moments (``time.perf_counter`` seconds):

* ``looked_up``: the scheduler's connector first answered a hit for the request, or
  asked to be asked again (a secondary tier's blocks on their way to the host tier);
* ``submitted``: vLLM allocated its blocks and the connector planned the load (it goes
  to the workers with this step);
* ``loaded``: the worker's copy is done (a synchronous load: when the copy engine
  has it done, at the latest when the worker's wait for it returns, before the step's
  forward pass; an asynchronous one: when the worker reports the request in
  ``finished_recving``);
* ``scheduled``: the scheduler ran the request with the loaded tokens (the step of a
  synchronous load; the next step it was scheduled in for an asynchronous one).

The restore's wall time is from ``looked_up`` to the later of ``loaded`` and
``scheduled``: until then the request can make no progress. It is set beside the time
the copy engine needs for the same bytes (:func:`copy_rate`).

Needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (scheduler and worker in this process).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Restore:
    req_id: str
    tokens: int = 0
    sync: bool = False
    looked_up: float | None = None
    submitted: float | None = None
    loaded: float | None = None
    scheduled: float | None = None
    copy_started: float | None = None  # a synchronous load: the worker submitted its copy
    steps_waited: int = 0  # engine steps between the lookup and the step that ran it

    @property
    def complete(self) -> bool:
        return None not in (self.looked_up, self.submitted, self.loaded, self.scheduled)

    @property
    def wall_s(self) -> float:
        assert self.looked_up is not None and self.loaded is not None
        assert self.scheduled is not None
        return max(self.loaded, self.scheduled) - self.looked_up


class RestoreTimeline:
    """Hooks on an in-process ``LLM``'s scheduler, its KV connector (scheduler side) and
    the worker-side connector, recording :class:`Restore` entries. ``close`` unhooks."""

    def __init__(self, llm: Any) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvtier.testkit.engine import scheduler_of

        self.restores: list[Restore] = []
        self._open: dict[str, Restore] = {}  # request -> its restore not yet scheduled
        self._pending_lookup: dict[str, tuple[float, int]] = {}
        self._step = 0
        self._undo: list[tuple[Any, str]] = []
        scheduler = scheduler_of(llm)
        connector = scheduler.connector
        worker = get_kv_transfer_group()

        def lookup(fn: Any) -> Any:
            def get_num_new_matched_tokens(request: Any, *args: Any, **kwargs: Any) -> Any:
                hit, load_async = fn(request, *args, **kwargs)
                if hit is None or hit:  # None: a hit whose blocks are on their way
                    self._pending_lookup.setdefault(
                        request.request_id, (time.perf_counter(), self._step)
                    )
                else:  # nothing to restore after all
                    self._pending_lookup.pop(request.request_id, None)
                return hit, load_async

            return get_num_new_matched_tokens

        def alloc(fn: Any) -> Any:
            def update_state_after_alloc(request: Any, blocks: Any, num_external: int) -> Any:
                out = fn(request, blocks, num_external)
                if num_external:
                    req_id = request.request_id
                    t0, step = self._pending_lookup.pop(req_id, (time.perf_counter(), self._step))
                    r = Restore(req_id, tokens=int(num_external), looked_up=t0)
                    r.submitted = time.perf_counter()
                    r.steps_waited = -step  # completed when scheduled
                    self._open[req_id] = r
                    self.restores.append(r)
                return out

            return update_state_after_alloc

        def schedule(fn: Any) -> Any:
            def scheduled(*args: Any, **kwargs: Any) -> Any:
                out = fn(*args, **kwargs)
                now = time.perf_counter()
                ran = out.num_scheduled_tokens
                for req_id in [r for r in self._open if r in ran]:
                    r = self._open.pop(req_id)
                    r.scheduled = now
                    r.steps_waited += self._step
                self._step += 1
                return out

            return scheduled

        sync_jobs: dict[int, str] = {}  # synchronous load job -> request

        def note_sync_jobs(meta: Any) -> None:
            jobs = getattr(meta, "load_jobs", None) or {}
            sync = set(getattr(meta, "kvtier_sync_load_jobs", None) or ())
            sync |= {j for j, e in jobs.items() if getattr(e, "sync", False)}
            sync_jobs.update((j, jobs[j].req_id) for j in sync if j in jobs)

        def loaded(job_id: int) -> None:
            req_id = sync_jobs.pop(job_id, None)
            if req_id is not None:
                self._loaded(req_id, time.perf_counter(), sync=True)

        def preempting(fn: Any) -> Any:
            def handle_preemptions(meta: Any, *args: Any, **kwargs: Any) -> Any:
                note_sync_jobs(meta)
                return fn(meta, *args, **kwargs)

            return handle_preemptions

        def submitted(fn: Any) -> Any:
            def submit_load(job_id: int, *args: Any, **kwargs: Any) -> Any:
                req_id = sync_jobs.get(job_id)
                if req_id is not None:
                    self._copy_started(req_id, time.perf_counter())
                out = fn(job_id, *args, **kwargs)
                core = getattr(copier, "core", None)
                if job_id in sync_jobs and core is not None and core.copied(job_id):
                    loaded(job_id)  # a copy engine that copies on submission (CPU)
                return out

            return submit_load

        def waited(fn: Any) -> Any:
            def wait(job_ids: Any) -> Any:
                out = fn(job_ids)
                for job_id in list(job_ids):
                    loaded(job_id)
                return out

            return wait

        def finished(fn: Any) -> Any:
            def get_finished(*args: Any, **kwargs: Any) -> Any:
                out = fn(*args, **kwargs)
                now = time.perf_counter()
                for req_id in out[1] or ():
                    self._loaded(req_id, now, sync=False)
                return out

            return get_finished

        self._wrap(scheduler, "schedule", schedule)
        if connector is not None:
            self._wrap(connector, "get_num_new_matched_tokens", lookup)
            self._wrap(connector, "update_state_after_alloc", alloc)
        inner = getattr(worker, "connector_worker", None)
        copier = getattr(inner, "worker", None)
        if worker is not None:
            # vLLM's model runner hands every step's metadata to handle_preemptions
            # first, before any load is submitted.
            self._wrap(worker, "handle_preemptions", preempting)
            if inner is not None and callable(getattr(inner, "get_finished", None)):
                self._wrap(inner, "get_finished", finished)
            if copier is not None and callable(getattr(copier, "wait", None)):
                self._wrap(copier, "wait", waited)
                self._wrap(copier, "submit_load", submitted)

    def _unloaded(self, req_id: str) -> Restore | None:
        """The request's latest restore not yet loaded, if any."""
        for r in reversed(self.restores):
            if r.req_id == req_id and r.loaded is None:
                return r
        return None

    def _loaded(self, req_id: str, when: float, *, sync: bool) -> None:
        """The request's latest restore not yet loaded is loaded at ``when``."""
        r = self._unloaded(req_id)
        if r is not None:
            r.loaded, r.sync = when, sync

    def _copy_started(self, req_id: str, when: float) -> None:
        r = self._unloaded(req_id)
        if r is not None and r.copy_started is None:
            r.copy_started = when

    def _wrap(self, obj: Any, name: str, make: Any) -> None:
        setattr(obj, name, make(getattr(obj, name)))
        self._undo.append((obj, name))

    def close(self) -> None:
        for obj, name in reversed(self._undo):
            obj.__dict__.pop(name, None)
        self._undo.clear()

    def summary(self, bytes_per_token: int, copy_gbps: float) -> dict[str, Any]:
        """Medians and sums over the complete restores: phase times in ms, restored MiB,
        and the restore wall time over what the bytes cost at ``copy_gbps``."""
        done = [r for r in self.restores if r.complete]
        if not done:
            return {"restores": 0}

        def ms(values: list[float]) -> float:
            return round(1000 * statistics.median(values), 2)

        nbytes = [r.tokens * bytes_per_token for r in done]
        walls = [r.wall_s for r in done]
        copy_s = [b / (copy_gbps * 1e9) for b in nbytes]
        started = [r for r in done if r.copy_started is not None]
        to_copy = [r.copy_started - r.submitted for r in started]  # type: ignore[operator]
        copying = [r.loaded - r.copy_started for r in started]  # type: ignore[operator]
        return {
            "restores": len(done),
            "sync": sum(r.sync for r in done),
            "restored_mib": round(sum(nbytes) / (1 << 20), 1),
            "lookup_to_submit_ms": ms([r.submitted - r.looked_up for r in done]),  # type: ignore[operator]
            "submit_to_loaded_ms": ms([r.loaded - r.submitted for r in done]),  # type: ignore[operator]
            # A synchronous load's part of it: until the worker submits its copy, the copy.
            "submit_to_copy_ms": ms(to_copy) if to_copy else None,
            "copy_ms": ms(copying) if copying else None,
            "loaded_to_scheduled_ms": ms(
                [max(0.0, r.scheduled - r.loaded) for r in done]  # type: ignore[operator]
            ),
            "steps_waited_median": statistics.median(r.steps_waited for r in done),
            "restore_wall_ms": ms(walls),
            "restore_wall_total_s": round(sum(walls), 3),
            "copy_cost_total_s": round(sum(copy_s), 3),
            "wall_over_copy": round(sum(walls) / sum(copy_s), 2) if sum(copy_s) else None,
        }


def copy_rate(layers: int, block_bytes_per_layer: int, blocks: int = 24, sets: int = 8) -> float:
    """GB/s of kvtier's copy engine loading ``blocks`` scattered host blocks into a KV
    cache of ``layers`` layers (vLLM's CPU layout): the median over ``sets`` loads, each
    from and to blocks the others do not touch, so no load finds its bytes in a cache
    (as a restore in a running engine does not)."""
    import torch

    from kvtier.npu_copy import TransferEngine

    num = sets * blocks
    kv = [
        torch.ones((num, 2, block_bytes_per_layer // 8), dtype=torch.float32) for _ in range(layers)
    ]
    host = torch.zeros((num, layers * block_bytes_per_layer), dtype=torch.uint8)
    # Written once, as a host tier's blocks are before they are loaded: pages never
    # written read from the kernel's one shared zero page, always in cache, and made the
    # rate up to 1.6x what a load from written memory reaches (12-20 GB/s from run to
    # run here, against 12-13 GB/s written).
    host.fill_(1)
    engine = TransferEngine(kv, host)
    times = []
    try:
        engine.load([0], [0]).wait()  # first call: the engine's own set-up
        for s in range(sets):
            ids = list(range(s, num, sets))  # scattered, as a block table is
            t0 = time.perf_counter()
            engine.load(ids, ids[::-1]).wait()
            times.append(time.perf_counter() - t0)
    finally:
        engine.close()
    return blocks * layers * block_bytes_per_layer / statistics.median(times) / 1e9


__all__ = ["Restore", "RestoreTimeline", "copy_rate"]
