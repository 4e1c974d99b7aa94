"""What an LRU host tier serves of a trace at every capacity, in one pass (stack distances).

LRU is a stack policy: at any capacity it holds the most recently used blocks, so the
contents at a smaller capacity are always part of those at a larger one, and one pass
over a trace tells, for each block a request looks up, the smallest capacity at which
it is still cached (Mattson et al., 1970). The replay (:mod:`kvtier.tiering_spec.replay`)
counts a request as served the longest cached prefix of its blocks, so a block is
served at capacity ``C`` when it and every block before it in its prompt rank among
the ``C`` most recently used; and when the request finishes, the manager puts all of
its blocks first in recency, its head most recent (what kvtier's manager does at
``on_request_finished``). :func:`depths` gives each prompt block its *serving depth*:
the least capacity that serves it.

This module needs neither torch nor vLLM.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: The serving depth of a block seen for the first time: no capacity serves it.
NEVER = -1


@dataclass(frozen=True)
class Depths:
    """Per prompt block of a trace, in trace order: ``own``, its stack depth when its
    request arrives (the number of distinct blocks used more recently, plus one: the
    least LRU capacity that holds it), and ``served``, its serving depth (the largest
    stack depth of its prompt up to it: a prefix is served only whole). Both are
    :data:`NEVER` for a block not seen before (``served`` also after one)."""

    own: list[int]
    served: list[int]


def depths(requests: Iterable[Sequence[int]]) -> Depths:
    """The stack and serving depths of every prompt block of ``requests`` (see
    :class:`Depths`). A Fenwick tree over use times counts the blocks used after a given
    time in O(log n)."""
    requests = [tuple(r) for r in requests]
    size = sum(len(r) for r in requests) + 1
    tree = [0] * (size + 1)  # Fenwick tree: 1 at each block's latest use time
    last: dict[int, int] = {}  # block -> its latest use time (1-based)
    live = 0  # blocks in the tree
    now = 0
    own: list[int] = []
    served: list[int] = []
    add_own, add_served = own.append, served.append
    for blocks in requests:
        deepest = 0
        for b in blocks:
            t = last.get(b)
            if t is None:
                depth = deepest = NEVER
            else:
                upto = 0  # blocks used at or before t: a prefix sum of the tree
                i = t
                while i:
                    upto += tree[i]
                    i &= i - 1
                depth = live - upto + 1
                if deepest != NEVER and depth > deepest:
                    deepest = depth
            add_own(depth)
            add_served(deepest)
        # The request's blocks become the most recent, its head first.
        for b in reversed(blocks):
            t = last.get(b)
            if t is not None:
                i = t
                while i <= size:
                    tree[i] -= 1
                    i += i & -i
            else:
                live += 1
            now += 1
            last[b] = now
            i = now
            while i <= size:
                tree[i] += 1
                i += i & -i
    return Depths(own, served)


def _at_most(values: Iterable[int], capacities: Sequence[int]) -> list[int]:
    """How many of ``values`` (other than :data:`NEVER`) are at most each capacity."""
    ordered = sorted(d for d in values if d != NEVER)
    return [bisect.bisect_right(ordered, cap) for cap in capacities]


def served_curve(found: Depths, capacities: Sequence[int]) -> list[int]:
    """Blocks an LRU host tier of each of ``capacities`` serves: those whose serving
    depth is at most the capacity."""
    return _at_most(found.served, capacities)


def written_curve(found: Depths, capacities: Sequence[int]) -> list[int]:
    """Blocks an LRU host tier of each of ``capacities`` stores: those it does not hold
    when their request stores them (stack depth past the capacity, or never seen)."""
    held = _at_most(found.own, capacities)
    return [len(found.own) - n for n in held]


def reused_blocks(requests: Iterable[Sequence[int]]) -> int:
    """Distinct blocks used by more than one request: the capacity past which the
    optimum serves nothing more is at most this (LRU may need more: it keeps blocks
    never used again until they age out; see :class:`Depths`)."""
    seen: set[int] = set()
    again: set[int] = set()
    for blocks in requests:
        for b in blocks:
            if b in seen:
                again.add(b)
            else:
                seen.add(b)
    return len(again)
