"""Configuration: the guide's keys, validated at start-up with the key named."""

from __future__ import annotations

import logging

import pytest

from kvtier.recompute_connector import DEFAULT_TOTAL_BYTES, RecomputeOffloadConfig
from kvtier.recompute_connector.config import KNOWN_KEYS


def config(extra=None, **kw):
    kw.setdefault("world_size", 1)
    kw.setdefault("kv_role", "kv_consumer")
    return RecomputeOffloadConfig.from_settings(extra, **kw)


def test_per_rank_budget_wins() -> None:
    c = config({"cpu_bytes_to_use_per_rank": 1000, "cpu_bytes_to_use": 10}, world_size=4)
    budget = c.resolve_budget(100)
    assert (budget.bytes_per_rank, budget.num_blocks, budget.source_key) == (
        1000,
        10,
        "cpu_bytes_to_use_per_rank",
    )


def test_total_budget_is_divided_by_world_size() -> None:
    budget = config({"cpu_bytes_to_use": 1000}, world_size=4).resolve_budget(10)
    assert budget.bytes_per_rank == 250 and budget.num_blocks == 25


def test_default_is_8_gib_total() -> None:
    budget = config(world_size=2).resolve_budget(1 << 20)
    assert budget.bytes_per_rank == DEFAULT_TOTAL_BYTES // 2 == 4 << 30


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"cpu_bytes_to_use_per_rank": -1}, "cpu_bytes_to_use_per_rank"),
        ({"cpu_bytes_to_use_per_rank": "16G"}, "cpu_bytes_to_use_per_rank"),
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1.5}, "cpu_bytes_to_use"),
        ({"enable_offload_prefix_caching": "maybe"}, "enable_offload_prefix_caching"),
    ],
)
def test_bad_values_name_the_key(extra, key) -> None:
    with pytest.raises(ValueError, match=key):
        config(extra)


def test_budget_below_one_block_names_the_key() -> None:
    with pytest.raises(ValueError, match="cpu_bytes_to_use_per_rank"):
        config({"cpu_bytes_to_use_per_rank": 10}).resolve_budget(100)


@pytest.mark.parametrize("role", ["kv_producer", None, "decode"])
def test_roles_other_than_consumer_and_both_are_refused(role) -> None:
    with pytest.raises(ValueError, match="kv_role"):
        config(kv_role=role)


def test_guide_flag_in_additional_config_is_accepted() -> None:
    c = config(additional_config={"recompute_scheduler_enable": True})
    assert c.scheduler_flag is True
    with pytest.raises(ValueError, match="recompute_scheduler_enable"):
        config(additional_config={"recompute_scheduler_enable": "yes please"})


def test_json_style_numbers_are_accepted() -> None:
    c = config(
        {"cpu_bytes_to_use_per_rank": 1.7179869184e10, "enable_offload_prefix_caching": False}
    )
    assert c.resolve_budget(1 << 20).bytes_per_rank == 17179869184
    assert c.enable_offload_prefix_caching is False


@pytest.mark.parametrize("value", ["false", "true", "False", 0, 1])
def test_booleans_given_as_strings_or_numbers_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match="enable_offload_prefix_caching must be a JSON boolean"):
        config({"cpu_bytes_to_use_per_rank": 1 << 20, "enable_offload_prefix_caching": value})


def test_unknown_keys_are_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    config({"cpu_bytes_to_use_per_rank": 1 << 20, "cpu_bytes_to_usee": 5})
    assert "cpu_bytes_to_usee" in caplog.text


def test_no_test_only_key_is_known(caplog: pytest.LogCaptureFixture) -> None:
    """Fault injection lives in kvtier.testkit.faults: a test key is an unknown key."""
    with caplog.at_level(logging.WARNING, logger="kvtier.recompute_connector"):
        config({"cpu_bytes_to_use_per_rank": 1 << 20, "kvtier_test_fail_loads": True})
    assert "kvtier_test_fail_loads" in caplog.text
    assert not [k for k in KNOWN_KEYS if "test" in k]


def test_device_staging_bytes_is_a_positive_number_of_bytes() -> None:
    assert config({"device_staging_bytes": 8 << 20}).device_staging_bytes == 8 << 20
    assert config().device_staging_bytes is None
    for bad in ("32M", 0, -1):
        with pytest.raises(ValueError, match="device_staging_bytes"):
            config({"device_staging_bytes": bad})
