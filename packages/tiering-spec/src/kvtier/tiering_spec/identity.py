"""What the model's weights are, so fs tier files are never loaded into another model.

A file written by the fs tier holds KV computed by one set of weights. A model
re-trained or re-quantised and served from the same path has the same name and
config, and its old files would pass every checksum while every output is wrong.
So the fingerprint of the fs tier covers a digest of the weight files' *contents*.

:func:`digest_model` hashes every file vLLM may read weights or model code from
(XXH3-128 over all bytes, about 20 GB/s from the page cache, where the workers have
just loaded them). Digests are cached per file in a JSON file beside the tier's
data, keyed by the file's device, inode, size, mtime and ctime: any rewrite, even
one that restores the mtime, changes the ctime, so only a changed file is hashed
again. No vLLM import.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import xxhash

logger = logging.getLogger("kvtier.tiering_spec")

# Files whose bytes decide the KV a model computes: weights, configs (quantisation,
# rope, weight index), remote model code. Tokenizer files do not: the offload keys
# are hashes of token ids.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth")
META_SUFFIXES = (".json", ".py")
_TOKENIZER_PREFIXES = ("tokenizer", "special_tokens_map", "vocab", "merges")
_READ_CHUNK = 16 << 20
CACHE_VERSION = 1


@dataclass
class ModelDigest:
    """The identity of one model's files.

    Attributes:
        location: the directory (or single file) that was hashed.
        files: ``[name, size in bytes, XXH3-128 hex]`` per file, sorted by name.
        digest: one hex digest over ``files``.
        hashed_bytes: bytes read this time (0 when every digest came from the cache).
        seconds: wall time of the hashing.
    """

    location: str
    files: list[list[Any]] = field(default_factory=list)
    digest: str = ""
    hashed_bytes: int = 0
    seconds: float = 0.0


def model_files(location: str, *, prefer_safetensors: bool = True) -> list[str]:
    """The files of a model folder (top level, no hidden files) that :func:`digest_model`
    covers, as names relative to ``location``; ``[""]`` for a single-file model.

    With ``prefer_safetensors`` (vLLM's ``auto`` and ``safetensors`` load formats),
    pickled weight files are skipped when ``.safetensors`` files exist, as vLLM skips them.
    """
    if os.path.isfile(location):
        return [""]
    names = []
    for entry in os.scandir(location):
        name = entry.name
        if name.startswith(".") or not entry.is_file():
            continue
        lower = name.lower()
        if lower.startswith(_TOKENIZER_PREFIXES):
            continue
        if lower.endswith(WEIGHT_SUFFIXES) or lower.endswith(META_SUFFIXES):
            names.append(name)
    if prefer_safetensors and any(n.endswith(".safetensors") for n in names):
        names = [n for n in names if not n.lower().endswith(PICKLE_WEIGHT_SUFFIXES)]
    return sorted(names)


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _hash_file(path: str) -> tuple[str, int]:
    h = xxhash.xxh3_128()
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    total = 0
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(view)
            if not n:
                break
            h.update(view[:n])
            total += n
    return h.hexdigest(), total


class DigestCache:
    """File digests by path and stat, in one JSON file (a best-effort cache: a bad or
    missing file only means hashing again)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.entries: dict[str, list[Any]] = {}
        self.dirty = False
        if path is None:
            return
        try:
            with open(path, encoding="utf-8") as fh:
                raw = json.load(fh)
            if isinstance(raw, dict) and raw.get("version") == CACHE_VERSION:
                entries = raw.get("files", {})
                if isinstance(entries, dict):
                    self.entries = entries
        except (OSError, ValueError):
            pass

    def get(self, path: str, key: list[int]) -> str | None:
        entry = self.entries.get(path)
        if isinstance(entry, list) and len(entry) == 2 and entry[0] == key:
            return str(entry[1])
        return None

    def put(self, path: str, key: list[int], digest: str) -> None:
        self.entries[path] = [key, digest]
        self.dirty = True

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"version": CACHE_VERSION, "files": self.entries}, fh)
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError as exc:
            logger.warning("kvtier: could not save the weight digest cache %s: %s", self.path, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass


def digest_model(
    location: str,
    *,
    cache_path: str | None = None,
    prefer_safetensors: bool = True,
) -> ModelDigest:
    """Digest the contents of a model folder (or single model file).

    Raises ``OSError`` when a file cannot be read, and ``ValueError`` when the folder
    holds no weight file: then nothing identifies the weights.
    """
    start = time.monotonic()
    location = os.path.realpath(location)
    names = model_files(location, prefer_safetensors=prefer_safetensors)
    if not any(n == "" or n.lower().endswith(WEIGHT_SUFFIXES) for n in names):
        raise ValueError(f"no weight file ({', '.join(WEIGHT_SUFFIXES)}) in {location}")
    cache = DigestCache(cache_path)
    out = ModelDigest(location=location)
    for name in names:
        path = os.path.join(location, name) if name else location
        st = os.stat(path)  # hub snapshots link to their blobs: follow
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        key = _stat_key(st)
        digest = cache.get(path, key)
        if digest is None:
            digest, n = _hash_file(path)
            out.hashed_bytes += n
            after = _stat_key(os.stat(path))
            if after != key:  # written while we read it: do not trust this digest
                raise OSError(f"{path} changed while it was hashed")
            cache.put(path, key, digest)
        out.files.append([name or os.path.basename(location), st.st_size, digest])
    cache.save()
    out.digest = files_digest(out.files)
    out.seconds = time.monotonic() - start
    return out


def files_digest(files: Iterable[list[Any]]) -> str:
    """One hex digest over ``[name, size, digest]`` rows."""
    text = json.dumps(sorted(files), separators=(",", ":"))
    return str(xxhash.xxh3_128_hexdigest(text.encode()))


def resolve_model_location(
    model: str, *, revision: str | None = None, download_dir: str | None = None
) -> str | None:
    """The local folder or file vLLM loads ``model`` from: the path itself, or the
    Hugging Face cache snapshot of a hub id at ``revision``; None when neither exists."""
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return str(
            snapshot_download(
                repo_id=model, revision=revision, cache_dir=download_dir, local_files_only=True
            )
        )
    except Exception:  # not in the cache, not a repo id, no hub library: unresolved
        return None
