"""Adversarial battery of the store tier (issue #25): objects planted by anyone who
reaches the store, and the key that authenticates them (``auth_key_file``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.tiering_spec import auth, fsformat
from kvtier.tiering_spec.config import ConfigError, parse_fs_tier, parse_mooncake_tier

from .tier_support import PAYLOAD

KEY = os.urandom(32)


def foreign(seed: int) -> bytes:
    return (seed.to_bytes(4, "little") * (PAYLOAD // 4))[:PAYLOAD]


# ----------------------------------------------------------------- the key file


def write_key(path: Path, data: bytes, mode: int = 0o600) -> str:
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def test_key_file_is_checked_like_a_private_key(tmp_path: Path) -> None:
    good = write_key(tmp_path / "key", os.urandom(64))
    assert len(auth.load_auth_key(good, "k")) == auth.MAC_SIZE
    assert auth.load_auth_key(good, "k") == auth.load_auth_key(good, "k")
    bad = {
        "group readable": write_key(tmp_path / "g", os.urandom(64), 0o640),
        "world writable": write_key(tmp_path / "w", os.urandom(64), 0o602),
        "too short": write_key(tmp_path / "s", b"secret\n"),
        "missing": str(tmp_path / "none"),
        "a directory": str(tmp_path),
    }
    link = tmp_path / "link"
    link.symlink_to(good)
    bad["a symlink"] = str(link)
    for path in bad.values():
        with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.auth_key_file"):
            auth.load_auth_key(path, "secondary_tiers[0].auth_key_file")


def test_auth_key_file_in_both_tier_configs(tmp_path: Path) -> None:
    good = write_key(tmp_path / "key", os.urandom(64))
    loose = write_key(tmp_path / "loose", os.urandom(64), 0o644)
    mooncake = {
        "type": "mooncake",
        "master_server_address": "127.0.0.1:50051",
        "metadata_server": "P2PHANDSHAKE",
    }
    fs = {"type": "fs", "root_dir": str(tmp_path / "fs")}
    assert parse_mooncake_tier(mooncake, "t").auth_key_file is None
    assert parse_fs_tier(fs, "t").auth_key_file is None
    assert parse_mooncake_tier({**mooncake, "auth_key_file": good}, "t").auth_key_file == good
    assert parse_fs_tier({**fs, "auth_key_file": good}, "t").auth_key_file == good
    for value in (loose, "", 7):
        with pytest.raises(ConfigError, match=r"t\.auth_key_file"):
            parse_mooncake_tier({**mooncake, "auth_key_file": value}, "t")
        with pytest.raises(ConfigError, match=r"t\.auth_key_file"):
            parse_fs_tier({**fs, "auth_key_file": value}, "t")


def test_header_mac_covers_header_and_payload() -> None:
    fp, dg, payload = b"f" * 16, b"d" * 16, foreign(3)
    header = fsformat.encode_header(
        fp, dg, PAYLOAD, fsformat.checksum(payload), auth_key=KEY, payload=payload
    )
    assert len(header) == fsformat.HEADER_USED_MAC
    page = header + bytes(fsformat.HEADER_SIZE - len(header))
    assert fsformat.decode_header(page, fingerprint=fp, digest=dg, payload_len=PAYLOAD)
    fsformat.check_mac(page, payload, KEY)
    changed = bytearray(payload)
    changed[-1] ^= 1
    for bad_page, bad_payload, key in (
        (page, bytes(changed), KEY),
        (page, payload, os.urandom(32)),
        (page[:40] + b"\x00" + page[41:], payload, KEY),  # a header field changed
    ):
        with pytest.raises(fsformat.FormatError) as err:
            fsformat.check_mac(bad_page, bad_payload, key)
        assert err.value.kind == "unauthenticated"
    plain = fsformat.encode_header(fp, dg, PAYLOAD, fsformat.checksum(payload))
    assert len(plain) == fsformat.HEADER_USED
    with pytest.raises(fsformat.FormatError, match="no MAC"):
        fsformat.check_mac(plain + bytes(4028), payload, KEY)
