"""Finding the device: the accelerator torch knows about, with torch_npu loaded if present."""

from __future__ import annotations

import importlib
import os

import torch


def import_npu_backend() -> bool:
    """Import torch_npu if it is installed (it registers the ``npu`` device with torch).

    Returns True when an NPU is usable afterwards. Never raises.
    """
    try:
        importlib.import_module("torch_npu")
    except Exception:
        return False
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available() and npu.device_count() > 0)
    except Exception:
        return False


def default_device() -> torch.device:
    """``$KVTIER_DEVICE`` if set, else the current accelerator (NPU or CUDA), else cpu."""
    name = os.environ.get("KVTIER_DEVICE")
    if name:
        if name.startswith("npu"):
            import_npu_backend()
        return torch.device(name)
    import_npu_backend()
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None:
            return torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.device("cpu")
