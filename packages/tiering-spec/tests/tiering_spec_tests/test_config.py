"""Start-up validation of kv_connector_extra_config: errors name the key and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.tiering_spec.config import ConfigError, parse_config

BASE = {"cpu_bytes_to_use": 1 << 30}


def fs(tmp_path: Path, **kw: object) -> dict[str, object]:
    return {"type": "fs", "root_dir": str(tmp_path / "kv"), **kw}


def test_missing_cpu_bytes_to_use_says_it_is_required() -> None:
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use is required"):
        parse_config({"blocks_per_chunk": 8}, tiering=False)


def test_the_guides_configurations_validate(tmp_path: Path) -> None:
    cpu = parse_config({"cpu_bytes_to_use": 8 * (1 << 30), "blocks_per_chunk": 8}, tiering=False)
    assert cpu.blocks_per_chunk == 8 and cpu.budget == {"cpu_bytes_to_use": 8 << 30}
    tier = parse_config(
        {"cpu_bytes_to_use": 8589934592, "blocks_per_chunk": 8, "secondary_tiers": [fs(tmp_path)]},
        tiering=True,
    )
    assert tier.secondary_tiers[0].root_dir == str(tmp_path / "kv")
    assert (tmp_path / "kv").stat().st_mode & 0o777 == 0o700


def test_blocks_per_chunk_and_block_size_are_mutually_exclusive() -> None:
    with pytest.raises(ConfigError, match="mutually exclusive"):
        parse_config({**BASE, "blocks_per_chunk": 2, "block_size": 64}, tiering=False)


@pytest.mark.parametrize("key", ["blocks_per_chunk", "block_size"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, "x", True])
def test_chunk_size_must_be_a_positive_integer(key: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_config({**BASE, key: bad}, tiering=False)


def test_eviction_policy_defaults_to_frecency_and_lru_arc_stay_selectable() -> None:
    assert parse_config(BASE, tiering=False).eviction_policy == "frecency"
    for name in ("lru", "arc"):
        config = parse_config({**BASE, "eviction_policy": name}, tiering=False)
        assert config.eviction_policy == name


def test_eviction_policy_names_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"eviction_policy must be one of lru, arc, frecency"):
        parse_config({**BASE, "eviction_policy": "mru"}, tiering=False)


@pytest.mark.parametrize("policy", ["lru", "arc", "frecency"])
def test_every_policy_is_accepted_in_front_of_secondary_tiers(tmp_path: Path, policy: str) -> None:
    """A promotion counts as a use (the manager's tests show why that matters), so no
    policy is kept to the host tier alone."""
    tiers = {"secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs")}]}
    config = parse_config({**BASE, **tiers, "eviction_policy": policy}, tiering=True)
    assert config.eviction_policy == policy


def test_store_threshold_is_refused_by_the_tiering_spec_like_vllm() -> None:
    parse_config({**BASE, "store_threshold": 3}, tiering=False)
    with pytest.raises(ConfigError, match="store_threshold"):
        parse_config({**BASE, "store_threshold": 3}, tiering=True)


@pytest.mark.parametrize(
    ("key", "value"),
    [("cpu_bytes_to_use", -5), ("cpu_bytes_to_use", "lots"), ("max_tracker_size", 0)],
)
def test_bad_numbers_name_their_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_config({**BASE, key: value}, tiering=False)


def test_unknown_tier_type_lists_the_allowed_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.type must be one of fs"):
        parse_config({**BASE, "secondary_tiers": [{"type": "s3"}]}, tiering=True)


def test_secondary_tiers_must_be_a_list() -> None:
    with pytest.raises(ConfigError, match="secondary_tiers must be a list"):
        parse_config({**BASE, "secondary_tiers": {"type": "fs"}}, tiering=True)


def test_root_dir_is_required(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.root_dir is required"):
        parse_config({**BASE, "secondary_tiers": [{"type": "fs"}]}, tiering=True)


def test_root_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        parse_config({**BASE, "secondary_tiers": [fs(tmp_path, root_dir=str(f))]}, tiering=True)


def test_root_dir_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    bad = str(f / "sub")
    with pytest.raises(ConfigError, match="cannot be created"):
        parse_config({**BASE, "secondary_tiers": [fs(tmp_path, root_dir=bad)]}, tiering=True)


def test_root_dir_that_is_not_writable_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not writable"):
        parse_config({**BASE, "secondary_tiers": [fs(tmp_path, root_dir="/proc")]}, tiering=True)


@pytest.mark.parametrize(
    ("key", "value"),
    [("n_read_threads", 0), ("n_write_threads", "many"), ("capacity_bytes", -1)],
)
def test_bad_tier_numbers_name_their_key(tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"secondary_tiers\[0\]\.{key}"):
        parse_config({**BASE, "secondary_tiers": [fs(tmp_path, **{key: value})]}, tiering=True)


def test_an_fs_tier_takes_an_eviction_policy_by_name(tmp_path: Path) -> None:
    config = parse_config({**BASE, "secondary_tiers": [fs(tmp_path)]}, tiering=True)
    assert config.secondary_tiers[0].eviction_policy == "frecency"
    for name in ("lru", "arc", "frecency"):
        tiers = {"secondary_tiers": [fs(tmp_path, eviction_policy=name)]}
        config = parse_config({**BASE, **tiers}, tiering=True)
        assert config.secondary_tiers[0].eviction_policy == name
    with pytest.raises(
        ConfigError,
        match=r"secondary_tiers\[0\]\.eviction_policy must be one of lru, arc, frecency, got 'mru'",
    ):
        tiers = {"secondary_tiers": [fs(tmp_path, eviction_policy="mru")]}
        parse_config({**BASE, **tiers}, tiering=True)


def test_unknown_tier_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        parse_config({**BASE, "secondary_tiers": [fs(tmp_path, rot_dir="x")]}, tiering=True)


def test_secondary_tiers_need_the_tiering_spec(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="TieringOffloadingSpec"):
        parse_config({**BASE, "secondary_tiers": [fs(tmp_path)]}, tiering=False)


MOONCAKE = {
    "type": "mooncake",
    "master_server_address": "10.0.0.1:50051",
    "metadata_server": "http://10.0.0.1:8080/metadata",
    "protocol": "tcp",
}


def test_a_mooncake_tier_validates_with_defaults(tmp_path: Path) -> None:
    from kvtier.tiering_spec.tiers.store.schema import MooncakeTierConfig

    cfg = parse_config({**BASE, "secondary_tiers": [fs(tmp_path), MOONCAKE]}, tiering=True)
    _, store = cfg.secondary_tiers
    assert isinstance(store, MooncakeTierConfig)
    assert store.master_server_address == "10.0.0.1:50051" and store.protocol == "tcp"
    assert store.global_segment_size == 1 << 30 and store.locality == "REMOTE"
    assert store.local_hostname, "the local hostname defaults to this machine's"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"master_server_address": "10.0.0.1"}, r"master_server_address must be 'HOST:PORT'"),
        ({"master_server_address": "h:70000"}, r"master_server_address must be 'HOST:PORT'"),
        ({"metadata_server": "10.0.0.1:8080"}, r"metadata_server must be 'http://HOST:PORT"),
        ({"protocol": "udp"}, r"protocol must be one of tcp, rdma, got 'udp'"),
        ({"protocol": "rdma"}, r"device_name .* required with protocol 'rdma'"),
        ({"global_segment_size": -1}, r"global_segment_size"),
        ({"local_buffer_size": "64"}, r"local_buffer_size"),
        ({"root_dir": "/x"}, r"unknown key\(s\) \['root_dir'\] for a mooncake tier"),
        ({"enable_kv_events": "false"}, r"enable_kv_events"),
    ],
)
def test_a_bad_mooncake_value_names_its_key(change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({**BASE, "secondary_tiers": [{**MOONCAKE, **change}]}, tiering=True)


def test_a_mooncake_tier_without_a_master_says_it_is_required() -> None:
    raw = {k: v for k, v in MOONCAKE.items() if k != "master_server_address"}
    with pytest.raises(ConfigError, match=r"master_server_address is required"):
        parse_config({**BASE, "secondary_tiers": [raw]}, tiering=True)


def test_a_mooncake_tier_without_mooncakes_client_names_the_package(monkeypatch) -> None:
    import builtins

    from kvtier.tiering_spec.tiers.store import schema
    from kvtier.tiering_spec.tiers.store.schema import parse_mooncake_tier

    real = builtins.__import__

    def no_mooncake(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("mooncake"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_mooncake)
    monkeypatch.setattr(schema.importlib, "import_module", lambda name: no_mooncake(name))
    cfg = parse_mooncake_tier(MOONCAKE, "secondary_tiers[0]")
    with pytest.raises(ConfigError, match=r"mooncake-transfer-engine-non-cuda"):
        schema.mooncake_connector(cfg, "secondary_tiers[0]")
