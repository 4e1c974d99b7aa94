"""The fs tier's I/O threads: plain threads on C queues, one pool for reads and one for
writes (and removals), each thread with its own page-aligned scratch buffers.

A task costs one put and one get, no future objects. The pool knows nothing of files:
the tier hands it callables, and counts what it submitted and what came back.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class IoThreads:
    """``n_read`` reader and ``n_write`` writer threads named ``kvtier-<name>-<kind>-<i>``.

    Args:
        n_read: reader threads.
        n_write: writer threads (they also remove files).
        name: the threads' name prefix.
    """

    def __init__(self, n_read: int, n_write: int, name: str = "fs") -> None:
        self._queues: dict[str, queue.SimpleQueue[Any]] = {
            "read": queue.SimpleQueue(),
            "write": queue.SimpleQueue(),
        }
        self._counts = {"read": max(1, n_read), "write": max(1, n_write)}
        self._local = threading.local()
        self._tmp_counter = 0
        self._tmp_lock = threading.Lock()
        self.threads = [
            threading.Thread(
                target=self._serve,
                args=(self._queues[kind],),
                name=f"kvtier-{name}-{kind}-{i}",
                daemon=True,
            )
            for kind, n in (("read", n_read), ("write", n_write))
            for i in range(n)
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def _serve(tasks: queue.SimpleQueue[Any]) -> None:
        while True:
            task = tasks.get()
            if task is None:
                return
            task[0](*task[1])

    def put(self, kind: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a ``kind`` ("read" or "write") thread."""
        self._queues[kind].put((fn, args))

    def put_shares(self, kind: str, fn: Callable[..., Any], items: list[Any], *args: Any) -> None:
        """Run ``fn(share, *args)`` on ``kind`` threads for ``items`` cut in order into
        one share per thread (fewer where there are fewer items): a job's blocks cost
        one put per thread, not one a block."""
        if not items:
            return
        threads = min(self._counts[kind], len(items))
        per = -(-len(items) // threads)
        for start in range(0, len(items), per):
            self.put(kind, fn, items[start : start + per], *args)

    def stop(self, deadline: float, also: threading.Thread | None = None) -> list[str]:
        """Stop every thread once its queue is done, waiting for them (and ``also``)
        until ``deadline`` (``time.monotonic``); the names of those still in a call."""
        for t in self.threads:
            self._queues["read" if "read" in t.name else "write"].put(None)
        for t in [*([also] if also is not None else []), *self.threads]:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]

    def buffer(self, name: str, size: int) -> mmap.mmap:
        """The calling thread's own scratch buffer ``name``: page aligned (for O_DIRECT)
        and zero filled when made."""
        buf = getattr(self._local, name, None)
        if buf is None:
            buf = mmap.mmap(-1, size)
            setattr(self._local, name, buf)
        return buf

    def tmp_suffix(self) -> str:
        """A suffix no other thread of this process uses: ``<pid>-<thread>-<n>``."""
        with self._tmp_lock:
            self._tmp_counter += 1
            n = self._tmp_counter
        return f"{os.getpid()}-{threading.get_ident()}-{n}"
