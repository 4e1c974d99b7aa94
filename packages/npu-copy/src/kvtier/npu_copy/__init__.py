"""kvtier-npu-copy: batched, ordered KV block copies between a device and host memory.

The only place in kvtier that moves KV bytes between device and host. Depends on torch;
never imports vLLM. torch_npu is imported only to make the NPU backend available.
"""

from kvtier.npu_copy.__about__ import __version__
from kvtier.npu_copy.backend import DependencyFailed
from kvtier.npu_copy.device import default_device, import_npu_backend
from kvtier.npu_copy.engine import TransferEngine
from kvtier.npu_copy.handle import TransferHandle
from kvtier.npu_copy.layout import KVCaches, KVLayout, Segment
from kvtier.npu_copy.stream_backend import BatchMemcpy, copy_each

__all__ = [
    "BatchMemcpy",
    "DependencyFailed",
    "KVCaches",
    "KVLayout",
    "Segment",
    "TransferEngine",
    "TransferHandle",
    "__version__",
    "copy_each",
    "default_device",
    "import_npu_backend",
]
