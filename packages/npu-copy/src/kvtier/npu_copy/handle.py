"""Transfer handles: poll, wait, and order the compute stream after a transfer."""

from __future__ import annotations

import threading
from typing import Any, Protocol


class Completion(Protocol):
    """What a handle asks of the backend running its transfer (every backend of
    :mod:`kvtier.npu_copy.backend` answers it)."""

    def poll(self, handle: TransferHandle) -> bool: ...

    def block(self, handle: TransferHandle) -> None: ...

    def stream_wait(self, handle: TransferHandle, stream: Any) -> None: ...


class TransferHandle:
    """One submitted store or load.

    ``done()`` polls, ``wait()`` blocks; both report failure through ``ok`` and
    ``error``, never by raising. A failed transfer leaves its destination blocks
    undefined: the caller must not mark them valid.
    """

    __slots__ = (
        "_backend",
        "_error",
        "_finished",
        "_keep",
        "_token",
        "device_block_ids",
        "device_set",
        "direction",
        "host_block_ids",
        "host_set",
    )

    def __init__(
        self,
        backend: Completion | None,
        direction: str,
        device_block_ids: list[int],
        host_block_ids: list[int],
    ) -> None:
        self._backend = backend
        self.direction = direction
        """``"store"`` (device -> host) or ``"load"`` (host -> device)."""
        self.device_block_ids = device_block_ids
        self.host_block_ids = host_block_ids
        self.device_set = frozenset(device_block_ids)
        self.host_set = frozenset(host_block_ids)
        self._error: BaseException | None = None
        self._finished = backend is None
        # The backend's completion token: a threading.Event (CPU) or a stream event.
        self._token: Any = None
        # Buffers and index tensors the copy reads or writes: alive until it finished.
        self._keep: list[Any] = []

    @property
    def num_blocks(self) -> int:
        """Blocks moved by this transfer."""
        return len(self.device_block_ids)

    def done(self) -> bool:
        """True once the transfer finished, successfully or not. Never blocks, never raises."""
        if not self._finished and self._backend is not None and self._backend.poll(self):
            self._finish()
        return self._finished

    def wait(self) -> bool:
        """Block until the transfer finished; return :attr:`ok`. Never raises for a failed copy."""
        if not self._finished and self._backend is not None:
            self._backend.block(self)
            self._finish()
        return self.ok

    @property
    def ok(self) -> bool:
        """True when the transfer finished and every byte was copied."""
        return self.done() and self._error is None

    @property
    def error(self) -> BaseException | None:
        """Why the transfer failed, or None (also None while it is in flight)."""
        return self._error if self.done() else None

    def wait_on_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current stream of the KV device) wait for this
        transfer before running later work; the host is not blocked. On the CPU backend,
        where compute is synchronous, this blocks until the transfer finished."""
        if self._backend is not None and not self._finished:
            self._backend.stream_wait(self, stream)

    def _fail(self, error: BaseException) -> None:
        self._error = error

    def _finish(self) -> None:
        self._keep = []
        self._finished = True

    def __repr__(self) -> str:
        state = "in flight" if not self._finished else ("ok" if self._error is None else "failed")
        return f"<TransferHandle {self.direction} {self.num_blocks} blocks {state}>"


def completed_handle(direction: str, device_ids: list[int], host_ids: list[int]) -> TransferHandle:
    """A handle for a transfer with nothing to do (no blocks)."""
    return TransferHandle(None, direction, device_ids, host_ids)


def new_cpu_token() -> threading.Event:
    return threading.Event()
