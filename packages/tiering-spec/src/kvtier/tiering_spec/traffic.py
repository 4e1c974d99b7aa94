"""Recording the traffic an engine serves, as a trace the plan reads.

With ``record_traffic_dir`` set, the scheduler side writes one JSON line per request in
Mooncake's trace format (:mod:`kvtier.tiering_spec.tracefile`): ``timestamp`` (seconds
since the engine started), ``input_length``, ``output_length`` and ``hash_ids``, one
integer per offload chunk of the prompt, in prefix order. The integers stand for the
engine's chunk hashes, numbered in order of first sight within each file: no token and
no hash leaves the engine. vLLM's block hashes cover a request's ``cache_salt`` and
LoRA adapter, so requests that differ in either never share an id.

The file's first line is a header (``{"kvtier_trace": {...}}``: the tokens an id stands
for, the bytes a chunk takes in host memory, the model), so a plan needs no flags; its
last line, written when the file is closed or rotated, says how many requests were
written and how many were dropped (``{"kvtier_trace_end": {...}}``).

The scheduler thread only appends to a queue (:meth:`TrafficRecorder.arrive`,
:meth:`TrafficRecorder.finish`); a background thread numbers the chunks and writes.
Lines go out in arrival order, each once its request has finished (a request still
running holds back the lines after it). When too many wait (the writer falls behind,
or one long request holds back those after it), new arrivals are dropped and counted
(``vllm:kvtier_traffic_dropped``); a write that fails (a full disk) drops its line,
leaves nothing of it in the file, and is logged once. Files are created ``0600`` in a
folder checked as an fs tier's ``root_dir`` is, and rotated past
``record_traffic_max_bytes``.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from kvtier.tiering_spec.private_dirs import DIR_FLAGS

logger = logging.getLogger("kvtier.tiering_spec")

HEADER_KEY = "kvtier_trace"
END_KEY = "kvtier_trace_end"
FORMAT_VERSION = 1
FILE_PREFIX = "traffic-"
FILE_SUFFIX = ".jsonl"
# Requests queued or waiting for an earlier one to finish; past this, arrivals drop.
MAX_PENDING = 65536
POLL_SECONDS = 0.05
_write = os.write  # (tests fail it to fill the disk)
_OPEN_FLAGS = (
    os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
)


class TrafficRecorder:
    """Writes the requests a scheduler sees into ``folder`` (see the module's docstring).

    ``header`` is the header line's content; ``max_bytes`` the size past which a file is
    closed and the next begun. :meth:`arrive` and :meth:`finish` are called from the
    scheduler thread only; :meth:`close` once, at shutdown.
    """

    def __init__(
        self,
        folder: str,
        header: Mapping[str, Any],
        *,
        max_bytes: int,
        max_pending: int = MAX_PENDING,
        clock: Any = time.monotonic,
    ) -> None:
        self.folder = folder
        self.header = {"version": FORMAT_VERSION, "timestamp_unit": "s", **header}
        self.max_bytes = max_bytes
        self.max_pending = max_pending
        self._clock = clock
        self._start = clock()
        self._events: collections.deque[tuple[Any, ...]] = collections.deque()
        # Arrivals queued and not yet finished: request id -> its arrival's number (a
        # request id may come back once its request ended).
        self._accepted: dict[str, int] = {}
        self._queued = 0  # arrivals queued (scheduler thread)
        self._dropped_full = 0  # arrivals dropped, too many waiting (scheduler thread)
        self._done = 0  # arrivals written or lost (writer thread)
        self._lost = 0  # lines a failed write lost (writer thread)
        self._failure_logged = False
        self.files: list[str] = []  # every file begun, in order
        self._dir_fd = os.open(folder, DIR_FLAGS)
        self._fd = -1
        self._file_bytes = 0
        self._file_lines = 0
        self._file_dropped_base = 0
        self._ids: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-traffic", daemon=True)
        self._thread.start()

    # -- the scheduler thread ------------------------------------------------------------

    def arrive(self, req_id: str, input_length: int, keys: Sequence[Hashable]) -> None:
        """A request arrived with ``input_length`` prompt tokens and its prompt's chunk
        keys (``keys``, in prefix order; kept, not copied)."""
        if self._queued - self._done >= self.max_pending:
            self._dropped_full += 1
            return
        seq = self._queued
        self._queued += 1
        self._accepted[req_id] = seq
        self._events.append((seq, round(self._clock() - self._start, 3), input_length, keys))

    def finish(self, req_id: str, output_length: int) -> None:
        """A request finished (or was aborted) after ``output_length`` generated tokens."""
        seq = self._accepted.pop(req_id, None)
        if seq is not None:
            self._events.append((seq, output_length))

    @property
    def dropped(self) -> int:
        """Requests not written: arrivals dropped while the writer was behind, and lines
        a failed write lost."""
        return self._dropped_full + self._lost

    # -- the writer thread ---------------------------------------------------------------

    def _run(self) -> None:
        waiting: collections.OrderedDict[int, list[Any]] = collections.OrderedDict()
        events = self._events
        try:
            self._open_file()  # the header at once: the record is there from the start
        except Exception as exc:
            logger.warning("kvtier: the traffic record in %s cannot begin (%s)", self.folder, exc)
        while True:
            stopping = self._stop.is_set()
            try:
                while events:
                    event = events.popleft()
                    if len(event) == 4:
                        seq, ts, input_length, keys = event
                        waiting[seq] = [ts, input_length, keys, None]
                    else:
                        seq, output_length = event
                        entry = waiting.get(seq)
                        if entry is not None:
                            entry[3] = output_length
                while waiting:
                    entry = next(iter(waiting.values()))
                    if entry[3] is None and not stopping:
                        break
                    waiting.popitem(last=False)
                    out = 0 if entry[3] is None else entry[3]
                    self._write(entry[0], entry[1], out, entry[2])
            except Exception:  # never let the writer die: arrivals would pile up
                logger.exception("kvtier: the traffic record's writer failed")
            if stopping:
                self._close_file()
                self._close_dir()
                return
            self._stop.wait(POLL_SECONDS)

    def _write(self, ts: float, input_length: int, output_length: int, keys: Any) -> None:
        try:
            if self._fd < 0 or self._file_bytes >= self.max_bytes:
                self._close_file()
                self._open_file()
            ids = self._ids
            # Keyed by the hashes' own hash: a 64-bit digest of 32 bytes, kept per file.
            hash_ids = [ids.setdefault(hash(k), len(ids)) for k in keys]
            line = {
                "timestamp": ts,
                "input_length": int(input_length),
                "output_length": int(output_length),
                "hash_ids": hash_ids,
            }
            self._append(line)
            self._file_lines += 1
        except Exception as exc:
            self._lost += 1
            if not self._failure_logged:
                self._failure_logged = True
                logger.warning(
                    "kvtier: the traffic record in %s lost a line (%s); further losses "
                    "are counted in vllm:kvtier_traffic_dropped",
                    self.folder,
                    exc,
                )
        finally:
            self._done += 1

    def _append(self, obj: Mapping[str, Any]) -> None:
        """Write one JSON line whole, or nothing of it (the file is cut back; it is
        opened to append, so the next line follows what is kept)."""
        data = (json.dumps(obj, separators=(",", ":"), default=str) + "\n").encode()
        try:
            view = memoryview(data)
            while view:
                view = view[_write(self._fd, view) :]
        except OSError:
            try:
                os.ftruncate(self._fd, self._file_bytes)
            except OSError:
                pass
            raise
        self._file_bytes += len(data)

    def _open_file(self) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        for attempt in range(100):
            name = f"{FILE_PREFIX}{stamp}-{os.getpid()}-{len(self.files) + attempt:03d}"
            try:
                self._fd = os.open(name + FILE_SUFFIX, _OPEN_FLAGS, 0o600, dir_fd=self._dir_fd)
                break
            except FileExistsError:  # another recorder of this process, this second
                continue
        else:
            raise FileExistsError(f"no free file name in {self.folder}")
        self.files.append(os.path.join(self.folder, name + FILE_SUFFIX))
        self._ids = {}
        self._file_bytes = 0
        self._file_lines = 0
        # Drops counted in this file's end line: since it began (the first: since start).
        self._file_dropped_base = self.dropped if len(self.files) > 1 else 0
        try:
            self._append({HEADER_KEY: self.header})
        except OSError:
            os.close(self._fd)
            self._fd = -1
            raise

    def _close_file(self) -> None:
        if self._fd < 0:
            return
        end = {"requests": self._file_lines, "dropped": self.dropped - self._file_dropped_base}
        try:
            self._append({END_KEY: end})
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = -1

    def _close_dir(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (a request still running is written with
        ``output_length`` 0), end the file and stop the writer (which closes its files;
        idempotent)."""
        self._stop.set()
        self._thread.join(timeout)
