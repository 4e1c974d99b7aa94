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

import errno
import json
import logging
import mmap
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from kvtier.tiering_spec.auth import load_auth_key
from kvtier.tiering_spec.errors import ConfigError
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
from kvtier.tiering_spec.tiers.fs.dirs import TierDirs
from kvtier.tiering_spec.tiers.fs.index import FsCapacity, FsIndex
from kvtier.tiering_spec.tiers.fs.scan import FsScanner, remove_tree

logger = logging.getLogger("kvtier.tiering_spec")

# Faults whose file is removed at once: damaged, or not this tier's.
_REMOVED_FAULTS = (
    TierFault.CORRUPT,
    TierFault.TRUNCATED,
    TierFault.FOREIGN,
    TierFault.UNAUTHENTICATED,
)
# Without capacity_bytes the tier may fill this share of the free space it found.
DEFAULT_FREE_FRACTION = 0.5
# How often the background thread looks for files written by other engines.
DISCOVER_INTERVAL_S = 1.0
# How long shutdown waits for I/O threads (a hung mount must not hang the engine).
SHUTDOWN_TIMEOUT_S = 10.0


class FileSystemTier(SecondaryTier):
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
        self.payload_bytes = payload_bytes
        self.file_bytes = fs_format.HEADER_SIZE + payload_bytes
        self.world_size = len(layouts)
        self.entry_bytes = self.file_bytes * self.world_size
        self._capacity = FsCapacity(cfg.capacity_bytes, self.entry_bytes, cfg.n_write_threads)
        self.capacity_is_default = cfg.capacity_bytes is None
        if self.capacity_bytes is not None and self.capacity_bytes < self.entry_bytes:
            raise ConfigError(
                f"capacity_bytes={self.capacity_bytes} of fs tier {name!r} cannot hold one "
                f"entry: {self.entry_bytes} bytes ({self.world_size} rank file(s) of a "
                f"{fs_format.HEADER_SIZE}-byte header plus a {payload_bytes}-byte chunk); "
                f"allowed: at least {self.entry_bytes}"
            )
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
        self.fingerprints = [fs_format.layout_fingerprint(layout) for layout in layouts]
        # Every folder is checked and held open from here on; files are reached only
        # relative to these descriptors.
        self.fsdirs = TierDirs(cfg.root_dir, [fp.hex() for fp in self.fingerprints], "fs tier")
        self.dirs = [self.fsdirs.fingerprint_path(rank) for rank in range(self.world_size)]
        for rank, layout in enumerate(layouts):
            fp_fd = self.fsdirs.fingerprint(rank)
            try:
                os.stat("layout.json", dir_fd=fp_fd, follow_symlinks=False)
            except FileNotFoundError:
                text = json.dumps(dict(layout), indent=2, sort_keys=True)
                self._write_small_file(fp_fd, "layout.json", text)
        self.direct = fs_io.probe_o_direct(self.dirs[0], dir_fd=self.fsdirs.fingerprint(0))
        self._free_at_start = fs_io.free_bytes(self.fsdirs.root)
        if self.capacity_is_default:
            self._capacity.reset(self._default_capacity(0))
        # Free bytes seen by the last write that found the disk full, and by the
        # background thread while the capacity is lowered (None: not looked).
        self._free_seen: int | None = None
        self.enable_events = enable_events
        self._events: list[tuple[bool, list[bytes]]] = []
        # The files this engine may read, their bytes and the writes' in flight, and
        # the policy that picks which go first (sized for the target capacity).
        self._index = FsIndex(
            self.entry_bytes, cfg.eviction_policy, (self.capacity_bytes or 0) // self.entry_bytes
        )
        self._reading: dict[bytes, int] = {}
        self._writing: set[bytes] = set()
        self._unlinking: dict[bytes, int] = {}
        # digest being written -> the evicted digest whose files that write takes over
        self._reusing: dict[bytes, bytes] = {}
        self._results: deque[TierResult] = deque()
        self._inflight = 0
        self._faults: dict[str, int] = dict.fromkeys(map(str, FAULT_KINDS), 0)
        self._fault_logged: set[str] = set()
        self.stats = TierStats()
        self._local = threading.local()
        self._tmp_counter = 0
        self._tmp_lock = threading.Lock()
        # Plain threads on C queues: a job costs one put and one get, no future objects.
        self._readers: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writers: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(
                target=self._serve, args=(q,), name=f"kvtier-fs-{kind}-{i}", daemon=True
            )
            for q, kind, n in (
                (self._readers, "read", cfg.n_read_threads),
                (self._writers, "write", cfg.n_write_threads),
            )
            for i in range(n)
        ]
        for t in self._threads:
            t.start()
        self._closed = False
        self.stuck = False
        self._retried: set[bytes] = set()
        # The start-up scan runs on a thread of its own; poll() takes in what it found.
        self._scan_result: list[Any] = []
        self.scan_done = threading.Event()
        self._stop = threading.Event()
        # The folders on disk: the start-up scan, and files other engines write.
        self._disk = FsScanner(self.fsdirs, self.world_size, self.file_bytes, self.fingerprints)
        self._scanner = threading.Thread(
            target=self._scan_in_background, name="kvtier-fs-scan", daemon=True
        )
        self._scanner.start()
        logger.info(
            "kvtier fs tier %r at %s: %s I/O, %d read / %d write threads, capacity %s, "
            "fingerprint(s) %s; %s; files of earlier runs are indexed in the background",
            name,
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

    def _default_capacity(self, held: int) -> int:
        """Half the free space at start plus what this tier's files already hold, at
        least one entry."""
        return max(self.entry_bytes, int(DEFAULT_FREE_FRACTION * (self._free_at_start + held)))

    # ----------------------------------------------------------------- start-up

    @staticmethod
    def _write_small_file(dir_fd: int, name: str, text: str) -> None:
        tmp = f"{name}{fs_format.TMP_PREFIX}{os.getpid()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

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
        """Index what the background thread found on disk (scheduler thread)."""
        self._index_found(self._disk.take_found())
        self._make_room(0)

    def _index_found(self, digests: Iterable[bytes]) -> None:
        """Index files found on disk, oldest first: the policy sees each stored on its
        own (a batch would be taken for one request's prefix; scheduler thread)."""
        index = self._index
        for digest in digests:
            if digest in index or digest in self._writing or digest in self._unlinking:
                continue
            index.add(digest, None)

    def touch(self, digests: Sequence[bytes]) -> None:
        """``digests`` were used (head first); unknown ones are ignored."""
        self._index.touch(digests)

    def finish_request(self, digests: Sequence[bytes], reused: Collection[bytes]) -> None:
        """A request finished with ``digests`` (head first); those in ``reused`` it
        loaded rather than computed."""
        self._index.finish_request(digests, reused)

    def _take_scan(self) -> None:
        """Index what the start-up scan found (scheduler thread; once)."""
        if not self._scan_result:
            return
        report = self._scan_result.pop()
        if report is None:
            return
        # Older than anything this run indexed: at the LRU end, oldest first.
        self._index_found(report.entries)
        self.stats.files_indexed_at_start = len(report.entries)
        if self.capacity_is_default:
            self._capacity.reset(self._default_capacity(len(report.entries) * self.entry_bytes))
        self._make_room(0)
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
        self._take_scan()
        return done

    # ----------------------------------------------------------------- paths

    def paths(self, digest: bytes) -> list[str]:
        """One file path per rank for a key digest (for logs and tools: the tier itself
        reaches files through its held folders, see :meth:`_where`)."""
        shard, name = fs_format.file_name(digest)
        return [os.path.join(d, shard, name) for d in self.dirs]

    def _where(self, digest: bytes) -> tuple[int, str]:
        """(shard, file name) of a key digest."""
        shard, name = fs_format.file_name(digest)
        return int(shard, 16), name

    def _views_now(self) -> Sequence[memoryview] | None:
        if self._views is None:
            self._views = self._region_views()
        return self._views

    # ----------------------------------------------------------------- queries

    def contains(self, digest: bytes) -> bool:
        """Whether the tier holds ``digest``, from the in-memory index alone (files other
        engines write are added to it in the background)."""
        self.stats.queries += 1
        if digest in self._index:
            self.stats.hits += 1
            return True
        return False

    @property
    def in_flight(self) -> int:
        return self._inflight

    @property
    def used_bytes(self) -> int:
        return self._index.used

    # ----------------------------------------------------------------- capacity

    def _make_room(
        self, nbytes: int, protect: bytes | None = None, *, reuse: bool = False
    ) -> tuple[bool, bytes | None]:
        """Evict the entries the policy picks (never ones being read) until ``nbytes``
        more fit. Returns (whether they fit, evicting nothing more when they cannot;
        with ``reuse``, one evicted entry whose files the caller's write takes over
        instead of creating new ones, or None). A reused digest stays in
        ``_unlinking`` until that write is polled."""
        reading = self._reading
        evicted = self._index.make_room(
            nbytes, self.capacity_bytes, lambda digest: digest in reading or digest == protect
        )
        if evicted is None:
            return False, None
        removed_keys: list[bytes] = []
        reused: bytes | None = None
        for digest, entry in evicted:
            self.stats.evictions += 1
            if entry.key is not None:
                removed_keys.append(entry.key)
            if reuse and reused is None and entry.nbytes == self.entry_bytes:
                reused = digest
                self._unlinking[digest] = self._unlinking.get(digest, 0) + 1
            else:
                self._unlink(digest)
        if removed_keys and self.enable_events:
            self._events.append((True, removed_keys))
        return True, reused

    def _forget(self, digest: bytes, key: bytes | None, unlink: bool) -> None:
        entry = self._index.remove(digest)
        if entry is not None and self.enable_events and (entry.key or key):
            self._events.append((True, [entry.key or key]))  # type: ignore[list-item]
        if unlink:
            self._unlink(digest)

    def _unlink(self, digest: bytes) -> None:
        # A digest being unlinked is neither written nor discovered until the unlink
        # ran, so the unlink cannot remove a newer file of the same name.
        self._unlinking[digest] = self._unlinking.get(digest, 0) + 1
        self._submit(self._writers, self._unlink_task, digest)

    def _unlinked(self, digest: bytes) -> None:
        count_down(self._unlinking, digest)

    # ----------------------------------------------------------------- jobs

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[Any]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            job[0](*job[1])

    def _submit(self, jobs: queue.SimpleQueue[Any], fn: Callable[..., Any], *args: Any) -> None:
        if self._closed:
            return
        self._inflight += 1
        jobs.put((fn, args))

    def submit_write(self, key: bytes, digest: bytes, block_id: int) -> bool:
        """Write host block ``block_id`` (all ranks) as ``key``. False if not submitted:
        already present, no room under ``capacity_bytes``, or the region is not mapped."""
        if (
            digest in self._index
            or digest in self._writing
            or digest in self._unlinking
            or self._closed
        ):
            return False
        views = self._views_now()
        if views is None:
            self.stats.writes_dropped += 1
            return False
        fits, reuse = self._make_room(self.entry_bytes, reuse=True)
        if not fits:
            self.stats.writes_dropped += 1
            return False
        self._index.reserved += self.entry_bytes
        self._writing.add(digest)
        if reuse is not None:
            self._reusing[digest] = reuse
        self._submit(
            self._writers,
            self._write_task,
            key,
            digest,
            block_id,
            views,
            reuse,
        )
        return True

    def submit_read(self, key: bytes, digest: bytes, block_id: int) -> bool:
        """Read ``key``'s files into host block ``block_id``. False if not submitted."""
        if digest not in self._index or self._closed:
            return False
        views = self._views_now()
        if views is None:
            return False
        self._reading[digest] = self._reading.get(digest, 0) + 1
        self._index.touch([digest])
        self._submit(self._readers, self._read_task, key, digest, block_id, views)
        return True

    def poll(self) -> list[TierResult]:
        """Finished jobs since the last call; updates the index and counters."""
        if self._scan_result:
            self._take_scan()
        if self._disk.waiting:
            self._take_discovered()
        if self._free_seen is not None and self._capacity.lowered:
            self._regrow()
        out: list[TierResult] = []
        results = self._results
        while results:
            res = results.popleft()
            self._inflight -= 1
            if res.op == "unlink":
                self._unlinked(res.key)
                continue
            digest = res.digest or fs_format.key_digest(res.key)
            if res.op == "write":
                self._writing.discard(digest)
                reused = self._reusing.pop(digest, None)
                if reused is not None:
                    self._unlinked(reused)
                self._index.reserved -= self.entry_bytes
                if res.ok:
                    self._retried.discard(digest)
                    self._index.add(digest, res.key)
                    self.stats.record(res)
                    if self.enable_events:
                        self._events.append((False, [res.key]))
                elif res.fault == TierFault.DISK_FULL and self._retry_on_full_disk(res, digest):
                    continue
                else:
                    self._fault(res.fault or TierFault.WRITE_FAILED, res)
            else:
                count_down(self._reading, digest)
                if res.ok:
                    self.stats.record(res)
                else:
                    self._fault(res.fault or TierFault.UNREADABLE, res)
                    # A bad file is removed so it is never tried again; an unreadable
                    # one may be another process's, so it is only forgotten.
                    self._forget(digest, res.key, unlink=res.fault in _REMOVED_FAULTS)
            out.append(res)
        self.stats.used_bytes = self._index.used
        self.stats.entries = len(self._index)
        return out

    def _retry_on_full_disk(self, res: TierResult, digest: bytes) -> bool:
        """The disk filled up before the tier's capacity did: hold no more than this
        tier's files plus what the disk shows free (never less than ``FsCapacity.floor``;
        logged), evict least recently used entries down to that, and write once more.
        The capacity grows back as the disk shows room again (:meth:`_regrow`). False
        (not retried) for a second failure of the same write, or when no room can be
        made."""
        if digest in self._retried or self._closed or self._views is None:
            self._retried.discard(digest)
            return False
        free = self._free_seen or 0
        before = self.capacity_bytes
        if self._capacity.lower_for_full_disk(self._index.used, free):
            logger.warning(
                "kvtier fs tier %r: the disk is full (%d bytes free) with %d bytes of this "
                "tier's files; capacity lowered from %s to %d bytes until the disk shows "
                "room again, least recently used files evicted",
                self.name,
                free,
                self._index.used,
                before,
                self.capacity_bytes,
            )
        if not self._make_room(self.entry_bytes)[0]:
            return False
        self._fault(TierFault.DISK_FULL, res)
        self._retried.add(digest)
        self._writing.add(digest)
        self._index.reserved += self.entry_bytes
        self._submit(self._writers, self._write_task, res.key, digest, res.block_id, self._views)
        return True

    def _regrow(self) -> None:
        """After a full disk: raise the capacity toward its target as far as the room the
        background thread last saw allows (scheduler thread)."""
        free, self._free_seen = self._free_seen or 0, None
        before = self.capacity_bytes
        if self._capacity.regrow(self._index.used, self._index.reserved, free):
            logger.info(
                "kvtier fs tier %r: the disk shows %d bytes free again; capacity raised from "
                "%s to %s bytes (target %s)",
                self.name,
                free,
                before,
                self.capacity_bytes,
                self.target_capacity,
            )

    @property
    def capacity_bytes(self) -> int | None:
        """The bytes of files the tier may hold now (None: no bound)."""
        return self._capacity.current

    @property
    def target_capacity(self) -> int | None:
        """What ``capacity_bytes`` returns to after a full disk lowered it."""
        return self._capacity.target

    def _fault(self, kind: TierFault, res: TierResult) -> None:
        self._faults[kind] = self._faults.get(kind, 0) + 1
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
                kind,
            )

    def _timed_out(self, what: str) -> None:
        super()._timed_out(what)
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
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for t in self._threads:
            (self._readers if "read" in t.name else self._writers).put(None)
        for t in [self._scanner, *self._threads]:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
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

    # ----------------------------------------------------------------- I/O threads

    def _thread_buffer(self, name: str, size: int) -> mmap.mmap:
        """This I/O thread's own scratch buffer ``name``: page aligned (for O_DIRECT)
        and zero filled when made."""
        buf = getattr(self._local, name, None)
        if buf is None:
            buf = mmap.mmap(-1, size)
            setattr(self._local, name, buf)
        return buf

    def _payload(self, views: Sequence[memoryview], rank: int, block_id: int) -> memoryview:
        start = block_id * self.payload_bytes
        return views[rank][start : start + self.payload_bytes]

    def _tmp_name(self) -> str:
        with self._tmp_lock:
            self._tmp_counter += 1
            n = self._tmp_counter
        return f"{fs_format.TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{n}"

    def _write_task(
        self,
        key: bytes,
        digest: bytes,
        block_id: int,
        views: Sequence[memoryview],
        reuse: bytes | None = None,
    ) -> None:
        t0 = time.perf_counter()
        shard, name = self._where(digest)
        done: list[int] = []
        # Evicted files not taken over (one found changed, or a write failed first)
        # are removed; a taken-over one no longer has its name.
        leftover = list(range(self.world_size)) if reuse is not None else []
        fault: TierFault | None = None
        try:
            for rank in range(self.world_size):
                tmp = self._tmp_name()
                fd = None
                if reuse is not None:
                    fd = self._take_over(rank, reuse, shard, tmp)
                    if fd is not None:
                        leftover.remove(rank)
                payload = self._payload(views, rank, block_id)
                fp = self.fingerprints[rank]
                self._write_file(rank, shard, name, tmp, fd, fp, digest, payload)
                done.append(rank)
        except OSError as exc:
            fault = (
                TierFault.DISK_FULL
                if exc.errno in (errno.ENOSPC, errno.EDQUOT)
                else TierFault.WRITE_FAILED
            )
            if fault == TierFault.DISK_FULL:
                self._free_seen = fs_io.free_bytes(self.fsdirs.root)
        except Exception:
            fault = TierFault.WRITE_FAILED
        if fault is not None:
            self._remove(shard, name, done)
        else:
            self._disk.note_own_change(shard, digest, True)
        if reuse is not None:
            old_shard, old_name = self._where(reuse)
            self._remove(old_shard, old_name, leftover)
            self._disk.note_own_change(old_shard, reuse, False)
        self._finish("write", key, digest, block_id, fault, t0)

    def _finish(
        self, op: str, key: bytes, digest: bytes, block_id: int, fault: TierFault | None, t0: float
    ) -> None:
        """Hand a finished read or write (begun at ``t0``) to the next ``poll``."""
        ok = fault is None
        self._results.append(
            TierResult(
                op,
                key,
                block_id,
                ok,
                fault,
                self.entry_bytes if ok else 0,
                time.perf_counter() - t0,
                digest,
            )
        )

    def _remove(self, shard: int, name: str, ranks: Iterable[int]) -> None:
        for rank in ranks:
            try:
                os.unlink(name, dir_fd=self.fsdirs.shard(rank, shard))
            except OSError:
                pass

    def _take_over(self, rank: int, old: bytes, shard: int, tmp: str) -> int | None:
        """The evicted block file of digest ``old``, renamed to ``tmp`` in ``shard`` and
        open for writing (``fs_io.take_over``), or None."""
        old_shard, old_name = self._where(old)
        src, dst = self.fsdirs.shard(rank, old_shard), self.fsdirs.shard(rank, shard)
        fd = fs_io.take_over(src, old_name, dst, tmp, self.file_bytes, self.direct)
        if fd is not None:
            self.stats.files_reused += 1
        return fd

    def _write_file(
        self,
        rank: int,
        shard: int,
        name: str,
        tmp: str,
        fd: int | None,
        fingerprint: bytes,
        digest: bytes,
        payload: memoryview,
    ) -> None:
        """Write one block file to ``tmp`` (a new file, or the taken-over one open as
        ``fd``), then rename it to ``name``; both in the rank's held shard folder."""
        if fd is None:
            fd = self._create(rank, shard, tmp, self.direct)
        hdr = self._thread_buffer("hdr", fs_format.HEADER_SIZE)
        folder = self.fsdirs.shard(rank, shard)
        fs_io.write_and_rename(
            folder, tmp, name, fd, hdr, fingerprint, digest, payload, self._key, self.direct
        )

    def _create(self, rank: int, shard: int, tmp: str, direct: bool) -> int:
        """A new file ``tmp`` in the rank's shard folder; a folder removed while the
        engine ran is made again first (from its held parent, checked again)."""
        flags = (
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | (fs_io.O_DIRECT if direct else 0)
        )
        try:
            return os.open(tmp, flags, 0o600, dir_fd=self.fsdirs.shard(rank, shard))
        except FileNotFoundError:
            try:
                revived = self.fsdirs.revive(rank, shard)
            except ConfigError as exc:
                if "revive" not in self._fault_logged:
                    self._fault_logged.add("revive")
                    logger.warning(
                        "kvtier fs tier %r: a folder removed while the engine ran cannot be "
                        "made again (%s); writes there fail and are recomputed",
                        self.name,
                        exc,
                    )
                raise OSError(errno.EACCES, str(exc)) from None
            if not revived:
                raise
            self.stats.folders_recreated += 1
            return os.open(tmp, flags, 0o600, dir_fd=self.fsdirs.shard(rank, shard))

    def _read_task(
        self, key: bytes, digest: bytes, block_id: int, views: Sequence[memoryview]
    ) -> None:
        t0 = time.perf_counter()
        fault: TierFault | None = None
        shard, name = self._where(digest)
        try:
            for rank in range(self.world_size):
                self._read_file(
                    rank,
                    shard,
                    name,
                    self.fingerprints[rank],
                    digest,
                    self._payload(views, rank, block_id),
                )
        except fs_format.FormatError as exc:
            fault = exc.kind
        except FileNotFoundError:
            fault = TierFault.VANISHED
        except OSError as exc:
            # O_NOFOLLOW refuses a symlink planted under the block's name with ELOOP.
            fault = TierFault.FOREIGN if exc.errno == errno.ELOOP else TierFault.UNREADABLE
        except Exception:
            fault = TierFault.UNREADABLE
        self._finish("read", key, digest, block_id, fault, t0)

    def _read_file(
        self,
        rank: int,
        shard: int,
        name: str,
        fingerprint: bytes,
        digest: bytes,
        payload: memoryview,
    ) -> None:
        # A file longer than a block file reads into one page of slack.
        fs_io.read_block(
            self.fsdirs.shard(rank, shard),
            name,
            self._thread_buffer("hdr", fs_format.HEADER_SIZE),
            self._thread_buffer("tail", fs_format.ALIGNMENT),
            fingerprint,
            digest,
            payload,
            self._key,
            self.direct,
        )

    def _unlink_task(self, digest: bytes) -> None:
        shard, name = self._where(digest)
        for rank in range(self.world_size):
            try:
                os.unlink(name, dir_fd=self.fsdirs.shard(rank, shard))
            except OSError:
                pass
        self._disk.note_own_change(shard, digest, False)
        self._results.append(TierResult("unlink", digest, -1, True))
