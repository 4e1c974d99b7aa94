"""A store tier: host blocks as objects in a key-value store that many engines share.

Mooncake Store is the store this is built for (any object with the :class:`StoreClient`
methods works). Runs in the scheduler process, like the fs tier, as a ``SecondaryTier``
(``tiers/base.py``), so the manager treats both alike. This module keeps the tier's
state (index, jobs, faults, back-off); its threads' work is in ``threads``, store calls
with a deadline in ``calls``, existence checks in ``probes``, object checks in ``objects``.

* **Keys and bytes as in the fs tier.** One object per copy (rank) of a host block,
  named ``kvtier-kv-v1/<layout fingerprint>/<key digest>``, holding the fs tier's block
  file. An object whose header or checksum does not match is a miss, counted and
  removed; one the store evicted is a miss, counted.
* **Zero copy.** The host region is registered with the store client once, by the
  thread that connects; a write puts from, and a read gets into, the host block itself
  (plus a header page). Until it is registered, writes are dropped and reads refused.
* **No store call on the scheduler thread.** Lookups read an in-memory index of
  objects this tier wrote or found; an unknown key is checked in the background and
  :meth:`StoreTier.contains` returns None ("ask again") until the answer came.
* **A store that is down or slow gives misses.** A failed call counts a fault and
  sends the tier into a back-off (``BACKOFF_MIN_S`` doubling to ``BACKOFF_MAX_S``,
  back to the minimum after a call that succeeds) during which lookups miss, writes
  are dropped and nothing waits on the store.
* **Every store call has a deadline** (``call_timeout_s``; ``probe_timeout_s`` for
  existence checks). :meth:`StoreTier.poll` abandons a call past it: its probes answer
  "absent", its reads fail (fault ``timeout``) and the tier backs off. A read that
  timed out may still land in its host block, so the manager keeps that block reserved
  until a ``"release"`` result says the call returned. A write that timed out keeps its
  host block pinned until it returns, then counts as failed.
* **Authenticated objects** (``auth_key``): each object's header carries a MAC keyed
  with a secret every engine of the store shares; an object without a valid MAC is a
  miss (fault ``unauthenticated``), removed, never loaded. Without a key, every client
  of the master is trusted (logged at start-up).

Units: bytes, unless a name says blocks.
"""

from __future__ import annotations

import logging
import mmap
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.tiering_spec.tiers.base import (
    FAULT_KINDS,
    SecondaryTier,
    TierFault,
    TierResult,
    TierStats,
    count_down,
)
from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.store.calls import MAX_BATCH, Call, DeadlineCalls
from kvtier.tiering_spec.tiers.store.client import StoreClient, StoreTierSettings
from kvtier.tiering_spec.tiers.store.probes import MAX_PENDING_PROBES, ProbeCache
from kvtier.tiering_spec.tiers.store.threads import StoreThreads, address

__all__ = [
    "MAX_BATCH",
    "MAX_PENDING_PROBES",
    "MAX_STUCK_CALLS",
    "StoreClient",
    "StoreTier",
    "StoreTierSettings",
]

logger = logging.getLogger("kvtier.tiering_spec")

# Keys the index remembers (least recently used dropped first).
MAX_INDEX_ENTRIES = 1_000_000
MAX_STUCK_CALLS = 3
"""Abandoned calls (per kind: jobs, probes) that may still be running before the tier
stops issuing calls of that kind; each holds a thread (and, for jobs, its header
pages)."""


DEFAULT_SETTINGS = StoreTierSettings()


class StoreTier(StoreThreads, SecondaryTier):
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
        settings: StoreTierSettings = DEFAULT_SETTINGS,
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
        self._map_headers()
        self._init_state()
        self._start_threads()
        if self._key is None:
            logger.warning(
                "kvtier store tier %r: no auth_key_file: every client of the Mooncake "
                "master is trusted (any of them can plant KV that this engine loads); "
                "set auth_key_file to load only objects written with a shared secret",
                self.name,
            )

    def _map_headers(self) -> None:
        """Header pages: one set of MAX_BATCH * copies pages per job thread that may be
        in a store call (the serving one plus MAX_STUCK_CALLS abandoned ones), all
        registered with the client once it is connected."""
        self._slot_pages = MAX_BATCH * self.copies
        self._headers = mmap.mmap(
            -1, fs_format.HEADER_SIZE * self._slot_pages * (MAX_STUCK_CALLS + 1)
        )
        self._headers_view = memoryview(self._headers)
        self._headers_addr = address(self._headers_view)

    def _init_state(self) -> None:
        """The scheduler thread's bookkeeping: the index, what is in flight, faults."""
        self.stats = TierStats()
        self._faults: dict[str, int] = dict.fromkeys(map(str, FAULT_KINDS), 0)
        self._fault_logged: set[str] = set()
        self._index: OrderedDict[bytes, bytes | None] = OrderedDict()  # digest -> key
        self._probe_cache = ProbeCache(MAX_INDEX_ENTRIES)
        self._writing: set[bytes] = set()
        self._reading: dict[bytes, int] = {}
        self._events: list[tuple[bool, list[bytes]]] = []
        self._inflight = 0
        self._down_until = 0.0
        self._backoff = self.cfg.backoff_min_s
        self._closed = False
        self.stuck = False
        self._started = time.monotonic()
        self._connect_overdue = False
        # I/O thread results, taken in by poll() (scheduler thread).
        self._results: deque[TierResult] = deque()
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def _start_threads(self) -> None:
        """Start a jobs thread, a probes thread and the connect thread."""
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._caller = DeadlineCalls(
            self.name, self._serve_jobs, self._serve_probes, MAX_STUCK_CALLS
        )
        # Outcomes of store calls in order: (None, "") for a success, else (fault, why).
        self._outcomes = self._caller.outcomes
        # Shared with the calling threads, under _lock (the caller's): jobs whose store
        # call has not returned, abandoned writes not returned.
        self._lock = self._caller.lock
        self._unfinished = 0
        self._parked = 0
        with self._lock:
            self._caller.spawn("jobs")
            self._caller.spawn("probes")
        connector = threading.Thread(
            target=self._connect_loop, name=f"kvtier-{self.name}-connect", daemon=True
        )
        self._caller.threads.append(connector)
        connector.start()

    @property
    def _threads(self) -> list[threading.Thread]:
        """The tier's threads (calling ones and the connect thread)."""
        return self._caller.threads

    @property
    def _probing(self) -> set[bytes]:
        """Digests whose existence check has not been taken in."""
        return self._probe_cache.probing

    # ----------------------------------------------------------------- helpers

    def object_keys(self, digest: bytes) -> list[str]:
        """The store keys of a key digest, one per copy."""
        hexd = digest.hex()
        return [prefix + hexd for prefix in self._prefixes]

    def _down(self) -> bool:
        return (
            self.client is None or time.monotonic() < self._down_until or not self._caller.serving()
        )

    def _fail_queued(self, kind: str) -> None:
        """Answer every queued job or probe of ``kind`` as failed (no thread serves
        them); under ``_lock``."""
        if kind == "probes":
            self._probe_cache.fail_queued()
            return
        q = self._jobs
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            if item is None:  # shutdown's marker: for the thread that comes back
                q.put(None)
                return
            op, key, _digest, block = item
            self._unfinished -= 1
            self._results.append(TierResult(op, key, block, False, TierFault.TIMEOUT))
            if op == "read":
                self._results.append(TierResult("release", key, block, False, TierFault.TIMEOUT))

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
        if self._probe_cache.known_absent(digest, time.monotonic()) or not (
            self._probe_cache.ask(digest)
        ):
            self.stats.queries += 1
            return False
        return None

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
        if self._caller.calls:
            self._expire(now)
        while self._outcomes:
            kind, why = self._outcomes.popleft()
            if kind is None:
                self._backoff = self.cfg.backoff_min_s  # the store answers again
            else:
                self._back_off(kind, why)
        for digest in self._probe_cache.take(now):
            self._remember(digest, None)
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
            for call in self._caller.overdue(now):
                what = f"a {call.running or 'queued'} call of {len(call.items)} item(s)"
                if call.kind == "probes":
                    for d in call.items:
                        self._probe_cache.answer(d, False)
                else:
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
                if not self._caller.spawn(call.kind):
                    self._fail_queued(call.kind)

    def _release(self, call: Call, i: int) -> None:
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
            if self._caller.calls:
                self._expire(time.monotonic())
            if deadline is not None and time.monotonic() > deadline:
                self._timed_out(f"{self._unfinished} job(s) still in store calls")
                return False
            time.sleep(0.001)
        return True

    def wait_probes(self, timeout: float = 10.0) -> None:
        """Wait until every started existence check answered (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while self._probe_cache.unanswered > 0 and time.monotonic() < deadline:
            if self._caller.calls:
                self._expire(time.monotonic())
            time.sleep(0.001)
        self.poll()

    def shutdown(self) -> bool:
        """Stop the threads (waiting at most ``shutdown_timeout_s``); False if one is
        still in a store call (the host region must then stay mapped)."""
        if self._closed:
            return not self.stuck
        self._closed = self._caller.closed = True
        self._stop.set()
        threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
            self._probe_cache.queue.put(None)
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        for t in threads:
            if t.ident:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.stuck = any(t.is_alive() for t in threads)
        if self.stuck:
            self._timed_out("shutdown: a store call still running")
        self.poll()
        return not self.stuck
