"""How registered KV tensors map onto host blocks.

A *device block* is one block id of the KV cache: in every registered tensor it is a
fixed-size run of bytes (a *segment* of that block). A *host block* holds all segments
of one device block, back to back, at fixed byte offsets: one host block is one DMA.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class _BlockRows:
    """One run of bytes per device block in device memory: block ``b`` of it is the
    ``width`` bytes at address ``start + b * stride``. ``source`` is a tensor on its
    memory (to make the view from)."""

    name: str
    start: int
    stride: int
    width: int
    source: torch.Tensor

    def span_end(self, num_blocks: int) -> int:
        """First address after block ``num_blocks - 1``."""
        return self.start + (num_blocks - 1) * self.stride + self.width


def _physical_order(t: torch.Tensor) -> torch.Tensor:
    """``t`` permuted so that its dimensions run from the largest stride to the smallest
    (vLLM hands out permuted views)."""
    order = sorted(range(t.dim()), key=lambda d: (-int(t.stride()[d]), -int(t.shape[d])))
    return t.permute(order)


def _split_rows(t: torch.Tensor, num_blocks: int, name: str) -> list[_BlockRows]:
    """``t`` as one or more runs of bytes per block.

    ``[num_blocks, ...]`` gives one run; ``[m * num_blocks, ...]`` (m block-major
    parts, for example K blocks then V blocks) and ``[m, num_blocks, ...]`` give m. The
    part of one block must be dense; blocks may lie further apart than their size (a
    view into a buffer that other layers or KV cache groups share, as in vLLM's hybrid
    layouts).
    """
    if t.dim() == 0 or t.numel() == 0:
        raise ValueError(f"KV tensor {name!r} is empty or 0-dimensional")
    p = _physical_order(t)
    shape = p.shape
    es = t.element_size()
    if shape[0] % num_blocks == 0:
        parts, block_dim = shape[0] // num_blocks, 0
    elif p.dim() > 1 and shape[1] == num_blocks:
        parts, block_dim = int(shape[0]), 1
    else:
        raise ValueError(
            f"KV tensor {name!r} has shape {tuple(shape)} (in memory order): its first "
            f"dimension is not a multiple of num_blocks={num_blocks}, and it is not "
            f"[parts, num_blocks, ...]"
        )
    inner = p[0, 0] if block_dim == 1 else p[0]
    if p.dim() > block_dim + 1 and not inner.is_contiguous():
        raise ValueError(
            f"KV tensor {name!r} (shape {tuple(t.shape)}, strides {t.stride()}): one "
            "block of it is not a permutation of a dense tensor; register the dense "
            "tensor it is a view of"
        )
    width = inner.numel() * es
    stride = int(p.stride(block_dim)) * es
    part_stride = num_blocks * stride if block_dim == 0 else int(p.stride(0)) * es
    if stride < width:
        raise ValueError(
            f"KV tensor {name!r}: its blocks overlap ({width} bytes each, {stride} apart)"
        )
    return [
        _BlockRows(name, t.data_ptr() + i * part_stride, stride, width, t) for i in range(parts)
    ]


def _blocks_in_common(a: _BlockRows, b: _BlockRows, num_blocks: int) -> set[int]:
    """The differences ``i - j`` (in blocks) for which block ``i`` of ``a`` and block
    ``j`` of ``b`` share bytes; both have the same stride."""
    d, s = b.start - a.start, a.stride
    lo = (d - a.width) // s + 1  # least k with k * s > d - a.width
    hi = -(-(d + b.width) // s) - 1  # greatest k with k * s < d + b.width
    return set(range(max(lo, 1 - num_blocks), min(hi, num_blocks - 1) + 1))


def _merge_rows(rows: list[_BlockRows], num_blocks: int) -> list[_BlockRows]:
    """Runs of bytes that share memory only within the same block id merge into one
    (one tensor registered for several layers, or KV cache groups overlaid on one
    buffer, each block owned by one group at a time); any other sharing is an error."""
    merged: list[_BlockRows] = []
    for row in rows:
        touching: list[int] = []
        for i, other in enumerate(merged):
            if row.start >= other.span_end(num_blocks) or other.start >= row.span_end(num_blocks):
                continue
            key = (row.start, row.stride, row.width)
            if key == (other.start, other.stride, other.width):
                common = {0}
            elif row.stride == other.stride:
                common = _blocks_in_common(other, row, num_blocks)
            else:
                common = {0, 1}  # different block strides: never the same blocks
            if common - {0}:
                raise ValueError(
                    f"KV tensors {other.name!r} and {row.name!r} overlap without being the "
                    "same memory or the same blocks of it; register each KV buffer once"
                )
            if common:
                touching.append(i)
        for i in reversed(touching):
            other = merged.pop(i)
            start = min(row.start, other.start)
            end = max(row.start + row.width, other.start + other.width)
            same = (start, end - start) == (other.start, other.width)
            name = other.name if same else f"{other.name}+{row.name}"
            row = _BlockRows(name, start, row.stride, end - start, other.source)
            if row.width > row.stride:
                raise ValueError(
                    f"KV tensors {name!r} overlay one buffer with {row.width} bytes per "
                    f"block but blocks {row.stride} bytes apart"
                )
        merged.insert(min(touching, default=len(merged)), row)
    if len(merged) < len(rows) and len(merged) > 1:
        # A merge widens a run: check the merged runs against each other again.
        return _merge_rows(merged, num_blocks) if len(merged) > 1 else merged
    return merged


def _byte_rows(rows: _BlockRows, num_blocks: int) -> torch.Tensor:
    """A ``[num_blocks, width]`` uint8 view of ``rows`` (row stride ``rows.stride``)."""
    storage = rows.source.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=rows.source.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    offset = rows.start - storage.data_ptr()
    return flat.as_strided((num_blocks, rows.width), (rows.stride, 1), offset)


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
        Tensors that are views into one buffer shared by several KV cache groups (vLLM's
        hybrid models) give one segment per run of bytes a block id owns there: views
        may overlap only within the same block id. ``num_blocks`` defaults to the first
        dimension when every tensor has the same one.
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

        # Layers that share one tensor, or KV cache groups overlaid on one buffer (each
        # block id is owned by one group at a time), give one segment.
        rows: list[_BlockRows] = []
        for name, t in entries:
            rows.extend(_split_rows(t, num_blocks, name))
        parts_of: dict[str, int] = {}
        for r in rows:
            parts_of[r.name] = parts_of.get(r.name, 0) + 1
        index: dict[str, int] = {}
        named = []
        for r in rows:
            if parts_of[r.name] > 1:
                i = index.get(r.name, 0)
                index[r.name] = i + 1
                r = _BlockRows(f"{r.name}#{i}", r.start, r.stride, r.width, r.source)
            named.append(r)

        segments: list[Segment] = []
        offset = 0
        for r in _merge_rows(named, num_blocks):
            offset = -(-offset // segment_alignment) * segment_alignment
            segments.append(Segment(r.name, _byte_rows(r, num_blocks), r.width, offset))
            offset += r.width
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
