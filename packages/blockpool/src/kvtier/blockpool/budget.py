"""Host-memory budget arithmetic.

Every figure here is in bytes unless the name says blocks. The rules:

* ``cpu_bytes_to_use_per_rank`` wins when given;
* otherwise ``cpu_bytes_to_use`` is the total for all ranks, divided by the world size;
* a host block holds ``bytes_per_block`` bytes rounded up to ``alignment``;
* the block count is the per-rank budget divided by the aligned block size, rounded
  down, with no power-of-two rounding of anything.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("kvtier.blockpool")

PER_RANK_KEY = "cpu_bytes_to_use_per_rank"
TOTAL_KEY = "cpu_bytes_to_use"


def require_positive_int(key: str, value: Any, *, allow_zero: bool = False) -> int:
    """Return ``value`` as an int or raise a ``ValueError`` that names ``key``.

    Accepts ints and integral floats (``8e9``, as JSON and YAML like to write big
    numbers). Rejects bools, strings, fractions, negatives and (unless ``allow_zero``) 0.
    """
    what = "a non-negative integer" if allow_zero else "a positive integer"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be {what}, got {value!r} ({type(value).__name__})")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{key} must be {what}, got {value!r} (not a whole number)")
        value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{key} must be {what}, got {value!r}")
    return int(value)


def require_bool(key: str, value: Any) -> bool:
    """Return ``value`` if it is a bool, else raise a ``ValueError`` that names ``key``.

    A string is refused even when it reads "false": ``bool("false")`` is True, so a
    configuration that quotes its booleans would silently mean the opposite.
    """
    if isinstance(value, bool):
        return value
    raise ValueError(
        f"{key} must be a JSON boolean, true or false (not a string), "
        f"got {value!r} ({type(value).__name__})"
    )


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class HostBudget:
    """A rank's resolved host budget.

    Attributes:
        bytes_per_rank: bytes this rank may use for host blocks.
        source_key: the configuration key the budget came from.
        world_size: ranks sharing the total budget.
        block_bytes: bytes of one host block after alignment padding.
        payload_bytes_per_block: bytes of KV in one host block (before padding).
        num_blocks: host blocks this rank gets (floor of bytes_per_rank / block_bytes).
    """

    bytes_per_rank: int
    source_key: str
    world_size: int
    block_bytes: int
    payload_bytes_per_block: int
    num_blocks: int

    @property
    def region_bytes(self) -> int:
        """Bytes of the host region: exactly ``num_blocks * block_bytes``."""
        return self.num_blocks * self.block_bytes

    def describe(self) -> str:
        return (
            f"{self.bytes_per_rank} bytes per rank (from {self.source_key}, world size "
            f"{self.world_size}) -> {self.num_blocks} host blocks of {self.block_bytes} bytes "
            f"({self.region_bytes} bytes allocated)"
        )


def resolve_bytes_per_rank(
    config: Mapping[str, Any], world_size: int, *, default_total: int | None = None
) -> tuple[int, str]:
    """Bytes per rank and the key they came from.

    Raises ``ValueError`` naming the key when neither key is usable.
    """
    world_size = require_positive_int("world_size", world_size)
    if config.get(PER_RANK_KEY) is not None:
        return require_positive_int(PER_RANK_KEY, config[PER_RANK_KEY]), PER_RANK_KEY
    total = config.get(TOTAL_KEY)
    if total is None:
        if default_total is None:
            raise ValueError(
                f"{TOTAL_KEY} (total bytes for all ranks) or {PER_RANK_KEY} must be set in "
                "kv_connector_extra_config, as a positive integer number of bytes"
            )
        total = default_total
    total = require_positive_int(TOTAL_KEY, total)
    per_rank = total // world_size
    if per_rank == 0:
        raise ValueError(
            f"{TOTAL_KEY}={total} divided by world size {world_size} leaves 0 bytes per rank; "
            f"it must be at least the world size"
        )
    return per_rank, TOTAL_KEY


def resolve_budget(
    config: Mapping[str, Any],
    *,
    world_size: int,
    bytes_per_block: int,
    alignment: int = 1,
    default_total: int | None = None,
) -> HostBudget:
    """Resolve a rank's host budget into a block count.

    Args:
        config: mapping with ``cpu_bytes_to_use_per_rank`` and/or ``cpu_bytes_to_use`` (bytes).
        world_size: ranks that share ``cpu_bytes_to_use``.
        bytes_per_block: KV bytes one host block must hold (all layers of one block).
        alignment: host block size is rounded up to this many bytes; a power of two.
        default_total: total bytes to use when neither key is set; ``None`` makes it required.
    """
    bytes_per_block = require_positive_int("bytes_per_block", bytes_per_block)
    alignment = require_positive_int("alignment", alignment)
    if alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two (1, 2, 4, ...), got {alignment}")
    per_rank, key = resolve_bytes_per_rank(config, world_size, default_total=default_total)
    block_bytes = round_up(bytes_per_block, alignment)
    num_blocks = per_rank // block_bytes
    if num_blocks == 0:
        minimum = block_bytes * world_size if key == TOTAL_KEY else block_bytes
        raise ValueError(
            f"{key}: {per_rank} bytes per rank is smaller than one host block "
            f"({block_bytes} bytes); it must be at least {minimum} bytes"
        )
    return HostBudget(
        bytes_per_rank=per_rank,
        source_key=key,
        world_size=world_size,
        block_bytes=block_bytes,
        payload_bytes_per_block=bytes_per_block,
        num_blocks=num_blocks,
    )
