"""Running requests' device block tables, rebuilt from the scheduler's outputs.

vLLM 0.32 hands a scheduler-side connector its ``KVCacheManager``
(``bind_kv_cache_manager``), which answers a request's blocks. Older releases (0.23)
hand it nothing to ask, but every step's ``SchedulerOutput`` says what changed:

* a new request brings its whole table (``scheduled_new_reqs[].block_ids``);
* a resumed request brings its whole table again (``scheduled_cached_reqs``, its id in
  ``resumed_req_ids``);
* a running request brings the blocks allocated for it in the step, appended per group
  (``scheduled_cached_reqs.new_block_ids``).

That is the whole story for full attention, whose tables only grow. A sliding-window
group also retires blocks: vLLM frees every block wholly before the window of the
request's next token and puts its null block in that position. The mirror retires by
the same rule, from the request's computed tokens *after* the step, which is at least
what vLLM counted when it retired: so it retires every block vLLM freed (a freed block
may hold another request's KV already), and the extra ones it retires are outside the
window of every later token too (the window only moves forward).

Any other kind of group (chunked local attention, state groups) changes its tables in
ways the outputs do not show: such a model's tables are not mirrored.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.recompute_connector.state_types import KVGroup


class BlockTableMirror:
    """Each running request's device blocks (per group), as the scheduler's outputs
    told them."""

    def __init__(self, groups: Sequence[KVGroup], null_block_id: int = 0) -> None:
        self.groups = list(groups)
        self.null_block_id = null_block_id
        self._tables: dict[str, list[list[int]]] = {}
        # Whether every group's table can be rebuilt from the outputs alone.
        self.supported = all(g.supported and not g.state and g.mirrorable for g in groups)

    def replace(self, req_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        """A new or resumed request: its whole table."""
        self._tables[req_id] = [list(b) for b in block_ids]

    def append(self, req_id: str, new_block_ids: Sequence[Sequence[int]] | None) -> bool:
        """A running request's blocks allocated in this step; False if its table is not
        known (it was never seen whole), so what it holds cannot be told."""
        table = self._tables.get(req_id)
        if table is None:
            return False
        for row, new in zip(table, new_block_ids or ()):
            if new:
                row.extend(new)
        return True

    def table(self, req_id: str, kv_tokens: int) -> list[list[int]] | None:
        """The request's blocks once ``kv_tokens`` tokens are computed (its sliding-window
        groups' retired blocks null), or None when it is not known."""
        table = self._tables.get(req_id)
        if table is None:
            return None
        for group, row in zip(self.groups, table):
            if group.sliding_window:
                skipped = max(0, kv_tokens - group.sliding_window + 1) // group.block_size
                for i in range(min(skipped, len(row))):
                    row[i] = self.null_block_id
        return [list(row) for row in table]

    def forget(self, req_id: str) -> None:
        """Preempted (its blocks are freed) or finished."""
        self._tables.pop(req_id, None)
