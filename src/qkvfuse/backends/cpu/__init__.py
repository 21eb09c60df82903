"""Native CPU backend: C++ kernels against ATen, the ``CPU`` kernels of the ops' ``default`` overload.

At ``import qkvfuse`` (:func:`register_lazy_kernels`) a Python kernel is registered for the ``CPU`` key that, on
the first call, builds the library (a plain shared library, compiled once per version of its sources and
cached: see :mod:`.build`) and loads it; loading registers the C++ kernels from C++
(``TORCH_LIBRARY_IMPL(qkvfuse, CPU, m)``) in place of the Python one, so every later call -- eager, traced,
exported or compiled -- reaches the native kernel through the dispatcher without a Python frame in between.
``python -m qkvfuse build`` (:func:`prebuild`) builds ahead of time.

Vector width follows ``torch.backends.cpu.get_cpu_capability()`` (AVX-512, AVX2 or ATen's portable
``DEFAULT`` vectors); ``QKVFUSE_CPU_CAPABILITY`` overrides it. A machine that cannot build the library (no
C++ compiler) gets ``available() == (False, reason)``; the lazy kernel then falls back to the reference backend
with one warning (an explicit ``backend="cpu"`` raises instead).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ... import _library, reference

__all__ = ["available", "load_library", "prebuild", "register_lazy_kernels", "split_qkv_rmsnorm_rope_out",
           "add_rmsnorm_out"]

_SOURCES = ("split_qkv_rmsnorm_rope.cpp", "add_rmsnorm.cpp")
# ATen's vector headers pick their implementation from CPU_CAPABILITY*; the -m flags are the ones torch's
# own build uses for the same capability. -ffp-contract=off keeps the scalar tails free of compiler-chosen
# FMAs (the kernels place theirs explicitly). OpenMP pragmas inside at::parallel_for need -fopenmp at
# compile time; the OpenMP runtime is torch's own, resolved through libtorch at load time.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}
_COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wall"]

_state: Optional[Tuple[bool, str]] = None
_lock = threading.RLock()


def capability() -> str:
    """The ATen vector capability the library is built for (a key of the flag table)."""
    requested = os.environ.get("QKVFUSE_CPU_CAPABILITY") or torch.backends.cpu.get_cpu_capability()
    requested = requested.upper()
    if requested.startswith("AVX512"):
        return "AVX512"
    return requested if requested in _CAPABILITY_FLAGS else "DEFAULT"


def build_directory(cap: Optional[str] = None) -> Path:
    """Where the library is built and cached: ``$QKVFUSE_BUILD_DIR``, else ``$TORCH_EXTENSIONS_DIR/qkvfuse``,
    else ``~/.cache/qkvfuse`` (``$XDG_CACHE_HOME`` respected), one subfolder per torch version, Python
    version and capability so that a torch upgrade never loads a stale binary."""
    root = os.environ.get("QKVFUSE_BUILD_DIR")
    if not root:
        ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR")
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(ext_dir, "qkvfuse") if ext_dir else os.path.join(cache, "qkvfuse")
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{(cap or capability()).lower()}"
    return Path(root) / tag.replace("+", "_")


def load_library(verbose: bool = False) -> str:
    """Build (if needed) and load the native library; returns its path. Raises if it cannot be built."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH (install g++ or set CXX)")
    cap = capability()
    here = Path(__file__).resolve().parent
    build_dir = build_directory(cap)
    build_dir.mkdir(parents=True, exist_ok=True)
    flags: List[str] = _COMMON_FLAGS + _CAPABILITY_FLAGS[cap]
    if cap != "DEFAULT":
        flags += [f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}"]
    cpp_extension.load(name=f"qkvfuse_cpu_{cap.lower()}", sources=[str(here / s) for s in _SOURCES],
                       extra_cflags=flags, extra_include_paths=[str(here)], build_directory=str(build_dir),
                       is_python_module=False, verbose=verbose)
    return str(build_dir)


def _summary(exc: BaseException) -> str:
    """One line out of a build failure (cpp_extension puts the whole compiler log in the message)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    error = next((line for line in lines[1:] if "error" in line.lower() or "not found" in line.lower()), "")
    detail = first[:160] + (f" ... {error[:200]}" if error and error not in first else "")
    return (f"the native CPU kernel could not be built: {detail} (build folder {build_directory()}; set "
            f"QKVFUSE_BACKEND=reference to skip it)")


def available() -> Tuple[bool, str]:
    """``(True, "")`` once the native library is built and loaded (its C++ kernels registered), else
    ``(False, reason)``; tried once per process."""
    global _state
    with _lock:
        if _state is None:
            # The lazy Python kernel makes way first: the library registers the C++ kernels when it loads.
            if _lazy_lib is not None:
                _lazy_lib._destroy()
            try:
                load_library()
                _state = (True, "")
            except Exception as exc:  # a missing compiler, a failed build: the lazy kernel falls back
                _state = (False, _summary(exc))
                if _fall_back is not None:
                    _register_lazy()
    return _state


def prebuild() -> str:
    """Build and load the native library now (``python -m qkvfuse build``); returns its folder. Raises
    ``RuntimeError`` with the reason when it cannot be built."""
    ok, reason = available()
    if not ok:
        raise RuntimeError(reason)
    return str(build_directory())


# --------------------------------------------------------------------------------------------------------
# The lazy kernel: registered at import for the default overload's CPU key; the first call builds and loads
# the library, after which the dispatcher calls the C++ kernels directly (this Python kernel is destroyed).
# --------------------------------------------------------------------------------------------------------
_lazy_lib: Optional[torch.library.Library] = None
_fall_back = None


def _first_call_split(*args) -> None:
    ok, reason = available()
    if not ok:
        _fall_back(reason)
        return reference.split_qkv_rmsnorm_rope_out(*args)
    split_qkv_rmsnorm_rope_out(*args)


def _first_call_norm(*args) -> None:
    ok, reason = available()
    if not ok:
        _fall_back(reason)
        return reference.add_rmsnorm_out(*args)
    add_rmsnorm_out(*args)


def register_lazy_kernels(fall_back) -> None:
    """Register the building-on-first-call kernels (``fall_back(reason)`` warns when the build fails)."""
    global _fall_back
    if _fall_back is None:
        _fall_back = fall_back
        _register_lazy()


def _register_lazy() -> None:
    global _lazy_lib
    _lazy_lib = torch.library.Library("qkvfuse", "IMPL")
    _library.register_kernels(_lazy_lib, "default", "CPU", _first_call_split, _first_call_norm)


def split_qkv_rmsnorm_rope_out(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight,
                               k_weight, q_bias, k_bias, eps, is_neox, mrope_section, mrope_interleaved, q_out,
                               k_out, v_out) -> None:
    """The native kernel with the reference signature (validated input; see :mod:`qkvfuse.reference`)."""
    rope = _library.encode_rope(is_neox, mrope_section, mrope_interleaved)
    torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out.default(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias,
                                                         k_bias, num_q_heads, num_kv_heads, eps, rope, q_out, k_out,
                                                         v_out)


def add_rmsnorm_out(x, residual, weight, bias, eps, y_out, residual_out) -> None:
    """The native kernel with the reference signature (validated input; see :mod:`qkvfuse.reference`)."""
    torch.ops.qkvfuse.add_rmsnorm_out.default(x, residual, weight, bias, eps, y_out, residual_out)
