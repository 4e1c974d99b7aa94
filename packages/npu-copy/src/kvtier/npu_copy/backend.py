"""What the transfer engine needs from a backend, and the dependency types both backends share.

Two backends implement it: :mod:`kvtier.npu_copy.cpu_backend` (host memcpy, for KV
tensors on the host) and :mod:`kvtier.npu_copy.stream_backend` (torch's device-generic
streams and events: CUDA, Ascend NPU, any accelerator).
"""

from __future__ import annotations

from typing import Any, Protocol

from kvtier.npu_copy.handle import TransferHandle


class Backend(Protocol):
    """What the engine needs from a backend. Ids are validated before these are called."""

    name: str

    def store(
        self, handle: TransferHandle, device_ids: list[int], host_ids: list[int], deps: list[Dep]
    ) -> None: ...

    def load(
        self, handle: TransferHandle, host_ids: list[int], device_ids: list[int], deps: list[Dep]
    ) -> None: ...

    def poll(self, handle: TransferHandle) -> bool: ...

    def block(self, handle: TransferHandle) -> None: ...

    def stream_wait(self, handle: TransferHandle, stream: Any) -> None: ...

    def close(self) -> None: ...


Dep = tuple[TransferHandle, bool]
"""An earlier transfer to wait for, and whether its failure fails this one (it wrote
bytes this transfer reads) or only orders it (this transfer overwrites bytes it reads)."""


class DependencyFailed(RuntimeError):
    """A transfer this one reads the output of failed, so this one cannot be valid."""
