"""kvtier-blockpool: the host block pool behind kvtier's KV-cache offload.

No vLLM import anywhere in this package: it is plain Python and torch.
"""

from kvtier.blockpool.__about__ import __version__
from kvtier.blockpool.admission import DEFAULT_MAX_TRACKER_SIZE, StoreAdmissionFilter
from kvtier.blockpool.allocator import RunAllocator
from kvtier.blockpool.budget import (
    PER_RANK_KEY,
    TOTAL_KEY,
    HostBudget,
    require_bool,
    require_positive_int,
    resolve_budget,
    resolve_bytes_per_rank,
    round_up,
)
from kvtier.blockpool.holds import Hold
from kvtier.blockpool.host_memory import InsufficientHostMemoryError, mem_available_bytes
from kvtier.blockpool.policies import (
    ARCPolicy,
    EvictionPolicy,
    FrecencyPolicy,
    LRUPolicy,
    make_policy,
)
from kvtier.blockpool.pool import HostBlockPool
from kvtier.blockpool.records import ALLOCATION_BUCKETS, CacheEvent, PoolStats, StorePlan
from kvtier.blockpool.region import HostRegion
from kvtier.blockpool.region_files import (
    InsufficientSharedMemoryError,
    cleanup_stale_regions,
    shm_free_bytes,
)

__all__ = [
    "ALLOCATION_BUCKETS",
    "DEFAULT_MAX_TRACKER_SIZE",
    "PER_RANK_KEY",
    "TOTAL_KEY",
    "ARCPolicy",
    "CacheEvent",
    "EvictionPolicy",
    "FrecencyPolicy",
    "Hold",
    "HostBlockPool",
    "HostBudget",
    "HostRegion",
    "InsufficientHostMemoryError",
    "InsufficientSharedMemoryError",
    "LRUPolicy",
    "PoolStats",
    "RunAllocator",
    "StoreAdmissionFilter",
    "StorePlan",
    "__version__",
    "cleanup_stale_regions",
    "make_policy",
    "mem_available_bytes",
    "require_bool",
    "require_positive_int",
    "resolve_budget",
    "resolve_bytes_per_rank",
    "round_up",
    "shm_free_bytes",
]
