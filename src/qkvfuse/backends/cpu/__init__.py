"""Native CPU backend: C++ kernels against ATen, registered as the ``CPU`` implementation of ``torch.ops.qkvfuse``.

The sources next to this file are compiled with :func:`torch.utils.cpp_extension.load` (ninja) the first time
the backend is needed -- never at install time, where pip's build isolation would pull another torch -- and
the library is cached outside the source tree (see :func:`build_directory`). Loading it registers, from C++
(``TORCH_LIBRARY_IMPL(qkvfuse, CPU, m)``), all five ops defined in :mod:`qkvfuse.ops`, so eager calls and
``torch.compile`` graphs on CPU tensors reach the native kernels through the dispatcher without a Python
frame in between.

Vector width follows ``torch.backends.cpu.get_cpu_capability()`` (AVX-512, AVX2 or ATen's portable
``DEFAULT`` vectors); ``QKVFUSE_CPU_CAPABILITY`` overrides it. A machine that cannot build the library (no
C++ compiler, no ninja) gets ``available() == (False, reason)``: the registry then falls back to the reference
backend with one warning when the backend was chosen automatically.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ... import ops as _ops  # the schemas must exist before the library registers kernels for them

__all__ = ["available", "build_directory", "load_library", "split_qkv_rmsnorm_rope_out", "add_rmsnorm_out",
           "DISPATCH_DEVICE_TYPES"]

# The public ops send CPU tensors through torch.ops.qkvfuse.* (the C++ registration), not through the
# Python functions below.
DISPATCH_DEVICE_TYPES = ("cpu",)

_SOURCES = ("split_qkv_rmsnorm_rope.cpp", "add_rmsnorm.cpp", "python_entry.cpp")
_HEADERS = ("vec_io.h", "entry.h")
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
# The library as a Python module once loaded: its ``split`` / ``split_inplace`` / ``add_rmsnorm`` are the fast
# path of qkvfuse.ops for CPU tensors, ``bind`` what they check a call's backend choice against
# (python_entry.cpp).
entry = None


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
    global entry
    from torch.utils import cpp_extension

    # The two usual reasons a machine cannot build, said plainly before cpp_extension says them at length.
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH (install g++ or set CXX)")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    cap = capability()
    here = Path(__file__).resolve().parent
    build_dir = build_directory(cap)
    build_dir.mkdir(parents=True, exist_ok=True)
    flags: List[str] = _COMMON_FLAGS + _CAPABILITY_FLAGS[cap]
    if cap != "DEFAULT":
        flags += [f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}"]
    entry = cpp_extension.load(
        name=f"qkvfuse_cpu_{cap.lower()}",
        sources=[str(here / s) for s in _SOURCES],
        extra_cflags=flags,
        extra_include_paths=[str(here)],
        build_directory=str(build_dir),
        is_python_module=True,
        verbose=verbose,
    )
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
    """``(True, "")`` once the native library is built and loaded, else ``(False, reason)``; tried once."""
    global _state
    if _state is None:
        try:
            load_library()
            _state = (True, "")
        except Exception as exc:  # a missing compiler or ninja: the registry falls back to the reference
            _state = (False, _summary(exc))
    return _state


def split_qkv_rmsnorm_rope_out(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight,
                               k_weight, q_bias, k_bias, eps, is_neox, mrope_section, mrope_interleaved, q_out,
                               k_out, v_out) -> None:
    """The native kernel with the reference signature (validated input; see :mod:`qkvfuse.reference`)."""
    torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads,
                                                 head_dim, q_weight, k_weight, q_bias, k_bias, eps, is_neox,
                                                 list(mrope_section or ()), mrope_interleaved, q_out, k_out, v_out)


def add_rmsnorm_out(x, residual, weight, bias, eps, y_out, residual_out) -> None:
    """The native kernel with the reference signature (validated input; see :mod:`qkvfuse.reference`)."""
    torch.ops.qkvfuse.add_rmsnorm_out(x, residual, weight, bias, eps, y_out, residual_out)
