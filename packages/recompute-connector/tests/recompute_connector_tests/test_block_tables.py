"""Block tables rebuilt from scheduler outputs (vLLM releases without
``bind_kv_cache_manager``), checked against a model of vLLM's own bookkeeping."""

from __future__ import annotations

import random

from kvtier.recompute_connector.block_tables import BlockTableMirror
from kvtier.recompute_connector.state import KVGroup

BS = 4


def test_full_attention_tables_grow_and_resumed_tables_replace() -> None:
    mirror = BlockTableMirror([KVGroup(BS)])
    mirror.replace("a", ([5, 6],))
    assert mirror.append("a", ([7],))
    assert mirror.append("a", None)  # nothing allocated this step
    assert mirror.append("a", ([],))
    assert mirror.table("a", 12) == [[5, 6, 7]]
    assert not mirror.append("b", ([1],)), "a table never seen whole is not guessed"
    assert mirror.table("b", 4) is None
    mirror.forget("a")  # preempted: its blocks are free
    assert mirror.table("a", 12) is None
    mirror.replace("a", ([9, 10, 11],))  # resumed: the whole table again
    assert mirror.table("a", 12) == [[9, 10, 11]]
    assert mirror.supported


def _vllm_sliding_window(window: int, steps: list[int], seed: int) -> None:
    """Drive the mirror beside a model of vLLM's sliding-window manager: at each
    allocation vLLM retires the blocks wholly before the window of the next token
    (counted from the computed tokens before the step), then allocates blocks for the
    step's tokens. Every block vLLM retired must be null in the mirror's table, and every
    block the mirror keeps must be vLLM's."""
    rng = random.Random(seed)
    free = list(range(1, 1000))
    rng.shuffle(free)
    table: list[int] = []
    computed = 0
    mirror = BlockTableMirror([KVGroup(BS, sliding_window=window)])
    first = True
    for n in steps:
        skipped = max(0, computed - window + 1) // BS
        for i in range(min(skipped, len(table))):
            table[i] = 0
        new = [free.pop() for _ in range(-(-(computed + n) // BS) - len(table))]
        table.extend(new)
        if first:
            mirror.replace("r", (list(table),))
            first = False
        else:
            assert mirror.append("r", (new,))
        seen = mirror.table("r", computed + n)
        assert seen is not None
        for ours, theirs in zip(seen[0], table, strict=True):
            assert theirs != 0 or ours == 0, (seen, table)
            assert ours == 0 or ours == theirs
        # What the mirror retires beyond vLLM lies before the next token's window.
        next_window_start = computed + n - window + 1
        for i, ours in enumerate(seen[0]):
            if ours == 0 and table[i] != 0:
                assert (i + 1) * BS <= next_window_start
        computed += n


def test_sliding_window_tables_retire_every_block_vllm_freed() -> None:
    rng = random.Random(7)
    for seed in range(200):
        window = rng.choice([BS, 2 * BS, 3 * BS + 1, 16])
        steps = [rng.choice([1, 1, 1, 3, BS, 2 * BS + 1]) for _ in range(rng.randint(1, 30))]
        _vllm_sliding_window(window, steps, seed)


def test_groups_whose_tables_the_outputs_do_not_show_are_not_mirrored() -> None:
    assert not BlockTableMirror([KVGroup(BS), KVGroup(BS, mirrorable=False)]).supported
    assert not BlockTableMirror([KVGroup(BS, None, True, state=True)]).supported
