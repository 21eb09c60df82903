"""The Triton backend: one kernel source for NVIDIA/AMD GPUs (``cuda``), Intel GPUs (``xpu``) and Ascend NPUs
(``npu``, through triton-ascend: untested), and for CPU tensors under ``TRITON_INTERPRET=1``.

Importing this module on a machine with such a device registers the launchers for the ``CUDA``, ``XPU`` and
``PrivateUse1`` dispatch keys of ``torch.ops.qkvfuse.*``, so the public ops reach them through the dispatcher
(one opaque op under ``torch.compile``). On a CPU-only machine it registers nothing; with ``TRITON_INTERPRET=1``
set before import, ``backend="triton"`` runs the same kernels on CPU tensors (how CI tests them).
"""

from __future__ import annotations

from typing import Tuple

import torch

from ... import ops
from .launch import INTERPRET, add_rmsnorm_out, split_qkv_rmsnorm_rope_out

__all__ = ["available", "split_qkv_rmsnorm_rope_out", "add_rmsnorm_out", "DISPATCH_DEVICE_TYPES"]

# Device types whose tensors reach this backend through torch.ops.qkvfuse (see qkvfuse.ops._kernel).
DISPATCH_DEVICE_TYPES = ("cuda", "xpu", "npu")
_DISPATCH_KEYS = {"cuda": "CUDA", "xpu": "XPU", "npu": "PrivateUse1"}


def _present_device_types() -> Tuple[str, ...]:
    present = []
    for device_type in DISPATCH_DEVICE_TYPES:
        module = getattr(torch, device_type, None)  # torch.npu exists only once torch_npu is imported
        try:
            if module is not None and module.is_available():
                present.append(device_type)
        except Exception:  # a broken driver makes the device absent, not the import fail
            pass
    return tuple(present)


PRESENT_DEVICE_TYPES = _present_device_types()

for _device_type in PRESENT_DEVICE_TYPES:
    ops.register_split_kernels(_DISPATCH_KEYS[_device_type], split_qkv_rmsnorm_rope_out)
    ops.register_norm_kernels(_DISPATCH_KEYS[_device_type], add_rmsnorm_out)


def available() -> Tuple[bool, str]:
    """``(True, "")`` when the kernels can run here: a cuda/xpu/npu device, or the CPU interpreter."""
    if PRESENT_DEVICE_TYPES or INTERPRET:
        return True, ""
    return False, ("no cuda/xpu/npu device; set TRITON_INTERPRET=1 before importing qkvfuse to run the Triton "
                   "kernels on CPU tensors")
