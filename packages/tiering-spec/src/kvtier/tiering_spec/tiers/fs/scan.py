"""The fs tier's folders on disk, apart from its index: the start-up scan of what
earlier runs left (and its clean-up), and the look for files other engines write."""

from __future__ import annotations

import heapq
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.fs.dirs import DIR_FLAGS, TierDirs

# Temporary files older than this are a crashed write's: removed at start-up.
STALE_TMP_S = 3600.0
SORT_SLICE = 8192
"""Entries sorted in one call at most: a sort holds the interpreter's lock throughout,
and the scheduler's thread waits for it (1.4 s for a million entries at once)."""
# Fingerprint directories (other models or layouts) untouched this long are removed.
STALE_FINGERPRINT_AGE_S = 7 * 86400.0


@dataclass
class ScanReport:
    """What the start-up scan found and removed."""

    files: int = 0
    entries: list[bytes] = field(default_factory=list)
    removed_tmp: int = 0
    removed_bad: int = 0
    removed_fingerprints: list[str] = field(default_factory=list)


def named_entry(entry: os.DirEntry[str]) -> tuple[bytes, os.stat_result] | None:
    """(key digest, lstat) of a directory entry named like a block file, else None."""
    digest = fs_format.parse_file_name(entry.name)
    if digest is None:
        return None
    try:
        return digest, entry.stat(follow_symlinks=False)
    except OSError:
        return None


def is_block_file(st: os.stat_result, file_bytes: int) -> bool:
    """A regular file (no symlink, no FIFO) of exactly a block file's size."""
    return stat.S_ISREG(st.st_mode) and st.st_size == file_bytes


def foreign(st: os.stat_result) -> str | None:
    """Why a file found under a block file's name was not written by this tier (another
    user's, a hard link, not a regular file), or None."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if st.st_nlink != 1:
        return f"{st.st_nlink} links"
    return None


def own_block_file(st: os.stat_result, file_bytes: int) -> bool:
    """A block file this tier may index: this user's, one link, the right size."""
    return foreign(st) is None and st.st_size == file_bytes


def remove_tree(name: str, dir_fd: int) -> None:
    """Remove folder ``name`` under ``dir_fd`` and everything in it, following no link
    (errors ignored: what stays is tried again at the next start)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return
    try:
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in entries:
            if is_dir:
                remove_tree(child, fd)
            else:
                try:
                    os.unlink(child, dir_fd=fd)
                except OSError:
                    pass
    except OSError:
        pass
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError:
        pass


class FsScanner:
    """What the fs tier knows of its folders on disk, apart from its index: the start-up
    scan (what earlier runs left, and the clean-up), and the look for files other
    engines sharing ``root_dir`` write, which it reports once each.

    ``scan`` and ``discover`` run on the tier's background thread, ``note_own_change``
    on its I/O threads, ``take_found`` on the scheduler thread; one lock guards what
    they share.

    Args:
        dirs: the tier's folders, held open.
        world_size: ranks, each with its own fingerprint folder.
        file_bytes: size of one rank's block file.
        fingerprints: this engine's layout fingerprints (other fingerprints' folders
            unused for ``STALE_FINGERPRINT_AGE_S`` are removed at start-up).
    """

    def __init__(
        self, dirs: TierDirs, world_size: int, file_bytes: int, fingerprints: Sequence[bytes]
    ) -> None:
        self.fsdirs = dirs
        self.world_size = world_size
        self.file_bytes = file_bytes
        self.fingerprints = list(fingerprints)
        self._lock = threading.Lock()
        # What a look found and the scheduler has not taken yet: one set at most, of
        # files not reported before.
        self._found: set[bytes] = set()
        # Per shard, the entries last seen on disk (reported or this tier's own): a
        # later look reports only what is new. At most the files on disk.
        self._seen: list[set[bytes]] = [set() for _ in range(fs_format.NUM_SHARDS)]
        self._shard_mtimes: dict[tuple[int, int], int] = {}

    @property
    def waiting(self) -> int:
        """Digests found and not taken yet."""
        return len(self._found)

    def take_found(self, most: int | None = None) -> list[bytes]:
        """Digests found and not taken yet, ``most`` of them at most (scheduler thread).
        Those left wait here, where a file this tier removes meanwhile is forgotten
        (:meth:`note_own_change`)."""
        with self._lock:
            found = self._found
            if most is None or len(found) <= most:
                self._found = set()
                return list(found)
            return [found.pop() for _ in range(most)]

    def _scandir(self, rank: int, shard: int) -> list[tuple[bytes, os.stat_result]]:
        """(digest, lstat) of the entries named like block files in one shard folder."""
        out = []
        with os.scandir(self.fsdirs.shard(rank, shard)) as it:
            for entry in it:
                named = named_entry(entry)
                if named is not None:
                    out.append(named)
        return out

    def discover(self) -> None:
        """Look for entries on disk for every rank, in shard folders changed since the
        last look, that were not there at that look (files other engines wrote): they
        wait in ``take_found`` (the background thread)."""
        found: set[bytes] = set()
        for shard in range(fs_format.NUM_SHARDS):
            changed = False
            for rank in range(self.world_size):
                try:
                    mtime = os.fstat(self.fsdirs.shard(rank, shard)).st_mtime_ns
                except OSError:
                    continue
                if self._shard_mtimes.get((rank, shard)) != mtime:
                    self._shard_mtimes[(rank, shard)] = mtime
                    changed = True
            if not changed:
                continue
            common: set[bytes] | None = None
            for rank in range(self.world_size):
                try:
                    entries = self._scandir(rank, shard)
                    present = {d for d, st in entries if own_block_file(st, self.file_bytes)}
                except OSError:
                    present = set()
                common = present if common is None else common & present
            common = common or set()
            with self._lock:
                found |= common - self._seen[shard]
                self._seen[shard] = common
        if found:
            with self._lock:
                self._found |= found

    def note_own_change(self, shard: int, digest: bytes, present: bool) -> None:
        """This tier wrote (``present``) or removed ``digest`` in a shard folder (an I/O
        thread): the background look for other engines' files need not read the folder
        again for that, nor report the file. A change by another engine in the same
        instant goes unseen until the folder changes again (a miss, no harm)."""
        with self._lock:
            if present:
                self._seen[shard].add(digest)
            else:
                self._seen[shard].discard(digest)
                self._found.discard(digest)
        for rank in range(self.world_size):
            try:
                mtime = os.fstat(self.fsdirs.shard(rank, shard)).st_mtime_ns
            except OSError:
                continue
            self._shard_mtimes[(rank, shard)] = mtime

    def scan(self) -> ScanReport:
        """Find the entries every rank has a file for (oldest first) and clean up: stale
        temporary files, block files of the wrong size, and old fingerprints' folders.
        Runs on the scanner thread: it touches the disk and its report, nothing else.
        Files that are not this tier's (another owner, links) are neither indexed nor
        removed."""
        now = time.time()
        report = ScanReport()
        per_rank: list[dict[bytes, float]] = []
        by_shard: list[set[bytes]] = [set() for _ in range(fs_format.NUM_SHARDS)]
        for rank in range(self.world_size):
            found: dict[bytes, float] = {}
            for shard in range(fs_format.NUM_SHARDS):
                fd = self.fsdirs.shard(rank, shard)
                try:
                    self._shard_mtimes[(rank, shard)] = os.fstat(fd).st_mtime_ns
                    it = os.scandir(fd)
                except OSError:
                    continue
                with it:
                    for entry in it:
                        report.files += 1
                        if entry.name.startswith(fs_format.TMP_PREFIX):
                            try:
                                if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S:
                                    os.unlink(entry.name, dir_fd=fd)
                                    report.removed_tmp += 1
                            except OSError:
                                pass
                            continue
                        named = named_entry(entry)
                        if named is None:
                            continue
                        digest, st = named
                        if foreign(st) is not None:
                            continue
                        if st.st_size == self.file_bytes:
                            found[digest] = st.st_mtime
                            if rank == 0:
                                by_shard[shard].add(digest)
                        else:
                            # A block file can only have one size here (renamed into
                            # place whole): zero-length or another size is damage.
                            try:
                                os.unlink(entry.name, dir_fd=fd)
                                report.removed_bad += 1
                            except OSError:
                                pass
            per_rank.append(found)
        # Python loops, not one C call over all files each, so the scheduler's thread
        # gets the interpreter's lock between them.
        others = per_rank[1:]
        if others:  # rank 0's files of entries every rank has, asked once a file
            by_shard = [{d for d in ds if all(d in f for f in others)} for ds in by_shard]
            held: set[bytes] = set()
            for digests in by_shard:  # (a shard's worth of C work at a time)
                held |= digests
            common = [d for d in per_rank[0] if d in held]
        else:
            common = list(per_rank[0])
        mtime = per_rank[0].__getitem__
        report.entries = list(
            heapq.merge(
                *(
                    sorted(common[i : i + SORT_SLICE], key=mtime)
                    for i in range(0, len(common), SORT_SLICE)
                ),
                key=mtime,
            )
        )
        with self._lock:
            for shard, digests in enumerate(by_shard):
                self._seen[shard] |= digests
        report.removed_fingerprints = self._remove_old_fingerprints(now)
        return report

    def _remove_old_fingerprints(self, now: float) -> list[str]:
        """Remove other fingerprints' folders untouched for ``STALE_FINGERPRINT_AGE_S``."""
        base = self.fsdirs.base
        mine = {fp.hex() for fp in self.fingerprints}
        removed: list[str] = []
        try:
            with os.scandir(base) as it:
                candidates = [e for e in it if e.name not in mine]
        except OSError:
            return removed
        for entry in candidates:
            if len(entry.name) != 32 or not entry.is_dir(  # 16-byte fingerprints, in hex
                follow_symlinks=False
            ):
                continue
            try:
                fd = os.open(entry.name, DIR_FLAGS, dir_fd=base)
            except OSError:
                continue
            try:
                # A write renames a file into a shard folder, which updates its mtime.
                with os.scandir(fd) as it:
                    times = [s.stat(follow_symlinks=False).st_mtime for s in it]
                newest = max([os.fstat(fd).st_mtime, *times])
            except OSError:
                continue
            finally:
                os.close(fd)
            if now - newest > STALE_FINGERPRINT_AGE_S:
                remove_tree(entry.name, base)
                removed.append(entry.name)
        return removed
