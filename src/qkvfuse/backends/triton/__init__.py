"""The Triton backend: one kernel source for NVIDIA/AMD GPUs (``cuda``), Intel GPUs (``xpu``) and Ascend NPUs
(``npu``, through triton-ascend: untested), and for CPU tensors under ``TRITON_INTERPRET=1``.

The launchers here are the kernels of the ops' ``triton`` overload (every device key) and of the ``default``
overload's ``CUDA``, ``XPU`` and ``PrivateUse1`` keys; :mod:`qkvfuse.backends` registers them at ``import
qkvfuse`` behind a first-call import of this module (importing Triton costs seconds). With
``TRITON_INTERPRET=1`` set before Triton is imported, ``backend="triton"`` runs the same kernels on CPU tensors
(how CI tests them).
"""

from __future__ import annotations

from typing import Tuple

import torch

from .cache import split_qkv_rmsnorm_rope_cache
from .launch import INTERPRET, add_rmsnorm_out, split_entry, split_qkv_rmsnorm_rope_out

__all__ = ["available", "split_qkv_rmsnorm_rope_out", "split_entry", "split_qkv_rmsnorm_rope_cache",
           "add_rmsnorm_out", "PRESENT_DEVICE_TYPES"]

DEVICE_TYPES = ("cuda", "xpu", "npu")


def _present_device_types() -> Tuple[str, ...]:
    present = []
    for device_type in DEVICE_TYPES:
        module = getattr(torch, device_type, None)  # torch.npu exists only once torch_npu is imported
        try:
            if module is not None and module.is_available():
                present.append(device_type)
        except Exception:  # a broken driver makes the device absent, not the import fail
            pass
    return tuple(present)


PRESENT_DEVICE_TYPES = _present_device_types()


def available() -> Tuple[bool, str]:
    """``(True, "")`` when the kernels can run here: a cuda/xpu/npu device, or the CPU interpreter."""
    if PRESENT_DEVICE_TYPES or INTERPRET:
        return True, ""
    return False, ("no cuda/xpu/npu device; set TRITON_INTERPRET=1 before importing qkvfuse to run the Triton "
                   "kernels on CPU tensors")
