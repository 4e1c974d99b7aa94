"""kvtier-tiering-spec: host DRAM and filesystem KV-cache tiers for vLLM's OffloadingConnector.

``CPUOffloadingSpec`` and ``TieringOffloadingSpec`` (and their aliases
``KvtierCPUOffloadingSpec``, ``KvtierTieringOffloadingSpec``) are loaded on first
access, so importing this package does not import vLLM.
"""

from __future__ import annotations

from typing import Any

from kvtier.tiering_spec.__about__ import __version__

_SPECS = (
    "CPUOffloadingSpec",
    "TieringOffloadingSpec",
    "KvtierCPUOffloadingSpec",
    "KvtierTieringOffloadingSpec",
)

__all__ = [*_SPECS, "__version__"]


def __getattr__(name: str) -> Any:
    # vLLM's factory does getattr(import_module(spec_module_path), spec_name).
    if name in _SPECS:
        from kvtier.tiering_spec import vllm_adapter

        return getattr(vllm_adapter, name)
    raise AttributeError(f"module 'kvtier.tiering_spec' has no attribute {name!r}")
