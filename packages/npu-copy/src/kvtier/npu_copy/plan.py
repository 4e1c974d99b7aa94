"""Validated block-id lists and their coalesced runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BlockIds = Sequence[int] | torch.Tensor
"""Block ids: a sequence of ints or a 1-D integer tensor (any device)."""


def as_id_list(ids: BlockIds, what: str) -> list[int]:
    """``ids`` as a list of Python ints (no range checks)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"{what} must be a 1-D integer tensor, got {ids.dtype} {ids.shape}")
        return [int(i) for i in ids.tolist()]
    out = list(ids)
    for i in out:
        if not isinstance(i, int) or isinstance(i, bool):
            try:
                out = [int(i.__index__()) for i in out]  # numpy ints and the like
            except (AttributeError, TypeError):
                raise ValueError(f"{what} must be integers, got {type(i).__name__}") from None
            break
    return out


def check_ids(ids: list[int], limit: int, what: str) -> None:
    """Raise ValueError unless every id is in ``[0, limit)``."""
    if ids and (min(ids) < 0 or max(ids) >= limit):
        bad = next(i for i in ids if i < 0 or i >= limit)
        raise ValueError(f"{what} id {bad} is out of range [0, {limit})")


def check_unique(ids: list[int], what: str) -> None:
    """Raise ValueError if a destination block appears twice in one transfer."""
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        dup = next(i for i in ids if i in seen or seen.add(i))  # type: ignore[func-returns-value]
        raise ValueError(f"destination {what} id {dup} appears more than once in one transfer")


@dataclass(frozen=True)
class Run:
    """``length`` consecutive blocks: source ``src..src+length-1`` -> ``dst..``."""

    src: int
    dst: int
    length: int


def coalesce(src: list[int], dst: list[int]) -> list[Run]:
    """Group pairs into runs where both the source and the destination ids are consecutive."""
    runs: list[Run] = []
    if not src:
        return runs
    start_s, start_d, length = src[0], dst[0], 1
    for s, d in zip(src[1:], dst[1:]):
        if s == start_s + length and d == start_d + length:
            length += 1
        else:
            runs.append(Run(start_s, start_d, length))
            start_s, start_d, length = s, d, 1
    runs.append(Run(start_s, start_d, length))
    return runs


def consecutive_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive ids in one list: (position in ``ids``, first id, length)."""
    out: list[tuple[int, int, int]] = []
    if not ids:
        return out
    pos, first, length = 0, ids[0], 1
    for i in range(1, len(ids)):
        if ids[i] == first + length:
            length += 1
        else:
            out.append((pos, first, length))
            pos, first, length = i, ids[i], 1
    out.append((pos, first, length))
    return out
