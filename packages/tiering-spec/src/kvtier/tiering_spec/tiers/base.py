"""What every secondary tier shares: the interface the manager calls, the result of a
job, the counters, and the kinds of fault a tier counts."""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


class TierFault(str, enum.Enum):
    """The kinds of fault a secondary tier counts (``vllm:kvtier_tier_faults{tier,kind}``).

    Each member is its own string (``TierFault.CORRUPT == "corrupt"``, the same hash and
    ``str``), so metric labels, logs and counters keyed by the plain name read alike.
    """

    CORRUPT = "corrupt"  # bad magic, version, checksum, fingerprint or key
    TRUNCATED = "truncated"  # shorter than its header says
    VANISHED = "vanished"  # gone between lookup and read
    UNREADABLE = "unreadable"  # an I/O error on read
    DISK_FULL = "disk_full"  # ENOSPC or EDQUOT on write
    WRITE_FAILED = "write_failed"  # any other failed write
    TIMEOUT = "timeout"  # past its deadline
    UNREACHABLE = "unreachable"  # a store tier's store did not answer
    FOREIGN = "foreign"  # a file this tier did not write: another owner, a link, no regular file
    UNAUTHENTICATED = "unauthenticated"  # no valid MAC where a key is configured

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str(self.value)


FAULT_KINDS: tuple[TierFault, ...] = tuple(TierFault)
"""Every fault kind, in the order the metrics list them."""


@dataclass
class TierResult:
    """One finished item of a secondary tier's job, handed over by the tier's ``poll``
    (:meth:`SecondaryTier.results` labels it with its job's id)."""

    op: str  # "read" | "write"
    key: bytes
    block_id: int
    ok: bool
    fault: TierFault | None = None
    nbytes: int = 0
    seconds: float = 0.0
    digest: bytes | None = None  # the key's digest, where the job had it
    job: int = 0  # the id of the job it belongs to (0: none, e.g. a timed-out read's release)


@dataclass
class TierJob:
    """Reads or writes of one request on one tier, the unit a tier takes
    (:meth:`SecondaryTier.submit`): ``items`` are (key, digest, host block) with each
    digest computed once for the job. ``left`` counts its items that started and whose
    results have not come back; the tier holds the job until it is 0 (finished)."""

    id: int
    op: str  # "read" | "write"
    request: str
    items: list[tuple[bytes, bytes, int]]
    left: int = 0

    @property
    def finished(self) -> bool:
        """Whether every item that started is back."""
        return not self.left


class JobBook:
    """The jobs a tier holds: each item in flight -> its job (by op and key, as the
    tier's results name their item), and the jobs with items in flight by id."""

    __slots__ = ("by_item", "open")

    def __init__(self) -> None:
        self.by_item: dict[tuple[str, bytes], TierJob] = {}
        self.open: dict[int, TierJob] = {}

    def started(self, job: TierJob, started: Iterable[bool]) -> None:
        """The items of ``job`` whose flag in ``started`` (one per item, in order) is
        true started."""
        by_item, op = self.by_item, job.op
        count = 0
        for (key, _digest, _block), ok in zip(job.items, started):
            if ok:
                by_item[(op, key)] = job
                count += 1
        if count:
            job.left += count
            self.open[job.id] = job

    def started_all(self, jobs: Sequence[TierJob], started: Sequence[bool]) -> list[list[bool]]:
        """:meth:`started` of each of ``jobs``, whose flags follow each other in
        ``started`` (one per item, the jobs in order); each job's flags."""
        out: list[list[bool]] = []
        at = 0
        for job in jobs:
            flags = list(started[at : at + len(job.items)])
            at += len(flags)
            self.started(job, flags)
            out.append(flags)
        return out

    def back(self, results: Iterable[TierResult]) -> None:
        """``results`` came back: label each with its job's id (0: of no job) and count
        its item off its job, which leaves the book once finished."""
        by_item, jobs = self.by_item, self.open
        for res in results:
            job = by_item.pop((res.op, res.key), None)
            if job is not None:
                res.job = job.id
                job.left -= 1
                if not job.left:  # (finished)
                    del jobs[job.id]


@dataclass
class TierStats:
    """Cumulative counters of one secondary tier."""

    files_indexed_at_start: int = 0
    hits: int = 0
    queries: int = 0
    reads: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    writes: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    writes_dropped: int = 0
    evictions: int = 0
    folders_recreated: int = 0
    files_reused: int = 0
    used_bytes: int = 0
    entries: int = 0

    def record(self, res: TierResult) -> None:
        """Count a read or write that succeeded."""
        if res.op == "write":
            self.writes += 1
            self.write_bytes += res.nbytes
            self.write_seconds += res.seconds
        else:
            self.reads += 1
            self.read_bytes += res.nbytes
            self.read_seconds += res.seconds


def count_down(counts: dict[bytes, int], digest: bytes) -> None:
    """One job fewer for ``digest`` in a digest -> jobs map (0 removes it)."""
    n = counts.get(digest, 0) - 1
    if n > 0:
        counts[digest] = n
    else:
        counts.pop(digest, None)


class SecondaryTier(ABC):
    """A tier behind the host tier: what the manager calls, and what every such tier
    keeps the same way (an index of digests, the digests being written, finished jobs
    for ``poll``, fault counts and KV events). A tier sets these attributes in its
    constructor; ``name`` labels it in metrics and logs.

    A lookup (``contains``) answers from memory: True, False, or None while the tier
    is still asking (a store tier asks its store in the background). ``submit_read``
    and ``submit_write`` start a job on a host block and say whether they did; its
    :class:`TierResult` comes back from a later ``poll``. The manager submits whole
    jobs (:meth:`submit`) and takes their items' results from :meth:`results`; the
    tier holds each job until its items are back (:attr:`jobs_in_flight`).
    """

    name: str
    cfg: Any  # the tier's settings; ``cfg.locality`` is reported in KV events
    stats: TierStats
    _index: Collection[bytes]  # what the tier holds, by digest
    _writing: set[bytes]
    _results: deque[TierResult]
    _inflight: int
    _faults: dict[str, int]
    _events: list[tuple[bool, list[bytes]]]

    @abstractmethod
    def contains(self, digest: bytes) -> bool | None:
        """Whether the tier holds ``digest``; None: not known yet, ask again."""

    @abstractmethod
    def submit_write(self, key: bytes, digest: bytes, block_id: int) -> bool:
        """Start writing host block ``block_id`` as ``key``; False if not started."""

    @abstractmethod
    def submit_read(self, key: bytes, digest: bytes, block_id: int) -> bool:
        """Start reading ``key`` into host block ``block_id``; False if not started."""

    @abstractmethod
    def poll(self) -> list[TierResult]:
        """Jobs finished since the last call; the tier's index and counters follow."""

    @property
    def has_news(self) -> bool:
        """Whether :meth:`poll` may hand back or take in anything now (a tier that can
        tell it cannot answers False, and its manager skips the call: asked every
        step)."""
        return True

    @abstractmethod
    def touch(self, digests: Sequence[bytes]) -> None:
        """``digests`` were used (head first); unknown ones are ignored."""

    @abstractmethod
    def shutdown(self) -> bool:
        """Stop the tier's threads; False if some did not stop in time."""

    @property
    @abstractmethod
    def in_flight(self) -> int:
        """Jobs submitted and not yet polled."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes the tier holds for this engine."""

    @property
    def locality(self) -> str:
        """``LOCAL`` or ``REMOTE``, as KV events report the tier."""
        return str(self.cfg.locality)

    def submit(self, job: TierJob) -> list[bool]:
        """Start every item of ``job``; for each, whether it started. The tier holds the
        job until the results of the items that started came back from :meth:`results`
        (each labelled ``job.id``)."""
        start = self.submit_read if job.op == "read" else self.submit_write
        started = [start(key, digest, block_id) for key, digest, block_id in job.items]
        self._job_book().started(job, started)
        return started

    def submit_all(self, jobs: Sequence[TierJob]) -> list[list[bool]] | None:
        """Start ``jobs`` (a step's write jobs for this tier) together, as :meth:`submit`
        of each in turn would: each job's started flags. None, starting nothing, where
        the tier cannot (the default: its caller submits them one by one)."""
        return None

    def results(self) -> list[TierResult]:
        """What :meth:`poll` returns, each result labelled with the id of its job (0: of
        no job, e.g. a timed-out read's ``"release"``); a job whose items are all back
        is finished and no longer held."""
        out = self.poll()
        book = self._job_book()
        if book.by_item:
            book.back(out)
        return out

    @property
    def jobs_in_flight(self) -> int:
        """Jobs submitted with items whose results have not come back."""
        return len(self._job_book().open)

    def _job_book(self) -> JobBook:
        """The jobs this tier holds (made on first use, so a tier's constructor need not
        call this class's)."""
        book: JobBook | None = self.__dict__.get("_jobs_held")
        if book is None:
            book = self.__dict__["_jobs_held"] = JobBook()
        return book

    def has(self, digest: bytes) -> bool:
        """Indexed or being written (no I/O, no counters)."""
        return digest in self._index or digest in self._writing

    def indexed(self, digest: bytes) -> bool:
        """Whether a read of ``digest`` can start now, from what the tier already knows
        (no I/O, no probe, no counters: a look ahead, not a lookup)."""
        return digest in self._index

    def served_ahead(self) -> None:
        """A key :meth:`indexed` found is read for a request before vLLM looks it up:
        counted as the lookup that would have found it (a query and a hit)."""
        self.stats.queries += 1
        self.stats.hits += 1

    @property
    def lookup_version(self) -> object | None:
        """A value equal exactly when :meth:`contains` answers the same for every
        digest and counts the same (no I/O); None (the default) where the tier cannot
        tell, e.g. one that asks a store in the background."""
        return None

    @property
    def index_size(self) -> int:
        """Digests the tier's index holds (no I/O)."""
        return len(self._index)

    def finish_request(self, digests: Sequence[bytes], reused: Collection[bytes]) -> None:
        """A request finished with ``digests`` (head first); those in ``reused`` it
        loaded rather than computed."""
        self.touch(digests)

    def faults(self) -> dict[str, int]:
        return dict(self._faults)

    @property
    def fault_count(self) -> int:
        """Faults of every kind so far (it grows with each one)."""
        return sum(self._faults.values())

    def take_events(self) -> list[tuple[bool, list[bytes]]]:
        """(removed, keys) pairs since the last call (empty unless events are enabled)."""
        events, self._events = self._events, []
        return events

    def drain(self, timeout: float | None = None) -> bool:
        """Block until every submitted job finished (then ``poll`` collects them), or
        ``timeout`` seconds passed: then False, and a ``timeout`` fault is counted."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._inflight - len(self._results) > 0:
            if deadline is not None and time.monotonic() > deadline:
                self._timed_out(f"{self._inflight - len(self._results)} job(s) still running")
                return False
            time.sleep(0.001)
        return True

    def _timed_out(self, what: str) -> None:
        self._faults["timeout"] += 1
