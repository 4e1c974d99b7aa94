"""Thin classes with the constructors vLLM's tests call, building kvtier's objects, and
views that show kvtier's state under the names of vLLM's classes that the tests read.

vLLM's manager tests read its ``CPUOffloadingManager``'s private attributes (``_policy``
and its ``t1``/``t2``/``b1``/``b2`` lists, ``target_t1_size``, a chunk's ``ref_cnt``;
``counts``; ``_num_evictable_cache_chunks``). kvtier's manager keeps that state in
kvtier-blockpool's ``HostBlockPool`` (its policy's lists, its load pins, its admission
filter's counts). The views below read and write that state itself, never a copy: the
policy view *is* the pool's policy (it forwards the pool's calls to kvtier's
``ARCPolicy`` or ``LRUPolicy``), so a test that counts, spies on or replaces what the
policy does sees what kvtier's pool does. Only what kvtier has is shown: vLLM's
per-request policy hooks (``on_request_finished``, ``on_store_miss``) and the manager's
private helpers are absent, and the tests that reach for them are deviations.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from typing import Any

from kvtier.blockpool import HostBlockPool
from kvtier.blockpool.policies import ARCPolicy, LRUPolicy
from kvtier.tiering_spec import vllm_compat as compat
from kvtier.tiering_spec.build import SchedulerSide, build
from kvtier.tiering_spec.config import parse_config
from kvtier.tiering_spec.manager import TierManager
from kvtier.tiering_spec.offload_facts import OffloadFacts
from kvtier.tiering_spec.vllm_manager import KvtierOffloadingManager
from kvtier.tiering_spec.vllm_policy import VllmPolicyAdapter


def _vllm_policy_classes() -> dict[str, type]:
    """vLLM's policy classes by kvtier's policy name (what the tests' ``isinstance``
    asks); empty where vLLM has none."""
    try:
        from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
        from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy
    except ImportError:
        return {}
    return {"arc": ARCCachePolicy, "lru": LRUCachePolicy}


class _Status:
    """A key's entry as vLLM's ``ChunkStatus`` shows it, read from kvtier's pool:
    ``ref_cnt`` is -1 while the key is being stored, else the loads pinning it (setting
    it pins or unpins the key with the pool's own ``prepare_load``/``complete_load``)."""

    __slots__ = ("_key", "_pool")

    def __init__(self, pool: HostBlockPool, key: Hashable) -> None:
        self._pool = pool
        self._key = key

    @property
    def is_ready(self) -> bool:
        return self._pool.contains(self._key)

    @property
    def ref_cnt(self) -> int:
        if self._pool.is_storing(self._key):
            return -1
        return self._pool.pins(self._key)

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        pool, key = self._pool, self._key
        while pool.pins(key) < value:
            pool.prepare_load([key])
        while pool.pins(key) > max(value, 0):
            pool.complete_load([key])

    def __repr__(self) -> str:
        return f"_Status({self._key!r}, ref_cnt={self.ref_cnt})"


class _Listing(Mapping[Hashable, Any]):
    """One of kvtier's policy lists (an ordered dict of keys, oldest first) as vLLM's
    ``OrderedDict[key, ChunkStatus]``: the same dict, its values shown as statuses.
    ``items()`` walks the dict's own ``items()``."""

    def __init__(self, keys: Any, status: Callable[[Hashable], _Status]) -> None:
        self._keys = keys
        self._status = status

    def __getitem__(self, key: Hashable) -> _Status:
        if key not in self._keys:
            raise KeyError(key)
        return self._status(key)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def items(self) -> Any:
        status = self._status
        return ((key, status(key)) for key, _ in self._keys.items())


class _PolicyView:
    """The pool's eviction policy: kvtier's ``inner`` policy, with vLLM's policy
    surface on top (see the module). The pool calls ``evict(n, evictable)``; vLLM's
    tests call ``evict(n, protected)``, which evicts through the pool as the manager
    would (the keys' blocks are freed) and answers ``[(key, status), ...]``."""

    def __init__(self, inner: Any) -> None:
        self.rebind(inner)

    def rebind(self, inner: Any) -> None:
        """Show ``inner`` (a new pool's policy, after a reset) from now on."""
        self.inner = inner
        self.name = inner.name
        self.pool: HostBlockPool | None = None  # set once the pool is built
        self._statuses: dict[Hashable, _Status] = {}

    # -- what kvtier's pool calls ----------------------------------------------------
    def insert(self, keys: Sequence[Hashable]) -> None:
        self.inner.insert(keys)

    def touch(self, keys: Sequence[Hashable]) -> None:
        self.inner.touch(keys)

    def touch_prefix(self, keys: Sequence[Hashable], reused: Collection[Hashable]) -> None:
        self.inner.touch_prefix(keys, reused)

    def remove(self, key: Hashable) -> None:
        self.inner.remove(key)

    def keys_in_eviction_order(self) -> list[Hashable]:
        return list(self.inner.keys_in_eviction_order())

    def evict(self, n: int, which: Any) -> Any:
        if callable(which):  # the pool's call: which keys may go
            return self.inner.evict(n, which)
        assert self.pool is not None
        victims = self.pool.evict(n, keep=which)
        return None if victims is None else [(key, self._status(key)) for key in victims]

    # -- what vLLM's tests read -------------------------------------------------------
    @property
    def cache_capacity(self) -> int:
        assert self.pool is not None
        return self.pool.num_blocks

    def get(self, key: Hashable) -> _Status | None:
        assert self.pool is not None
        known = self.pool.contains(key) or self.pool.is_storing(key)
        return self._status(key) if known else None

    def _status(self, key: Hashable) -> _Status:
        status = self._statuses.get(key)
        if status is None:  # one per key, so that statuses read twice compare equal
            assert self.pool is not None
            status = self._statuses[key] = _Status(self.pool, key)
        return status


class _ARCView(_PolicyView):
    """kvtier's ``ARCPolicy``: its lists, and ``p`` as ``target_t1_size``. A list given
    to a setter becomes kvtier's list itself (its values are ignored)."""

    inner: ARCPolicy

    def _list(name: str) -> property:  # type: ignore[misc]  # (a helper of the class body)
        def get(self: _ARCView) -> _Listing:
            return _Listing(getattr(self.inner, name), self._status)

        def put(self: _ARCView, value: Any) -> None:
            setattr(self.inner, name, value)

        return property(get, put)

    t1 = _list("t1")
    t2 = _list("t2")
    b1 = _list("b1")
    b2 = _list("b2")
    del _list

    @property
    def target_t1_size(self) -> float:
        return self.inner.p

    @target_t1_size.setter
    def target_t1_size(self, value: float) -> None:
        self.inner.p = float(value)


class _LRUView(_PolicyView):
    """kvtier's ``LRUPolicy``: its one ordered dict of keys is what vLLM's lazy heap
    holds (``_heap``), so its size is the policy's memory."""

    inner: LRUPolicy

    @property
    def _heap(self) -> Any:
        return self.inner._order


def _policy_view(name: str, capacity: int) -> _PolicyView | None:
    """A view of kvtier's policy ``name`` that passes for vLLM's class of that name;
    None for other policies (frecency, vLLM's or a module path's)."""
    base = _vllm_policy_classes().get(name)
    if base is None:
        return None
    view_cls, inner_cls = (_ARCView, ARCPolicy) if name == "arc" else (_LRUView, LRUPolicy)
    # A class of both, so that isinstance(view, vLLM's class) holds; vLLM's __init__ is
    # never run, and every attribute read is the view's.
    cls = type(f"kvtier{base.__name__}", (view_cls, base), {"__init__": view_cls.__init__})
    return cls(inner_cls(capacity))  # type: ignore[no-any-return]


# The unit chunk of the host tier the tests size by its number of chunks.
_CHUNK = 4096


class _HostTier:
    """kvtier's host tier of ``num_chunks`` chunks, built by kvtier's composition root
    from the manager arguments vLLM's tests give; for ``lru`` and ``arc``, its pool's
    policy is behind a view of vLLM's surface (the same policy, the same calls)."""

    def __init__(self, num_chunks: int, extra: dict[str, Any], enable_events: bool) -> None:
        if num_chunks < 1:
            # No budget buys no chunk: the pool refuses that capacity itself, with the
            # error vLLM's tests meet (its manager takes a capacity of 0).
            HostBlockPool(num_chunks)
        settings = parse_config({"cpu_bytes_to_use": num_chunks * _CHUNK, **extra}, tiering=False)
        facts = OffloadFacts(
            engine_id="conformance",
            model_name="conformance",
            cache_dtype="auto",
            groups=(),
            blocks_per_chunk=1,
            tokens_per_hash=16,
            worker_kv_bytes_per_block=_CHUNK,
            kv_events=enable_events,
        )
        self.offload = build(facts, settings, tiering=False, name="CPUOffloadingManager")
        assert self.offload.sizing.num_chunks == num_chunks
        self._view: _PolicyView | None = None

    def new_pool(self) -> HostBlockPool:
        """kvtier's pool as its build makes it, its policy behind the view."""
        offload = self.offload
        s = offload.settings
        view = None
        if s.cache_policy_module_path is None:
            view = _policy_view(s.eviction_policy, offload.sizing.num_chunks)
        if view is not None and self._view is not None:
            # A reset: the pool is new, and so is its policy; the view the test holds
            # (vLLM's manager keeps one policy object) shows the new one.
            self._view.rebind(view.inner)
            view = self._view
        self._view = view
        if view is None:
            return offload.new_pool()
        pool = HostBlockPool(
            offload.sizing.num_chunks, policy=view, enable_events=offload.facts.kv_events
        )
        view.pool = pool
        return pool

    def scheduler_side(self) -> SchedulerSide:
        """The manager's side: this host tier alone. No spec sized it for vLLM's info
        metric, so it publishes no sizing (as vLLM's manager built without its spec)."""
        s = self.offload.settings
        core = TierManager(
            self.new_pool(),
            [],
            store_threshold=s.store_threshold,
            max_tracker_size=s.max_tracker_size,
        )
        return SchedulerSide(core, None, self.new_pool, offload=self.offload, info_row={})


class CPUOffloadingManager(KvtierOffloadingManager):
    """kvtier's manager, built from the arguments of vLLM's ``CPUOffloadingManager``."""

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
    ) -> None:
        extra: dict[str, Any] = {
            "eviction_policy": cache_policy,
            "store_threshold": store_threshold,
            "max_tracker_size": max_tracker_size,
        }
        if cache_policy_module_path is not None:
            extra["cache_policy_module_path"] = cache_policy_module_path
        super().__init__(_HostTier(num_chunks, extra, enable_events).scheduler_side())

    @property
    def medium(self) -> Any:
        """vLLM's manager's medium, which kvtier's host-tier events carry: CPU."""
        return compat.PORT.offloading_event([], False).medium

    @property
    def _policy(self) -> Any:
        """The pool's policy: a view of vLLM's surface for ``lru`` and ``arc``; a vLLM
        policy (named, or by module path) is itself, behind kvtier's adapter."""
        policy = self.core.pool.policy
        return policy.policy if isinstance(policy, VllmPolicyAdapter) else policy

    @property
    def _num_evictable_cache_chunks(self) -> int:
        """Cached chunks no load pins: what an eviction may take now."""
        pool = self.core.pool
        return pool.num_cached - pool.num_read_pinned

    @property
    def counts(self) -> Mapping[Hashable, int]:
        """The admission filter's offer counts (empty without one)."""
        admission = self.core.admission
        return {} if admission is None else admission.counts

    @property
    def stores_skipped_in_current_batch(self) -> int:
        """Keys the admission filter left unstored (a running total: the tests compare
        it before and after a call)."""
        admission = self.core.admission
        return 0 if admission is None else admission.stores_skipped
