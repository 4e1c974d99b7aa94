"""Eviction policies by name: the registry (``POLICIES``), ``make_policy``, and the
names the pool and its callers import from here (the protocol, ``finish_request``,
each family's class).

Policies are chosen by name (``lru``, ``arc``, ``frecency``) or loaded from a module
path ``"package.module:ClassName"`` (or ``"package.module.ClassName"``). Each family
lives in a module of its own (``policy_lru``, ``policy_arc``, ``policy_frecency``);
what a policy is, in ``policy_base``.
"""

from __future__ import annotations

import importlib

from kvtier.blockpool.policy_arc import ARCPolicy
from kvtier.blockpool.policy_base import EvictionPolicy, Key, finish_request
from kvtier.blockpool.policy_frecency import FrecencyPolicy
from kvtier.blockpool.policy_lru import LRUPolicy

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "EvictionPolicy",
    "FrecencyPolicy",
    "Key",
    "LRUPolicy",
    "finish_request",
    "make_policy",
]

POLICIES: dict[str, type] = {"lru": LRUPolicy, "arc": ARCPolicy, "frecency": FrecencyPolicy}


def _load_class(path: str) -> type:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"cache_policy_module_path must look like 'package.module:ClassName', got {path!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"cache_policy_module_path={path!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"cache_policy_module_path={path!r}: {attr!r} is not a class")
    return cls


def make_policy(name: str, capacity: int, module_path: str | None = None) -> EvictionPolicy:
    """Build an eviction policy by name, or from ``module_path`` when one is given.

    Raises ``ValueError`` naming ``eviction_policy`` or ``cache_policy_module_path``.
    """
    if module_path:
        cls = _load_class(module_path)
    else:
        if not isinstance(name, str) or name.lower() not in POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {sorted(POLICIES)} "
                f"(or set cache_policy_module_path), got {name!r}"
            )
        cls = POLICIES[name.lower()]
    try:
        policy = cls(capacity)
    except Exception as exc:
        raise ValueError(
            f"cache_policy_module_path={module_path!r}: {cls.__name__}(capacity) failed: {exc}"
        ) from exc
    missing = [
        m for m in ("insert", "touch", "remove", "evict") if not callable(getattr(policy, m, None))
    ]
    if missing:
        raise ValueError(
            f"cache_policy_module_path={module_path!r}: class lacks method(s) {missing}"
        )
    return policy  # type: ignore[no-any-return,unused-ignore]
