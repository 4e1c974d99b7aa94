"""KV cache layouts the engine must accept, each with an independent way to read a block."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.npu_copy.layout import KVCaches

NUM_BLOCKS = 12


@dataclass
class LayoutCase:
    """KV tensors as an engine hands them over, and how to read block ``b`` of each."""

    name: str
    kv: KVCaches
    tensors: list[torch.Tensor]  # every distinct tensor once
    block_of: Callable[[torch.Tensor, int], torch.Tensor]

    def snapshot(self, block: int) -> list[torch.Tensor]:
        """Bytes of one device block in every tensor (copies)."""
        return [self.block_of(t, block).clone() for t in self.tensors]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, device: str, gen: torch.Generator):
    data = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    return data.view(dtype).to(device) if dtype != torch.uint8 else data.to(device)


def make_layout(name: str, device: str = "cpu", *, large: bool = False, seed: int = 0):
    """Build one named layout. ``large`` makes each segment 64 KiB (the threaded path)."""
    gen = torch.Generator().manual_seed(seed)
    nb = NUM_BLOCKS
    hd = 1024 if large else 16  # float16 elements per row of a block
    first = lambda t, b: t[b]  # noqa: E731
    if name == "per_layer":  # vLLM CPU: [num_blocks, 2, block_size, 2 * head_dim]
        ts = [
            _rand((nb, 2, 16, hd * 2), torch.uint8, device, gen).view(torch.float16)
            for _ in range(3)
        ]
        return LayoutCase(name, {f"layer.{i}": t for i, t in enumerate(ts)}, ts, first)
    if name == "kv_tuple":  # Ascend: (K, V) per layer, each [num_blocks, block_size, heads, d]
        layers = [
            tuple(
                _rand((nb, 16, 2, hd), torch.uint8, device, gen).view(torch.float16)
                for _ in range(2)
            )
            for _ in range(2)
        ]
        ts = [t for kv in layers for t in kv]
        return LayoutCase(name, layers, ts, first)
    if name == "multiple_first":  # [2 * num_blocks, ...]: K blocks, then V blocks
        ts = [_rand((2 * nb, 16, hd * 2), torch.uint8, device, gen) for _ in range(2)]

        def stacked(t: torch.Tensor, b: int) -> torch.Tensor:
            return torch.stack([t[b], t[nb + b]])

        return LayoutCase(name, ts, ts, stacked)
    if name == "leading_kv":  # [2, num_blocks, ...] (vLLM flash-attention)
        ts = [
            _rand((2, nb, 16, hd), torch.uint8, device, gen).view(torch.float16) for _ in range(2)
        ]
        return LayoutCase(name, ts, ts, lambda t, b: t[:, b])
    if name == "shared":  # two layers share one KV tensor (counted once)
        shared = _rand((nb, 2, 16, hd), torch.uint8, device, gen).view(torch.float16)
        own = _rand((nb, 2, 16, hd), torch.uint8, device, gen).view(torch.float16)
        kv = {"layer.0": shared, "layer.1": shared, "layer.2": own}
        return LayoutCase(name, kv, [shared, own], first)
    if name == "permuted":  # a permuted view of a dense tensor, blocks outermost in memory
        raw = _rand((nb, 16, 2, hd), torch.uint8, device, gen).view(torch.float16)
        t = raw.permute(0, 2, 1, 3)
        return LayoutCase(name, [t], [t], first)
    if name == "mixed_sizes":  # layers with different bytes per block (hybrid models)
        ts = [
            _rand((nb, 2, 16, hd * 2), torch.uint8, device, gen).view(torch.float16),
            _rand((nb, 2, 16, hd // 2), torch.uint8, device, gen).view(torch.float16),
            _rand((nb, 4, hd), torch.uint8, device, gen),
        ]
        return LayoutCase(name, ts, ts, first)
    if name == "hybrid_overlay":
        # vLLM's hybrid models: KV cache groups overlaid on one buffer, layer-outermost.
        # Slot l's page of block b is at l * nb * page + b * page; in it a full-attention
        # layer sees [heads, block_size, dims], a linear-attention layer a float16 conv
        # state and, after it, a float32 recurrent state, with unused padding after both.
        page = 2 * 16 * hd * 2 * 2  # bytes of one attention page
        raw = _rand((2 * nb * page,), torch.uint8, device, gen)
        kv: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        pages = []
        for slot in range(2):
            base = slot * nb * page
            attn = raw[base : base + nb * page].view(nb, 2, 16, hd * 4).view(torch.float16)
            conv = raw.view(torch.float16).as_strided((nb, 3, hd), (page // 2, hd, 1), base // 2)
            ssm_at = base + 3 * hd * 2
            ssm = raw.view(torch.float32).as_strided((nb, 2, hd), (page // 4, hd, 1), ssm_at // 4)
            kv[f"layers.{2 * slot}.linear_attn"] = (conv, ssm)
            kv[f"layers.{2 * slot + 1}.attn"] = attn
            pages.append(attn)
        return LayoutCase(name, kv, pages, first)
    raise ValueError(name)


LAYOUTS = [
    "per_layer",
    "kv_tuple",
    "multiple_first",
    "leading_kv",
    "shared",
    "permuted",
    "mixed_sizes",
    "hybrid_overlay",
]
