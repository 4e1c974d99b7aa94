"""How registered KV tensors map onto host blocks.

A *device block* is one block id of the KV cache: in every registered tensor it is a
fixed-size run of bytes (a *segment* of that block). A *host block* holds all segments
of one device block, back to back, at fixed byte offsets: one host block is one DMA.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

KVCacheEntry = torch.Tensor | Sequence[torch.Tensor]
"""One layer's KV cache: one tensor, or a tuple/list of tensors (for example K and V)."""

KVCaches = Mapping[str, KVCacheEntry] | Sequence[KVCacheEntry]
"""The engine's KV caches: layer name -> entry (vLLM's ``kv_caches`` dict), or a list."""


@dataclass(frozen=True)
class Segment:
    """The bytes of one block in one registered tensor.

    ``rows`` is a ``[num_blocks, block_bytes]`` uint8 view of the device tensor: row
    ``b`` holds block ``b``'s bytes of this segment. In a host block they start at
    byte ``host_offset``.
    """

    name: str
    rows: torch.Tensor
    block_bytes: int
    host_offset: int

    @property
    def host_end(self) -> int:
        """First byte after this segment in a host block."""
        return self.host_offset + self.block_bytes


def _physical_order(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` permuted so that it is contiguous (vLLM hands out permuted views)."""
    if t.is_contiguous():
        return t
    order = sorted(range(t.dim()), key=lambda d: -int(t.stride()[d]))
    p = t.permute(order)
    if not p.is_contiguous():
        raise ValueError(
            f"KV tensor {name!r} (shape {tuple(t.shape)}, strides {t.stride()}) is not a "
            "permutation of a dense tensor; register the dense tensor it is a view of"
        )
    return p


def _split_rows(t: torch.Tensor, num_blocks: int, name: str) -> list[torch.Tensor]:
    """``t`` as one or more ``[num_blocks, bytes]`` uint8 row views.

    ``[num_blocks, ...]`` gives one segment; ``[m * num_blocks, ...]`` (m block-major
    parts, for example K blocks then V blocks) and ``[m, num_blocks, ...]`` give m.
    """
    if t.dim() == 0 or t.numel() == 0:
        raise ValueError(f"KV tensor {name!r} is empty or 0-dimensional")
    p = _physical_order(t, name)
    shape = p.shape
    if shape[0] % num_blocks == 0:
        parts = shape[0] // num_blocks
    elif p.dim() > 1 and shape[1] == num_blocks:
        parts = shape[0]
    else:
        raise ValueError(
            f"KV tensor {name!r} has shape {tuple(shape)} (in memory order): its first "
            f"dimension is not a multiple of num_blocks={num_blocks}, and it is not "
            f"[parts, num_blocks, ...]"
        )
    flat = p.reshape(-1).view(torch.uint8)
    rows = flat.view(parts, num_blocks, -1)
    return [rows[i] for i in range(parts)]


def _entries(kv_caches: KVCaches) -> list[tuple[str, torch.Tensor]]:
    items: list[tuple[str, KVCacheEntry]]
    if isinstance(kv_caches, Mapping):
        items = [(str(k), v) for k, v in kv_caches.items()]
    elif isinstance(kv_caches, torch.Tensor):
        items = [("0", kv_caches)]
    else:
        items = [(str(i), v) for i, v in enumerate(kv_caches)]
    out: list[tuple[str, torch.Tensor]] = []
    for name, entry in items:
        if isinstance(entry, torch.Tensor):
            out.append((name, entry))
        elif isinstance(entry, Sequence):
            for j, t in enumerate(entry):
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"KV cache {name!r}[{j}] is {type(t).__name__}, not a tensor")
                out.append((f"{name}[{j}]", t))
        else:
            raise ValueError(f"KV cache {name!r} is {type(entry).__name__}, not a tensor or tuple")
    if not out:
        raise ValueError("no KV tensors to register")
    return out


class KVLayout:
    """The registered KV tensors, as segments of a device block, and the host block layout.

    Build it with :meth:`from_kv_caches`. Units: ``num_blocks`` is device blocks;
    every ``*_bytes`` is bytes.
    """

    def __init__(self, segments: Sequence[Segment], num_blocks: int) -> None:
        if not segments:
            raise ValueError("a KV layout needs at least one segment")
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.num_blocks = num_blocks
        self.device: torch.device = self.segments[0].rows.device
        self.block_bytes: int = max(s.host_end for s in self.segments)
        """Bytes of one block over all segments: the least bytes a host block must have."""

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: KVCaches,
        num_blocks: int | None = None,
        *,
        segment_alignment: int = 1,
    ) -> KVLayout:
        """Describe the KV tensors of an engine.

        ``kv_caches``: layer name -> tensor or tuple of tensors (K, V), or a list of them.
        Each tensor holds ``num_blocks`` device blocks on its first dimension
        (``[num_blocks, ...]``), or several block-major parts (``[m * num_blocks, ...]``
        or ``[m, num_blocks, ...]``). Tensors shared by several layers count once.
        ``num_blocks`` defaults to the first dimension when every tensor has the same one.
        Each segment starts at a host-block byte offset that is a multiple of
        ``segment_alignment`` (bytes).
        """
        if segment_alignment < 1:
            raise ValueError(f"segment_alignment must be >= 1 byte, got {segment_alignment}")
        entries = _entries(kv_caches)
        devices = {t.device for _, t in entries}
        if len(devices) != 1:
            names = ", ".join(f"{n}: {t.device}" for n, t in entries[:8])
            raise ValueError(f"KV tensors are on different devices ({names})")
        if num_blocks is None:
            firsts = {tuple(t.shape)[:1] for _, t in entries}
            if len(firsts) != 1 or not next(iter(firsts)):
                raise ValueError(
                    "KV tensors have different first dimensions; pass num_blocks explicitly"
                )
            num_blocks = int(next(iter(firsts))[0])
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")

        # Layers that share one tensor (same memory) are registered once.
        seen: dict[tuple[int, int], str] = {}
        spans: list[tuple[int, int, str]] = []
        dense: list[tuple[str, torch.Tensor]] = []
        for name, t in entries:
            start = t.data_ptr()
            nbytes = t.numel() * t.element_size()
            key = (start, nbytes)
            if key in seen:
                continue
            seen[key] = name
            spans.append((start, start + nbytes, name))
            dense.append((name, t))
        spans.sort()
        for (_, end_a, name_a), (start_b, _, name_b) in itertools.pairwise(spans):
            if start_b < end_a:
                raise ValueError(
                    f"KV tensors {name_a!r} and {name_b!r} overlap without being the same "
                    "memory; register each KV buffer once"
                )

        segments: list[Segment] = []
        offset = 0
        for name, t in dense:
            parts = _split_rows(t, num_blocks, name)
            for i, rows in enumerate(parts):
                offset = -(-offset // segment_alignment) * segment_alignment
                seg_name = name if len(parts) == 1 else f"{name}#{i}"
                nbytes = int(rows.shape[1])
                segments.append(Segment(seg_name, rows, nbytes, offset))
                offset += nbytes
        return cls(segments, num_blocks)

    def check_host_blocks(self, host_blocks: torch.Tensor) -> None:
        """Raise ValueError unless ``host_blocks`` is a ``[num_host_blocks, bytes]`` uint8
        CPU tensor, rows contiguous, each row at least :attr:`block_bytes` bytes."""
        if not isinstance(host_blocks, torch.Tensor):
            raise ValueError(f"host blocks must be a tensor, got {type(host_blocks).__name__}")
        if host_blocks.device.type != "cpu":
            raise ValueError(f"host blocks must be on the host (cpu), not {host_blocks.device}")
        if host_blocks.dtype != torch.uint8:
            raise ValueError(
                f"host blocks must be uint8 [num_host_blocks, host_block_bytes], "
                f"got dtype {host_blocks.dtype}"
            )
        if host_blocks.dim() != 2:
            raise ValueError(
                f"host blocks must be 2-D [num_host_blocks, host_block_bytes], "
                f"got shape {tuple(host_blocks.shape)}"
            )
        if host_blocks.shape[1] < self.block_bytes:
            raise ValueError(
                f"host block of {host_blocks.shape[1]} bytes is smaller than one KV block "
                f"of this layout ({self.block_bytes} bytes over {len(self.segments)} segments)"
            )
        if host_blocks.stride(1) != 1 or (
            host_blocks.shape[0] > 1 and host_blocks.stride(0) < host_blocks.shape[1]
        ):
            raise ValueError(
                f"host blocks must have contiguous rows, got strides {host_blocks.stride()}"
            )

    def __repr__(self) -> str:
        return (
            f"KVLayout(num_blocks={self.num_blocks}, segments={len(self.segments)}, "
            f"block_bytes={self.block_bytes}, device={self.device})"
        )
