"""Budget resolution: per-rank wins, totals divide by world size, exact block counts."""

import pytest

from kvtier.blockpool import resolve_budget, resolve_bytes_per_rank


def test_per_rank_budget_wins_over_total() -> None:
    budget = resolve_budget(
        {"cpu_bytes_to_use_per_rank": 10_000, "cpu_bytes_to_use": 1_000_000},
        world_size=4,
        bytes_per_block=1000,
    )
    assert budget.bytes_per_rank == 10_000
    assert budget.source_key == "cpu_bytes_to_use_per_rank"
    assert budget.num_blocks == 10


def test_total_budget_is_divided_by_world_size() -> None:
    budget = resolve_budget({"cpu_bytes_to_use": 8000}, world_size=4, bytes_per_block=500)
    assert budget.bytes_per_rank == 2000
    assert budget.num_blocks == 4
    assert budget.source_key == "cpu_bytes_to_use"


def test_block_count_is_exact_without_power_of_two_rounding() -> None:
    # 3 GiB + a bit with blocks of 3000 bytes aligned to 512 -> 3072-byte blocks.
    total = 3 * 2**30 + 12345
    budget = resolve_budget(
        {"cpu_bytes_to_use": total}, world_size=1, bytes_per_block=3000, alignment=512
    )
    assert budget.block_bytes == 3072
    assert budget.num_blocks == total // 3072
    assert budget.region_bytes == budget.num_blocks * 3072
    assert budget.region_bytes <= total < budget.region_bytes + 3072


def test_alignment_of_one_keeps_block_size() -> None:
    budget = resolve_budget({"cpu_bytes_to_use": 999}, world_size=1, bytes_per_block=333)
    assert (budget.block_bytes, budget.num_blocks) == (333, 3)


def test_default_total_applies_when_no_key_is_set() -> None:
    per_rank, key = resolve_bytes_per_rank({}, 2, default_total=8 << 30)
    assert (per_rank, key) == (4 << 30, "cpu_bytes_to_use")


def test_integral_float_is_accepted() -> None:
    budget = resolve_budget({"cpu_bytes_to_use": 8e3}, world_size=1, bytes_per_block=1000)
    assert budget.num_blocks == 8


def test_missing_budget_names_both_keys() -> None:
    with pytest.raises(ValueError, match=r"cpu_bytes_to_use.*cpu_bytes_to_use_per_rank"):
        resolve_budget({}, world_size=1, bytes_per_block=10)


@pytest.mark.parametrize("key", ["cpu_bytes_to_use", "cpu_bytes_to_use_per_rank"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "8GiB", "1000", True, [1000]], ids=repr)
def test_bad_budget_value_names_key_and_what_is_allowed(key: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        resolve_budget({key: value}, world_size=1, bytes_per_block=10)
    assert key in str(info.value), f"error does not name {key}: {info.value}"
    assert "positive integer" in str(info.value)


def test_budget_smaller_than_one_block_names_key_and_minimum() -> None:
    with pytest.raises(ValueError, match=r"cpu_bytes_to_use_per_rank.*at least 4096"):
        resolve_budget(
            {"cpu_bytes_to_use_per_rank": 4000},
            world_size=1,
            bytes_per_block=4000,
            alignment=4096,
        )


def test_total_too_small_for_world_size_names_key() -> None:
    with pytest.raises(ValueError, match=r"cpu_bytes_to_use.*at least 400"):
        resolve_budget({"cpu_bytes_to_use": 300}, world_size=4, bytes_per_block=100)


@pytest.mark.parametrize("alignment", [3, 6, 100, 0, -4])
def test_alignment_must_be_a_power_of_two(alignment: int) -> None:
    with pytest.raises(ValueError, match="alignment"):
        resolve_budget(
            {"cpu_bytes_to_use": 10**6}, world_size=1, bytes_per_block=10, alignment=alignment
        )


@pytest.mark.parametrize("world_size", [0, -1, 1.5, "2"])
def test_bad_world_size_is_named(world_size: object) -> None:
    with pytest.raises(ValueError, match="world_size"):
        resolve_budget(
            {"cpu_bytes_to_use": 10**6},
            world_size=world_size,  # type: ignore[arg-type]
            bytes_per_block=10,
        )


def test_describe_mentions_key_and_counts() -> None:
    budget = resolve_budget({"cpu_bytes_to_use": 8000}, world_size=2, bytes_per_block=1000)
    text = budget.describe()
    assert "4000 bytes per rank" in text and "cpu_bytes_to_use" in text and "4 host blocks" in text
