"""Public ops: argument validation (once, here), backend dispatch and ``torch.library`` registration.

The op schemas are defined once, below, in the ``qkvfuse`` namespace:

* ``torch.ops.qkvfuse.split_qkv_rmsnorm_rope`` -- functional, returns ``(q, k, v)``;
* ``torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out`` -- writes ``q_out, k_out, v_out``;
* ``torch.ops.qkvfuse.split_qkv_rmsnorm_rope_inplace`` -- rewrites Q and K inside ``qkv``;
* ``torch.ops.qkvfuse.add_rmsnorm`` / ``add_rmsnorm_out`` -- fused residual add + RMSNorm (+ bias).

The reference backend is registered for ``CompositeExplicitAutograd`` (any device); the native CPU kernel
registers the ``CPU`` key from C++ and the Triton kernel the ``CUDA``/``XPU``/``PrivateUse1`` keys, so a
machine without them still has the reference. Fake implementations let ``torch.compile(fullgraph=True)``
trace the ops. The raw ``torch.ops`` entry points assume validated input: call the Python functions below.

Position range checks: positions outside ``[0, max_position)`` raise ``ValueError``. The check is done where
it costs no host synchronisation -- in Python for CPU tensors on the reference and Triton-interpreter
backends, inside the native CPU kernel (before any output is written) -- and on accelerators in eager mode. Under ``torch.compile`` or
CUDA-graph capture on an accelerator the check would need a host sync, so it is skipped and the kernel clamps
positions into the table instead: nothing outside the cache is ever read.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import backends as _backends
from . import reference
from .backends import get_backend, resolve_backend

__all__ = ["split_qkv_rmsnorm_rope", "split_qkv_rmsnorm_rope_", "add_rmsnorm"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64)
MAX_HEAD_DIM = 512

# --------------------------------------------------------------------------------------------------------
# Schemas (the single definition) and the reference registration.
# --------------------------------------------------------------------------------------------------------
_SPLIT_ARGS = (
    "Tensor positions, Tensor cos_sin_cache, int num_q_heads, int num_kv_heads, int head_dim, "
    "Tensor? q_weight, Tensor? k_weight, Tensor? q_bias, Tensor? k_bias, float eps, bool is_neox, "
    "int[] mrope_section, bool mrope_interleaved"
)
_NORM_ARGS = "Tensor? residual, Tensor weight, Tensor? bias, float eps"

_lib = torch.library.Library("qkvfuse", "DEF")
_lib.define(f"split_qkv_rmsnorm_rope(Tensor qkv, {_SPLIT_ARGS}) -> (Tensor, Tensor, Tensor)")
_lib.define(f"split_qkv_rmsnorm_rope_out(Tensor qkv, {_SPLIT_ARGS}, Tensor(a!) q_out, Tensor(b!) k_out, "
            "Tensor(c!) v_out) -> ()")
_lib.define(f"split_qkv_rmsnorm_rope_inplace(Tensor(a!) qkv, {_SPLIT_ARGS}) -> ()")
_lib.define(f"add_rmsnorm(Tensor x, {_NORM_ARGS}) -> (Tensor, Tensor)")
_lib.define(f"add_rmsnorm_out(Tensor x, {_NORM_ARGS}, Tensor(a!) y_out, Tensor(b!)? residual_out) -> ()")


def _split_outputs(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int):
    T = qkv.shape[0]
    kv = num_kv_heads * head_dim
    return (qkv.new_empty((T, num_q_heads * head_dim)), qkv.new_empty((T, kv)), qkv.new_empty((T, kv)))


def _inplace_views(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int):
    q_width, kv_width = num_q_heads * head_dim, num_kv_heads * head_dim
    # One op for the three views: each tensor op costs microseconds, a decode step's whole budget.
    return tuple(qkv.split_with_sizes([q_width, kv_width, kv_width], dim=1))


def register_split_kernels(dispatch_key: str, out_kernel) -> None:
    """Register ``out_kernel`` (reference signature) for all three split ops on ``dispatch_key``."""

    def functional(qkv, *args):
        outs = _split_outputs(qkv, *args[2:5])
        out_kernel(qkv, *args, *outs)
        return outs

    def inplace(qkv, *args):
        out_kernel(qkv, *args, *_inplace_views(qkv, *args[2:5]))

    _lib.impl("split_qkv_rmsnorm_rope", functional, dispatch_key)
    _lib.impl("split_qkv_rmsnorm_rope_out", out_kernel, dispatch_key)
    _lib.impl("split_qkv_rmsnorm_rope_inplace", inplace, dispatch_key)


def register_norm_kernels(dispatch_key: str, out_kernel) -> None:
    """Register ``out_kernel`` (reference signature) for both add_rmsnorm ops on ``dispatch_key``."""

    def functional(x, residual, weight, bias, eps):
        y = torch.empty_like(x)
        residual_out = torch.empty_like(x) if residual is not None else x.new_empty((0,))
        out_kernel(x, residual, weight, bias, eps, y, residual_out if residual is not None else None)
        return y, residual_out

    _lib.impl("add_rmsnorm", functional, dispatch_key)
    _lib.impl("add_rmsnorm_out", out_kernel, dispatch_key)


register_split_kernels("CompositeExplicitAutograd", reference.split_qkv_rmsnorm_rope_out)
register_norm_kernels("CompositeExplicitAutograd", reference.add_rmsnorm_out)


@torch.library.register_fake("qkvfuse::split_qkv_rmsnorm_rope")
def _split_fake(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, *_):
    return _split_outputs(qkv, num_q_heads, num_kv_heads, head_dim)


@torch.library.register_fake("qkvfuse::split_qkv_rmsnorm_rope_out")
def _split_out_fake(*_):
    return None


@torch.library.register_fake("qkvfuse::split_qkv_rmsnorm_rope_inplace")
def _split_inplace_fake(*_):
    return None


@torch.library.register_fake("qkvfuse::add_rmsnorm")
def _norm_fake(x, residual, weight, bias, eps):
    return torch.empty_like(x), (torch.empty_like(x) if residual is not None else x.new_empty((0,)))


@torch.library.register_fake("qkvfuse::add_rmsnorm_out")
def _norm_out_fake(*_):
    return None


# --------------------------------------------------------------------------------------------------------
# Validation: one place, messages name the argument, the value and the expectation.
# --------------------------------------------------------------------------------------------------------
def _fail(arg: str, got, expected: str, exc=ValueError):
    raise exc(f"{arg}: expected {expected}, got {got}")


def _check_int(arg: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(arg, repr(value), f"an int >= {minimum}", TypeError if not isinstance(value, int) else ValueError)


def _check_tensor(arg: str, t, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(arg, type(t).__name__, "a torch.Tensor", TypeError)
    if t.device != device:
        _fail(arg, f"a tensor on {t.device}", f"a tensor on {device} (the device of the first input)")


def _check_vector(arg: str, t, length: int, device: torch.device, dtypes: Tuple[torch.dtype, ...]) -> None:
    _check_tensor(arg, t, device)
    if t.dtype not in dtypes:
        _fail(arg, f"dtype {t.dtype}", f"one of {list(dtypes)}", TypeError)
    if t.dim() != 1 or t.shape[0] != length:
        _fail(arg, f"shape {tuple(t.shape)}", f"shape ({length},)")


def _check_eps(eps) -> float:
    # A chained comparison rather than math.isfinite: it also traces under torch.compile(dynamic=True).
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        _fail("eps", repr(eps), "a finite number >= 0", TypeError if not isinstance(eps, (int, float)) else ValueError)
    return float(eps)


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """Byte range ``[start, end)`` touched by a strided tensor (empty for numel 0)."""
    if t.numel() == 0:
        return (0, 0)
    size_of = t.element_size()
    start = end = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        reach = (size - 1) * stride * size_of
        if reach < 0:
            start += reach
        else:
            end += reach
    return (start, end + size_of)


def _spans_overlap(a: Tuple[int, int], b: Tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _spans_overlap(_span(a), _span(b))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _check_outputs(names: Sequence[str], outs, expected_shapes, like: torch.Tensor, inputs, own_slices) -> None:
    """``outs`` match shape/dtype/device/layout and overlap nothing except (exactly) their own input slice.

    ``own_slices`` holds, per output, ``(input name, the view it may alias)`` or None; it may be a callable
    returning that list, called only when an output overlaps an input (slicing costs microseconds)."""
    if not isinstance(outs, (tuple, list)) or len(outs) != len(names):
        _fail("out", type(outs).__name__ if not isinstance(outs, (tuple, list)) else f"{len(outs)} tensors",
              f"a tuple of {len(names)} tensors ({', '.join(names)})", TypeError)
    for name, t, shape in zip(names, outs, expected_shapes):
        if t is None:
            continue
        _check_tensor(name, t, like.device)
        if t.dtype != like.dtype:
            _fail(name, f"dtype {t.dtype}", f"dtype {like.dtype} (the input's)", TypeError)
        if tuple(t.shape) != shape:
            _fail(name, f"shape {tuple(t.shape)}", f"shape {shape}")
        if t.numel() and (t.stride(1) != 1 or t.stride(0) < t.shape[1]):
            _fail(name, f"strides {t.stride()}", "a contiguous last dim and non-overlapping rows")
    if torch.compiler.is_compiling():
        return  # data pointers are not traceable; overlap is checked in eager mode
    # Each tensor's byte range is computed once (this check runs on every decode step of an engine).
    present = [(n, t, i, _span(t)) for i, (n, t) in enumerate(zip(names, outs)) if t is not None]
    sources = [(in_name, _span(src)) for in_name, src in inputs if src is not None]
    for k, (name, t, i, span) in enumerate(present):
        for in_name, src_span in sources:
            if not _spans_overlap(span, src_span):
                continue
            if callable(own_slices):
                own_slices = own_slices()
            own = own_slices[i]
            if own is not None and in_name == own[0] and _same_view(t, own[1]):
                continue
            _fail(name, f"memory overlapping {in_name}",
                  "no overlap with an input other than exactly aliasing its own slice of it")
        for other_name, _, _, other_span in present[k + 1 :]:
            if _spans_overlap(span, other_span):
                _fail(name, f"memory overlapping {other_name}", "outputs that do not overlap each other")


def _check_positions_in_range(positions: torch.Tensor, max_position: int) -> None:
    if positions.numel() == 0:
        return
    if torch.compiler.is_compiling():
        return  # kernels clamp; a range check here would need a host sync (or a graph break)
    if positions.device.type != "cpu":
        stream_capturing = getattr(torch.get_device_module(positions.device), "is_current_stream_capturing", None)
        if stream_capturing is not None and stream_capturing():
            return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= max_position:
        _fail("positions", f"values in [{lo}, {hi}]", f"values in [0, {max_position}) (cos_sin_cache rows)")


def _validate_split(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight, k_weight,
                    q_bias, k_bias, eps, is_neox, mrope_section, mrope_interleaved) -> Tuple[int, List[int], float]:
    if not isinstance(qkv, torch.Tensor):
        _fail("qkv", type(qkv).__name__, "a torch.Tensor", TypeError)
    device = qkv.device
    if qkv.dtype not in _FLOATS:
        _fail("qkv", f"dtype {qkv.dtype}", "torch.float32, torch.bfloat16 or torch.float16", TypeError)
    _check_int("num_q_heads", num_q_heads)
    _check_int("num_kv_heads", num_kv_heads)
    _check_int("head_dim", head_dim, 2)
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        _fail("head_dim", head_dim, f"an even int <= {MAX_HEAD_DIM}")
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        _fail("qkv", f"shape {tuple(qkv.shape)}",
              f"shape (T, {width}) = (T, (num_q_heads + 2*num_kv_heads) * head_dim) for "
              f"num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}")
    if qkv.numel() and (qkv.stride(1) != 1 or qkv.stride(0) < width):
        _fail("qkv", f"strides {qkv.stride()}", "a contiguous last dim (stride 1) and row stride >= width")
    T = qkv.shape[0]

    _check_tensor("cos_sin_cache", cos_sin_cache, device)
    if cos_sin_cache.dtype not in _FLOATS:
        _fail("cos_sin_cache", f"dtype {cos_sin_cache.dtype}", "torch.float32, torch.bfloat16 or torch.float16",
              TypeError)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[0] < 1:
        _fail("cos_sin_cache", f"shape {tuple(cos_sin_cache.shape)}", "shape (max_position >= 1, rotary_dim)")
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        _fail("cos_sin_cache", f"rotary_dim (shape[1]) = {rotary_dim}", f"an even rotary_dim in [2, head_dim={head_dim}]")
    if cos_sin_cache.stride(1) != 1 or cos_sin_cache.stride(0) < rotary_dim:
        _fail("cos_sin_cache", f"strides {cos_sin_cache.stride()}", "a contiguous last dim and row stride >= rotary_dim")

    _check_tensor("positions", positions, device)
    if positions.dtype not in _INTS:
        _fail("positions", f"dtype {positions.dtype}", "torch.int32 or torch.int64", TypeError)
    if mrope_section is None:
        sections: List[int] = []
        if positions.dim() != 1 or positions.shape[0] != T:
            hint = " (3-D positions need mrope_section)" if positions.dim() == 2 else ""
            _fail("positions", f"shape {tuple(positions.shape)}", f"shape ({T},) for RoPE{hint}")
    else:
        if not isinstance(mrope_section, (tuple, list)) or len(mrope_section) != 3 or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in mrope_section
        ):
            _fail("mrope_section", repr(mrope_section), "three non-negative ints (s_t, s_h, s_w)", TypeError)
        sections = list(mrope_section)
        if sum(sections) != rotary_dim // 2:
            _fail("mrope_section", f"{tuple(sections)} (sum {sum(sections)})",
                  f"sections summing to rotary_dim // 2 = {rotary_dim // 2}")
        if positions.dim() != 2 or tuple(positions.shape) != (3, T):
            _fail("positions", f"shape {tuple(positions.shape)}", f"shape (3, {T}) (temporal, height, width) with mrope_section")
    if not isinstance(mrope_interleaved, bool):
        _fail("mrope_interleaved", repr(mrope_interleaved), "a bool", TypeError)
    if not isinstance(is_neox, bool):
        _fail("is_neox", repr(is_neox), "a bool", TypeError)

    if (q_weight is None) != (k_weight is None):
        _fail("q_weight/k_weight", "only one of them", "both (QK-norm) or neither (no norm)")
    weight_dtypes = (torch.float32, qkv.dtype)
    if q_weight is not None:
        _check_vector("q_weight", q_weight, head_dim, device, weight_dtypes)
        _check_vector("k_weight", k_weight, head_dim, device, weight_dtypes)
    for name, bias in (("q_bias", q_bias), ("k_bias", k_bias)):
        if bias is not None:
            if q_weight is None:
                _fail(name, "a bias without norm weights", "q_weight and k_weight when a norm bias is given")
            _check_vector(name, bias, head_dim, device, weight_dtypes)
    eps = _check_eps(eps)
    return T, sections, eps


def _validate_norm(x, residual, weight, bias, eps) -> float:
    if not isinstance(x, torch.Tensor):
        _fail("x", type(x).__name__, "a torch.Tensor", TypeError)
    if x.dtype not in _FLOATS:
        _fail("x", f"dtype {x.dtype}", "torch.float32, torch.bfloat16 or torch.float16", TypeError)
    if x.dim() != 2 or x.shape[1] < 1:
        _fail("x", f"shape {tuple(x.shape)}", "shape (T, H) with H >= 1")
    if x.numel() and (x.stride(1) != 1 or x.stride(0) < x.shape[1]):
        _fail("x", f"strides {x.stride()}", "a contiguous last dim and row stride >= H")
    if residual is not None:
        _check_tensor("residual", residual, x.device)
        if residual.dtype != x.dtype:
            _fail("residual", f"dtype {residual.dtype}", f"dtype {x.dtype} (x's)", TypeError)
        if residual.shape != x.shape:
            _fail("residual", f"shape {tuple(residual.shape)}", f"shape {tuple(x.shape)} (x's)")
        if residual.numel() and (residual.stride(1) != 1 or residual.stride(0) < x.shape[1]):
            _fail("residual", f"strides {residual.stride()}", "a contiguous last dim and row stride >= H")
    H = x.shape[1]
    _check_vector("weight", weight, H, x.device, (torch.float32, x.dtype))
    if bias is not None:
        _check_vector("bias", bias, H, x.device, (torch.float32, x.dtype))
    return _check_eps(eps)


# --------------------------------------------------------------------------------------------------------
# Public functions.
# --------------------------------------------------------------------------------------------------------
# (backend argument, device type, QKVFUSE_BACKEND, op) -> (name, kernel, backend module): resolving a backend
# costs microseconds, a decode step's whole budget. An entry is dropped when its backend is re-registered.
_KERNELS: Dict[Tuple[Optional[str], str, Optional[str], str], Tuple[str, object, object]] = {}

# ``os.environ.get`` of an unset name raises and catches a KeyError inside (1.7 us here, a third of a decode
# step's budget); the encoded mapping behind ``os.environ`` (CPython's ``os._Environ``) answers in ~50 ns.
class _EnvLookup:
    """``get(key)`` of the raw ``$QKVFUSE_BACKEND`` (None when unset), wherever ``os.environ`` keeps it."""

    def get(self, _key):
        return os.environ.get("QKVFUSE_BACKEND")


_ENV_DATA = getattr(os.environ, "_data", None)
if isinstance(_ENV_DATA, dict) and hasattr(os.environ, "encodekey"):
    _ENV_KEY = os.environ.encodekey("QKVFUSE_BACKEND")
else:
    _ENV_DATA, _ENV_KEY = _EnvLookup(), None


def _env_backend() -> Optional[str]:
    """``$QKVFUSE_BACKEND``, or None when unset."""
    value = _ENV_DATA.get(_ENV_KEY)
    return value if value is None or isinstance(value, str) else os.environ.decodevalue(value)


def _resolved(backend: Optional[str], device_type: str, op: str) -> Tuple[str, object, object]:
    """``(backend name, kernel, backend module)`` running ``op`` (an ``*_out`` kernel name) on ``device_type``."""
    key = (backend, device_type, _env_backend() if backend is None else None, op)
    hit = _KERNELS.get(key)
    if hit is not None and _backends._loaded.get(hit[0]) is hit[2]:
        return hit
    name = resolve_backend(backend, device_type)
    if name == "reference":
        kernel, module = getattr(reference, op), _backends._loaded.get(name)
    else:
        module = get_backend(name)
        # Backends reached through the dispatcher (native CPU, Triton on a device) go through ``torch.ops`` so
        # torch.compile sees one opaque op; others (Triton under the CPU interpreter) are called directly.
        if getattr(module, "DISPATCH_DEVICE_TYPES", ()) and device_type in module.DISPATCH_DEVICE_TYPES:
            kernel = getattr(torch.ops.qkvfuse, op)
        else:
            kernel = getattr(module, op)
    hit = _KERNELS[key] = (name, kernel, module)
    return hit


def _kernel(backend: Optional[str], device: torch.device, op: str):
    """``(backend name, the callable that runs op)`` for tensors on ``device``."""
    name, kernel, _ = _resolved(backend, device.type, op)
    return name, kernel


_LOADED = _backends._loaded
# Bound once: it is called on every op call. Dynamo folds it to True while tracing (the C entry would break the
# graph); other tracers (export's non-strict mode, make_fx) pass fake tensors or run under a dispatch mode,
# which the entry hands back to the dispatcher by itself.
_is_compiling = torch.compiler.is_dynamo_compiling


def _cpu_entry(backend: Optional[str]):
    """The native CPU library's Python entry (``backends/cpu/python_entry.cpp``) when ``backend`` resolves to the
    cpu backend for CPU tensors, else None.

    A decode step's budget is a few microseconds: a ``torch.ops`` call with the split's 17 arguments costs about
    5 us and :func:`_validate_split` about as much. The entry's ``split`` / ``split_inplace`` / ``add_rmsnorm``
    take the public function's arguments as they are, check the scalars' Python types and the tensors with the
    kernels' predicates (``plainly_valid`` and ``plainly_valid_outputs`` in
    ``backends/cpu/split_qkv_rmsnorm_rope.cpp``, ``norm_plainly_valid`` and ``add_rmsnorm_checked_out`` in
    ``backends/cpu/add_rmsnorm.cpp``: the rules of :func:`_validate_split`, :func:`_validate_norm` and
    :func:`_check_outputs` one for one) and run the kernel. Anything they doubt -- and tensor subclasses,
    autograd, dispatch modes, profiler callbacks -- returns None with no output touched: the caller then
    validates as usual and raises the usual errors. Out-of-range positions raise from the kernel, as on the
    ordinary path.
    """
    try:
        name, _, module = _resolved(backend, "cpu", "split_qkv_rmsnorm_rope_out")  # cached by _resolved
    except (TypeError, ValueError, RuntimeError):  # a bad backend argument: the validating path says why
        return None
    return getattr(module, "entry", None) if name == "cpu" else None


class _Unbound:
    """Stands in for the native entry until a call on plain CPU tensors resolves to the cpu backend; then
    :func:`_bind_native` puts the entry itself in ``_NATIVE`` and later calls go straight to it."""

    @staticmethod
    def split(qkv, *rest):
        entry = _bind_native(qkv, rest[-1])
        return None if entry is None else entry.split(qkv, *rest)

    @staticmethod
    def split_inplace(qkv, *rest):
        entry = _bind_native(qkv, rest[-1])
        return None if entry is None else entry.split_inplace(qkv, *rest)

    @staticmethod
    def add_rmsnorm(x, *rest):
        entry = _bind_native(x, rest[-1])
        return None if entry is None else entry.add_rmsnorm(x, *rest)


_NATIVE = _Unbound


def _bind_native(first, backend):
    """The native entry when this call (first tensor argument, ``backend`` argument) runs on the cpu backend,
    after handing it what it needs to decide that by itself on later calls; else None.

    Once bound, each public call costs one C call before the kernel: the entry checks the ``backend`` argument
    and ``$QKVFUSE_BACKEND`` against the registry (``selects_this_backend`` in ``python_entry.cpp``) and the
    tensors as :func:`_cpu_entry` describes. Only a CPU tensor loads the cpu backend (a CUDA user's first call
    builds nothing).
    """
    global _NATIVE
    if type(first) is not torch.Tensor or first.device.type != "cpu":
        return None
    entry = _cpu_entry(backend)
    if entry is not None and isinstance(_ENV_DATA, dict):
        entry.bind(_ENV_DATA, _ENV_KEY, _LOADED, _LOADED["cpu"])
        _NATIVE = entry
    return entry


def split_qkv_rmsnorm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    q_weight: Optional[torch.Tensor] = None,
    k_weight: Optional[torch.Tensor] = None,
    q_bias: Optional[torch.Tensor] = None,
    k_bias: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    is_neox: bool = True,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split packed QKV, RMSNorm each Q and K head, and apply RoPE / mRoPE -- in one pass.

    Parameters
    ----------
    qkv : torch.Tensor
        Packed projection, shape ``(T, (num_q_heads + 2 * num_kv_heads) * head_dim)``, layout
        ``[Q heads | K heads | V heads]``, each head ``head_dim`` contiguous values. fp32, bf16 or fp16.
        The last dim must be contiguous; the row stride may be larger (a view into a wider buffer).
    positions : torch.Tensor
        int32 or int64, any strides. Shape ``(T,)`` for RoPE; ``(3, T)`` for mRoPE, rows temporal, height,
        width (image tokens have differing rows; text and decode tokens equal rows). Values in
        ``[0, cos_sin_cache.shape[0])``.
    cos_sin_cache : torch.Tensor
        Shape ``(max_position, rotary_dim)``, fp32/bf16/fp16 whatever ``qkv``'s dtype. Row ``p`` is
        ``[cos(p*f_0..f_{R/2-1}) | sin(p*f_0..f_{R/2-1})]`` (see :func:`qkvfuse.build_cos_sin_cache`).
        **The rotary dim is read from this table** (even, at most ``head_dim``); dims past it pass
        through unrotated (partial rotary). Values are used as stored.
    num_q_heads, num_kv_heads, head_dim : int
        Head geometry; ``head_dim`` even, at most 512.
    q_weight, k_weight : torch.Tensor, optional
        RMSNorm weights, shape ``(head_dim,)``, shared by all heads, fp32 or ``qkv``'s dtype. Both or
        neither (no QK-norm, e.g. GLM-4.5-Air).
    q_bias, k_bias : torch.Tensor, optional
        Post-norm bias, shape ``(head_dim,)``: ``y = norm(x) * w + b`` (not the projection bias).
    eps : float
        RMSNorm epsilon.
    is_neox : bool
        NeoX rotate-half pairs ``(j, j + R/2)`` (Qwen3, GLM-4-MoE) or GPT-J interleaved pairs ``(2j, 2j+1)``.
    mrope_section : tuple of 3 ints, optional
        ``(s_t, s_h, s_w)`` summing to ``rotary_dim // 2``; requires positions of shape ``(3, T)``.
    mrope_interleaved : bool
        Qwen3-VL interleaved layout (True) or contiguous sections (Qwen2-VL, GLM-4.5V).
    out : tuple of 3 tensors, optional
        Preallocated ``(q, k, v)`` outputs with ``qkv``'s dtype, contiguous last dim, any row stride. Each
        may exactly alias its own slice of ``qkv``; any other overlap raises.
    backend : str, optional
        ``"reference"``, ``"cpu"``, ``"triton"`` or ``"auto"`` (default; also ``QKVFUSE_BACKEND``).

    Returns
    -------
    (q, k, v) : tuple of torch.Tensor
        Shapes ``(T, num_q_heads * head_dim)``, ``(T, num_kv_heads * head_dim)`` twice, ``qkv``'s dtype.
        All arithmetic is fp32 with one rounding at the end. NaN/Inf inputs propagate (a NaN in a head makes
        that head's normalised output NaN); they are not checked, which would cost a pass over the data.
    """
    if not _is_compiling():
        fast = _NATIVE.split(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight, k_weight,
                             q_bias, k_bias, eps, is_neox, mrope_section, mrope_interleaved, out, backend)
        if fast is not None:
            return fast
    T, sections, eps = _validate_split(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim,
                                       q_weight, k_weight, q_bias, k_bias, eps, is_neox, mrope_section,
                                       mrope_interleaved)
    name, kernel = _kernel(backend, qkv.device, "split_qkv_rmsnorm_rope_out")
    if out is None and kernel is torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out:
        if name != "cpu" or qkv.device.type != "cpu":  # the native CPU kernel checks inside
            _check_positions_in_range(positions, cos_sin_cache.shape[0])
        # The functional op allocates its outputs on the other side of the dispatcher (no Python allocations).
        return torch.ops.qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads,
                                                        head_dim, q_weight, k_weight, q_bias, k_bias, eps, is_neox,
                                                        sections, mrope_interleaved)
    if out is None:
        out = _split_outputs(qkv, num_q_heads, num_kv_heads, head_dim)
    else:
        kv = num_kv_heads * head_dim
        inputs = [("qkv", qkv), ("positions", positions), ("cos_sin_cache", cos_sin_cache), ("q_weight", q_weight),
                  ("k_weight", k_weight), ("q_bias", q_bias), ("k_bias", k_bias)]
        own_slices = lambda: [("qkv", view) for view in _inplace_views(qkv, num_q_heads, num_kv_heads, head_dim)]
        _check_outputs(("q_out", "k_out", "v_out"), out, ((T, num_q_heads * head_dim), (T, kv), (T, kv)), qkv,
                       inputs, own_slices)
        out = tuple(out)
    if name != "cpu" or qkv.device.type != "cpu":  # the native CPU kernel checks inside
        _check_positions_in_range(positions, cos_sin_cache.shape[0])
    kernel(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight, k_weight, q_bias,
           k_bias, eps, is_neox, sections, mrope_interleaved, *out)
    return out


def split_qkv_rmsnorm_rope_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    q_weight: Optional[torch.Tensor] = None,
    k_weight: Optional[torch.Tensor] = None,
    q_bias: Optional[torch.Tensor] = None,
    k_bias: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    is_neox: bool = True,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In-place :func:`split_qkv_rmsnorm_rope`: Q and K are rewritten inside ``qkv`` (what serving engines do).

    Same arguments and semantics as :func:`split_qkv_rmsnorm_rope` (without ``out``). Returns views
    ``q = qkv[:, :Hq*D]``, ``k = qkv[:, Hq*D:(Hq+Hkv)*D]``, ``v = qkv[:, (Hq+Hkv)*D:]`` (row stride = qkv's);
    V is left untouched.
    """
    if not _is_compiling():
        fast = _NATIVE.split_inplace(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight,
                                     k_weight, q_bias, k_bias, eps, is_neox, mrope_section, mrope_interleaved,
                                     backend)
        if fast is not None:
            return fast
    _, sections, eps = _validate_split(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim,
                                       q_weight, k_weight, q_bias, k_bias, eps, is_neox, mrope_section,
                                       mrope_interleaved)
    for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache), ("q_weight", q_weight),
                    ("k_weight", k_weight), ("q_bias", q_bias), ("k_bias", k_bias)):
        if t is not None and not torch.compiler.is_compiling() and _overlaps(qkv, t):
            _fail("qkv", f"memory overlapping {name}", "an in-place target that overlaps no other input")
    views = _inplace_views(qkv, num_q_heads, num_kv_heads, head_dim)
    name, kernel = _kernel(backend, qkv.device, "split_qkv_rmsnorm_rope_out")
    if name != "cpu" or qkv.device.type != "cpu":  # the native CPU kernel checks inside
        _check_positions_in_range(positions, cos_sin_cache.shape[0])
    if kernel is torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out:
        torch.ops.qkvfuse.split_qkv_rmsnorm_rope_inplace(
            qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight, k_weight, q_bias,
            k_bias, eps, is_neox, sections, mrope_interleaved)
    else:
        kernel(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight, k_weight, q_bias,
               k_bias, eps, is_neox, sections, mrope_interleaved, *views)
    return views


def add_rmsnorm(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float = 1e-6,
    bias: Optional[torch.Tensor] = None,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    *,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm (+ post-norm bias).

    Parameters
    ----------
    x : torch.Tensor
        Shape ``(T, H)``, fp32/bf16/fp16, contiguous last dim (row stride may be larger).
    residual : torch.Tensor or None
        Shape ``(T, H)``, ``x``'s dtype; ``None`` for a plain RMSNorm.
    weight : torch.Tensor
        Shape ``(H,)``, fp32 or ``x``'s dtype.
    eps : float
        RMSNorm epsilon.
    bias : torch.Tensor, optional
        Post-norm bias, shape ``(H,)``: ``y = norm(s) * weight + bias``.
    out : tuple, optional
        Preallocated ``(y, residual_out)``, ``x``'s shape and dtype (``residual_out`` ignored without a
        residual). ``y`` may exactly alias ``x`` and ``residual_out`` exactly alias ``residual`` (the in-place
        form engines use); any other overlap raises.

    Returns
    -------
    (y, residual_out) : tuple of torch.Tensor
        ``residual_out = x + residual`` rounded to ``x.dtype`` (bit-exact with the unfused add; ``x`` itself
        when ``residual`` is None) and ``y = residual_out * rsqrt(mean(residual_out^2) + eps) * weight (+ bias)``
        computed in fp32 and rounded once.
    """
    if not _is_compiling():
        fast = _NATIVE.add_rmsnorm(x, residual, weight, eps, bias, out, backend)
        if fast is not None:
            return fast
    eps = _validate_norm(x, residual, weight, bias, eps)
    name, kernel = _kernel(backend, x.device, "add_rmsnorm_out")
    if out is None and kernel is torch.ops.qkvfuse.add_rmsnorm_out:
        y, residual_out = torch.ops.qkvfuse.add_rmsnorm(x, residual, weight, bias, eps)
        return y, (residual_out if residual is not None else x)
    if out is None:
        y = torch.empty_like(x)
        residual_out = torch.empty_like(x) if residual is not None else None
    else:
        shape = tuple(x.shape)
        if isinstance(out, (tuple, list)) and len(out) == 2 and residual is None:
            out = (out[0], None)
        _check_outputs(("y_out", "residual_out"), out, (shape, shape), x,
                       [("x", x), ("residual", residual), ("weight", weight), ("bias", bias)],
                       [("x", x), ("residual", residual)])
        y, residual_out = out
    kernel(x, residual, weight, bias, eps, y, residual_out)
    return y, (residual_out if residual is not None else x)
