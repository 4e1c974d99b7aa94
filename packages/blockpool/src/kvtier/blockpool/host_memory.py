"""Host memory for a region: an exactly sized mapping of its own, page-locking it for
an accelerator's copies, and the machine's available memory.

A private region is an anonymous memory file (``memfd``, named ``kvtier-region`` in
``/proc/<pid>/maps``) of exactly its size, never a caching allocator's block: torch's
pinned host allocator rounds a request up to a power of two. CUDA page-locks it with
``cudaHostRegister``; elsewhere the region comes from the accelerator's pinned host
allocator, or stays as it is on a CPU.
"""

from __future__ import annotations

import os

import torch


class InsufficientHostMemoryError(MemoryError):
    """The machine has less available memory than a private region needs."""


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None where it cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


MEMFD_NAME = "kvtier-region"


def pin_description() -> str:
    if not torch.accelerator.is_available():
        return "none"
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None else "none"


def cuda_host_register(tensor: torch.Tensor) -> bool:
    """Page-lock ``tensor``'s memory for CUDA DMA. False where registration is not offered."""
    if not (torch.cuda.is_available() and hasattr(torch.cuda, "cudart")):
        return False
    try:
        rc = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    except Exception:
        return False
    return int(rc) == 0


def cuda_host_unregister(tensor: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    except Exception:
        pass


def exact_mapping(size: int, *, reserve: bool = False) -> torch.Tensor:
    """``size`` bytes of host memory mapped for this region alone: an anonymous memory
    file (``memfd``) of exactly ``size`` bytes, which ``/proc/<pid>/maps`` names
    ``kvtier-region``. Plain anonymous memory where memfd is missing.

    With ``reserve``, the memory is allocated now (``posix_fallocate``), as page-locking
    it does on an accelerator: else each page is allocated and zeroed by the first
    store that writes it, inside an engine step (on vLLM's CPU platform about 5% of the
    wall time of a run whose stores fill 300 MB). Raises
    :class:`InsufficientHostMemoryError` when the machine cannot give it."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is None:
        return torch.empty(size, dtype=torch.uint8)
    fd = memfd_create(MEMFD_NAME, getattr(os, "MFD_CLOEXEC", 0))
    try:
        os.ftruncate(fd, size)
        fallocate = getattr(os, "posix_fallocate", None)
        if reserve and fallocate is not None:
            try:
                fallocate(fd, 0, size)
            except OSError as exc:
                raise InsufficientHostMemoryError(
                    f"a private host region of {size} bytes could not be allocated "
                    f"({exc.strerror or exc}); lower cpu_bytes_to_use or "
                    "cpu_bytes_to_use_per_rank"
                ) from exc
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
    finally:
        os.close(fd)  # the mapping keeps the memory


def power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
