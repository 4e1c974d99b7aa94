"""vLLM's cache policies behind kvtier's host tier: the policies vLLM's
``CachePolicyFactory`` knows by name, and vLLM's convention for an out-of-tree one
(``eviction_policy`` names the class, ``cache_policy_module_path`` the module).

kvtier's own policies (``lru``, ``arc``, ``frecency``, or a class given as
``"package.module:Class"``) need nothing from here. A vLLM ``CachePolicy`` orders keys
as kvtier's do but keeps each key's chunk status beside it; :class:`VllmPolicyAdapter`
gives it the calls kvtier's pool makes. Pins stay the pool's: the policy sees every
cached key as evictable, and eviction skips the keys the pool refuses.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

from kvtier.blockpool.policies import POLICIES
from kvtier.tiering_spec.errors import ConfigError
from kvtier.vllm_port.port import current as current_port

KVTIER_POLICIES = tuple(POLICIES)  # kvtier's own policies, by name

PolicyFactory = Callable[[int], Any]
"""Builds a policy for a capacity in chunks."""


def _vllm_policy_api() -> tuple[type, Any] | None:
    """vLLM's ``CachePolicy`` base and ``CachePolicyFactory``; None on releases without them."""
    try:
        port = current_port()
    except RuntimeError:  # no vLLM here: only kvtier's own policies
        return None
    return port.cache_policy_api()


class _Refused:
    """What vLLM's ``evict`` takes as its protected set: the keys kvtier's pool refuses."""

    __slots__ = ("_evictable",)

    def __init__(self, evictable: Callable[[Hashable], bool]) -> None:
        self._evictable = evictable

    def __contains__(self, key: object) -> bool:
        return not self._evictable(key)  # type: ignore[arg-type]


class VllmPolicyAdapter:
    """A vLLM ``CachePolicy`` as a kvtier eviction policy.

    Args:
        policy: the vLLM policy, built for the pool's capacity.
    """

    def __init__(self, policy: Any) -> None:
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

        self.policy = policy
        self.name = type(policy).__name__
        self._status = ChunkStatus
        # kvtier's pool calls carry no request: one context stands for all of them.
        self._context = ReqContext(req_id="kvtier")

    def insert(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            status = self._status(0)
            status.ref_cnt = 0  # evictable as far as the policy knows; the pool pins
            self.policy.insert(key, status)

    def touch(self, keys: Sequence[Hashable]) -> None:
        known = [k for k in keys if self.policy.get(k) is not None]
        if known:
            self.policy.touch(known, self._context)

    def touch_prefix(self, keys: Sequence[Hashable], reused: Collection[Hashable]) -> None:
        known = [k for k in keys if self.policy.get(k) is not None]
        if known:
            hits = {k for k in known if k in reused}
            stored = {k for k in known if k not in hits}
            self.policy.on_request_finished([known], stored, hits, self._context)

    def remove(self, key: Hashable) -> None:
        self.policy.remove(key)

    def evict(self, n: int, evictable: Callable[[Hashable], bool]) -> list[Hashable] | None:
        if n <= 0:
            return []
        chosen = self.policy.evict(n, _Refused(evictable))
        return None if chosen is None else [key for key, _ in chosen]


def _adapted(cls: type) -> PolicyFactory:
    return lambda capacity: VllmPolicyAdapter(cls(capacity))


def resolve_vllm_policy(name: str, module_path: str | None) -> PolicyFactory | None:
    """The factory of the vLLM policy a configuration names, or None when it names one
    of kvtier's (which ``kvtier.blockpool.make_policy`` builds).

    * ``cache_policy_module_path="package.module"`` (no ``:``) naming a module that has
      a class ``eviction_policy``: that class (vLLM's convention);
    * a ``"package.module:Class"`` that is a vLLM ``CachePolicy``: that class;
    * no module path, and ``eviction_policy`` not one of kvtier's: a policy registered
      with vLLM's ``CachePolicyFactory`` under that name.

    Raises ``ConfigError`` naming the key and what is allowed.
    """
    if not module_path and name in KVTIER_POLICIES:
        return None
    api = _vllm_policy_api()
    base = api[0] if api is not None else None
    if module_path:
        cls: Any = None
        if ":" not in module_path:
            try:
                module = importlib.import_module(module_path)
            except ImportError:
                module = None  # "package.module.Class", kvtier's other spelling
            if module is not None:
                cls = getattr(module, str(name), None)
                if not isinstance(cls, type):
                    raise ConfigError(
                        f"cache_policy_module_path={module_path!r} is a module without a "
                        f"class eviction_policy={name!r}: name the class in eviction_policy "
                        "(vLLM's convention) or give 'package.module:Class'"
                    )
        else:
            mod_name, _, attr = module_path.partition(":")
            try:
                cls = getattr(importlib.import_module(mod_name), attr, None)
            except ImportError:
                cls = None  # make_policy names the failure
        if isinstance(cls, type) and base is not None and issubclass(cls, base):
            return _adapted(cls)
        if isinstance(cls, type):
            return lambda capacity: cls(capacity)
        return None
    if api is not None:
        try:
            return _adapted(api[1].get_cache_policy_cls(str(name)))
        except (ValueError, ImportError, AttributeError):
            pass
    raise ConfigError(
        f"eviction_policy must be one of {', '.join(KVTIER_POLICIES)}, a policy registered "
        "with vLLM's CachePolicyFactory, or a class named with cache_policy_module_path, "
        f"got {name!r}"
    )
