"""The device axis of the shared suite: ``(backend, device)`` pairs, and moving a case's inputs to a device."""

from __future__ import annotations

import os
from typing import Dict, List, NamedTuple

import torch

# Backends that run on an accelerator's tensors (the native CPU kernel only takes CPU tensors).
DEVICE_BACKENDS = ("triton", "reference")


class BackendDevice(NamedTuple):
    """What the ``backend_device`` fixture yields: a backend name and the device its tensors live on."""

    backend: str
    device: torch.device

    @property
    def interpreted(self) -> bool:
        """Triton on CPU tensors, i.e. under ``TRITON_INTERPRET=1`` (slow: keep such cases small)."""
        return self.backend == "triton" and self.device.type == "cpu"

    def inputs(self, kwargs: Dict[str, object]) -> Dict[str, object]:
        return on_device(kwargs, self.device)


def pairs(backends) -> List[BackendDevice]:
    """Every backend on CPU tensors, plus the accelerator backends on ``cuda`` when there is a CUDA device."""
    found = [BackendDevice(b, torch.device("cpu")) for b in backends]
    if torch.cuda.is_available():
        found += [BackendDevice(b, torch.device("cuda")) for b in backends if b in DEVICE_BACKENDS]
    return found


def pair_id(pair: BackendDevice) -> str:
    return f"{pair.backend}-{pair.device.type}"


def unsupported(pair: BackendDevice) -> str:
    """Why ``pair`` cannot run in this process ("" when it can).

    ``TRITON_INTERPRET`` is read once, when the kernels are defined: with it on, Triton runs CPU tensors and a
    CUDA tensor would go through the interpreter too (not what a device test means); with it off, the reverse.
    """
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if pair.backend == "triton" and pair.device.type == "cpu" and not interpret:
        return "Triton on CPU tensors needs TRITON_INTERPRET=1 (set by tests/conftest.py unless overridden)"
    if pair.backend == "triton" and pair.device.type != "cpu" and interpret:
        return "TRITON_INTERPRET=1: run with TRITON_INTERPRET=0 to test the Triton kernels on the device"
    return ""


def _span(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` with the same strides (padded rows and stride-0 rows stay as they are)."""
    device = torch.device(device)
    if t.device == device:
        return t
    flat = t.as_strided((_span(t),), (1,), t.storage_offset())
    return flat.to(device).as_strided(t.shape, t.stride())


def on_device(kwargs: Dict[str, object], device) -> Dict[str, object]:
    """A case's keyword arguments with every tensor moved to ``device`` (strides kept), other values as is."""
    return {k: to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
