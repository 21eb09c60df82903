"""Backends and the backend rule.

Three backends implement every op of :mod:`qkvfuse._library`:

* ``reference`` -- :mod:`qkvfuse.reference`, plain PyTorch on any device (the specification);
* ``cpu`` -- the native C++ kernels (:mod:`.cpu`), built on first need;
* ``triton`` -- :mod:`.triton`, for ``cuda``/``xpu``/``npu`` tensors, and CPU tensors under ``TRITON_INTERPRET=1``.

Importing this package (``import qkvfuse`` does) registers every backend's kernels with the dispatcher, so
``torch.ops.qkvfuse.*`` -- also in a ``torch.export`` program loaded in a fresh process -- reaches the right
kernel whatever was imported before. The expensive parts stay lazy behind the registered kernels: the native
library is compiled (once per version, cached) and Triton imported on the first call that needs them.

The backend rule (:func:`select_ops`, the one place it lives): a ``backend=`` argument, else
``$QKVFUSE_BACKEND``, else ``auto``. ``auto`` is the ops of the ``qkvfuse`` namespace, for which the dispatcher
picks by device -- ``cpu`` for CPU tensors, ``triton`` for ``cuda``/``xpu``/``npu`` tensors, ``reference`` on other
devices -- and an automatically chosen backend that cannot be built or imported falls back to ``reference``
with one warning. An explicitly requested backend that is unavailable raises.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from typing import Dict, Optional, Tuple

from .. import _library, reference
from . import native_host

__all__ = ["BACKEND_NAMES", "select_ops", "resolve_backend", "available_backends", "backend_unavailable",
           "get_backend", "triton_host_kernels"]

BACKEND_NAMES = ("reference", "cpu", "triton")
_MODULES = {"reference": "qkvfuse.reference", "cpu": "qkvfuse.backends.cpu", "triton": "qkvfuse.backends.triton"}
# Device type -> the backend "auto" means there; other device types get the reference.
_DEVICE_BACKEND = {"cpu": "cpu", "cuda": "triton", "xpu": "triton", "npu": "triton"}
# Backend -> the ops that run it (a key of qkvfuse._library.NAMESPACES; the native CPU kernels are the auto
# ops' CPU kernels).
_OPS = {"reference": "reference", "cpu": "auto", "triton": "triton"}
# Backend -> device types it serves.
_SERVES = {"reference": None, "cpu": ("cpu",), "triton": ("cuda", "xpu", "npu", "cpu")}
_TRITON_KEYS = {"cuda": "CUDA", "xpu": "XPU", "npu": "PrivateUse1"}

_loaded: Dict[str, object] = {"reference": reference}
_unavailable: Dict[str, str] = {}
_lock = threading.Lock()


def _load(name: str) -> Tuple[Optional[object], str]:
    """``(module, "")`` once backend ``name`` is built/imported and usable, else ``(None, reason)``; tried once."""
    if name in _loaded:
        return _loaded[name], ""
    with _lock:
        if name not in _loaded and name not in _unavailable:
            try:
                module = importlib.import_module(_MODULES[name])
                ok, reason = module.available()
            except Exception as exc:  # an import or build failure makes the backend unavailable, with the reason
                ok, reason = False, f"{type(exc).__name__}: {exc}"
            if ok:
                _loaded[name] = module
            else:
                _unavailable[name] = reason
    return _loaded.get(name), _unavailable.get(name, "")


def available_backends() -> Dict[str, str]:
    """``{name: ""}`` for usable backends and ``{name: reason}`` for unusable ones (builds/imports them)."""
    return {name: backend_unavailable(name) for name in BACKEND_NAMES}


def backend_unavailable(name: str) -> str:
    """``""`` once backend ``name`` is usable, else the reason (builds/imports that backend alone: on a GPU
    machine, asking about ``triton`` does not compile the native CPU library)."""
    return _load(name)[1]


def get_backend(name: str):
    """The backend module ``name`` (raises ``RuntimeError`` with the reason when unavailable)."""
    module, reason = _load(name)
    if module is None:
        raise RuntimeError(f"qkvfuse: backend {name!r} is unavailable: {reason}")
    return module


def _unavailable_reason(name: str) -> Optional[str]:
    """``None`` once backend ``name`` is usable, else the reason. Dynamo calls it as it traces and keeps the
    answer as a constant: a process's first qkvfuse call may be inside ``torch.compile(fullgraph=True)``, and
    loading a backend (an import, a build, a lock) cannot be traced."""
    module, reason = _load(name)
    return None if module is not None else reason


# What torch.compiler.assume_constant_result(_unavailable_reason) does, without importing torch._dynamo (and with
# it Triton) at `import qkvfuse`; tests/test_modes.py (first call inside torch.compile, fresh process per backend)
# keeps it working.
_unavailable_reason._dynamo_marked_constant = True


_warned: set = set()


def _fall_back(name: str, reason: str) -> None:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"qkvfuse: backend {name!r} unavailable ({reason}); using the reference backend",
                      RuntimeWarning, stacklevel=4)


_selected: Dict[Tuple[Optional[str], str], str] = {}


def _select(backend: Optional[str], device_type: str, source: str) -> str:
    hit = _selected.get((backend, device_type))
    if hit is not None:
        return hit
    hit = _selected[(backend, device_type)] = _select_uncached(backend, device_type, source)
    return hit


# A constant for Dynamo too (its arguments are constants in a traced call): traced, the cache lookup guarded the
# graph on the cache's contents, and the entry the first call added failed that guard -- every torch.compile'd
# function calling qkvfuse was compiled twice in a process (tests/test_modes.py counts the compiles).
_select._dynamo_marked_constant = True


def _select_uncached(backend: Optional[str], device_type: str, source: str) -> str:
    if backend is None or backend == "auto":
        return "auto"
    if not isinstance(backend, str) or backend not in BACKEND_NAMES:
        raise ValueError(f"{source}: expected one of {('auto',) + BACKEND_NAMES}, got {backend!r}")
    serves = _SERVES[backend]
    if serves is not None and device_type not in serves:
        raise ValueError(f"{source}: backend {backend!r} does not run {device_type} tensors "
                         f"(it serves {', '.join(serves)})")
    reason = _unavailable_reason(backend)
    if reason is not None:
        raise RuntimeError(f"qkvfuse: backend {backend!r} was requested but is unavailable: {reason}")
    return _OPS[backend]


def select_ops(backend: Optional[str], device_type: str) -> str:
    """The ops (``"auto"``, ``"reference"`` or ``"triton"``: a key of :data:`qkvfuse._library.NAMESPACES`) that
    run ``backend`` -- an argument
    value, ``None`` meaning ``$QKVFUSE_BACKEND`` or ``auto`` -- on tensors of ``device_type``. Cached per
    (backend, device type, environment value); raises ``ValueError`` for an unknown backend and
    ``RuntimeError`` for an unavailable one."""
    if backend is not None:
        return _select(backend, device_type, "backend")
    return _select(os.environ.get("QKVFUSE_BACKEND") or None, device_type, "QKVFUSE_BACKEND")


def resolve_backend(backend: Optional[str], device_type: str) -> str:
    """The name of the backend that runs for ``backend`` on ``device_type`` (builds or imports it to know)."""
    ops = select_ops(backend, device_type)
    if ops != "auto":
        return ops
    name = _DEVICE_BACKEND.get(device_type, "reference")
    return name if _load(name)[0] is not None else "reference"


# --------------------------------------------------------------------------------------------------------
# Registration (at import). The reference is the auto ops' kernel on devices without another one.
# --------------------------------------------------------------------------------------------------------
_impls = {name: _library.impl_library(name) for name in _library.NAMESPACES}
for _name in ("reference", "auto"):
    _library.register_kernels(_impls[_name], "CompositeExplicitAutograd", reference.split_qkv_rmsnorm_rope_out,
                              reference.add_rmsnorm_out, reference.split_qkv_rmsnorm_rope_cache)


class _LazyTriton:
    """Triton kernels for one set of ops: import the backend on the first call. For ``auto`` a failed
    import falls back to the reference with one warning; for ``triton`` (requested) it raises.

    The first call also switches the Triton ops to the native host kernels where the native library has them
    (:mod:`.native_host`): later calls are checked in C++ and reach the launchers through :meth:`host_split` /
    :meth:`host_norm` / :meth:`host_cache`, which point the C++ kernels at the backend's own launchers once it is
    imported."""

    def __init__(self, name: str, fallback: bool):
        self.name, self.fallback = name, fallback
        self.split_out = self.norm_out = self.split_cache = None
        self.split_entry = self.norm_entry = self.cache_entry = None

    def _kernels(self):
        if self.split_out is None:
            module, reason = _load("triton")
            if module is None:
                if not self.fallback:
                    raise RuntimeError(f"qkvfuse: backend 'triton' was requested but is unavailable: {reason}")
                _fall_back("triton", reason)
                module = reference
                self.split_entry = native_host.split_entry_of(reference.split_qkv_rmsnorm_rope_out)
                self.norm_entry = native_host.norm_entry_of(reference.add_rmsnorm_out)
            else:
                self.split_entry, self.norm_entry = module.split_entry, module.add_rmsnorm_out
            self.split_out, self.norm_out = module.split_qkv_rmsnorm_rope_out, module.add_rmsnorm_out
            self.split_cache = module.split_qkv_rmsnorm_rope_cache
            self.cache_entry = native_host.cache_entry_of(module.split_qkv_rmsnorm_rope_cache,
                                                          staging=module is not reference)
            triton_host_kernels()
            native_host.set_launchers(self.name, self.split_entry, self.norm_entry, self.cache_entry)
        return self

    def split(self, *args):
        self._kernels().split_out(*args)

    def norm(self, *args):
        self._kernels().norm_out(*args)

    def cache(self, *args):
        self._kernels().split_cache(*args)

    def host_split(self, *args):
        self._kernels().split_entry(*args)

    def host_norm(self, *args):
        self._kernels().norm_entry(*args)

    def host_cache(self, *args):
        self._kernels().cache_entry(*args)


def triton_host_kernels() -> bool:
    """Switch the Triton ops to the native host kernels now (the first Triton launch does it anyway; this loads the
    native library, building it where needed); returns whether they run them (:mod:`.native_host`)."""
    return native_host.enable(_triton_libs, {lazy.name: (lazy.host_split, lazy.host_norm, lazy.host_cache)
                                             for lazy in _lazies})


# The Python kernels of the Triton keys, in libraries of their own: native_host.enable destroys them when the C++
# kernels take over.
_triton_libs = []
_lazies = []
for _name, _keys in (("auto", _TRITON_KEYS.values()), ("triton", ("CPU", *_TRITON_KEYS.values()))):
    _lazy = _LazyTriton(_name, fallback=_name == "auto")
    _lazies.append(_lazy)
    _triton_libs.append(_library.impl_library(_name))
    for _key in _keys:
        _library.register_kernels(_triton_libs[-1], _key, _lazy.split, _lazy.norm, _lazy.cache)

from . import cpu as _cpu  # noqa: E402  (registers the lazily built native kernels for CPU tensors)

_cpu.register_lazy_kernels(lambda reason: _fall_back("cpu", reason))
