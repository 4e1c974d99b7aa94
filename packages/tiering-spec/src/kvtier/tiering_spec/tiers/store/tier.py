"""A store tier: host blocks as objects in a key-value store that many engines share.

Mooncake Store is the store this is built for (``mooncake.store.MooncakeDistributedStore``,
any object with the :class:`StoreClient` methods works). Runs in the scheduler process,
like the fs tier, as a ``SecondaryTier`` (``tiers/base.py``), so the manager treats both alike.

* **Keys and bytes as in the fs tier.** One object per copy (rank) of a host block,
  named ``kvtier-kv-v1/<layout fingerprint>/<key digest>``; its bytes are the fs tier's
  file: a 4096-byte header (fingerprint, key digest, length, XXH3-64 of the payload)
  then the payload. An object whose header or checksum does not match is a miss,
  counted and removed; one the store evicted is a miss, counted.
* **Zero copy.** The host region is registered with the store client once, by the
  thread that connects; a write puts from, and a read gets into, the host block itself
  (plus a header page). Until it is registered, writes are dropped and reads refused.
* **No store call on the scheduler thread.** Lookups read an in-memory index of
  objects this tier wrote or found. An unknown key is handed to a background thread
  that asks the store in batches; until it answers, :meth:`StoreTier.contains`
  returns None ("ask again"); a key the store lacks is remembered for
  ``NEGATIVE_TTL_S``.
* **A store that is down or slow gives misses.** A failed call counts a fault and
  sends the tier into a back-off (``BACKOFF_MIN_S`` doubling to ``BACKOFF_MAX_S``,
  back to the minimum after a call that succeeds) during which lookups miss, writes
  are dropped and nothing waits on the store.
* **Every store call has a deadline** (``CALL_TIMEOUT_S`` for gets, puts and removes,
  ``PROBE_TIMEOUT_S`` for existence checks). :meth:`StoreTier.poll` abandons a call
  past it: its probes answer "absent", its reads fail (fault ``timeout``) and the tier
  backs off; a new thread takes over the queue (at most ``MAX_STUCK_CALLS`` abandoned
  calls at once; beyond that the tier gives misses until one returns). A read that
  timed out may still land in its host block, so its result is ``("read", fault
  "timeout")`` and the manager keeps that block reserved until a ``"release"`` result
  says the call returned; nothing it brought is ever reported as loaded. A write that
  timed out keeps its host block pinned (as the store still reads it) until it returns,
  then counts as failed. Each calling thread has its own header pages, so a late call
  never meets another batch's headers.
* **Authenticated objects** (``auth_key``, from ``auth_key_file``): each object's
  header carries a BLAKE2b MAC over the header and the payload, keyed with a secret
  every engine of the store shares; an object without a valid MAC is a miss (fault
  ``unauthenticated``), removed, never loaded. Without a key, every client of the
  master is trusted (logged at start-up).

Units: bytes, unless a name says blocks.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from kvtier.tiering_spec.tiers.base import (
    FAULT_KINDS,
    SecondaryTier,
    TierFault,
    TierResult,
    TierStats,
    count_down,
)
from kvtier.tiering_spec.tiers.fs import format as fs_format

logger = logging.getLogger("kvtier.tiering_spec")

# Objects per batched store call (and header pages registered for them).
MAX_BATCH = 64
# How long a small batch waits for more jobs of the same burst before it goes.
COALESCE_S = 0.0005
# How long a key the store lacks is not asked about again.
NEGATIVE_TTL_S = 2.0
# Back-off after a failed store call: doubled per failure up to the maximum.
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
REGION_POLL_S = 0.05
"""How often the connect thread looks for host regions not mapped yet (seconds)."""
# Keys the index remembers (least recently used dropped first).
MAX_INDEX_ENTRIES = 1_000_000
SHUTDOWN_TIMEOUT_S = 10.0
CALL_TIMEOUT_S = 10.0
"""Deadline of one batched get, put or remove (seconds): 64 objects of a few MiB take
well under a second even over TCP."""
PROBE_TIMEOUT_S = 2.0
"""Deadline of one batched existence check (seconds): requests wait on it."""
MAX_PENDING_PROBES = 4 * MAX_BATCH
"""Existence checks queued or running at most; beyond, an unknown key is a miss (a hung
master must not make the queue grow with every lookup)."""
MAX_STUCK_CALLS = 3
"""Abandoned calls (per kind: jobs, probes) that may still be running before the tier
stops issuing calls of that kind; each holds a thread (and, for jobs, its header
pages)."""
# Mooncake's error code for an object that does not exist (evicted or never put).
OBJECT_NOT_FOUND = -704


class StoreClient(Protocol):
    """The calls of Mooncake Store's Python client this tier uses."""

    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...

    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...

    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]: ...


@dataclass(frozen=True)
class StoreTierSettings:
    """What the tier needs besides the client: its name, locality and events switch,
    the MAC key (None: objects unauthenticated) and its time limits (seconds)."""

    name: str = "mooncake"
    locality: str = "REMOTE"
    enable_kv_events: bool = True
    auth_key: bytes | None = field(default=None, repr=False)
    call_timeout_s: float = CALL_TIMEOUT_S
    probe_timeout_s: float = PROBE_TIMEOUT_S
    backoff_min_s: float = BACKOFF_MIN_S
    backoff_max_s: float = BACKOFF_MAX_S
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S


class _Call:
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


def _address(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class StoreTier(SecondaryTier):
    """One store tier for one engine.

    Args:
        connect: returns a connected store client (see :class:`StoreClient`), or raises;
            called on a background thread, again with back-off after a failure, so a
            store that is down at start-up gives misses until it is up.
        layouts: one layout description per copy (rank), as for the fs tier.
        payload_bytes: bytes of one copy of a host block (a multiple of 4096).
        region_views: returns one writable memoryview per copy over its host region,
            or None while the regions cannot be mapped yet.
        settings: name, locality, events switch, MAC key and time limits.
    """

    def __init__(
        self,
        connect: Callable[[], StoreClient],
        layouts: Sequence[dict[str, Any]],
        payload_bytes: int,
        region_views: Callable[[], Sequence[memoryview] | None],
        settings: StoreTierSettings = StoreTierSettings(),
    ) -> None:
        if payload_bytes <= 0 or payload_bytes % fs_format.ALIGNMENT:
            raise ValueError(
                f"payload_bytes must be a positive multiple of 4096, got {payload_bytes}"
            )
        self._connect = connect
        self.client: StoreClient | None = None
        self.cfg = settings
        self.name = settings.name
        self._key = settings.auth_key
        self.payload_bytes = payload_bytes
        self.object_bytes = fs_format.HEADER_SIZE + payload_bytes
        self.copies = len(layouts)
        self.entry_bytes = self.object_bytes * self.copies
        self.fingerprints = [fs_format.layout_fingerprint(layout) for layout in layouts]
        self._prefixes = [f"{fs_format.FORMAT_DIR}/{fp.hex()}/" for fp in self.fingerprints]
        self._region_views = region_views
        # Base address of each copy's region, set by the connect thread once registered.
        self._regions: list[int] | None = None
        self._registered: set[int] = set()
        self._views: Sequence[memoryview] | None = None
        # Header pages: one set of MAX_BATCH * copies pages per job thread that may be
        # in a store call (the serving one plus MAX_STUCK_CALLS abandoned ones), all
        # registered with the client once it is connected.
        self._slot_pages = MAX_BATCH * self.copies
        self._headers = mmap.mmap(
            -1, fs_format.HEADER_SIZE * self._slot_pages * (MAX_STUCK_CALLS + 1)
        )
        self._headers_view = memoryview(self._headers)
        self._headers_addr = _address(self._headers_view)

        self.stats = TierStats()
        self._faults: dict[str, int] = dict.fromkeys(map(str, FAULT_KINDS), 0)
        self._fault_logged: set[str] = set()
        self._index: OrderedDict[bytes, bytes | None] = OrderedDict()  # digest -> key
        self._absent: dict[bytes, float] = {}  # digest -> when it may be asked again
        self._probing: set[bytes] = set()
        self._writing: set[bytes] = set()
        self._reading: dict[bytes, int] = {}
        self._events: list[tuple[bool, list[bytes]]] = []
        self._inflight = 0
        self._down_until = 0.0
        self._backoff = settings.backoff_min_s
        self._closed = False
        self.stuck = False
        self._started = time.monotonic()
        self._connect_overdue = False
        # I/O thread results and probe answers, taken in by poll() (scheduler thread).
        self._results: deque[TierResult] = deque()
        self._answers: deque[tuple[bytes, bool]] = deque()
        # Outcomes of store calls in order: (None, "") for a success, else (fault, why).
        self._outcomes: deque[tuple[str | None, str]] = deque()
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._probes: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._connected = threading.Event()
        # Shared with the calling threads, under _lock: the calls being served, the
        # threads serving each queue (abandoned ones not counted), free header sets,
        # jobs whose store call has not returned, abandoned writes not returned.
        self._lock = threading.Lock()
        self._calls: set[_Call] = set()
        self._live = {"jobs": 0, "probes": 0}
        self._stuck_calls = {"jobs": 0, "probes": 0}
        self._free_slots = list(range(MAX_STUCK_CALLS, -1, -1))
        self._unfinished = 0
        self._parked = 0
        self._threads: list[threading.Thread] = []
        with self._lock:
            self._spawn("jobs")
            self._spawn("probes")
        connector = threading.Thread(
            target=self._connect_loop, name=f"kvtier-{self.name}-connect", daemon=True
        )
        self._threads.append(connector)
        connector.start()
        if self._key is None:
            logger.warning(
                "kvtier store tier %r: no auth_key_file: every client of the Mooncake "
                "master is trusted (any of them can plant KV that this engine loads); "
                "set auth_key_file to load only objects written with a shared secret",
                self.name,
            )

    # ----------------------------------------------------------------- helpers

    def object_keys(self, digest: bytes) -> list[str]:
        """The store keys of a key digest, one per copy."""
        hexd = digest.hex()
        return [prefix + hexd for prefix in self._prefixes]

    def _down(self) -> bool:
        return (
            self.client is None
            or time.monotonic() < self._down_until
            or not self._live["jobs"]
            or not self._live["probes"]
        )

    def wait_connected(self, timeout: float = 30.0) -> bool:
        """Whether the client connected and registered the host regions within
        ``timeout`` seconds (tests, benchmarks)."""
        return self._connected.wait(timeout)

    def _spawn(self, kind: str) -> bool:
        """Start a thread serving ``kind`` ("jobs" or "probes"); under ``_lock``. False
        when too many abandoned calls still hold threads (and header pages)."""
        if self._closed or self._stuck_calls[kind] >= MAX_STUCK_CALLS:
            return False
        if kind == "jobs":
            slot = self._free_slots.pop()
            t = threading.Thread(
                target=self._serve_jobs, args=(slot,), name=f"kvtier-{self.name}-io", daemon=True
            )
        else:
            t = threading.Thread(
                target=self._serve_probes, name=f"kvtier-{self.name}-probe", daemon=True
            )
        self._live[kind] += 1
        self._threads = [x for x in self._threads if x.is_alive()]
        self._threads.append(t)
        t.start()
        return True

    def _fail_queued(self, kind: str) -> None:
        """Answer every queued job or probe of ``kind`` as failed (no thread serves
        them); under ``_lock``."""
        q = self._jobs if kind == "jobs" else self._probes
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            if item is None:  # shutdown's marker: for the thread that comes back
                q.put(None)
                return
            if kind == "probes":
                self._answers.append((item, False))
                continue
            op, key, _digest, block = item
            self._unfinished -= 1
            self._results.append(TierResult(op, key, block, False, TierFault.TIMEOUT))
            if op == "read":
                self._results.append(TierResult("release", key, block, False, TierFault.TIMEOUT))

    def _connect_loop(self) -> None:
        """Connect, then register the host regions once they are mapped. Registering
        pins the memory for RDMA, seconds for tens of GiB: never on the scheduler
        thread. Failures back off and try again until shutdown."""
        delay = self.cfg.backoff_min_s
        while not self._stop.is_set():
            try:
                if self.client is None:
                    client = self._connect()
                    if client.register_buffer(self._headers_addr, len(self._headers)) != 0:
                        raise RuntimeError("registering the header pages failed")
                    self.client = client
                    logger.info("kvtier store tier %r: connected", self.name)
                if self._register_regions(self.client):
                    self._connected.set()
                    return
                delay = REGION_POLL_S  # the regions are not mapped yet
            except Exception as exc:
                self._outcomes.append(
                    (TierFault.UNREACHABLE, f"connecting failed: {type(exc).__name__}: {exc}")
                )
                delay = max(delay, self.cfg.backoff_min_s)
                self._stop.wait(delay)
                delay = min(self.cfg.backoff_max_s, delay * 2)
                continue
            self._stop.wait(delay)

    def _register_regions(self, client: StoreClient) -> bool:
        """Register every copy's host region not registered yet; True once all are.
        False while the regions cannot be mapped; raises when the client refuses one."""
        views = self._region_views()
        if views is None:
            return False
        addrs = [_address(view) for view in views]
        for addr, view in zip(addrs, views):
            if addr in self._registered:
                continue
            if client.register_buffer(addr, len(view)) != 0:
                raise RuntimeError("registering the host region failed")
            self._registered.add(addr)
        self._views = views
        self._regions = addrs
        return True

    # ----------------------------------------------------------------- queries

    def contains(self, digest: bytes) -> bool | None:
        """Whether the store holds ``digest``: True or False from memory, or None when
        unknown (a background check was started; ask again). A check past
        ``probe_timeout_s`` answers False (see :meth:`poll`)."""
        if digest in self._index:
            self.stats.queries += 1
            self.stats.hits += 1
            return True
        if self._closed or self._down():
            self.stats.queries += 1
            if self.client is None and not self._connect_overdue:
                self._check_connect_deadline()
            return False
        until = self._absent.get(digest)
        if until is not None:
            if time.monotonic() < until:
                self.stats.queries += 1
                return False
            del self._absent[digest]
        if digest not in self._probing:
            if len(self._probing) >= MAX_PENDING_PROBES:
                self.stats.queries += 1
                return False
            self._probing.add(digest)
            self._probes.put(digest)
        return None

    def _check_connect_deadline(self) -> None:
        """Count one ``timeout`` when connecting takes longer than a call may."""
        if time.monotonic() - self._started > self.cfg.call_timeout_s:
            self._connect_overdue = True
            self._timed_out("connecting to the store")

    @property
    def in_flight(self) -> int:
        """Jobs and probes the manager must poll for (abandoned writes excluded: they
        report when their call returns, which may be never)."""
        return max(0, self._inflight - self._parked) + len(self._probing) + len(self._results)

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.entry_bytes

    # ----------------------------------------------------------------- jobs

    def submit_write(self, key: bytes, digest: bytes, block_id: int) -> bool:
        """Put host block ``block_id`` (every copy) as ``key``. False if not submitted."""
        if self._closed or digest in self._index or digest in self._writing:
            return False
        if self._down() or self._regions is None:
            self.stats.writes_dropped += 1
            return False
        self._writing.add(digest)
        self._inflight += 1
        with self._lock:
            self._unfinished += 1
        self._jobs.put(("write", key, digest, block_id))
        return True

    def submit_read(self, key: bytes, digest: bytes, block_id: int) -> bool:
        """Get ``key``'s objects into host block ``block_id``. False if not submitted."""
        if self._closed or digest not in self._index or self._down():
            return False
        if self._regions is None:
            return False
        self._reading[digest] = self._reading.get(digest, 0) + 1
        self._index.move_to_end(digest)
        self._inflight += 1
        with self._lock:
            self._unfinished += 1
        self._jobs.put(("read", key, digest, block_id))
        return True

    def poll(self) -> list[TierResult]:
        """Finished jobs and probe answers since the last call (scheduler thread).

        Abandons store calls past their deadline first. Results are ``"read"`` and
        ``"write"`` ones, plus ``"release"`` ones: the host block of a read that timed
        out (reported as a ``"timeout"`` failure) may be used again.
        """
        now = time.monotonic()
        if self._calls:
            self._expire(now)
        while self._outcomes:
            kind, why = self._outcomes.popleft()
            if kind is None:
                self._backoff = self.cfg.backoff_min_s  # the store answers again
            else:
                self._back_off(kind, why)
        while self._answers:
            digest, present = self._answers.popleft()
            self._probing.discard(digest)
            if present:
                self._remember(digest, None)
            else:
                self._absent[digest] = now + NEGATIVE_TTL_S
        if len(self._absent) > MAX_INDEX_ENTRIES:
            self._absent = {d: t for d, t in self._absent.items() if t > now}
        out: list[TierResult] = []
        while self._results:
            res = self._results.popleft()
            if res.op == "release":
                out.append(res)
                continue
            self._inflight -= 1
            digest = res.digest or fs_format.key_digest(res.key)
            if res.op == "write":
                self._writing.discard(digest)
                if res.ok:
                    self._remember(digest, res.key)
                    self.stats.record(res)
                    if self.cfg.enable_kv_events:
                        self._events.append((False, [res.key]))
                elif res.fault != TierFault.TIMEOUT:  # a timeout was counted when abandoned
                    self._fault(res.fault or TierFault.WRITE_FAILED, res)
            else:
                count_down(self._reading, digest)
                if res.ok:
                    self.stats.record(res)
                else:
                    if res.fault != TierFault.TIMEOUT:
                        self._fault(res.fault or TierFault.UNREADABLE, res)
                    self._forget(digest, res.key)
            out.append(res)
        self.stats.used_bytes = self.used_bytes
        self.stats.entries = len(self._index)
        return out

    def _expire(self, now: float) -> None:
        """Abandon every store call past its deadline: its probes answer absent, its
        reads fail as ``timeout`` (the blocks of reads not started are released at
        once), a fault is counted, the tier backs off and a new thread serves on."""
        with self._lock:
            for call in [c for c in self._calls if now > c.deadline and not c.abandoned]:
                call.abandoned = True
                self._calls.discard(call)
                self._live[call.kind] -= 1
                what = f"a {call.running or 'queued'} call of {len(call.items)} item(s)"
                if call.kind == "probes":
                    self._stuck_calls["probes"] += 1
                    for d in call.items:
                        self._answers.append((d, False))
                else:
                    self._stuck_calls["jobs"] += 1
                    for i, (op, key, _digest, block) in enumerate(call.items):
                        if i in call.done:
                            continue
                        started = op == "write" or call.running in ("read", "remove")
                        if op == "read":
                            self._results.append(
                                TierResult("read", key, block, False, TierFault.TIMEOUT)
                            )
                            if not started:
                                self._release(call, i)
                        else:
                            self._parked += 1  # pinned until the put returns
                self._outcomes.append((TierFault.TIMEOUT, f"{what} past its deadline"))
                if not self._spawn(call.kind):
                    self._fail_queued(call.kind)

    def _release(self, call: _Call, i: int) -> None:
        """Job ``i`` of an abandoned call will not touch its host block any more: a
        read's block may be reused, a write fails; under ``_lock``."""
        op, key, _, block = call.items[i]
        call.done.add(i)
        self._unfinished -= 1
        if op == "write":
            self._parked -= 1  # parked when abandoned
            self._results.append(TierResult("write", key, block, False, TierFault.TIMEOUT))
        else:
            self._results.append(TierResult("release", key, block, False, TierFault.TIMEOUT))

    def touch(self, digests: Sequence[bytes]) -> None:
        """``digests`` were used (head first): the head ends the newest in the index
        (which only bounds what this engine remembers; the master evicts)."""
        index = self._index
        for digest in reversed(digests):
            if digest in index:
                index.move_to_end(digest)

    def _remember(self, digest: bytes, key: bytes | None) -> None:
        self._index[digest] = key if key is not None else self._index.get(digest)
        self._index.move_to_end(digest)
        if len(self._index) > MAX_INDEX_ENTRIES:
            self._index.popitem(last=False)

    def _forget(self, digest: bytes, key: bytes | None) -> None:
        known = self._index.pop(digest, None)
        if self.cfg.enable_kv_events and (known or key):
            self._events.append((True, [known or key]))  # type: ignore[list-item]

    def _fault(self, kind: TierFault, res: TierResult) -> None:
        self._faults[kind] = self._faults.get(kind, 0) + 1
        if kind not in self._fault_logged:
            self._fault_logged.add(kind)
            logger.warning(
                "kvtier store tier %r: %s of the object for key %s failed (%s); treated as a "
                "miss, never loaded. Further faults of this kind are only counted "
                "(metric vllm:kvtier_tier_faults{tier=%r,kind=%r}).",
                self.name,
                res.op,
                fs_format.key_digest(res.key).hex(),
                kind,
                self.name,
                kind,
            )

    def _back_off(self, kind: str, why: str) -> None:
        """Count a failed or overdue store call (``kind`` "unreachable" or "timeout")
        and give misses for the current back-off, which then doubles."""
        self._faults[kind] = self._faults.get(kind, 0) + 1
        self._down_until = time.monotonic() + self._backoff
        if kind not in self._fault_logged:
            self._fault_logged.add(kind)
            logger.warning(
                "kvtier store tier %r: the store did not answer (%s); lookups miss and writes "
                "are dropped for %.1f s, then it is tried again (back-off up to %.0f s, back "
                "to %.1f s after a call that succeeds; metric "
                "vllm:kvtier_tier_faults{tier=%r,kind=%r})",
                self.name,
                why,
                self._backoff,
                self.cfg.backoff_max_s,
                self.cfg.backoff_min_s,
                self.name,
                kind,
            )
        self._backoff = min(self.cfg.backoff_max_s, self._backoff * 2)

    def _timed_out(self, what: str) -> None:
        super()._timed_out(what)
        if TierFault.TIMEOUT not in self._fault_logged:
            self._fault_logged.add(TierFault.TIMEOUT)
            logger.warning(
                "kvtier store tier %r: %s past the time limit; the engine goes on without "
                "it (metric vllm:kvtier_tier_faults{tier=%r,kind='timeout'})",
                self.name,
                what,
                self.name,
            )

    def drain(self, timeout: float | None = None) -> bool:
        """Block until no job is queued or in a store call (abandoned calls included:
        a late read may still land in its host block), or ``timeout`` seconds passed:
        then False, and a ``timeout`` fault is counted."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._unfinished > 0:
            if self._calls:
                self._expire(time.monotonic())
            if deadline is not None and time.monotonic() > deadline:
                self._timed_out(f"{self._unfinished} job(s) still in store calls")
                return False
            time.sleep(0.001)
        return True

    def wait_probes(self, timeout: float = 10.0) -> None:
        """Wait until every started existence check answered (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while len(self._answers) < len(self._probing) and time.monotonic() < deadline:
            if self._calls:
                self._expire(time.monotonic())
            time.sleep(0.001)
        self.poll()

    def shutdown(self) -> bool:
        """Stop the threads (waiting at most ``shutdown_timeout_s``); False if one is
        still in a store call (the host region must then stay mapped)."""
        if self._closed:
            return not self.stuck
        self._closed = True
        self._stop.set()
        threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
            self._probes.put(None)
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        for t in threads:
            if t.ident:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.stuck = any(t.is_alive() for t in threads)
        if self.stuck:
            self._timed_out("shutdown: a store call still running")
        self.poll()
        return not self.stuck

    # ----------------------------------------------------------------- threads

    @staticmethod
    def _take_batch(q: queue.SimpleQueue[Any]) -> list[Any] | None:
        """Up to ``MAX_BATCH`` items: one waited for, the rest already queued. None
        once the stop marker comes first (a marker after items ends the next call)."""
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

    def _begin(self, kind: str, items: list[Any], slot: int, timeout: float) -> _Call:
        call = _Call(kind, items, time.monotonic() + timeout, slot)
        with self._lock:
            self._calls.add(call)
        return call

    def _carry_on(self, call: _Call) -> bool:
        """After an abandoned call returned: whether its thread serves on (no other
        thread serves its queue) or ends."""
        with self._lock:
            self._stuck_calls[call.kind] -= 1
            if self._closed or self._live[call.kind]:
                if call.kind == "jobs":
                    self._free_slots.append(call.slot)
                return False
            self._live[call.kind] += 1
            return True

    def _serve_jobs(self, slot: int) -> None:
        while (batch := self._take_batch(self._jobs)) is not None:
            call = self._begin("jobs", batch, slot, self.cfg.call_timeout_s)
            for op in ("write", "read"):
                same = [i for i, j in enumerate(batch) if j[0] == op]
                if same:
                    self._run_batch(call, op, same)
            with self._lock:
                self._calls.discard(call)
                if call.abandoned:
                    # Jobs never started (abandoned first) are released here.
                    for i in range(len(batch)):
                        if i not in call.done:
                            self._release(call, i)
            if call.abandoned and not self._carry_on(call):
                return

    def _store_call(self, call: _Call, op: str, fn: Callable[[], Any], n: int) -> list[int]:
        """Run one store call of ``n`` objects for ``call``: its codes (-1 each when it
        raised or answered the wrong number of codes). Records the outcome."""
        with self._lock:
            if call.abandoned:
                return [-1] * n
            call.running = op
        try:
            codes = list(fn())
            if len(codes) != n:
                raise RuntimeError(f"{len(codes)} codes for {n} objects")
        except Exception as exc:  # the client raised: the store is unusable for now
            codes = [-1] * n
            self._outcomes.append((TierFault.UNREACHABLE, f"{op}: {type(exc).__name__}: {exc}"))
            return codes
        if codes and all(c < 0 and c != OBJECT_NOT_FOUND for c in codes):
            self._outcomes.append((TierFault.UNREACHABLE, f"{op} returned {codes[0]}"))
        elif not call.abandoned:  # a late answer does not end the back-off
            self._outcomes.append((None, ""))
        return codes

    def _run_batch(self, call: _Call, op: str, idx: list[int]) -> None:
        if call.abandoned:
            return
        t0 = time.perf_counter()
        regions = self._regions
        views = self._views
        assert regions is not None and views is not None
        batch = [call.items[i] for i in idx]
        keys: list[str] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        payload = self.payload_bytes
        hsize = fs_format.HEADER_SIZE
        base = call.slot * self._slot_pages
        for i, (_, _key, digest, block) in enumerate(batch):
            for copy, name in enumerate(self.object_keys(digest)):
                slot = base + i * self.copies + copy
                head = self._headers_addr + slot * hsize
                if op == "write":
                    data = views[copy][block * payload : (block + 1) * payload]
                    page = self._headers_view[slot * hsize : (slot + 1) * hsize]
                    header = fs_format.encode_header(
                        self.fingerprints[copy],
                        digest,
                        payload,
                        fs_format.checksum(data),
                        auth_key=self._key,
                        payload=data,
                    )
                    page[: len(header)] = header
                keys.append(name)
                ptrs.append([head, regions[copy] + block * payload])
                sizes.append([hsize, payload])
        client = self.client
        assert client is not None  # jobs are submitted only once connected
        if op == "write":
            codes = self._store_call(
                call, op, lambda: client.batch_put_from_multi_buffers(keys, ptrs, sizes), len(keys)
            )
        else:
            codes = self._store_call(
                call, op, lambda: client.batch_get_into_multi_buffers(keys, ptrs, sizes), len(keys)
            )
        seconds = (time.perf_counter() - t0) / max(1, len(batch))
        results: list[TierResult] = []
        corrupt: list[str] = []
        late = call.abandoned  # read without the lock: rechecked below
        for i, (_, key, digest, block) in enumerate(batch):
            mine = codes[i * self.copies : (i + 1) * self.copies]
            if op == "write":
                fault = None if all(c == 0 for c in mine) else TierFault.WRITE_FAILED
            elif late:
                fault = TierFault.TIMEOUT  # never checked: reported failed already
            else:
                fault = self._check_read(base + i * self.copies, digest, block, mine)
                # Removed, so that no engine tries it again.
                if fault in (TierFault.CORRUPT, TierFault.UNAUTHENTICATED):
                    corrupt += self.object_keys(digest)
            results.append(
                TierResult(
                    op,
                    key,
                    block,
                    fault is None,
                    fault,
                    self.entry_bytes if fault is None else 0,
                    seconds,
                    digest,
                )
            )
        with self._lock:
            call.running = None
            for i, res in zip(idx, results):
                if i in call.done:  # never started, released when abandoned
                    continue
                self._unfinished -= 1
                call.done.add(i)
                if not call.abandoned:
                    self._results.append(res)
                elif op == "write":  # returned late: counted, never trusted
                    self._parked -= 1
                    self._results.append(
                        TierResult("write", res.key, res.block_id, False, TierFault.TIMEOUT)
                    )
                else:  # the block was reported failed; the manager may reuse it now
                    self._results.append(
                        TierResult("release", res.key, res.block_id, False, TierFault.TIMEOUT)
                    )
        if corrupt and not call.abandoned:
            self._store_call(
                call, "remove", lambda: client.batch_remove(corrupt, True), len(corrupt)
            )

    def _check_read(
        self, first: int, digest: bytes, block: int, codes: list[int]
    ) -> TierFault | None:
        """The fault of one read whose header pages start at page ``first`` (None if
        every copy arrived intact and, with a key, authenticated)."""
        if any(c == OBJECT_NOT_FOUND for c in codes):
            return TierFault.VANISHED
        if any(c < 0 for c in codes):
            return TierFault.UNREADABLE
        if any(c != self.object_bytes for c in codes):
            return TierFault.CORRUPT
        views = self._views
        assert views is not None
        hsize = fs_format.HEADER_SIZE
        payload = self.payload_bytes
        for copy in range(self.copies):
            slot = first + copy
            page = self._headers_view[slot * hsize : (slot + 1) * hsize]
            data = views[copy][block * payload : (block + 1) * payload]
            try:
                crc = fs_format.decode_header(
                    page,
                    fingerprint=self.fingerprints[copy],
                    digest=digest,
                    payload_len=payload,
                )
                if self._key is not None:
                    fs_format.check_mac(page, data, self._key)
            except fs_format.FormatError as exc:
                return (
                    TierFault.UNAUTHENTICATED
                    if exc.kind == TierFault.UNAUTHENTICATED
                    else TierFault.CORRUPT
                )
            if fs_format.checksum(data) != crc:
                return TierFault.CORRUPT
        return None

    def _serve_probes(self) -> None:
        while (batch := self._take_batch(self._probes)) is not None:
            keys = [k for d in batch for k in self.object_keys(d)]
            call = self._begin("probes", batch, -1, self.cfg.probe_timeout_s)
            client = self.client
            if client is None:
                codes = [-1] * len(keys)
                self._outcomes.append((TierFault.UNREACHABLE, "existence check: not connected"))
            else:
                codes = self._store_call(
                    call, "probe", partial(client.batch_is_exist, keys), len(keys)
                )
            with self._lock:
                self._calls.discard(call)
                if not call.abandoned:  # else answered absent already
                    for i, d in enumerate(batch):
                        mine = codes[i * self.copies : (i + 1) * self.copies]
                        self._answers.append((d, all(c == 1 for c in mine)))
            if call.abandoned and not self._carry_on(call):
                return
