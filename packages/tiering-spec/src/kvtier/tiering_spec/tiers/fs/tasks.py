"""The fs tier's I/O-thread half: the tasks its threads run, each on one key's block
files of every rank, through the tier's held folders. A task never touches the index:
it hands a :class:`~kvtier.tiering_spec.tiers.base.TierResult` to the tier's ``poll``.

:class:`BlockFileTasks` is a part of :class:`~kvtier.tiering_spec.tiers.fs.tier.
FileSystemTier` (a mixin); the reading and writing of one file is in ``io``.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Sequence

from kvtier.tiering_spec.errors import ConfigError
from kvtier.tiering_spec.tiers.base import TierFault, TierResult, TierStats
from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.fs import io as fs_io
from kvtier.tiering_spec.tiers.fs.dirs import TierDirs
from kvtier.tiering_spec.tiers.fs.pool import IoThreads
from kvtier.tiering_spec.tiers.fs.scan import FsScanner

logger = logging.getLogger("kvtier.tiering_spec")


class BlockFileTasks:
    """Writing, reading and removing one key's files (see the module docstring)."""

    name: str
    payload_bytes: int
    file_bytes: int
    entry_bytes: int
    world_size: int
    fingerprints: list[bytes]
    direct: bool
    stats: TierStats
    fsdirs: TierDirs
    _key: bytes | None
    _io: IoThreads
    _disk: FsScanner
    _results: deque[TierResult]
    _fault_logged: set[str]
    _free_seen: int | None

    def _where(self, digest: bytes) -> tuple[int, str]:
        """(shard, file name) of a key digest."""
        shard, name = fs_format.file_name(digest)
        return int(shard, 16), name

    def _payload(self, views: Sequence[memoryview], rank: int, block_id: int) -> memoryview:
        start = block_id * self.payload_bytes
        return views[rank][start : start + self.payload_bytes]

    def _tmp_name(self) -> str:
        return f"{fs_format.TMP_PREFIX}{self._io.tmp_suffix()}"

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

    def _write_tasks(
        self, writes: Sequence[tuple[bytes, bytes, int, bytes | None]], views: Sequence[memoryview]
    ) -> None:
        """``_write_task`` of each (key, digest, host block, file to take over): the
        share of one job's writes that one write thread takes (``_submit_writes``).
        Every item hands a result to ``poll``, whatever the items before it met."""
        for key, digest, block_id, reuse in writes:
            t0 = time.perf_counter()
            try:
                self._write_task(key, digest, block_id, views, reuse)
            except Exception:  # never expected: _write_task keeps its faults
                self._finish("write", key, digest, block_id, TierFault.WRITE_FAILED, t0)

    def _read_tasks(
        self, reads: Sequence[tuple[bytes, bytes, int]], views: Sequence[memoryview]
    ) -> None:
        """``_read_task`` of each (key, digest, host block): the share of one job's
        reads that one read thread takes (``_submit_reads``). Every item hands a result
        to ``poll``, whatever the items before it met."""
        for key, digest, block_id in reads:
            t0 = time.perf_counter()
            try:
                self._read_task(key, digest, block_id, views)
            except Exception:  # never expected: _read_task keeps its faults
                self._finish("read", key, digest, block_id, TierFault.UNREADABLE, t0)

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
        hdr = self._io.buffer("hdr", fs_format.HEADER_SIZE)
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
            self._io.buffer("hdr", fs_format.HEADER_SIZE),
            self._io.buffer("tail", fs_format.ALIGNMENT),
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
