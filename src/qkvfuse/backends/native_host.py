"""The Triton ops' host path in C++: switching the Python kernels of the Triton ops for the native library's.

Until this switch, the kernels of the ``qkvfuse_triton`` ops (every device key) and of the ``qkvfuse`` ops'
``CUDA``, ``XPU`` and ``PrivateUse1`` keys are Python (:mod:`qkvfuse._library`'s schema kernels over
:class:`qkvfuse.backends._LazyTriton`): :func:`qkvfuse._checks.check_split` / ``check_norm``, then the launcher. The
native CPU library (``backends/cpu/triton_host.cpp``) carries C++ kernels for the same keys that check the
arguments with the CPU kernels' own code (``checks.h``; same rules, same messages: the bad-call catalogue holds
every backend to them) and then call the launcher, plus the ``ADInplaceOrView`` kernels of the ``qkvfuse_triton``
mutating forms. :func:`enable` takes the Python kernels away and registers those, once; the Triton backend asks
for it on its first call (:class:`qkvfuse.backends._LazyTriton`), which loads -- on a machine without it, builds --
the native library. Where the library cannot be built or has no host kernels (no Python headers at build time),
the Python kernels stay: same results, same messages, more host time.

The launchers the C++ kernels call (:func:`split_entry_of`, :func:`qkvfuse.backends.triton.launch.split_entry`)
take the checked arguments and the derived ``head_dim``: ``(qkv, positions, cos_sin_cache, q_weight, k_weight,
q_bias, k_bias, num_q_heads, num_kv_heads, eps, rope, head_dim, form, q_out, k_out, v_out, gate_out)`` with ``form``
0 (``out=``), 1 (functional: fresh outputs) or 2 (in place: no outputs given), and for add_rmsnorm
(:func:`norm_entry_of`, :func:`qkvfuse.backends.triton.launch.add_rmsnorm_out`) the reference launcher's ``(x,
residual, weight, bias, eps, gemma, y_out, residual_out)``; both then ``stage`` (:func:`stage_launch`). The
cache-writing split's (:func:`cache_entry_of`) takes the split's arguments and ``head_dim``, the cache's, the
out= form's outputs (None in place) and ``stage``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable, Optional

import torch

from .. import _library

__all__ = ["cache_entry_of", "enable", "enabled", "norm_entry_of", "set_launchers", "split_entry_of",
           "stage_launch"]

_lock = threading.Lock()
_state: Optional[bool] = None
_setter = None
_stager = None
NAMESPACE_INDEX = {"auto": 0, "triton": 1}  # the C++ side's launcher tables


def split_entry_of(split_out: Callable) -> Callable:
    """The host kernels' split launcher over a launcher of the reference signature ``split_out(qkv, positions,
    config, q_out, k_out, v_out, gate_out)`` (the reference's, for the auto ops' fallback)."""

    def entry(qkv, positions, cache, q_w, k_w, q_b, k_b, hq, hkv, eps, rope, head_dim, form, q_out=None, k_out=None,
              v_out=None, gate_out=None, stage=None):
        inplace = form == 2
        config = _library.config_of((cache, q_w, k_w, q_b, k_b, hq, hkv, eps, rope), head_dim, inplace)
        if inplace:
            q_out, k_out, v_out, gate_out = _library.inplace_outputs(qkv, hq, hkv, config.q_gate)
        if positions.device.type != "cpu":  # CPU positions: checked by the host kernel
            _library.check_positions(positions, cache.shape[0])
        split_out(qkv, positions, config, q_out, k_out, v_out, gate_out)

    return entry


def cache_entry_of(split_cache: Callable, staging: bool = False) -> Callable:
    """The host kernels' cache-writing split launcher over a launcher of the reference signature ``split_cache(qkv,
    positions, config, q_out, k_out, v_out, gate_out, target)``: the schema's arguments, the derived ``head_dim``, the
    cache arguments, then the out= form's outputs (None in place: ``qkv``'s own columns) and ``stage``, passed on
    as ``split_cache``'s last argument where it takes one (``staging``: the Triton launcher's)."""

    def entry(qkv, positions, cache, q_w, k_w, q_b, k_b, hq, hkv, eps, rope, head_dim, key_cache, value_cache,
              slot_mapping, cache_mode, k_scale, v_scale, q_out=None, k_out=None, v_out=None, gate_out=None,
              stage=None):
        inplace = q_out is None
        config = _library.config_of((cache, q_w, k_w, q_b, k_b, hq, hkv, eps, rope), head_dim, inplace)
        target = _library.CacheTarget(key_cache, value_cache, slot_mapping, cache_mode, k_scale, v_scale)
        if positions.device.type != "cpu":  # CPU tensors: checked by the host kernel
            _library.check_positions(positions, cache.shape[0])
            _library.check_cache_values(target, qkv.shape[0])
        if inplace:
            q_out, k_out, v_out, gate_out = _library.inplace_outputs(qkv, hq, hkv, config.q_gate)
        if staging:
            split_cache(qkv, positions, config, q_out, k_out, v_out, gate_out, target, stage)
        else:
            split_cache(qkv, positions, config, q_out, k_out, v_out, gate_out, target)

    return entry


def norm_entry_of(norm_out: Callable) -> Callable:
    """The host kernels' add_rmsnorm launcher over a launcher of the reference signature ``norm_out(x, residual,
    weight, bias, eps, gemma, y_out, residual_out)`` (the reference's, for the auto ops' fallback): the same
    arguments and ``stage``, which only a Triton launcher uses."""

    def entry(x, residual, weight, bias, eps, gemma, y_out, residual_out, stage=None):
        norm_out(x, residual, weight, bias, eps, gemma, y_out, residual_out)

    return entry


def _library_path() -> Optional[str]:
    for path in sorted(torch.ops.loaded_libraries):
        if os.path.basename(path).startswith("qkvfuse_cpu_"):
            return path
    return None


def set_launchers(backend: str, split: Callable, norm: Callable, cache: Callable) -> None:
    """Point the C++ kernels of ``backend``'s ops (``"auto"`` or ``"triton"``) at these launchers (after
    :func:`enable`; a no-op before)."""
    if _setter is not None:
        if _setter(NAMESPACE_INDEX[backend], split, norm, cache, 0) != 0:
            raise RuntimeError("qkvfuse: the native library refused the Triton launchers")


def stage_launch(run, function, packed_metadata, values: tuple, block_t: int, grid1: int, sections, launch_globals,
                 knobs_runtime) -> None:
    """Hand a compiled launch to the host kernel that called the launcher with ``stage=True`` (see
    :func:`qkvfuse.backends.triton.launch.split_entry`, ``add_rmsnorm_out`` and
    :func:`qkvfuse.backends.triton.cache.split_qkv_rmsnorm_rope_cache`): Triton's compiled launcher ``run`` and its
    ``function`` / ``packed_metadata``, the constexprs' values after the integer arguments, the token block, the
    grid's second dimension, the mRoPE ``(s_t, s_h, s_w)`` (zeros for add_rmsnorm), the launcher module's globals
    (:mod:`qkvfuse.backends.triton.launch`'s, for all three) and ``triton.knobs.runtime``."""
    if _stager is not None:
        _stager(run, function, packed_metadata, values, block_t, grid1, *sections, launch_globals, knobs_runtime)


def enabled() -> bool:
    """Whether the Triton ops run the C++ host kernels."""
    return bool(_state)


def enable(python_kernels, launchers) -> bool:
    """Switch the Triton ops to the native host kernels, once per process; returns whether they run them.

    ``python_kernels``: the ``torch.library.Library`` objects holding the Python kernels of the same keys (destroyed
    when the switch happens); ``launchers``: ``{"auto": (split, norm, cache), "triton": (split, norm, cache)}``, the
    callables the C++ kernels call first (lazy ones that import Triton on their first call may re-point them with
    :func:`set_launchers`).
    """
    global _state, _setter, _stager
    with _lock:
        if _state is not None:
            return _state
        _state = False
        from . import cpu  # noqa: PLC0415 (the native library: built or loaded here)

        ok, _ = cpu.available()
        path = _library_path() if ok else None
        if path is None:
            return False
        try:
            setter = ctypes.PyDLL(path).qkvfuse_set_triton_launchers
        except (OSError, AttributeError):  # a library built without the host kernels
            return False
        setter.argtypes = (ctypes.c_int, ctypes.py_object, ctypes.py_object, ctypes.py_object, ctypes.c_int)
        setter.restype = ctypes.c_int
        try:
            stager = ctypes.PyDLL(path).qkvfuse_stage_launch
        except AttributeError:  # a library built before the kept launches
            stager = None
        else:
            stager.argtypes = (*(ctypes.py_object,) * 4, *(ctypes.c_longlong,) * 5, ctypes.py_object,
                               ctypes.py_object)
            stager.restype = ctypes.c_int
        for lib in python_kernels:
            lib._destroy()
        _library.version_libraries.pop("triton")._destroy()
        setter(NAMESPACE_INDEX["auto"], *launchers["auto"], 0)
        if setter(NAMESPACE_INDEX["triton"], *launchers["triton"], 1) != 0:
            raise RuntimeError("qkvfuse: the native Triton host kernels could not be registered")
        _setter, _stager = setter, stager
        _state = True
        return True
