"""Backend registry.

A backend is a module-like object with two kernels that take *validated* arguments and write into
preallocated outputs (signatures of :mod:`qkvfuse.reference`):

* ``split_qkv_rmsnorm_rope_out(qkv, positions, cache, hq, hkv, d, q_w, k_w, q_b, k_b, eps, is_neox,
  mrope_section, mrope_interleaved, q_out, k_out, v_out)``
* ``add_rmsnorm_out(x, residual, weight, bias, eps, y_out, residual_out)``

and ``available() -> (bool, reason)``. Backends register with :func:`register_backend`; selection is by the
``backend=`` keyword of the public ops, else the ``QKVFUSE_BACKEND`` environment variable, else automatic:
``cpu`` for CPU tensors (``reference`` if the native kernel cannot be built), ``triton`` for ``cuda``, ``xpu``
and ``npu`` tensors. An automatically chosen backend that is unavailable falls back to ``reference`` with one
warning; an explicitly requested one raises.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Dict

__all__ = ["register_backend", "get_backend", "resolve_backend", "available_backends", "BACKEND_NAMES"]

# name -> import path of the module implementing it (imported lazily: building the native kernel or
# importing triton costs seconds and must not happen at ``import qkvfuse``).
_BACKEND_MODULES: Dict[str, str] = {
    "reference": "qkvfuse.reference",
    "cpu": "qkvfuse.backends.cpu",
    "triton": "qkvfuse.backends.triton",
}
BACKEND_NAMES = tuple(_BACKEND_MODULES)
_DEVICE_BACKEND = {"cpu": "cpu", "cuda": "triton", "xpu": "triton", "npu": "triton"}

_loaded: Dict[str, object] = {}
_unavailable: Dict[str, str] = {}
_warned: set = set()


def register_backend(name: str, module_path: str) -> None:
    """Register an extra backend implemented by ``module_path`` (see the module docstring)."""
    _BACKEND_MODULES[name] = module_path
    _loaded.pop(name, None)
    _unavailable.pop(name, None)


def _load(name: str):
    if name in _loaded:
        return _loaded[name], ""
    if name in _unavailable:
        return None, _unavailable[name]
    try:
        module = importlib.import_module(_BACKEND_MODULES[name])
        ok, reason = module.available() if hasattr(module, "available") else (True, "")
    except Exception as exc:  # an import or build failure makes the backend unavailable, with the reason
        ok, reason = False, f"{type(exc).__name__}: {exc}"
    if ok:
        _loaded[name] = module
        return module, ""
    _unavailable[name] = reason
    return None, reason


def available_backends() -> Dict[str, str]:
    """``{name: ""}`` for usable backends and ``{name: reason}`` for unusable ones."""
    return {name: _load(name)[1] for name in _BACKEND_MODULES}


def resolve_backend(backend, device_type: str) -> str:
    """Name of the backend serving tensors on ``device_type`` (validation of the ``backend`` argument)."""
    requested = backend if backend is not None else os.environ.get("QKVFUSE_BACKEND") or None
    if requested is None or requested == "auto":
        name = _DEVICE_BACKEND.get(device_type, "reference")
        module, reason = _load(name)
        if module is None:
            if name not in _warned:
                _warned.add(name)
                warnings.warn(f"qkvfuse: backend {name!r} unavailable ({reason}); using the reference backend",
                              RuntimeWarning, stacklevel=3)
            return "reference"
        return name
    if not isinstance(requested, str) or requested not in _BACKEND_MODULES:
        source = "backend" if backend is not None else "QKVFUSE_BACKEND"
        raise ValueError(f"{source}: expected one of {('auto',) + BACKEND_NAMES}, got {requested!r}")
    module, reason = _load(requested)
    if module is None:
        raise RuntimeError(f"qkvfuse: backend {requested!r} was requested but is unavailable: {reason}")
    return requested


def get_backend(name: str):
    """The backend module for a name returned by :func:`resolve_backend`."""
    module, reason = _load(name)
    if module is None:
        raise RuntimeError(f"qkvfuse: backend {name!r} is unavailable: {reason}")
    return module

