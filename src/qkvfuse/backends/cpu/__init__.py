"""Native CPU backend: C++ kernels against ATen, the ``CPU`` kernels of the auto ops (namespace ``qkvfuse``).

At ``import qkvfuse`` (:func:`register_lazy_kernels`) a Python kernel is registered for the ``CPU`` key that, on
the first call, builds the library (a plain shared library, compiled once per version of its sources and
cached: see :mod:`.build`) and loads it; loading registers the C++ kernels from C++
(``TORCH_LIBRARY_IMPL(qkvfuse, CPU, m)``) in place of the Python one, so every later call -- eager, traced,
exported or compiled -- reaches the native kernel through the dispatcher without a Python frame in between.
``python -m qkvfuse build`` (:func:`prebuild`) builds ahead of time.

Vector width follows ``torch.backends.cpu.get_cpu_capability()`` (AVX-512, AVX2 or ATen's portable
``DEFAULT`` vectors), and an AVX-512 CPU with AVX512-BF16 gets the ``AVX512_BF16`` build (its bf16 rounding is one
instruction); ``QKVFUSE_CPU_CAPABILITY`` forces a narrower one (``DEFAULT``, ``AVX2``, ``AVX512``, ``AVX512_BF16``).
The bf16/fp16 kernels are specialised for AVX2 and for AVX-512 (``isa.h``); each path's bit contract against the
generic kernel -- bit for bit, or within one ulp for the normed bf16 outputs in lane order -- is listed in this
folder's README.md. A machine that cannot build the library (no C++ compiler) gets ``available() == (False,
reason)``; the lazy kernel then falls back to the reference backend with one warning (an explicit ``backend="cpu"``
raises instead).
"""

from __future__ import annotations

import os
import sysconfig
import threading
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ... import _library, reference
from .build import build_library, cache_root, library_key

__all__ = ["available", "load_library", "prebuild", "register_lazy_kernels", "split_qkv_rmsnorm_rope_out",
           "add_rmsnorm_out"]

_SOURCES = ("split_qkv_rmsnorm_rope.cpp", "add_rmsnorm.cpp", "inplace_versions.cpp", "triton_host.cpp")
# ATen's vector headers pick their implementation from CPU_CAPABILITY*; the -m flags are the ones torch's
# own build uses for the same capability. -ffp-contract=off keeps the scalar tails free of compiler-chosen
# FMAs (the kernels place theirs explicitly). OpenMP pragmas inside at::parallel_for need -fopenmp at
# compile time; the OpenMP runtime is torch's own, resolved through libtorch at load time.
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
_CAPABILITY_FLAGS = {
    "AVX512_BF16": _AVX512_FLAGS + ["-mavx512bf16", "-DQKVFUSE_AVX512_BF16"],
    "AVX512": _AVX512_FLAGS,
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}
_COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wall"]

_state: Optional[Tuple[bool, str]] = None
_lock = threading.RLock()


_WIDTHS = ("DEFAULT", "AVX2", "AVX512", "AVX512_BF16")  # narrowest first


def _width(name: str) -> str:
    name = name.upper()
    if name in _CAPABILITY_FLAGS:
        return name
    return "AVX512" if name.startswith("AVX512") else "DEFAULT"


def _aten_capability(cap: str) -> str:
    """ATen's CPU_CAPABILITY for a build (its vector headers know DEFAULT, AVX2 and AVX512)."""
    return "AVX512" if cap.startswith("AVX512") else cap


def detected_capability() -> str:
    """This CPU's widest build: torch's detection, plus ``AVX512_BF16`` where AVX-512 comes with AVX512-BF16."""
    detected = _width(torch.backends.cpu.get_cpu_capability())
    if detected == "AVX512" and torch.cpu._is_avx512_bf16_supported():
        return "AVX512_BF16"
    return detected


def supported_capabilities() -> Tuple[str, ...]:
    """Every build this CPU runs, narrowest first (the test suite runs each)."""
    return _WIDTHS[: _WIDTHS.index(detected_capability()) + 1]


def capability() -> str:
    """The build the library is made for (a key of the flag table): this CPU's widest
    (:func:`detected_capability`), or ``$QKVFUSE_CPU_CAPABILITY``. Asking for more than the CPU has raises
    ``RuntimeError`` (the library would die with SIGILL): the backend is then unavailable, with that reason."""
    detected = detected_capability()
    requested = os.environ.get("QKVFUSE_CPU_CAPABILITY")
    if not requested:
        return detected
    if requested.upper() not in _WIDTHS and not requested.upper().startswith("AVX512"):
        raise RuntimeError(f"QKVFUSE_CPU_CAPABILITY: expected one of {', '.join(_WIDTHS)}, got {requested!r}")
    wanted = _width(requested)
    if _WIDTHS.index(wanted) > _WIDTHS.index(detected):
        raise RuntimeError(f"QKVFUSE_CPU_CAPABILITY={requested}: this CPU supports up to {detected} (torch's "
                           f"detection); a build for {wanted} would stop the process with an illegal instruction")
    return wanted


_HERE = Path(__file__).resolve().parent


def _ldflags(flags: List[str]) -> List[str]:
    """torch's Python library (THPVariable_Wrap) for a build with the Triton host kernels."""
    return ["-ltorch_python"] if "-DQKVFUSE_PYTHON_HOST" in flags else []


def _build_inputs(cap: str) -> Tuple[str, List[Path], List[str]]:
    """Name, sources and compiler flags of the library for capability ``cap``."""
    flags: List[str] = _COMMON_FLAGS + _CAPABILITY_FLAGS[cap] + _python_flags()
    if cap != "DEFAULT":
        aten = _aten_capability(cap)
        flags += [f"-DCPU_CAPABILITY={aten}", f"-DCPU_CAPABILITY_{aten}"]
    return f"qkvfuse_cpu_{cap.lower()}", [_HERE / s for s in _SOURCES], flags


def _python_flags() -> List[str]:
    """The Triton ops' C++ host kernels (triton_host.cpp) call the Python launcher: Python's headers, where this
    interpreter has them (without them that file compiles to nothing and the Triton ops keep their Python
    kernels)."""
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return []
    return ["-DQKVFUSE_PYTHON_HOST", "-isystem", include]


def build_directory(cap: Optional[str] = None) -> Path:
    """Where the library for ``cap`` (default :func:`capability`) is cached: ``<cache_root()>/<key>``, the key
    hashing the sources and headers, the flags, torch, Python and the compiler (:func:`.build.library_key`);
    just :func:`.build.cache_root` when no compiler is installed (the key is then unknown)."""
    name, sources, flags = _build_inputs(cap or capability())
    try:
        return cache_root() / library_key(name, sources, include_dirs=[_HERE], extra_cflags=flags,
                                          extra_ldflags=_ldflags(flags))
    except RuntimeError:
        return cache_root()


def load_library(verbose: bool = False) -> str:
    """Build (once per version of the sources: :func:`.build.build_library`) and load the native library;
    returns the path of the ``.so``. Raises ``RuntimeError`` with the reason if it cannot be built."""
    name, sources, flags = _build_inputs(capability())
    path = build_library(name, sources, include_dirs=[_HERE], extra_cflags=flags, extra_ldflags=_ldflags(flags),
                         verbose=verbose)
    torch.ops.load_library(str(path))
    return str(path)


def _summary(exc: BaseException) -> str:
    """One line out of a build failure (the builder's first line names the compiler error)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0][:300] if lines else type(exc).__name__
    return (f"the native CPU kernel could not be built: {first} (cache {cache_root()}; set "
            f"QKVFUSE_BACKEND=reference to skip it)")


def available() -> Tuple[bool, str]:
    """``(True, "")`` once the native library is built and loaded (its C++ kernels registered), else
    ``(False, reason)``; tried once per process."""
    global _state
    with _lock:
        if _state is None:
            # The lazy Python kernel and the Python version-counter kernels make way first: the library
            # registers its C++ kernels for the same keys when it loads.
            if _lazy_lib is not None:
                _lazy_lib._destroy()
            _library.version_libraries.pop("auto")._destroy()
            try:
                load_library()
                _state = (True, "")
            except Exception as exc:  # a missing compiler, a failed build: the lazy kernel falls back
                _state = (False, _summary(exc))
                _library.version_libraries["auto"] = _library.register_version_kernels("auto")
                if _fall_back is not None:
                    _register_lazy()
    return _state


def prebuild() -> str:
    """Build and load the native library now (``python -m qkvfuse build``); returns the path of the ``.so``.
    Raises ``RuntimeError`` with the reason when it cannot be built."""
    ok, reason = available()
    if not ok:
        raise RuntimeError(reason)
    name, sources, flags = _build_inputs(capability())
    # the fast path now
    return str(build_library(name, sources, include_dirs=[_HERE], extra_cflags=flags, extra_ldflags=_ldflags(flags)))


# --------------------------------------------------------------------------------------------------------
# The lazy kernel: registered at import for the auto ops' CPU key; the first call builds and loads
# the library, after which the dispatcher calls the C++ kernels directly (this Python kernel is destroyed).
# --------------------------------------------------------------------------------------------------------
_lazy_lib: Optional[torch.library.Library] = None
_fall_back = None


def _first_call(op: str, fallback):
    """The CPU kernel of op ``op`` until the library is loaded: it builds and loads the library, then runs the op
    again on the CPU key -- now the C++ kernel, exactly as every later call -- or ``fallback`` (the reference
    kernel of that schema) with one warning when the library cannot be built."""
    overload = getattr(torch.ops.qkvfuse, op).default
    cpu_keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

    def kernel(*args):
        ok, reason = available()
        if not ok:
            _fall_back(reason)
            return fallback(*args)
        return overload.redispatch(cpu_keys, *args)

    return kernel


def register_lazy_kernels(fall_back) -> None:
    """Register the building-on-first-call kernels (``fall_back(reason)`` warns when the build fails)."""
    global _fall_back
    if _fall_back is None:
        _fall_back = fall_back
        _register_lazy()


def _register_lazy() -> None:
    global _lazy_lib
    _lazy_lib = _library.impl_library("auto")
    fallbacks = _library.schema_kernels(reference.split_qkv_rmsnorm_rope_out, reference.add_rmsnorm_out,
                                        reference.split_qkv_rmsnorm_rope_cache)
    for op, fallback in fallbacks.items():
        _lazy_lib.impl(op, _first_call(op, fallback), "CPU")


def split_qkv_rmsnorm_rope_out(qkv, positions, config, q_out, k_out, v_out, gate_out) -> None:
    """The native kernel as a launcher (a :class:`qkvfuse._library.SplitConfig`, checked input; see
    :mod:`qkvfuse.reference`): the op's in-place form when ``config.inplace``, else its out= form."""
    if config.inplace:
        torch.ops.qkvfuse.split_qkv_rmsnorm_rope_inplace.default(qkv, positions, *config.schema_args())
    else:
        torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out.default(qkv, positions, *config.schema_args(), q_out, k_out,
                                                             v_out, gate_out)


def add_rmsnorm_out(x, residual, weight, bias, eps, gemma, y_out, residual_out) -> None:
    """The native kernel with the reference signature (validated input; see :mod:`qkvfuse.reference`)."""
    torch.ops.qkvfuse.add_rmsnorm_out.default(x, residual, weight, bias, eps, y_out, residual_out, gemma)
