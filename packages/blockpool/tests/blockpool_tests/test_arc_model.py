"""Every ARC that ships against a model of ARC, step by step.

The model keeps T1, T2, B1 and B2 as ordered dicts and does each operation the
obvious way (eviction copies the lists and picks victims one at a time). After
every step the policy and the model must agree on the lists' contents and order,
the ghost lists and the target ``p``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvtier.blockpool import ARCPolicy

KEY = st.integers(0, 15)

# Every ARC implementation that ships; each must behave as the model.
ARC_VARIANTS: list[type[ARCPolicy]] = [ARCPolicy]


class ModelARC:
    """ARC as documented by ``ARCPolicy``, with ordered dicts (oldest first)."""

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0.0
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            if key in self.b1:
                self.p = min(float(self.c), self.p + max(1.0, len(self.b2) / len(self.b1)))
                del self.b1[key]
                self.t2[key] = None
            elif key in self.b2:
                self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
                del self.b2[key]
                self.t2[key] = None
            else:
                self.t1[key] = None
        self.trim()

    def touch(self, keys: Sequence[Hashable]) -> None:
        for key in reversed(keys):
            if key in self.t1:
                del self.t1[key]
                self.t2[key] = None
            elif key in self.t2:
                self.t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]

    def evict(self, n: int, ok: Callable[[Hashable], bool]) -> list[Hashable] | None:
        free1: Iterator[Hashable] = (k for k in list(self.t1) if ok(k))
        free2: Iterator[Hashable] = (k for k in list(self.t2) if ok(k))
        head1, head2 = next(free1, None), next(free2, None)
        from1: list[Hashable] = []
        from2: list[Hashable] = []
        victims: list[Hashable] = []  # in the order chosen
        while len(victims) < n:
            if head1 is None and head2 is None:
                return None
            if head2 is None or (head1 is not None and len(self.t1) - len(from1) > self.p):
                from1.append(head1)
                victims.append(head1)
                head1 = next(free1, None)
            else:
                from2.append(head2)
                victims.append(head2)
                head2 = next(free2, None)
        for key in from1:
            del self.t1[key]
            self.b1[key] = None
        for key in from2:
            del self.t2[key]
            self.b2[key] = None
        self.trim()
        return victims

    def trim(self) -> None:
        while self.b1 and len(self.t1) + len(self.b1) > self.c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b2.popitem(last=False)


class ARCAgainstModel(RuleBasedStateMachine):
    variant: type[ARCPolicy] = ARCPolicy

    @initialize(capacity=st.integers(1, 10))
    def setup(self, capacity: int) -> None:
        self.arc = self.variant(capacity)
        self.model = ModelARC(capacity)
        self.refused: set[int] = set()  # keys the eviction predicate refuses (pinned)

    def _cached(self) -> list[Hashable]:
        return [*self.model.t1, *self.model.t2]

    @rule(keys=st.lists(KEY, min_size=1, max_size=6, unique=True))
    def insert(self, keys: list[int]) -> None:
        new = [k for k in keys if k not in self.model.t1 and k not in self.model.t2]
        if new:
            self.arc.insert(new)
            self.model.insert(new)

    @rule(keys=st.lists(KEY, min_size=1, max_size=8))  # repeats and unknown keys included
    def touch(self, keys: list[int]) -> None:
        self.arc.touch(keys)
        self.model.touch(keys)

    @precondition(lambda self: self.model.t1 or self.model.t2)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._cached()))
        self.arc.remove(key)
        self.model.remove(key)

    @rule(keys=st.sets(KEY, max_size=4))
    def pin(self, keys: set[int]) -> None:
        self.refused = keys

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        refused = self.refused

        def ok(key: Hashable) -> bool:
            return key not in refused

        assert self.arc.evict(n, ok) == self.model.evict(n, ok)

    @invariant()
    def same_lists(self) -> None:
        arc, model = self.arc, self.model
        assert list(arc.t1) == list(model.t1), "T1 contents or order differ"
        assert list(arc.t2) == list(model.t2), "T2 contents or order differ"
        assert list(arc.b1) == list(model.b1)
        assert list(arc.b2) == list(model.b2)
        assert arc.p == model.p


@pytest.mark.parametrize("variant", ARC_VARIANTS, ids=lambda cls: cls.__name__)
def test_arc_policy_matches_model(variant: type[ARCPolicy]) -> None:
    machine = type(f"{variant.__name__}AgainstModel", (ARCAgainstModel,), {"variant": variant})
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=150, stateful_step_count=60, deadline=None),
    )
