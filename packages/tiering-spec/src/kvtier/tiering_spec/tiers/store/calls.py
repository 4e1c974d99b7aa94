"""Store calls with a deadline: the threads that make them, in batches, and what happens
to a call that does not return in time.

Each kind of call ("jobs": gets and puts; "probes": existence checks) has its queue and
one serving thread. A thread takes a batch (:func:`take_batch`), opens a :class:`Call`
with a deadline (:meth:`DeadlineCalls.begin`) and makes its store calls through
:meth:`DeadlineCalls.run`, which records each outcome. The scheduler thread finds the
calls past their deadline (:meth:`DeadlineCalls.overdue`) and abandons them: a new
thread serves the queue on (:meth:`DeadlineCalls.spawn`) while the abandoned one stays
in its call. At most ``max_stuck`` abandoned calls of a kind may still be running;
beyond, no thread serves that kind until one returns (:meth:`DeadlineCalls.carry_on`).
What an abandoned call's items become is the tier's business, not this module's.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvtier.tiering_spec.tiers.base import TierFault

# Objects per batched store call (and header pages registered for them).
MAX_BATCH = 64
# How long a small batch waits for more jobs of the same burst before it goes.
COALESCE_S = 0.0005
# Mooncake's error code for an object that does not exist (evicted or never put).
OBJECT_NOT_FOUND = -704


class Call:
    """One batch of jobs or probes a thread is serving, watched for its deadline.

    ``running`` is the op of the store call in progress ("write", "read", "probe",
    "remove") or None between calls; ``done`` the jobs whose results were posted.
    """

    __slots__ = ("abandoned", "deadline", "done", "items", "kind", "running", "slot")

    def __init__(self, kind: str, items: list[Any], deadline: float, slot: int) -> None:
        self.kind = kind  # "jobs" | "probes"
        self.items = items
        self.deadline = deadline
        self.running: str | None = None
        self.abandoned = False
        self.done: set[int] = set()
        self.slot = slot


def take_batch(q: queue.SimpleQueue[Any]) -> list[Any] | None:
    """Up to ``MAX_BATCH`` items: one waited for, the rest already queued. None once
    the stop marker comes first (a marker after items ends the next call)."""
    first = q.get()
    if first is None:
        return None
    batch = [first]
    waited = False
    while len(batch) < MAX_BATCH:
        try:
            nxt = q.get_nowait()
        except queue.Empty:
            if waited:
                break
            # The scheduler submits a step's jobs in a burst: let it finish it.
            waited = True
            time.sleep(COALESCE_S)
            continue
        if nxt is None:
            q.put(None)
            break
        batch.append(nxt)
    return batch


class DeadlineCalls:
    """The calling threads of one store tier and their calls in progress.

    ``lock`` guards the calls, the thread counts and free header slots, and whatever
    the tier keeps with them. ``outcomes`` holds, in order, ``(None, "")`` for a call
    that succeeded and ``(fault, why)`` for one that failed, for the tier's ``poll``.

    Args:
        name: the tier's name, in the threads' names.
        serve_jobs: the body of a jobs thread, given its header slot.
        serve_probes: the body of a probes thread.
        max_stuck: abandoned calls of a kind that may still run (each holds a thread
            and, for jobs, a header slot: there are ``max_stuck + 1`` slots).
    """

    def __init__(
        self,
        name: str,
        serve_jobs: Callable[[int], None],
        serve_probes: Callable[[], None],
        max_stuck: int,
    ) -> None:
        self.name = name
        self._serve_jobs = serve_jobs
        self._serve_probes = serve_probes
        self.max_stuck = max_stuck
        self.lock = threading.Lock()
        self.calls: set[Call] = set()
        self.live = {"jobs": 0, "probes": 0}
        self.stuck = {"jobs": 0, "probes": 0}
        self.free_slots = list(range(max_stuck, -1, -1))
        self.threads: list[threading.Thread] = []
        self.outcomes: deque[tuple[str | None, str]] = deque()
        self.closed = False

    def serving(self) -> bool:
        """Whether a thread serves each kind."""
        return bool(self.live["jobs"] and self.live["probes"])

    def spawn(self, kind: str) -> bool:
        """Start a thread serving ``kind`` ("jobs" or "probes"); under ``lock``. False
        when closed or too many abandoned calls still hold threads (and header pages)."""
        if self.closed or self.stuck[kind] >= self.max_stuck:
            return False
        if kind == "jobs":
            slot = self.free_slots.pop()
            t = threading.Thread(
                target=self._serve_jobs, args=(slot,), name=f"kvtier-{self.name}-io", daemon=True
            )
        else:
            t = threading.Thread(
                target=self._serve_probes, name=f"kvtier-{self.name}-probe", daemon=True
            )
        self.live[kind] += 1
        self.threads = [x for x in self.threads if x.is_alive()]
        self.threads.append(t)
        t.start()
        return True

    def begin(self, kind: str, items: list[Any], slot: int, timeout: float) -> Call:
        """Open a call of ``items`` due within ``timeout`` seconds."""
        call = Call(kind, items, time.monotonic() + timeout, slot)
        with self.lock:
            self.calls.add(call)
        return call

    def overdue(self, now: float) -> list[Call]:
        """Abandon every call past its deadline at ``now`` and return them; under
        ``lock``. Their threads no longer count as serving."""
        late = [c for c in self.calls if now > c.deadline and not c.abandoned]
        for call in late:
            call.abandoned = True
            self.calls.discard(call)
            self.live[call.kind] -= 1
            self.stuck[call.kind] += 1
        return late

    def carry_on(self, call: Call) -> bool:
        """After an abandoned call returned: whether its thread serves on (no other
        thread serves its queue) or ends."""
        with self.lock:
            self.stuck[call.kind] -= 1
            if self.closed or self.live[call.kind]:
                if call.kind == "jobs":
                    self.free_slots.append(call.slot)
                return False
            self.live[call.kind] += 1
            return True

    def run(self, call: Call, op: str, fn: Callable[[], Any], n: int) -> list[int]:
        """Make one store call of ``n`` objects for ``call``: its codes (-1 each when it
        raised or answered the wrong number of codes). Records the outcome."""
        with self.lock:
            if call.abandoned:
                return [-1] * n
            call.running = op
        try:
            codes = list(fn())
            if len(codes) != n:
                raise RuntimeError(f"{len(codes)} codes for {n} objects")
        except Exception as exc:  # the client raised: the store is unusable for now
            codes = [-1] * n
            self.outcomes.append((TierFault.UNREACHABLE, f"{op}: {type(exc).__name__}: {exc}"))
            return codes
        if codes and all(c < 0 and c != OBJECT_NOT_FOUND for c in codes):
            self.outcomes.append((TierFault.UNREACHABLE, f"{op} returned {codes[0]}"))
        elif not call.abandoned:  # a late answer does not end the back-off
            self.outcomes.append((None, ""))
        return codes
