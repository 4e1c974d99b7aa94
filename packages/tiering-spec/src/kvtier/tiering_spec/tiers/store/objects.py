"""The store tier's objects: the header page written before a put, and the checks of
what a get brought (the store's codes, then each copy's header, MAC and checksum). The
bytes are the fs tier's block file (:mod:`kvtier.tiering_spec.tiers.fs.format`); these
are functions of what they are given, run on the tier's calling threads.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.tiering_spec.tiers.base import TierFault
from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.store.calls import OBJECT_NOT_FOUND


def write_header(
    page: memoryview, fingerprint: bytes, digest: bytes, data: memoryview, key: bytes | None
) -> None:
    """Write the header of an object whose payload is ``data`` into ``page`` (with a
    MAC where ``key`` is set)."""
    header = fs_format.encode_header(
        fingerprint,
        digest,
        len(data),
        fs_format.checksum(data),
        auth_key=key,
        payload=data,
    )
    page[: len(header)] = header


def check_object(
    codes: Sequence[int],
    object_bytes: int,
    pages: Sequence[memoryview],
    datas: Sequence[memoryview],
    fingerprints: Sequence[bytes],
    digest: bytes,
    key: bytes | None,
) -> TierFault | None:
    """The fault of one read of every copy (the store's ``codes``, then each copy's
    header page and payload), or None if every copy arrived intact and, with a ``key``,
    authenticated."""
    if any(c == OBJECT_NOT_FOUND for c in codes):
        return TierFault.VANISHED
    if any(c < 0 for c in codes):
        return TierFault.UNREADABLE
    if any(c != object_bytes for c in codes):
        return TierFault.CORRUPT
    for page, data, fingerprint in zip(pages, datas, fingerprints):
        try:
            crc = fs_format.decode_header(
                page, fingerprint=fingerprint, digest=digest, payload_len=len(data)
            )
            if key is not None:
                fs_format.check_mac(page, data, key)
        except fs_format.FormatError as exc:
            return (
                TierFault.UNAUTHENTICATED
                if exc.kind == TierFault.UNAUTHENTICATED
                else TierFault.CORRUPT
            )
        if fs_format.checksum(data) != crc:
            return TierFault.CORRUPT
    return None
