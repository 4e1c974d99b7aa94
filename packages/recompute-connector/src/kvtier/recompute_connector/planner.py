"""The copies' block maps: which host block each device block of a preempted request
becomes, and which device blocks a restore writes from which host blocks.

The preemption planner: :func:`plan_slots` decides what each of a preempted request's
blocks becomes on host (one :class:`~.state_types.Slot` per KV cache group and block
position: nothing, a private block, another request's shared block, or a new shared
block), or why the request falls back; :func:`take_host_blocks` then takes the host
blocks that plan needs from the pool at once. On resumption, :func:`covers` says whether
every block a restore reads was kept (:func:`state_unrestorable` for a recurrent
state), :func:`uncounted_state_blocks` what vLLM allocates for it beyond what it counts,
and :func:`map_load` pairs the request's new device blocks with its host blocks.

The scheduler (:mod:`.state`) calls these with its own pool, groups and shared entries;
nothing here logs or keeps state of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvtier.blockpool import HostBlockPool
from kvtier.recompute_connector.state_types import (
    Fallback,
    KVGroup,
    RunningRequest,
    SharedBlock,
    Slot,
    SlotKind,
    ceil_div,
)

SharedEntries = dict[tuple[int, bytes], SharedBlock]


def plan_slots(
    groups: Sequence[KVGroup],
    run: RunningRequest,
    block_hashes: Sequence[Sequence[bytes]] | None,
    valid: int,
    *,
    shared: SharedEntries,
    share_prefix: bool,
    null_block_id: int,
) -> list[list[Slot]] | tuple[Fallback, str]:
    """What each of the request's blocks becomes on host, per group and position
    (blocks holding KV only: speculative lookahead blocks hold none), or why the
    request falls back. Only blocks whose KV is valid (``valid`` tokens) are shared,
    and only with ``share_prefix``; ``shared`` holds the entries already on host."""
    slots: list[list[Slot]] = []
    new_keys: set[tuple[int, bytes]] = set()
    for g, (group, blocks) in enumerate(zip(groups, run.block_ids)):
        n = min(ceil_div(run.kv_tokens, group.block_size), len(blocks))
        if group.state:
            # The state after the last computed token lives in its block alone.
            last = blocks[n - 1] if n == ceil_div(run.kv_tokens, group.block_size) else None
            if last is None or last == null_block_id:
                return Fallback.STATE_POSITION, "its recurrent state block is gone"
            slots.append([Slot.null()] * (n - 1) + [Slot(SlotKind.PRIVATE, last)])
            continue
        hashes = block_hashes[g] if share_prefix and block_hashes else ()
        row: list[Slot] = []
        for i, b in enumerate(blocks[:n]):
            if b == null_block_id:
                row.append(Slot.null())
                continue
            key = (g, bytes(hashes[i])) if i < len(hashes) else None
            if key is None or (i + 1) * group.block_size > valid or key in new_keys:
                # Unshareable, not valid KV yet, or the same hash twice in one request.
                row.append(Slot(SlotKind.PRIVATE, b))
            elif key in shared and not shared[key].failed:
                row.append(Slot(SlotKind.SHARED, b, key, shared[key]))
            else:
                new_keys.add(key)
                row.append(Slot(SlotKind.NEW, b, key))
        slots.append(row)
    return slots


def blocks_needed(planned: list[list[Slot]]) -> int:
    """Host blocks ``planned`` takes from the pool (private and new shared ones)."""
    return sum(s.kind in (SlotKind.PRIVATE, SlotKind.NEW) for row in planned for s in row)


def take_host_blocks(
    pool: HostBlockPool,
    planned: list[list[Slot]],
    owner: int,
    shared: SharedEntries,
    shared_ids: Iterator[int],
) -> tuple[list[int], list[int], list[SharedBlock], list[list[int | None]]]:
    """Allocate the host blocks ``planned`` needs (the caller checked there is room):
    private ones owned by the store job ``owner``, a shared entry per new key (added to
    ``shared``, its owner numbered from ``shared_ids``).

    Returns the device and host blocks to copy (in step), the shared entries the
    request holds (a reference each), and the host block of each slot per group."""
    n_private = sum(s.kind is SlotKind.PRIVATE for row in planned for s in row)
    private = iter(pool.allocate_owned(owner, n_private, evict=False) or [])
    device: list[int] = []
    host: list[int] = []
    entries: list[SharedBlock] = []
    host_layout: list[list[int | None]] = []
    for row in planned:
        hosts: list[int | None] = []
        for slot in row:
            if slot.kind is SlotKind.NULL:
                hosts.append(None)
                continue
            if slot.kind is SlotKind.PRIVATE:
                h = next(private)
                device.append(slot.device)
                host.append(h)
                hosts.append(h)
                continue
            if slot.kind is SlotKind.NEW:
                assert slot.key is not None
                entry_owner = ("shared", next(shared_ids))
                (block,) = pool.allocate_owned(entry_owner, 1, evict=False) or [-1]
                entry = SharedBlock(slot.key, entry_owner, block, writer=owner)
                shared[slot.key] = entry
                device.append(slot.device)
                host.append(block)
            else:
                assert slot.entry is not None
                entry = slot.entry
            entry.refs += 1
            entries.append(entry)
            hosts.append(entry.host)
        host_layout.append(hosts)
    return device, host, entries, host_layout


def covers(
    groups: Sequence[KVGroup], host_blocks: Sequence[list[int | None]], start: int, end: int
) -> bool:
    """Whether every block a resume at ``end`` tokens reads beyond ``start`` is kept
    (``host_blocks``: per group and block position, the host block or ``None``)."""
    for group, hosts in zip(groups, host_blocks):
        bs = group.block_size
        if group.state:
            last = (end - 1) // bs
            if last >= len(hosts) or hosts[last] is None:
                return False
            continue
        first = start // bs
        if group.sliding_window:
            # One token of margin below the window: never claim a block vLLM keeps.
            first = max(first, max(0, end - group.sliding_window) // bs)
        last = ceil_div(end, bs)
        if last > len(hosts) or any(h is None for h in hosts[first:last]):
            return False
    return True


def state_unrestorable(tokens: int, kept: int) -> str:
    """Why a recurrent state kept at ``kept`` tokens cannot resume a request at
    ``tokens`` tokens, or "" when it can."""
    if tokens != kept:
        # A recurrent state is the state after all its tokens: no prefix of it exists.
        return "its recurrent state is past the tokens it resumes with"
    return ""


def uncounted_state_blocks(groups: Sequence[KVGroup], tokens: int, num_tokens: int) -> int:
    """Device blocks that vLLM (0.32, ``mamba_cache_mode="align"``) allocates without
    counting them first when a request of ``num_tokens`` tokens resumes with
    ``tokens`` restored: one per state group whose remaining tokens reach past the
    block of the restored state (it allocates that block and the block of the
    step's last token, but counts one)."""
    extra = 0
    for group in groups:
        room = group.block_size - tokens % group.block_size
        if group.state and (room == group.block_size or num_tokens - tokens > room):
            extra += 1
    return extra


@dataclass
class LoadMap:
    """A restore's copies: ``device[i]`` is written from ``host[i]``.

    Attributes:
        state_hosts: the host blocks holding a recurrent state (each copied into every
            device block vLLM may read the state from).
        unrestorable_blocks: device blocks whose KV was not kept (vLLM recomputes them).
        unrestorable: some KV the restore claims was not kept.
    """

    device: list[int] = field(default_factory=list)
    host: list[int] = field(default_factory=list)
    state_hosts: list[int] = field(default_factory=list)
    unrestorable_blocks: list[int] = field(default_factory=list)
    unrestorable: bool = False


def map_load(
    groups: Sequence[KVGroup],
    block_ids: Sequence[Sequence[int]],
    host_blocks: Sequence[list[int | None]],
    local_tokens: int,
    end: int,
    null_block_id: int,
) -> LoadMap:
    """The copies of a restore up to ``end`` tokens after a ``local_tokens`` prefix-cache
    hit, onto ``block_ids`` (per group, the request's whole table as vLLM allocated
    it), from ``host_blocks`` (per group and position, as stored)."""
    out = LoadMap()
    for group, blocks, hosts in zip(groups, block_ids, host_blocks):
        bs = group.block_size
        if group.state:
            # vLLM reads the state from the block of token end - 1, and may copy it
            # into the block of this step's last token before the load has run:
            # every allocated block from there on gets the state.
            first = (end - 1) // bs
            h = hosts[first] if first < len(hosts) else None
            targets = [b for b in blocks[first:] if b != null_block_id]
            if h is None or not targets or blocks[first] == null_block_id:
                out.unrestorable_blocks.extend(targets)
                out.unrestorable = True
                continue
            out.device.extend(targets)
            out.host.extend([h] * len(targets))
            out.state_hosts.append(h)
            continue
        # Clip to what is allocated (the load never writes lookahead blocks).
        stop = min(ceil_div(end, bs), len(blocks))
        for i in range(local_tokens // bs, stop):
            dev = blocks[i]
            if dev == null_block_id:
                continue  # outside the window now: nothing to restore there
            h = hosts[i] if i < len(hosts) else None
            if h is None:
                out.unrestorable_blocks.append(dev)
                out.unrestorable = True
                continue
            out.device.append(dev)
            out.host.append(h)
    return out


__all__ = [
    "LoadMap",
    "blocks_needed",
    "covers",
    "map_load",
    "plan_slots",
    "state_unrestorable",
    "take_host_blocks",
    "uncounted_state_blocks",
]
