"""The filesystem tier: host blocks written to and read from files under ``root_dir``.

Runs in the scheduler process. It reads and writes the bytes of host blocks through
memoryviews of the host region (one per rank), so a promotion lands directly in the
host block that the worker then copies to the device, and a write reads the host
block in place: no staging copy. Every byte moves in ``os.preadv``/``os.pwritev``
and the XXH3 checksum, all of which release the GIL, on ``n_read_threads`` +
``n_write_threads`` threads.

Guarantees:

* a file is written to a temporary name and renamed, so no reader (this engine or
  another one sharing ``root_dir``) ever opens a half-written block file;
* a file is loaded only if its header matches this engine's layout fingerprint and
  key and its payload matches the checksum; anything else is a *fault*: counted,
  logged once per kind, treated as a miss and removed;
* the tier keeps at most ``capacity_bytes`` of files, its eviction policy choosing
  which go first; unset, it is half of the filesystem's free space at start (plus what
  this fingerprint already holds), logged. A write that finds the disk full evicts
  the policy's first entries, lowers the capacity to what is held, and is retried
  once;
* files of an earlier run with the same fingerprint are indexed by a background scan
  (the engine starts at once); the scan removes stale temporary files, block files of
  the wrong size, and the directories of other fingerprints unused for
  ``STALE_FINGERPRINT_AGE_S``. The same thread then looks for files that other engines
  sharing ``root_dir`` write (every ``DISCOVER_INTERVAL_S``, re-reading only shard
  folders whose modification time changed), so a lookup never touches the filesystem:
  the scheduler thread works on the in-memory index alone.

Units: bytes, unless a name says blocks.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from kvtier.tiering_spec.auth import load_auth_key
from kvtier.tiering_spec.tier_config import TierConfig
from kvtier.tiering_spec.tiers.base import (
    FAULT_KINDS,
    SecondaryTier,
    TierFault,
    TierResult,
    TierStats,
    count_down,
)
from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.fs import io as fs_io
from kvtier.tiering_spec.tiers.fs.capacity import DEFAULT_FREE_FRACTION, TierCapacity
from kvtier.tiering_spec.tiers.fs.dirs import TierDirs
from kvtier.tiering_spec.tiers.fs.index import FsCapacity, FsIndex
from kvtier.tiering_spec.tiers.fs.pool import IoThreads
from kvtier.tiering_spec.tiers.fs.scan import FsScanner, remove_tree
from kvtier.tiering_spec.tiers.fs.tasks import BlockFileTasks

logger = logging.getLogger("kvtier.tiering_spec")

# Faults whose file is removed at once: damaged, or not this tier's.
_REMOVED_FAULTS = (
    TierFault.CORRUPT,
    TierFault.TRUNCATED,
    TierFault.FOREIGN,
    TierFault.UNAUTHENTICATED,
)
# How often the background thread looks for files written by other engines.
DISCOVER_INTERVAL_S = 1.0
# Seconds a poll may index the start-up scan's findings for, in slices of entries.
SCAN_TAKE_SECONDS, SCAN_TAKE_SLICE = 0.001, 128
# How long shutdown waits for I/O threads (a hung mount must not hang the engine).
SHUTDOWN_TIMEOUT_S = 10.0


class FileSystemTier(TierCapacity, BlockFileTasks, SecondaryTier):
    """One fs tier for one engine: an index of the files it may read, and its I/O threads.

    Args:
        cfg: the validated tier configuration.
        layouts: one layout description per rank (model, dtype, block shape, rank,
            world size, ...); each becomes a fingerprint and a directory.
        payload_bytes: bytes of one rank's host block (a multiple of 4096).
        region_views: returns one writable 1-D memoryview per rank over that rank's
            host region (``num_blocks * payload_bytes`` bytes), or None while the
            region cannot be mapped yet (the tier then neither reads nor writes).
        name: label in metrics and logs.
        ephemeral: the fingerprint is this engine's alone (the weights could not be
            identified): the tier's directories are removed at shutdown.
    """

    _index: FsIndex

    def __init__(
        self,
        cfg: TierConfig,
        layouts: Sequence[Mapping[str, Any]],
        payload_bytes: int,
        region_views: Callable[[], Sequence[memoryview] | None],
        *,
        name: str = "fs",
        enable_events: bool = False,
        ephemeral: bool = False,
    ) -> None:
        if payload_bytes <= 0 or payload_bytes % fs_format.ALIGNMENT:
            raise ValueError(
                f"payload_bytes must be a positive multiple of 4096, got {payload_bytes}"
            )
        self.cfg = cfg
        self.name = name
        self.ephemeral = ephemeral
        self.enable_events = enable_events
        self.payload_bytes = payload_bytes
        self.file_bytes = fs_format.HEADER_SIZE + payload_bytes
        self.world_size = len(layouts)
        self.entry_bytes = self.file_bytes * self.world_size
        self._capacity = FsCapacity(cfg.capacity_bytes, self.entry_bytes, cfg.n_write_threads)
        self.capacity_is_default = cfg.capacity_bytes is None
        self._check_capacity()
        self._region_views = region_views
        self._views: Sequence[memoryview] | None = None
        # A shared secret: every file carries a keyed MAC, checked on every read. For a
        # filesystem where this user id does not prove authorship (NFS without
        # Kerberos trusts the uid a client asserts).
        self._key = (
            None
            if cfg.auth_key_file is None
            else load_auth_key(cfg.auth_key_file, f"fs tier {name!r} auth_key_file")
        )
        self._open_folders(layouts)
        self._free_at_start = fs_io.free_bytes(self.fsdirs.root)
        if self.capacity_is_default:
            self._capacity.reset(self._default_capacity(0))
        self._free_seen: int | None = None
        self._init_state()
        self._io = IoThreads(cfg.n_read_threads, cfg.n_write_threads)
        self._start_scan()
        self._log_start()

    def _open_folders(self, layouts: Sequence[Mapping[str, Any]]) -> None:
        """Check the folders and hold them open (files are reached only relative to
        these descriptors from here on), write each rank's ``layout.json``, and see
        whether the filesystem takes O_DIRECT."""
        self.fingerprints = [fs_format.layout_fingerprint(layout) for layout in layouts]
        self.fsdirs = TierDirs(self.cfg.root_dir, [fp.hex() for fp in self.fingerprints], "fs tier")
        self.dirs = [self.fsdirs.fingerprint_path(rank) for rank in range(self.world_size)]
        for rank, layout in enumerate(layouts):
            fp_fd = self.fsdirs.fingerprint(rank)
            try:
                os.stat("layout.json", dir_fd=fp_fd, follow_symlinks=False)
            except FileNotFoundError:
                text = json.dumps(dict(layout), indent=2, sort_keys=True)
                fs_io.write_small_file(fp_fd, "layout.json", text)
        self.direct = fs_io.probe_o_direct(self.dirs[0], dir_fd=self.fsdirs.fingerprint(0))

    def _init_state(self) -> None:
        """The scheduler thread's bookkeeping: the index, what is in flight, faults."""
        self._events: list[tuple[bool, list[bytes]]] = []
        # The files this engine may read, their bytes and the writes' in flight, and
        # the policy that picks which go first (sized for the target capacity).
        self._index = FsIndex(
            self.entry_bytes,
            self.cfg.eviction_policy,
            (self.capacity_bytes or 0) // self.entry_bytes,
        )
        self._reading: dict[bytes, int] = {}
        self._writing: set[bytes] = set()
        self._unlinking: dict[bytes, int] = {}
        # digest being written -> the evicted digest whose files that write takes over
        self._reusing: dict[bytes, bytes] = {}
        self._results: deque[TierResult] = deque()
        self._inflight = 0
        self._faults: dict[str, int] = dict.fromkeys(map(str, FAULT_KINDS), 0)
        self._fault_total = 0  # (fault_count, asked every step, without a sum)
        self._fault_logged: set[str] = set()
        self.stats = TierStats()
        self._closed = False
        self.stuck = False
        self._retried: set[bytes] = set()

    def _start_scan(self) -> None:
        """Start the thread of the start-up scan and of the look for files other engines
        write; ``poll`` takes in what it found."""
        self._scan_result: list[Any] = []
        self._scan_taking: tuple[Any, int] | None = None  # (report, entries indexed)
        self.scan_done = threading.Event()
        self._stop = threading.Event()
        self._disk = FsScanner(self.fsdirs, self.world_size, self.file_bytes, self.fingerprints)
        self._scanner = threading.Thread(
            target=self._scan_in_background, name="kvtier-fs-scan", daemon=True
        )
        self._scanner.start()

    def _log_start(self) -> None:
        cfg = self.cfg
        logger.info(
            "kvtier fs tier %r at %s: %s I/O, %d read / %d write threads, capacity %s, "
            "fingerprint(s) %s; %s; files of earlier runs are indexed in the background",
            self.name,
            cfg.root_dir,
            "O_DIRECT" if self.direct else "buffered (O_DIRECT refused by the filesystem)",
            cfg.n_read_threads,
            cfg.n_write_threads,
            f"{self.capacity_bytes} bytes"
            + (
                f" (capacity_bytes not set: {DEFAULT_FREE_FRACTION:.0%} of the "
                f"{self._free_at_start} bytes free)"
                if self.capacity_is_default
                else ""
            ),
            ",".join(fp.hex()[:12] for fp in self.fingerprints),
            "files loaded only with a valid MAC of auth_key_file"
            if self._key is not None
            else "files loaded only if this OS user owns them",
        )

    # ----------------------------------------------------------------- start-up

    def _scan_in_background(self) -> None:
        try:
            self._scan_result.append(self._disk.scan())
        except Exception as exc:  # a scan that fails leaves the tier empty, never broken
            logger.warning("kvtier fs tier %r: start-up scan failed (%s)", self.name, exc)
            self._scan_result.append(None)
        finally:
            self.scan_done.set()
        while not self._stop.wait(DISCOVER_INTERVAL_S):
            try:
                self._disk.discover()
                if self._capacity.lowered:
                    self._free_seen = fs_io.free_bytes(self.fsdirs.root)
            except Exception:  # never fatal: the next round tries again
                continue

    def _take_discovered(self) -> None:
        """Index what the background thread found on disk (scheduler thread), as the
        scan's findings: ``SCAN_TAKE_SLICE`` digests at a time, each slice followed by a
        trim to the capacity, for ``SCAN_TAKE_SECONDS`` (everything on disk shows up at
        once where the start-up scan failed). The rest waits in the scanner, which
        forgets a file this tier removes meanwhile."""
        deadline = time.perf_counter() + SCAN_TAKE_SECONDS
        while True:
            found = self._disk.take_found(SCAN_TAKE_SLICE)
            if not found:
                break
            self._index_found(found)
            self._trim()
            if time.perf_counter() >= deadline:
                break

    def _take_scan_slices(self, entries: Sequence[bytes], done: int, whole: bool) -> int:
        """Index the start-up scan's ``entries[done:]`` in order, ``SCAN_TAKE_SLICE`` at
        a time, each slice followed by a trim to the capacity, for ``SCAN_TAKE_SECONDS``
        (``whole``: all); returns how far it got. A default capacity counts the files
        as they are indexed (the bound the whole scan gives, reached as it is taken), so
        a write in between does not evict files of earlier runs against the capacity the
        empty tier had. While a full disk holds the capacity down, each file indexed
        raises it by its bytes (toward the target): it was on disk when the capacity was
        lowered to the tier's files and the free space, and takes no new room."""
        deadline, step = time.perf_counter() + SCAN_TAKE_SECONDS, SCAN_TAKE_SLICE
        capacity = self._capacity
        while done < len(entries):
            end = min(len(entries), done + step)
            if self.capacity_is_default and not capacity.lowered:
                capacity.reset(self._default_capacity(end * self.entry_bytes))
            added = self._index_found(entries[done:end])
            if capacity.lowered:
                capacity.count_found(added * self.entry_bytes)
            done = end
            self._trim()
            if not whole and time.perf_counter() >= deadline:
                break
        return done

    def _index_found(self, digests: Iterable[bytes]) -> int:
        """Index files found on disk, oldest first: the policy sees each stored on its
        own (a batch would be taken for one request's prefix; scheduler thread). Returns
        how many were new to the index."""
        index = self._index
        added = 0
        for digest in digests:
            if digest in index.table or digest in self._writing or digest in self._unlinking:
                continue
            index.add(digest, None)
            added += 1
        return added

    def touch(self, digests: Sequence[bytes]) -> None:
        """``digests`` were used (head first); unknown ones are ignored."""
        self._index.touch(digests)

    def finish_request(self, digests: Sequence[bytes], reused: Collection[bytes]) -> None:
        """A request finished with ``digests`` (head first); those in ``reused`` it
        loaded rather than computed."""
        self._index.finish_request(digests, reused)

    def _take_scan(self, whole: bool = False) -> None:
        """Index what the start-up scan found (scheduler thread), ``SCAN_TAKE_SECONDS``
        of it a call (``whole``: all): a million files would stall one step for
        seconds. Until indexed, an entry reads as a miss, as during the scan."""
        taking = self._scan_taking
        if taking is None:
            if not self._scan_result:
                return
            report = self._scan_result.pop()
            if report is None:
                return
            taking = (report, 0)
        report, done = taking
        done = self._take_scan_slices(report.entries, done, whole)
        if done < len(report.entries):
            self._scan_taking = (report, done)
            return
        self._scan_taking = None
        self.stats.files_indexed_at_start = len(report.entries)
        if self.capacity_is_default:
            self._capacity.reset(self._default_capacity(len(report.entries) * self.entry_bytes))
        self._trim()
        logger.info(
            "kvtier fs tier %r: start-up scan found %d files, indexed %d entries (%d bytes) "
            "of earlier runs, removed %d stale temporary and %d damaged files and %d unused "
            "fingerprint folder(s); capacity %d bytes",
            self.name,
            report.files,
            len(report.entries),
            len(report.entries) * self.entry_bytes,
            report.removed_tmp,
            report.removed_bad,
            len(report.removed_fingerprints),
            self.capacity_bytes or 0,
        )

    def wait_scan(self, timeout: float | None = None) -> bool:
        """Wait for the start-up scan and index its findings; True when done."""
        done = self.scan_done.wait(timeout)
        self._take_scan(whole=True)
        return done

    # ----------------------------------------------------------------- paths

    def paths(self, digest: bytes) -> list[str]:
        """One file path per rank for a key digest (for logs and tools: the tier itself
        reaches files through its held folders, see :meth:`_where`)."""
        shard, name = fs_format.file_name(digest)
        return [os.path.join(d, shard, name) for d in self.dirs]

    def _views_now(self) -> Sequence[memoryview] | None:
        if self._views is None:
            self._views = self._region_views()
        return self._views

    # ----------------------------------------------------------------- queries

    def contains(self, digest: bytes) -> bool:
        """Whether the tier holds ``digest``, from the in-memory index alone (files other
        engines write are added to it in the background)."""
        self.stats.queries += 1
        if digest in self._index.table:
            self.stats.hits += 1
            return True
        return False

    def has(self, digest: bytes) -> bool:
        """Indexed or being written (no I/O, no counters)."""
        return digest in self._index.table or digest in self._writing

    def indexed(self, digest: bytes) -> bool:
        return digest in self._index.table

    @property
    def lookup_version(self) -> object | None:
        return self._index.changes  # (contains reads the index alone)

    @property
    def in_flight(self) -> int:
        return self._inflight

    @property
    def used_bytes(self) -> int:
        return self._index.used

    def _unlink(self, digest: bytes) -> None:
        # A digest being unlinked is neither written nor discovered until the unlink
        # ran, so the unlink cannot remove a newer file of the same name.
        self._unlinking[digest] = self._unlinking.get(digest, 0) + 1
        self._submit("write", self._unlink_task, digest)

    def _unlinked(self, digest: bytes) -> None:
        count_down(self._unlinking, digest)

    # ----------------------------------------------------------------- jobs

    def _submit(self, kind: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a ``kind`` ("read" or "write") I/O thread; its result
        comes back through ``_results``."""
        if self._closed:
            return
        self._inflight += 1
        self._io.put(kind, fn, *args)

    def submit_read(self, key: bytes, digest: bytes, block_id: int) -> bool:
        """Read ``key``'s files into host block ``block_id``. False if not submitted."""
        return self._submit_reads([(key, digest, block_id)])[0]

    def _submit_reads(self, items: Sequence[tuple[bytes, bytes, int]]) -> list[bool]:
        """:meth:`submit_read` of each item (key, digest, host block), in order: whether
        each started. The reads that start go to the read threads in one task per
        thread (``_read_tasks``); their digests are used in turn, as one call a read
        does (one ``touch``, the last read the newest)."""
        if self._closed:
            return [False] * len(items)
        views = self._views_now()
        if views is None:
            return [False] * len(items)
        table, reading = self._index.table, self._reading
        started: list[bool] = []
        reads: list[tuple[bytes, bytes, int]] = []
        for item in items:
            digest = item[1]
            if digest not in table:
                started.append(False)
                continue
            reading[digest] = reading.get(digest, 0) + 1
            reads.append(item)
            started.append(True)
        if reads:
            # (touch's first key ends up the newest: the reads' order, reversed)
            self._index.touch([digest for _key, digest, _block in reversed(reads)])
            self._inflight += len(reads)
            self._io.put_shares("read", self._read_tasks, reads, views)
        return started

    @property
    def has_news(self) -> bool:
        """A result, a scan's or a discovery's findings, or a capacity to regrow wait."""
        return bool(
            self._results
            or self._scan_result
            or self._scan_taking is not None
            or self._disk.waiting
            or self._over_capacity()
            or (self._free_seen is not None and self._capacity.lowered)
        )

    def poll(self) -> list[TierResult]:
        """Finished jobs since the last call; updates the index and counters."""
        if self._scan_result or self._scan_taking is not None:
            self._take_scan()
        if self._disk.waiting:
            self._take_discovered()
        elif self._over_capacity():
            self._trim()  # (a capacity lowered or recomputed: a slice a poll)
        if self._free_seen is not None and self._capacity.lowered:
            self._regrow()
        out: list[TierResult] = []
        results, stats = self._results, self.stats
        reading = self._reading
        written: list[TierResult] = []  # writes that succeeded, applied together in order
        while results:
            res = results.popleft()
            op = res.op
            if op == "write" and res.ok:
                written.append(res)  # (most results)
                continue
            if written:  # (a fault may evict or forget entries: index those written first)
                self._writes_landed(written, out)
                written = []
            self._inflight -= 1
            if op == "unlink":
                self._unlinked(res.key)
                continue
            digest = res.digest or fs_format.key_digest(res.key)
            if op == "write":
                self._writes_ended([digest])
            else:
                count_down(reading, digest)
            if res.ok:
                stats.record(res)
                out.append(res)
                continue
            if op == "write":
                if res.fault == TierFault.DISK_FULL and self._retry_on_full_disk(res, digest):
                    continue
                self._fault(res.fault or TierFault.WRITE_FAILED, res)
            else:
                self._fault(res.fault or TierFault.UNREADABLE, res)
                # A bad file is removed so it is never tried again; an unreadable one
                # may be another process's, so it is only forgotten.
                self._forget(digest, res.key, unlink=res.fault in _REMOVED_FAULTS)
            out.append(res)
        if written:
            self._writes_landed(written, out)
        self.stats.used_bytes = self._index.used
        self.stats.entries = len(self._index)
        return out

    @property
    def fault_count(self) -> int:
        return self._fault_total

    def _fault(self, kind: TierFault, res: TierResult) -> None:
        self._faults[kind] = self._faults.get(kind, 0) + 1
        self._fault_total += 1
        if kind not in self._fault_logged:
            self._fault_logged.add(kind)
            logger.warning(
                "kvtier fs tier %r: %s %s of block file for key %s failed (%s); treated as a "
                "miss, never loaded. Further faults of this kind are only counted "
                "(metric vllm:kvtier_tier_faults{kind=%r}).",
                self.name,
                "read" if res.op == "read" else "write",
                "" if res.op == "read" else "(dropped)",
                fs_format.key_digest(res.key).hex(),
                kind,
                str(kind),  # (the metric's label: 'write_failed', not the enum's repr)
            )

    def _timed_out(self, what: str) -> None:
        super()._timed_out(what)
        self._fault_total += 1
        logger.warning(
            "kvtier fs tier %r at %s: %s past the time limit (a hung or very slow "
            "filesystem?); the engine goes on without them "
            "(metric vllm:kvtier_tier_faults{kind='timeout'})",
            self.name,
            self.cfg.root_dir,
            what,
        )

    def shutdown(self) -> bool:
        """Stop the I/O threads, waiting at most ``SHUTDOWN_TIMEOUT_S`` for jobs in
        flight. False when some are still stuck: the host blocks they read into or
        write from must then stay mapped until the process ends."""
        if self._closed:
            return not self.stuck
        self._closed = True
        self._stop.set()
        stuck = self._io.stop(time.monotonic() + SHUTDOWN_TIMEOUT_S, also=self._scanner)
        self.poll()
        if stuck:
            self.stuck = True
            self._timed_out(f"shutdown: I/O thread(s) {', '.join(stuck)} still in a call")
        self._views = None
        if self.ephemeral:
            for fp in self.fingerprints:
                remove_tree(fp.hex(), self.fsdirs.base)
        if not stuck:  # a thread still in a call may yet use the descriptors
            self.fsdirs.close()
        return not stuck
