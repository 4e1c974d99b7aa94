"""What the store tier needs of a store: the calls of its client (:class:`StoreClient`,
Mooncake Store's ``MooncakeDistributedStore`` or any object with those methods), and
the tier's settings besides the client, time limits included (:class:`StoreTierSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# Back-off after a failed store call: doubled per failure up to the maximum.
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
SHUTDOWN_TIMEOUT_S = 10.0
CALL_TIMEOUT_S = 10.0
"""Deadline of one batched get, put or remove (seconds): 64 objects of a few MiB take
well under a second even over TCP."""
PROBE_TIMEOUT_S = 2.0
"""Deadline of one batched existence check (seconds): requests wait on it."""


class StoreClient(Protocol):
    """The calls of Mooncake Store's Python client this tier uses."""

    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...

    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...

    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]: ...


@dataclass(frozen=True)
class StoreTierSettings:
    """What the tier needs besides the client: its name, locality and events switch,
    the MAC key (None: objects unauthenticated) and its time limits (seconds)."""

    name: str = "mooncake"
    locality: str = "REMOTE"
    enable_kv_events: bool = True
    auth_key: bytes | None = field(default=None, repr=False)
    call_timeout_s: float = CALL_TIMEOUT_S
    probe_timeout_s: float = PROBE_TIMEOUT_S
    backoff_min_s: float = BACKOFF_MIN_S
    backoff_max_s: float = BACKOFF_MAX_S
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S
