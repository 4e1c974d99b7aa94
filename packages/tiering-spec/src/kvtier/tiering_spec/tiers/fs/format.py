"""The block file format: the fs tier's files on disk, and the bytes of the store
tier's objects (named ``kvtier-kv-v1/<fingerprint>/<key digest>`` there).

Layout under ``root_dir``::

    root_dir/kvtier-kv-v1/<fingerprint: 32 hex>/layout.json     what the fingerprint covers
    root_dir/kvtier-kv-v1/<fingerprint>/<shard: 1 hex>/<key digest: 32 hex>.kv

One file holds one rank's bytes of one offloaded chunk (host block). Ranks, models,
dtypes and block shapes never share a directory: each is part of the fingerprint.
The 16 shard directories are created once, at start-up.

A file is a 4096-byte header, then the payload (the host block's bytes, a multiple
of 4096 bytes, so O_DIRECT can read and write both in place)::

    offset size  field
    0      8     magic b"KVTIERKV"
    8      2     format version (1), little endian
    10     2     header size (4096)
    12     2     checksum algorithm (2 = XXH3-64)
    14     2     flags: bit 0 (FLAG_MAC) = a MAC follows the header checksum
    16     16    layout fingerprint (BLAKE2b-128)
    32     16    key digest (BLAKE2b-128 of the offload key)
    48     8     payload length in bytes
    56     8     payload checksum (XXH3-64, seed 0)
    64     4     header checksum (CRC-32 of bytes 0..63)
    68     32    with FLAG_MAC: BLAKE2b-256 MAC keyed with the tier's secret over
                 bytes 0..67 then the whole payload (see ``auth``); else zero
    100    3996  zero

Flags other than FLAG_MAC are refused. Readers written before the flag existed
ignore it (it was reserved), so objects with a MAC stay readable to them; a reader
with a key (``auth_key_file``) accepts only objects whose MAC checks, one without a
key reads both.

XXH3-64 hashes tens of GB/s per core, so checking every byte costs a few percent of
the I/O's CPU time; zlib's CRC-32 (about 2 GB/s here) would cost more than the I/O.

Nothing is pickled; names come only from hex digests.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import xxhash

from kvtier.tiering_spec import auth
from kvtier.tiering_spec.tiers.base import TierFault

MAGIC = b"KVTIERKV"
FORMAT_VERSION = 1
HEADER_SIZE = 4096
ALIGNMENT = 4096
CHECKSUM_XXH3_64 = 2
FORMAT_DIR = f"kvtier-kv-v{FORMAT_VERSION}"
NUM_SHARDS = 16
FILE_SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
_HEADER = struct.Struct("<8sHHHH16s16sQQ")
_HEADER_CRC = struct.Struct("<I")
HEADER_USED = _HEADER.size + _HEADER_CRC.size  # 68
FLAG_MAC = 0x0001
MAC_OFFSET = HEADER_USED
HEADER_USED_MAC = MAC_OFFSET + auth.MAC_SIZE  # 100
_FLAGS_OFFSET = 14


class FormatError(Exception):
    """A file that is not a valid block file for this layout and key.

    ``kind`` is ``CORRUPT`` (bad magic, version, flags, checksum, fingerprint or
    key), ``TRUNCATED`` (shorter than its header says) or ``UNAUTHENTICATED``
    (no MAC, or a MAC that does not check, where a key is configured).
    """

    def __init__(self, kind: TierFault, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def key_digest(key: bytes) -> bytes:
    """16-byte BLAKE2b digest of an offload key: the file's name and header field."""
    return hashlib.blake2b(key, digest_size=16).digest()


def layout_fingerprint(fields: Mapping[str, Any]) -> bytes:
    """16-byte fingerprint of a KV layout description (JSON-serialisable values)."""
    text = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def checksum(payload: Any) -> int:
    """XXH3-64 of a bytes-like payload."""
    return int(xxhash.xxh3_64_intdigest(payload))


def encode_header(
    fingerprint: bytes,
    digest: bytes,
    payload_len: int,
    crc: int,
    *,
    auth_key: bytes | None = None,
    payload: Any = None,
) -> bytes:
    """The used bytes of a header (the rest of the 4096 are zero): ``HEADER_USED``
    bytes, or with ``auth_key`` ``HEADER_USED_MAC`` bytes ending in the MAC of the
    header and ``payload`` (required then: the bytes the header describes)."""
    head = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        CHECKSUM_XXH3_64,
        0 if auth_key is None else FLAG_MAC,
        fingerprint,
        digest,
        payload_len,
        crc,
    )
    head += _HEADER_CRC.pack(zlib.crc32(head) & 0xFFFFFFFF)
    if auth_key is None:
        return head
    if payload is None:
        raise ValueError("encode_header with auth_key needs the payload")
    return head + auth.mac(auth_key, head, payload)


def check_mac(header: Any, payload: Any, auth_key: bytes) -> None:
    """Check the MAC of a header that :func:`decode_header` accepted against
    ``payload`` (the whole payload). Raises ``FormatError(TierFault.UNAUTHENTICATED, ...)``
    when the header has no MAC or it does not match."""
    raw = bytes(header[:HEADER_USED_MAC])
    if len(raw) < HEADER_USED_MAC:
        raise FormatError(TierFault.TRUNCATED, f"header of {len(raw)} bytes")
    (flags,) = struct.unpack_from("<H", raw, _FLAGS_OFFSET)
    if not flags & FLAG_MAC:
        raise FormatError(TierFault.UNAUTHENTICATED, "no MAC, and a key is configured")
    if not auth.mac_matches(auth_key, raw[:MAC_OFFSET], payload, raw[MAC_OFFSET:]):
        raise FormatError(TierFault.UNAUTHENTICATED, "MAC mismatch (another key, or forged)")


def decode_header(header: Any, *, fingerprint: bytes, digest: bytes, payload_len: int) -> int:
    """Check a header against what the reader expects; return the payload checksum.

    Raises ``FormatError(TierFault.CORRUPT, ...)`` for any mismatch. The MAC, if any, is not
    checked here: a reader with a key calls :func:`check_mac` too.
    """
    raw = bytes(header[:HEADER_USED])
    if len(raw) < HEADER_USED:
        raise FormatError(TierFault.TRUNCATED, f"header of {len(raw)} bytes")
    head = raw[: _HEADER.size]
    (stored_header_crc,) = _HEADER_CRC.unpack(raw[_HEADER.size : HEADER_USED])
    if zlib.crc32(head) & 0xFFFFFFFF != stored_header_crc:
        raise FormatError(TierFault.CORRUPT, "header checksum mismatch")
    magic, version, hsize, algo, flags, fp, dg, plen, crc = _HEADER.unpack(head)
    if magic != MAGIC:
        raise FormatError(TierFault.CORRUPT, f"bad magic {magic!r}")
    if flags & ~FLAG_MAC:
        raise FormatError(TierFault.CORRUPT, f"unknown header flags {flags:#x}")
    if version != FORMAT_VERSION or hsize != HEADER_SIZE or algo != CHECKSUM_XXH3_64:
        raise FormatError(TierFault.CORRUPT, f"unsupported format {version}/{hsize}/{algo}")
    if fp != fingerprint:
        raise FormatError(TierFault.CORRUPT, "layout fingerprint differs from this engine's")
    if dg != digest:
        raise FormatError(TierFault.CORRUPT, "file holds another key")
    if plen != payload_len:
        raise FormatError(TierFault.CORRUPT, f"payload length {plen}, expected {payload_len}")
    return int(crc)


def file_name(digest: bytes) -> tuple[str, str]:
    """(shard directory, file name) of a key digest."""
    hexd = digest.hex()
    return hexd[0], hexd + FILE_SUFFIX


def parse_file_name(name: str) -> bytes | None:
    """The key digest a block file name encodes, or None for any other name."""
    if len(name) != 32 + len(FILE_SUFFIX) or not name.endswith(FILE_SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:32])
    except ValueError:
        return None
