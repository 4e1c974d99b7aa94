"""The host tier's size: chunk bytes, how many copies, how many chunks the budget buys,
and the tokens that holds. No vLLM import."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.blockpool import resolve_budget, round_up
from kvtier.tiering_spec.config import OffloadConfig
from kvtier.tiering_spec.errors import ConfigError
from kvtier.tiering_spec.offload_facts import OffloadFacts
from kvtier.tiering_spec.tiers.fs.format import ALIGNMENT


@dataclass(frozen=True)
class Sizing:
    """The host tier's shape.

    Attributes:
        replicated_layout: one copy serves every rank (rank 0 stores it).
        num_copies: copies of each chunk the host tier keeps (one per rank, or one).
        sub_block_bytes: bytes of one device block in a chunk (padded to 4096 where the
            chunk would not be a multiple of it otherwise).
        chunk_bytes: bytes of one chunk in one copy.
        kv_bytes_per_chunk: a chunk's bytes in every copy (vLLM's name; 0: unknown).
        cpu_page_size_per_worker: a chunk's bytes in one worker's copy (vLLM's name).
        num_chunks: chunks the budget buys (0 while the KV bytes are unknown).
        budget_description: how the budget was read, for the start-up log.
    """

    replicated_layout: bool
    num_copies: int
    sub_block_bytes: int
    chunk_bytes: int
    kv_bytes_per_chunk: int
    cpu_page_size_per_worker: int
    num_chunks: int
    budget_description: str


def size_host_tier(facts: OffloadFacts, settings: OffloadConfig, *, replicated: bool) -> Sizing:
    """Size the host tier: ``replicated`` says one copy serves every rank. Raises
    ``ConfigError`` for a budget that buys no chunk."""
    world_size = max(1, facts.world_size)
    num_copies = 1 if replicated else world_size
    bpc = int(facts.blocks_per_chunk)
    wkb = int(facts.worker_kv_bytes_per_block)
    # A chunk is bpc sub-blocks of equal size, a multiple of 4096 bytes in all, so
    # O_DIRECT reads and writes it in place. KV pages are 4096-multiples in practice.
    sub_block_bytes = wkb if (bpc * wkb) % ALIGNMENT == 0 else round_up(max(wkb, 1), ALIGNMENT)
    chunk_bytes = bpc * sub_block_bytes
    num_chunks = 0
    if wkb > 0:
        try:
            # One copy gets the whole of cpu_bytes_to_use (as vLLM's spec gives it), or
            # cpu_bytes_to_use_per_rank: what each rank maps.
            budget = resolve_budget(
                settings.budget,
                world_size=num_copies,
                bytes_per_block=chunk_bytes,
                alignment=ALIGNMENT,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        num_chunks = budget.num_blocks
        description = budget.describe()
        if replicated:
            description += (
                f"; one copy for all {world_size} ranks (vLLM reports the KV "
                "replicated across them), stored by rank 0"
            )
    else:
        description = "no KV bytes per block known yet"
    return Sizing(
        replicated_layout=replicated,
        num_copies=num_copies,
        sub_block_bytes=sub_block_bytes,
        chunk_bytes=chunk_bytes,
        kv_bytes_per_chunk=chunk_bytes * num_copies if wkb > 0 else 0,
        cpu_page_size_per_worker=chunk_bytes if wkb > 0 else 0,
        num_chunks=num_chunks,
        budget_description=description,
    )


def size_in_tokens(facts: OffloadFacts, num_chunks: int) -> int | str:
    """Tokens ``num_chunks`` host chunks hold for requests of the model's longest
    length, each KV cache group taking its chunks (a sliding-window group at most its
    window's): vLLM's reckoning. "None" where the length or the groups are unknown."""
    max_len = facts.max_model_len
    if max_len <= 0 or not facts.groups:
        return "None"
    per_request = 0
    for group in facts.groups:
        chunks = -(-max_len // (int(group.tokens_per_block) * int(facts.blocks_per_chunk)))
        if group.sliding_window_chunks is not None:
            chunks = min(chunks, int(group.sliding_window_chunks))
        per_request += chunks
    return num_chunks * max_len // per_request if per_request else "None"
