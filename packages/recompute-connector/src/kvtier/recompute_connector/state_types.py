"""The records of the scheduler side's state: what it knows of KV cache groups, running
and preempted requests, shared host blocks, and why a request is recomputed.

Plain data, no behaviour beyond a derived property: :mod:`.planner` plans copies from
these records and :mod:`.state`'s :class:`~kvtier.recompute_connector.state.
RecomputeOffloadScheduler` moves them through a preempted request's life.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field


class Fallback(str, enum.Enum):
    """Why a preempted request is recomputed instead of restored."""

    CAPACITY = "capacity"  # host blocks short
    STORE_FAILED = "store_failed"  # a rank's device -> host copy failed
    LOAD_FAILED = "load_failed"  # a rank's host -> device copy failed
    WINDOW_GAP = "window_gap"  # a sliding-window block needed at resume was not stored
    UNSUPPORTED = "unsupported_kv_cache"  # a KV cache group that is not paged attention
    STORE_TIMEOUT = "store_timeout"  # no store report from the workers in time
    STATE_POSITION = "state_position"  # a recurrent state kept past the tokens it resumes at


class Phase(str, enum.Enum):
    STORING = "storing"
    RESTORABLE = "restorable"
    LOADING = "loading"


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group as the connector sees it.

    Attributes:
        block_size: tokens per device block of this group.
        sliding_window: attention window in tokens, or ``None`` for full attention.
        supported: False for groups the connector cannot keep.
        state: the group holds one recurrent state per request (linear attention,
            Mamba), in the block of the request's last computed token, as vLLM's
            ``mamba_cache_mode="align"`` keeps it: only that block is kept, and a
            restore resumes at exactly the token the state was kept at.
        mirrorable: its block tables follow from the scheduler's outputs (full
            attention, sliding window; see ``block_tables``).
    """

    block_size: int
    sliding_window: int | None = None
    supported: bool = True
    state: bool = False
    mirrorable: bool = True


@dataclass(eq=False)
class SharedBlock:
    """One full, hashed block kept once on host for every preempted request holding it.

    Attributes:
        key: (KV cache group, block hash).
        owner: its owner in the host pool (one block each).
        host: the host block.
        refs: preempted requests referencing it.
        writer: the store job writing it, 0 once written.
        ready: its store succeeded on every rank.
        failed: its store failed (never restored from; freed with its last reference).
    """

    key: tuple[int, bytes]
    owner: tuple[str, int]
    host: int
    refs: int = 0
    writer: int = 0
    ready: bool = False
    failed: bool = False


class SlotKind(enum.Enum):
    """What one device block of a preempted request becomes on host."""

    NULL = "null"  # no block at this position (a null block): nothing to keep
    PRIVATE = "private"  # a host block of the request's own store job
    SHARED = "shared"  # an entry already on host (stored for another request)
    NEW = "new"  # a new shared entry this store writes


@dataclass(frozen=True)
class Slot:
    """One position of one KV group in a preempted request's plan."""

    kind: SlotKind
    device: int = -1  # the device block copied (PRIVATE, NEW)
    key: tuple[int, bytes] | None = None  # (group, block hash) of a shared entry
    entry: SharedBlock | None = None  # the entry on host (SHARED)

    @staticmethod
    def null() -> Slot:
        return _NULL_SLOT


_NULL_SLOT = Slot(SlotKind.NULL)


@dataclass
class RunningRequest:
    """What the connector knows of a running request (updated every step it runs)."""

    block_ids: tuple[list[int], ...]
    kv_tokens: int


@dataclass
class PreemptedRequestState:
    """A preempted request whose KV is (being) kept in host blocks.

    Attributes:
        req_id: the request.
        phase: STORING, RESTORABLE or LOADING.
        num_tokens: tokens of KV held (``kv_tokens`` at preemption; may include a
            partial last block).
        host_blocks: per KV cache group, per logical block position, the host block
            holding it, or ``None`` where the device block was a null block.
        job_id: the store or load job in flight.
        ranks_ok / ranks_failed: reports received for the job in flight.
        planned_step: the scheduler steps counted when its store was planned (a
            request stays STORING from then until it leaves that phase for good).
        free_when_done: the request finished while a copy was in flight.
    """

    req_id: str
    phase: Phase
    num_tokens: int
    host_blocks: tuple[list[int | None], ...]
    job_id: int
    owner: int = 0
    pinned: list[int] = field(default_factory=list)
    ranks_ok: int = 0
    ranks_failed: int = 0
    planned_step: int = 0
    free_when_done: bool = False
    load_tokens: int = 0
    timed_out: bool = False
    shared: list[SharedBlock] = field(default_factory=list)
    stored: bool = False

    @property
    def all_host_blocks(self) -> list[int]:
        return [h for group in self.host_blocks for h in group if h is not None]


@dataclass
class SchedulerStats:
    """Counters since the last ``RecomputeOffloadScheduler.take_stats`` (deltas)."""

    preemptions_offloaded: int = 0
    tokens_stored: int = 0
    restores: int = 0
    tokens_restored: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)


def ceil_div(a: int, b: int) -> int:
    """Blocks of ``b`` tokens that ``a`` tokens fill (a partial last one counted)."""
    return -(-a // b)
