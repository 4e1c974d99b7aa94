"""What an eviction policy of the host block pool is: the ``EvictionPolicy`` protocol
the pool calls, the key type, and ``finish_request``, which hands a finished request's
keys to a policy.

A policy only orders keys; the pool owns blocks, holds and states. The pool tells
the policy when keys enter the cache (``insert``), are used again (``touch``) or
leave it other than by eviction (``remove``), and asks it for victims with
``evict``, passing a predicate that says whether a key may go now (held and
unfinished blocks may not). A policy must not evict a key the predicate refuses.

When a request finishes, the pool passes all of its keys, head first, to the
policy's optional ``touch_prefix`` (a policy without one gets ``touch``): the keys
it stored as well as those it reused, so that its prefix's tail goes first.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Protocol, runtime_checkable

Key = Hashable

NO_KEY = object()  # a sentinel no key equals: what ``next`` or ``pop`` return for none


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the pool needs from an eviction policy.

    Methods take whole batches so that a call costs one Python call, not one per key.
    """

    def insert(self, keys: Sequence[Key]) -> None:
        """``keys`` were added to the cache, in this order (the last is the newest).
        Each is listed once and is not in the policy already (the pool makes sure)."""

    def touch(self, keys: Sequence[Key]) -> None:
        """``keys`` were used again. The *first* key ends up the most recently used
        (a prefix's head is shared by the most requests). Unknown keys are ignored."""

    def remove(self, key: Key) -> None:
        """``key`` left the cache other than by ``evict`` (a failed store, a clear)."""

    # Optional (the pool calls ``touch(keys)`` on policies without it):
    #
    # def touch_prefix(self, keys: Sequence[Key], reused: Collection[Key]) -> None:
    #     """A request finished with ``keys``, its keys in prefix order (head first):
    #     the head ends up the most recently used, the tail the least. Only the keys
    #     in ``reused`` were used again; the others the request stored, which is not
    #     a second use. Unknown keys are ignored."""

    def evict(self, n: int, evictable: Callable[[Key], bool]) -> list[Key] | None:
        """Choose and forget ``n`` keys for which ``evictable`` is true.

        Returns the keys in eviction order, or ``None`` (forgetting nothing) when
        fewer than ``n`` keys may be evicted.
        """


def finish_request(policy: EvictionPolicy, keys: Sequence[Key], reused: Collection[Key]) -> None:
    """Tell ``policy`` a request finished with ``keys`` (head first), having reused the
    keys in ``reused``: its ``touch_prefix`` where it has one, else ``touch``."""
    touch_prefix = getattr(policy, "touch_prefix", None)
    if touch_prefix is None:
        policy.touch(keys)
    else:
        touch_prefix(keys, reused)
