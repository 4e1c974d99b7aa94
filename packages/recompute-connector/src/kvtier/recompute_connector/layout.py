"""The engine's KV layout as the connector uses it, from kvtier-vllm-port's
:class:`~kvtier.vllm_port.facts.KVLayoutFacts`: the KV cache groups the scheduler side
keeps (:func:`kv_groups`), the bytes of one host block (:func:`device_block_bytes`),
and where each layer's blocks lie in vLLM's allocation (:func:`block_placements`), which
gives the views the workers register with the copy engine (:func:`block_views`).

No vLLM import: the port read the facts from vLLM's configs.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.recompute_connector.state_types import KVGroup
from kvtier.vllm_port.facts import KVLayoutFacts


def block_placements(kv: KVLayoutFacts) -> list[tuple[str, int, int, int]] | None:
    """Where each layer's blocks lie in vLLM's KV cache allocation, in bytes: per layer
    ``(name, offset of block 0, distance between blocks, bytes of one block)``.

    vLLM releases whose ``KVCacheTensor`` has a ``layer_stride`` place every tensor in
    one allocation, and KV cache groups overlay each other there (a block id belongs to
    one group at a time): a hybrid model's linear-attention layers get that whole
    allocation as their KV cache, so their blocks can only be found from here. ``None``
    on releases where each ``KVCacheTensor`` is an allocation of its own.
    """
    tensors = kv.device_tensors()
    if not tensors or any(t.placement is None for t in tensors):
        return None
    pages: dict[str, int | None] = {}  # a layer's page: its (first) group's
    for g in kv.groups:
        for layer, page in g.page_bytes.items():
            pages.setdefault(layer, page)
    out = []
    for t in tensors:
        placed = t.placement
        assert placed is not None
        layer_stride, block_stride = placed.layer_stride, placed.block_stride
        for i, layer in enumerate(t.layers):
            page = pages.get(layer)
            if page is None:
                page = min(s for s in (layer_stride, block_stride) if s > 0)
            out.append((layer, placed.offset + i * layer_stride, block_stride, page))
    return out


def device_block_bytes(kv: KVLayoutFacts) -> int:
    """Bytes of one device block over every KV tensor of a rank (one host block)."""
    placements = block_placements(kv)
    if placements is not None and kv.num_blocks > 0:
        # Overlaid groups share their bytes: count the union of block 0's runs.
        total, end = 0, -1
        for start, stop in sorted((p[1], p[1] + p[3]) for p in placements):
            total += max(0, stop - max(start, end))
            end = max(end, stop)
        return total
    tensors = kv.device_tensors()
    if not tensors or kv.num_blocks <= 0:
        raise ValueError("the KV cache config has no device KV tensors to offload")
    return sum(t.size for t in tensors) // kv.num_blocks


def block_views(kv_caches: dict[str, Any], kv: KVLayoutFacts) -> dict[str, Any]:
    """The KV tensors to register with the copy engine: per layer a ``[num_blocks,
    page bytes]`` uint8 view placed as :func:`block_placements` says, or ``kv_caches``
    as vLLM gave them on releases without placements."""
    placements = block_placements(kv)
    if placements is None:
        return kv_caches
    views: dict[str, Any] = {}
    for name, start, stride, page in placements:
        entry = kv_caches.get(name)
        if isinstance(entry, (list, tuple)):
            entry = entry[0] if entry else None
        if not isinstance(entry, torch.Tensor):
            continue
        # Every layer's tensor is a view of the one allocation, which starts its storage.
        storage = entry.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=entry.device)
        flat.set_(storage, 0, (storage.nbytes(),), (1,))
        views[name] = flat.as_strided((kv.num_blocks, page), (stride, 1), start)
    return views


def kv_groups(kv: KVLayoutFacts) -> list[KVGroup]:
    """The KV cache groups as the scheduler side sees them.

    A Mamba group (linear attention's convolution and recurrent state) is kept only in
    vLLM's ``mamba_cache_mode`` ``"align"`` without speculative blocks: there the state
    after a request's last computed token is the block of that token, so one block
    per request restores it. Other modes keep it elsewhere: recomputed.
    """
    groups = []
    for g in kv.groups:
        if "Mamba" in g.kind:
            state = (
                g.mamba_cache_mode == "align"
                and not g.speculative_blocks
                and not g.prefill_checkpoint_blocks
            )
            groups.append(KVGroup(g.block_size, None, state, state=state))
            continue
        supported = g.kind in ("FullAttentionSpec", "SlidingWindowSpec") or g.has_heads
        mirrorable = bool(g.lineage & {"FullAttentionSpec", "SlidingWindowSpec"}) and not (
            g.lineage & {"ChunkedLocalAttentionSpec"}
        )
        groups.append(KVGroup(g.block_size, g.sliding_window, supported, mirrorable=mirrorable))
    return groups


__all__ = ["block_placements", "block_views", "device_block_bytes", "kv_groups"]
