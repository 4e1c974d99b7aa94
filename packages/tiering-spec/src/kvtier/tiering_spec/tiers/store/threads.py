"""What the store tier's threads do: connect and register the host regions (the
connect thread), put and get batches of objects (the jobs thread) and check which keys
the store holds (the probes thread). Each store call goes through the tier's
:class:`~kvtier.tiering_spec.tiers.store.calls.DeadlineCalls`; results and answers go
to the scheduler thread's ``poll``.

:class:`StoreThreads` is a part of :class:`~kvtier.tiering_spec.tiers.store.tier.
StoreTier` (a mixin).
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from kvtier.tiering_spec.tiers.base import TierFault, TierResult
from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.store.calls import Call, DeadlineCalls, take_batch
from kvtier.tiering_spec.tiers.store.client import StoreClient, StoreTierSettings
from kvtier.tiering_spec.tiers.store.objects import check_object, write_header
from kvtier.tiering_spec.tiers.store.probes import ProbeCache

logger = logging.getLogger("kvtier.tiering_spec")

REGION_POLL_S = 0.05
"""How often the connect thread looks for host regions not mapped yet (seconds)."""


def address(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class StoreThreads:
    """The bodies of the store tier's threads (see the module docstring)."""

    name: str
    cfg: StoreTierSettings
    client: StoreClient | None
    copies: int
    payload_bytes: int
    object_bytes: int
    entry_bytes: int
    fingerprints: list[bytes]
    _key: bytes | None
    _connect: Callable[[], StoreClient]
    _region_views: Callable[[], Sequence[memoryview] | None]
    _regions: list[int] | None
    _registered: set[int]
    _views: Sequence[memoryview] | None
    _headers: Any
    _headers_view: memoryview
    _headers_addr: int
    _slot_pages: int
    _stop: threading.Event
    _connected: threading.Event
    _caller: DeadlineCalls
    _lock: threading.Lock
    _outcomes: deque[tuple[str | None, str]]
    _probe_cache: ProbeCache
    _jobs: queue.SimpleQueue[Any]
    _results: deque[TierResult]
    _unfinished: int
    _parked: int
    _started: float
    _connect_overdue: bool

    if TYPE_CHECKING:

        def object_keys(self, digest: bytes) -> list[str]: ...

        def _release(self, call: Call, i: int) -> None: ...

        def _timed_out(self, what: str) -> None: ...

    def wait_connected(self, timeout: float = 30.0) -> bool:
        """Whether the client connected and registered the host regions within
        ``timeout`` seconds (tests, benchmarks)."""
        return self._connected.wait(timeout)

    def _check_connect_deadline(self) -> None:
        """Count one ``timeout`` when connecting takes longer than a call may."""
        if time.monotonic() - self._started > self.cfg.call_timeout_s:
            self._connect_overdue = True
            self._timed_out("connecting to the store")

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
        addrs = [address(view) for view in views]
        for addr, view in zip(addrs, views):
            if addr in self._registered:
                continue
            if client.register_buffer(addr, len(view)) != 0:
                raise RuntimeError("registering the host region failed")
            self._registered.add(addr)
        self._views = views
        self._regions = addrs
        return True

    def _serve_jobs(self, slot: int) -> None:
        while (batch := take_batch(self._jobs)) is not None:
            call = self._caller.begin("jobs", batch, slot, self.cfg.call_timeout_s)
            for op in ("write", "read"):
                same = [i for i, j in enumerate(batch) if j[0] == op]
                if same:
                    self._run_batch(call, op, same)
            with self._lock:
                self._caller.calls.discard(call)
                if call.abandoned:
                    # Jobs never started (abandoned first) are released here.
                    for i in range(len(batch)):
                        if i not in call.done:
                            self._release(call, i)
            if call.abandoned and not self._caller.carry_on(call):
                return

    def _run_batch(self, call: Call, op: str, idx: list[int]) -> None:
        """Put or get (``op``) the jobs ``idx`` of ``call`` in one store call, check what
        came, post their results and remove the objects found damaged."""
        if call.abandoned:
            return
        t0 = time.perf_counter()
        batch = [call.items[i] for i in idx]
        base = call.slot * self._slot_pages
        keys, ptrs, sizes = self._buffers(op, batch, base)
        client = self.client
        assert client is not None  # jobs are submitted only once connected
        if op == "write":
            codes = self._caller.run(
                call, op, lambda: client.batch_put_from_multi_buffers(keys, ptrs, sizes), len(keys)
            )
        else:
            codes = self._caller.run(
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
            ok = fault is None
            nbytes = self.entry_bytes if ok else 0
            results.append(TierResult(op, key, block, ok, fault, nbytes, seconds, digest))
        self._post(call, op, idx, results)
        if corrupt and not call.abandoned:
            self._caller.run(
                call, "remove", lambda: client.batch_remove(corrupt, True), len(corrupt)
            )

    def _buffers(
        self, op: str, batch: list[Any], base: int
    ) -> tuple[list[str], list[list[int]], list[list[int]]]:
        """The store keys, buffer addresses and sizes of ``batch`` (header page, then
        the host block, per copy), its header pages from page ``base`` on; for a put,
        the headers are written first."""
        regions = self._regions
        views = self._views
        assert regions is not None and views is not None
        keys: list[str] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        payload = self.payload_bytes
        hsize = fs_format.HEADER_SIZE
        for i, (_, _key, digest, block) in enumerate(batch):
            for copy, name in enumerate(self.object_keys(digest)):
                slot = base + i * self.copies + copy
                head = self._headers_addr + slot * hsize
                if op == "write":
                    write_header(
                        self._headers_view[slot * hsize : (slot + 1) * hsize],
                        self.fingerprints[copy],
                        digest,
                        views[copy][block * payload : (block + 1) * payload],
                        self._key,
                    )
                keys.append(name)
                ptrs.append([head, regions[copy] + block * payload])
                sizes.append([hsize, payload])
        return keys, ptrs, sizes

    def _post(self, call: Call, op: str, idx: list[int], results: list[TierResult]) -> None:
        """Hand the results of jobs ``idx`` of ``call`` to ``poll``: as they are, or, for
        a call abandoned meanwhile, a late write as failed and a late read's block as
        free again (``"release"``)."""
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

    def _check_read(
        self, first: int, digest: bytes, block: int, codes: list[int]
    ) -> TierFault | None:
        """The fault of one read whose header pages start at page ``first`` (None if
        every copy arrived intact and, with a key, authenticated)."""
        views = self._views
        assert views is not None
        hsize = fs_format.HEADER_SIZE
        payload = self.payload_bytes
        return check_object(
            codes,
            self.object_bytes,
            [
                self._headers_view[(first + c) * hsize : (first + c + 1) * hsize]
                for c in range(self.copies)
            ],
            [views[c][block * payload : (block + 1) * payload] for c in range(self.copies)],
            self.fingerprints,
            digest,
            self._key,
        )

    def _serve_probes(self) -> None:
        while (batch := take_batch(self._probe_cache.queue)) is not None:
            keys = [k for d in batch for k in self.object_keys(d)]
            call = self._caller.begin("probes", batch, -1, self.cfg.probe_timeout_s)
            client = self.client
            if client is None:
                codes = [-1] * len(keys)
                self._outcomes.append((TierFault.UNREACHABLE, "existence check: not connected"))
            else:
                codes = self._caller.run(
                    call, "probe", partial(client.batch_is_exist, keys), len(keys)
                )
            with self._lock:
                self._caller.calls.discard(call)
                if not call.abandoned:  # else answered absent already
                    for i, d in enumerate(batch):
                        mine = codes[i * self.copies : (i + 1) * self.copies]
                        self._probe_cache.answer(d, all(c == 1 for c in mine))
            if call.abandoned and not self._caller.carry_on(call):
                return
