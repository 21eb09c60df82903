"""The per-call rules of every op, as the kernels check them (the Python copy: reference, Triton, fake kernels).

Each Python kernel of :mod:`qkvfuse._library` (the reference's, the Triton launchers', the first-call CPU kernel)
and each fake kernel calls :func:`check_split` or :func:`check_norm` with the op's own arguments before it reads
or writes anything, so a raw ``torch.ops`` call -- e.g. from a loaded ``torch.export`` program -- is as safe as
the public call, and the public layer (:mod:`qkvfuse.ops`) checks only what the schema cannot carry. The native
CPU kernels check the same rules in C++ (``backends/cpu/checks.h`` and the ``make_plan`` / ``check_out`` of each
op), with the same exception types and messages; the bad-call catalogue
(:data:`qkvfuse._verify.failure_modes.BAD_CALLS`) holds the two copies to one rule: every case, every backend,
the same type and message.

Messages name the argument, the value and the expectation: ``"<arg>: expected <expectation>, got <value>"``.
Every tensor must be on ``qkv``'s (``x``'s) device. With grad mode on, no input may require grad (the ops have no
autograd formula). Outputs (``out=`` tensors, in-place targets) may not share an element with an input other than
exactly aliasing their own slice of it, nor with each other -- decided exactly for row layouts
(:func:`share_elements`); tensors without real memory (fake, meta) skip that rule (``real=False``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ._cache_mode import AMX, FP8_MAX, LAYOUT_NAMES, NHD, VEC, cache_dims, decode_cache, is_fp8
from ._rope_mode import GEMMA, MROPE, Q_GATE, decode_rope

__all__ = ["FLOATS", "INTS", "MAX_HEAD_DIM", "MAX_HEADS", "HEADS_EXPECTED", "fail", "fail_gemma_without_weights",
           "check_split", "check_norm", "check_cache", "real_memory", "share_elements", "strided_share"]

MAX_HEAD_DIM = 512
# Head counts are bounded before anything is derived from them: with Hq, Hkv <= 2**20 and head_dim <= 512 every
# derived size ((2 Hq + 2 Hkv) * head_dim, Hq * head_dim, T * heads) stays far inside int64, where the native
# kernels compute them (unbounded, the products wrap to small numbers that pass the shape checks).
MAX_HEADS = 1 << 20
HEADS_EXPECTED = f"an int in [1, {MAX_HEADS}]"
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INTS = (torch.int32, torch.int64)
_FLOAT_NAMES = "torch.float32, torch.bfloat16 or torch.float16"
_SPLIT_OUTS = ("q_out", "k_out", "v_out", "gate_out")


def fail(arg: str, got, expected: str, exc=ValueError):
    raise exc(f"{arg}: expected {expected}, got {got}")


def _device(arg: str, t: torch.Tensor, device: torch.device, anchor: str) -> None:
    if t.device != device:
        fail(arg, f"a tensor on {t.device}", f"a tensor on {device} (the device of {anchor})")


def _rows(arg: str, t: torch.Tensor, width) -> None:
    row, col = t.stride()
    if (col != 1 or row < width) and t.numel():
        fail(arg, f"strides {t.stride()}", f"a contiguous last dim (stride 1) and row stride >= {width}")


def _vector(arg: str, t: torch.Tensor, length, device: torch.device, anchor: str) -> None:
    _device(arg, t, device, anchor)
    if t.dtype not in FLOATS:
        fail(arg, f"dtype {t.dtype}", f"torch.float32 or the activations' dtype (one of {list(FLOATS)})", TypeError)
    if t.dim() != 1 or t.shape[0] != length:
        fail(arg, f"shape {tuple(t.shape)}", f"shape ({length},)")


def served_dtypes(weights) -> Tuple[torch.dtype, ...]:
    """Activation dtypes these norm weights/biases (None: absent) serve under :func:`_io_dtype`'s rule: fp32 ones
    serve every float dtype, others only their own (integrations ask before a call that would raise)."""
    own = {w.dtype for w in weights if w is not None and w.dtype != torch.float32}
    return tuple(own) if len(own) == 1 else (FLOATS if not own else ())


def _io_dtype(arg: str, dtype: torch.dtype, named) -> None:
    """Norm weights and biases are fp32 or the activations' dtype."""
    for name, w in named:
        if w is not None and w.dtype != torch.float32 and w.dtype != dtype:
            fail(name, f"dtype {w.dtype}", f"torch.float32 or {arg}'s dtype {dtype}", TypeError)


def _no_grad(named) -> None:
    if torch.is_grad_enabled():
        for name, t in named:
            if t is not None and t.requires_grad:
                raise RuntimeError(
                    f"{name}: expected a tensor that does not require grad (qkvfuse ops are inference only: call "
                    f"them under torch.no_grad() or torch.inference_mode(), or detach), got one that requires grad")


def _sizes_differ(a, b) -> bool:
    """``a != b`` for two sizes; symbolic sizes (a fake kernel under ``torch.compile``, e.g. an unbacked token dim)
    are asserted equal at run time instead (``torch._check``), so the check never guards on them."""
    if type(a) is int and type(b) is int:
        return a != b
    torch._check(a == b, lambda: "positions: expected as many tokens as qkv")
    return False


def _out_tensor(name: str, t, shape, like: torch.Tensor, like_name: str) -> None:
    _device(name, t, like.device, like_name)
    if t.dtype != like.dtype:
        fail(name, f"dtype {t.dtype}", f"dtype {like.dtype} ({like_name}'s)", TypeError)
    if tuple(t.shape) != shape:
        fail(name, f"shape {tuple(t.shape)}", f"shape {shape}")
    _rows(name, t, shape[1])


# --------------------------------------------------------------------------------------------------------
# The exact overlap rule (the C++ copy: backends/cpu/checks.h).
# --------------------------------------------------------------------------------------------------------
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def real_memory(*tensors) -> bool:
    """True when every tensor is a plain tensor (or parameter) with memory to compare: not meta, not a subclass
    (fake, functional, distributed tensors have no comparable data pointers)."""
    for t in tensors:
        # type() identity, not isinstance: tensor subclasses' isinstance goes through a Python metaclass hook.
        if t is not None and (type(t) not in _PLAIN or t.is_meta):
            return False
    return True


def _layout(t: torch.Tensor) -> Optional[Tuple[int, int, int, int]]:
    """``(first byte, row stride in bytes, rows, row width in bytes)`` when ``t``'s elements are equal-width rows
    of contiguous bytes (1-D contiguous, or 2-D with a unit last stride and a non-negative row stride)."""
    size_of = t.element_size()
    shape, stride = t.shape, t.stride()
    if len(shape) == 2 and (shape[1] <= 1 or stride[1] == 1) and stride[0] >= 0:
        return t.data_ptr(), (stride[0] * size_of if shape[0] > 1 else 0), shape[0], shape[1] * size_of
    if len(shape) == 1 and (shape[0] <= 1 or stride[0] == 1):
        return t.data_ptr(), 0, 1, shape[0] * size_of
    return None


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """Byte range ``[start, end)`` a strided tensor touches (``numel() > 0``)."""
    size_of = t.element_size()
    start = end = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        reach = (size - 1) * stride * size_of
        if reach < 0:
            start += reach
        else:
            end += reach
    return start, end + size_of


def share_elements(ra, rb) -> bool:
    """Whether two tensors whose byte ranges intersect share a byte, given their :func:`_layout`. Exact for row
    layouts with one row stride (e.g. column slices of one buffer); for other layouts (None) the intersecting
    ranges count as sharing."""
    if ra is None or rb is None or (ra[2] > 1 and rb[2] > 1 and ra[1] != rb[1]):
        return True
    (a0, a_rs, a_rows, a_w), (b0, b_rs, b_rows, b_w) = ra, rb
    stride, d = (a_rs if a_rows > 1 else b_rs), b0 - a0
    if stride == 0:
        return -b_w < d < a_w
    # Row i of a and row j of b intersect iff -b_w < d + (j - i) * stride < a_w; is there such a k = j - i?
    k_lo = max(1 - a_rows, (-b_w - d) // stride + 1)
    k_hi = min(b_rows - 1, -((d - a_w) // stride) - 1)
    return k_lo <= k_hi


def _entries(named):
    """``(name, tensor, layout or None, byte span)`` of each non-empty tensor among ``(name, tensor or None)``."""
    out = []
    for name, t in named:
        if t is None or not t.numel():
            continue
        rows = _layout(t)
        if rows is None:
            out.append((name, t, None, _span(t)))
        else:
            first, row_stride, count, width = rows
            out.append((name, t, rows, (first, first + (count - 1) * row_stride + width)))
    return out


def _meet(a, b) -> bool:
    return a[3][0] < b[3][1] and b[3][0] < a[3][1] and share_elements(a[2], b[2])


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and (a.shape[0] <= 1 or a.stride() == b.stride())


def _check_outputs(outs, inputs, own) -> None:
    """Outputs share no element with an input -- except output ``name`` exactly aliasing ``own(name)`` = (its
    input's name, the view it may be) -- nor with each other."""
    outs, inputs = _entries(outs), _entries(inputs)
    for src in inputs:
        for out in outs:
            if not _meet(out, src):
                continue
            own_name, own_view = own(out[0])
            if src[0] == own_name and own_view is not None and _same_view(out[1], own_view):
                continue
            fail(out[0], f"memory shared with {src[0]}",
                 f"no element shared with an input other than exactly aliasing its own slice of {own_name}")
    for k, out in enumerate(outs):
        for other in outs[k + 1 :]:
            if _meet(out, other):
                fail(out[0], f"memory shared with {other[0]}", "outputs that share no element with each other")


def _check_targets(targets, inputs) -> None:
    """In-place targets share no element with each other (the second is named) nor with another input."""
    targets, inputs = _entries(targets), _entries(inputs)
    if len(targets) == 2 and _meet(*targets):
        fail(targets[1][0], f"memory shared with {targets[0][0]}",
             f"an in-place target that shares no element with {targets[0][0]}")
    for target in targets:
        for src in inputs:
            if _meet(target, src):
                fail(target[0], f"memory shared with {src[0]}",
                     "an in-place target that shares no element with another input")


# --------------------------------------------------------------------------------------------------------
# The ops' rules.
# --------------------------------------------------------------------------------------------------------
def fail_gemma_without_weights():
    """The Gemma flag says how the q/k norm weights are stored: without weights it would be silently ignored."""
    fail("gemma_norm", "True without norm weights",
         "q_weight and k_weight when gemma_norm is set (norm weights stored centred at 0)")


def check_split(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads: int,
                num_kv_heads: int, eps: float, rope: int, outs: Optional[Sequence[torch.Tensor]] = None,
                inplace: bool = False, real: bool = True) -> int:
    """Check a split op's arguments (the lean schema's, in its order: ``head_dim`` is derived from ``qkv``'s
    width), its outputs ``outs`` (``out=`` form) or its in-place target ``qkv`` (``inplace``); returns
    ``head_dim``. ``eps`` is taken as the schema gives it (any float; the public layer checks its range)."""
    if qkv.dtype not in FLOATS:
        fail("qkv", f"dtype {qkv.dtype}", _FLOAT_NAMES, TypeError)
    for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
        if not 1 <= value <= MAX_HEADS:
            fail(name, value, HEADS_EXPECTED)
    q_gate = bool(rope & Q_GATE)
    heads = (2 if q_gate else 1) * num_q_heads + 2 * num_kv_heads
    shape = qkv.shape
    if len(shape) != 2 or shape[1] % heads or (shape[1] // heads) % 2 or not 0 < shape[1] // heads <= MAX_HEAD_DIM:
        if q_gate:
            fail("qkv", f"shape {tuple(shape)}", f"shape (T, (2*num_q_heads + 2*num_kv_heads) * head_dim) with an "
                 f"even head_dim <= {MAX_HEAD_DIM} for num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads} "
                 "(q_gate: each Q head followed by its gate head)")
        fail("qkv", f"shape {tuple(shape)}", f"shape (T, (num_q_heads + 2*num_kv_heads) * head_dim) with an even "
             f"head_dim <= {MAX_HEAD_DIM} for num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}")
    T, width = shape
    head_dim = width // heads
    _rows("qkv", qkv, width)
    device = qkv.device
    _device("positions", positions, device, "qkv")
    if positions.dtype not in INTS:
        fail("positions", f"dtype {positions.dtype}", "torch.int32 or torch.int64", TypeError)
    mrope, p_shape = bool(rope & MROPE), positions.shape
    if mrope:
        if len(p_shape) != 2 or p_shape[0] != 3 or _sizes_differ(p_shape[1], T):
            fail("positions", f"shape {tuple(p_shape)}", f"shape (3, {T}) (temporal, height, width) with mrope_section")
    elif len(p_shape) != 1 or _sizes_differ(p_shape[0], T):
        hint = " (3-D positions need mrope_section)" if len(p_shape) == 2 else ""
        fail("positions", f"shape {tuple(p_shape)}", f"shape ({T},) for RoPE{hint}")
    cache = cos_sin_cache
    _device("cos_sin_cache", cache, device, "qkv")
    if cache.dtype not in FLOATS:
        fail("cos_sin_cache", f"dtype {cache.dtype}", _FLOAT_NAMES, TypeError)
    if cache.dim() != 2 or cache.shape[0] < 1:
        fail("cos_sin_cache", f"shape {tuple(cache.shape)}", "shape (max_position >= 1, rotary_dim)")
    rotary_dim = cache.shape[1]
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        fail("cos_sin_cache", f"rotary_dim (shape[1]) = {rotary_dim}",
             f"an even rotary_dim in [2, head_dim={head_dim}]")
    if cache.stride(1) != 1 or cache.stride(0) < rotary_dim:
        fail("cos_sin_cache", f"strides {cache.stride()}", "a contiguous last dim and row stride >= rotary_dim")
    if mrope:
        sections = decode_rope(rope)[1]
        if sum(sections) != rotary_dim // 2:
            fail("mrope_section", f"{sections} (sum {sum(sections)})",
                 f"sections summing to rotary_dim // 2 = {rotary_dim // 2}")
    if (q_weight is None) != (k_weight is None):
        given, missing = ("q_weight", "k_weight") if k_weight is None else ("k_weight", "q_weight")
        fail(missing, "None", f"a tensor since {given} is given (QK-norm takes both q_weight and k_weight, or "
             "neither)")
    if q_weight is not None:
        _vector("q_weight", q_weight, head_dim, device, "qkv")
        _vector("k_weight", k_weight, head_dim, device, "qkv")
    for name, bias in (("q_bias", q_bias), ("k_bias", k_bias)):
        if bias is not None:
            if q_weight is None:
                fail(name, "a bias without norm weights", "q_weight and k_weight when a norm bias is given")
            _vector(name, bias, head_dim, device, "qkv")
    if (q_bias is None) != (k_bias is None):
        given, missing = ("q_bias", "k_bias") if k_bias is None else ("k_bias", "q_bias")
        fail(missing, "None", f"a tensor since {given} is given (a post-norm bias for Q and K: both or neither)")
    if rope & GEMMA and q_weight is None:
        fail_gemma_without_weights()
    statics = (("q_weight", q_weight), ("k_weight", k_weight), ("q_bias", q_bias), ("k_bias", k_bias))
    _io_dtype("qkv", qkv.dtype, statics)
    _no_grad((("qkv", qkv),) + statics + (("cos_sin_cache", cache),))
    q_width, kv_width = num_q_heads * head_dim, num_kv_heads * head_dim
    if outs is not None:
        gate_out = outs[3] if len(outs) > 3 else None
        if q_gate != (gate_out is not None):
            fail("gate_out", "a tensor" if gate_out is not None else "None",
                 f"a ({T}, {q_width}) tensor exactly when the layout is gated (q_gate)")
        outs = tuple(outs[:3]) + ((gate_out,) if q_gate else ())
        names = _SPLIT_OUTS[:len(outs)]
        for name, t, w in zip(names, outs, (q_width, kv_width, kv_width, q_width)):
            _out_tensor(name, t, (T, w), qkv, "qkv")
        if real and real_memory(qkv, *outs):
            starts = {"q_out": 0, "k_out": width - 2 * kv_width, "v_out": width - kv_width}
            widths = {"q_out": q_width, "k_out": kv_width, "v_out": kv_width}

            def own(name):
                # Gated, the Q and gate heads are interleaved in qkv: q_out and gate_out have no slice of their own.
                if name == "gate_out" or (q_gate and name == "q_out"):
                    return "qkv", None
                return "qkv", qkv[:, starts[name]:starts[name] + widths[name]]

            _check_outputs(tuple(zip(names, outs)),
                           (("qkv", qkv), ("positions", positions), ("cos_sin_cache", cache)) + statics, own)
    elif inplace and real and real_memory(qkv):
        _check_targets((("qkv", qkv),), (("positions", positions), ("cos_sin_cache", cache)) + statics)
    return head_dim


def check_norm(x, residual, weight, bias, outs: Optional[Sequence[Optional[torch.Tensor]]] = None,
               inplace: bool = False, real: bool = True) -> None:
    """Check an add_rmsnorm op's arguments, its outputs ``outs = (y_out, residual_out)`` (``out=`` form) or its
    in-place targets ``x`` and ``residual`` (``inplace``)."""
    if x.dtype not in FLOATS:
        fail("x", f"dtype {x.dtype}", _FLOAT_NAMES, TypeError)
    if x.dim() != 2 or x.shape[1] < 1:
        fail("x", f"shape {tuple(x.shape)}", "shape (T, H) with H >= 1")
    T, hidden = x.shape
    _rows("x", x, hidden)
    device = x.device
    if residual is not None:
        _device("residual", residual, device, "x")
        if residual.dtype != x.dtype:
            fail("residual", f"dtype {residual.dtype}", f"dtype {x.dtype} (x's)", TypeError)
        if residual.shape != x.shape:
            fail("residual", f"shape {tuple(residual.shape)}", f"shape {tuple(x.shape)} (x's)")
        _rows("residual", residual, hidden)
    _vector("weight", weight, hidden, device, "x")
    if bias is not None:
        _vector("bias", bias, hidden, device, "x")
    statics = (("weight", weight), ("bias", bias))
    _io_dtype("x", x.dtype, statics)
    _no_grad((("x", x), ("residual", residual)) + statics)
    if outs is not None:
        y_out, residual_out = outs
        if (residual is None) != (residual_out is None):
            fail("residual_out", "None" if residual_out is None else "a tensor",
                 "a tensor exactly when residual is given")
        _out_tensor("y_out", y_out, (T, hidden), x, "x")
        if residual_out is not None:
            _out_tensor("residual_out", residual_out, (T, hidden), x, "x")
        if real and real_memory(x, residual, y_out, residual_out):
            _check_outputs((("y_out", y_out), ("residual_out", residual_out)),
                           (("x", x), ("residual", residual)) + statics,
                           lambda name: ("x", x) if name == "y_out" else ("residual", residual))
    elif inplace and real and real_memory(x, residual):
        _check_targets((("x", x), ("residual", residual)), statics)


# --------------------------------------------------------------------------------------------------------
# The cache-writing split's caches (qkvfuse._cache_mode; the C++ copy: backends/cpu/checks.h).
# --------------------------------------------------------------------------------------------------------
_CACHE_SHAPES = {"NHD": "(num_blocks, block_size, num_kv_heads, head_dim)",
                 "HND": "(num_blocks, num_kv_heads, block_size, head_dim)",
                 "vec": "(num_blocks, num_kv_heads, block_size, head_dim)",
                 "amx": "(num_blocks, num_kv_heads, block_size, head_dim)"}
_FP8_NAMES = "torch.float8_e4m3fn or torch.float8_e5m2"


def _nested(sizes, strides) -> bool:
    """Whether no two indices of a strided tensor reach the same element, by the sufficient rule the cache
    layouts meet: sorted by stride, each stride exceeds the reach of the dims below it."""
    reach = 0
    for size, stride in sorted(((n, s) for n, s in zip(sizes, strides) if n > 1), key=lambda p: p[1]):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def _offset_reachable(d: int, dims) -> bool:
    """Whether ``d = sum(i_k * stride_k)`` with ``|i_k| < size_k`` for ``dims = [(size, stride), ...]`` sorted by
    decreasing stride, each stride above the reach of the smaller ones (:func:`_nested`)."""
    if not dims:
        return d == 0
    (size, stride), rest = dims[0], dims[1:]
    reach = sum((n - 1) * s for n, s in rest)
    q = d // stride
    return any(abs(i) < size and abs(d - i * stride) <= reach and _offset_reachable(d - i * stride, rest)
               for i in (q, q + 1))


def strided_share(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two non-empty strided tensors share a byte. Exact for two translates of one nested layout (the K
    and V halves of an interleaved KV buffer: same shape, strides and element size); otherwise intersecting byte
    ranges count as sharing."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if not (a0 < b1 and b0 < a1):
        return False
    size_of = a.element_size()
    if (a.shape != b.shape or a.stride() != b.stride() or size_of != b.element_size()
            or (b.data_ptr() - a.data_ptr()) % size_of or not _nested(a.shape, a.stride())):
        return True
    dims = sorted(((n, s) for n, s in zip(a.shape, a.stride()) if n > 1), key=lambda p: -p[1])
    return _offset_reachable((b.data_ptr() - a.data_ptr()) // size_of, dims)


def _scale(name: str, scale, device: torch.device, fp8: bool) -> None:
    if not fp8:
        if scale is not None:
            fail(name, "a tensor", "None for a cache of qkv's dtype (scales are for FP8 caches)")
        return
    if scale is None:
        fail(name, "None", "a 0-d (or one-element) torch.float32 tensor for an FP8 cache")
    _device(name, scale, device, "qkv")
    if scale.dtype != torch.float32:
        fail(name, f"dtype {scale.dtype}", "torch.float32", TypeError)
    if scale.numel() != 1 or scale.dim() > 1:
        fail(name, f"shape {tuple(scale.shape)}", "shape () or (1,)")


def check_cache(qkv, key_cache, value_cache, slot_mapping, cache_mode: int, k_scale, v_scale, num_kv_heads: int,
                head_dim: int, inputs=(), real: bool = True) -> None:
    """Check the cache arguments of the cache-writing split (after :func:`check_split` checked the rest):
    ``cache_mode`` (:func:`qkvfuse._cache_mode.encode_cache`), the two caches' device, dtype, shape for the layout
    and ``(num_kv_heads, head_dim)``, strides, ``slot_mapping`` and the FP8 scales; with ``real``, that the caches
    share no element with each other (an interleaved KV buffer's halves are fine), with ``qkv`` or with
    ``inputs`` (``(name, tensor or None)`` pairs: the split's other tensors, then the out= form's outputs, named
    ``*_out``). Slot and scale values are :func:`qkvfuse._library.check_cache_values`' (data, not metadata)."""
    layout, truncate = decode_cache(cache_mode)
    if layout not in LAYOUT_NAMES or cache_mode < 0 or cache_mode & ~31:
        fail("cache_mode", cache_mode, f"a layout code in {sorted(LAYOUT_NAMES)}, plus 16 for truncating FP8 "
             "rounding (qkvfuse._cache_mode.encode_cache)")
    name_of = LAYOUT_NAMES[layout]
    device, dtype = qkv.device, qkv.dtype
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        _device(name, c, device, "qkv")
        if c.dtype != dtype and not is_fp8(c.dtype):
            fail(name, f"dtype {c.dtype}", f"qkv's dtype {dtype}, {_FP8_NAMES}", TypeError)
        if c.dim() != 4:
            fail(name, f"shape {tuple(c.shape)}", f"a 4-D cache {_CACHE_SHAPES[name_of]} (layout {name_of!r})")
    if value_cache.dtype != key_cache.dtype:
        fail("value_cache", f"dtype {value_cache.dtype}", f"key_cache's dtype {key_cache.dtype}", TypeError)
    if value_cache.shape != key_cache.shape:
        fail("value_cache", f"shape {tuple(value_cache.shape)}", f"key_cache's shape {tuple(key_cache.shape)}")
    blocks, block_size, heads, dim = cache_dims(layout, key_cache)
    if heads != num_kv_heads or dim != head_dim or blocks < 1 or block_size < 1:
        fail("key_cache", f"shape {tuple(key_cache.shape)}",
             f"{_CACHE_SHAPES[name_of]} with num_kv_heads={num_kv_heads}, head_dim={head_dim} and at least one "
             f"block (layout {name_of!r})")
    if layout == AMX and (key_cache.element_size() != 2 or block_size % 16 or head_dim % 16):
        fail("key_cache", f"dtype {key_cache.dtype}, block_size {block_size} and head_dim {head_dim}",
             "a 16-bit cache with block_size and head_dim multiples of 16 (layout 'amx')")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if layout in (VEC, AMX):
            if c.stride(3) != 1 or c.stride(2) != head_dim or c.stride(1) < block_size * head_dim:
                fail(name, f"strides {c.stride()}", f"a contiguous (block_size, head_dim) region per block and "
                     f"head (layout {name_of!r})")
        if not _nested(c.shape, c.stride()) or min(c.stride()) < 0:
            fail(name, f"strides {c.stride()}", "non-negative strides with no element reached twice")
    _device("slot_mapping", slot_mapping, device, "qkv")
    if slot_mapping.dtype not in INTS:
        fail("slot_mapping", f"dtype {slot_mapping.dtype}", "torch.int32 or torch.int64", TypeError)
    if slot_mapping.dim() != 1:
        fail("slot_mapping", f"shape {tuple(slot_mapping.shape)}", "shape (num_slots,) (tokens past its end are not "
             "written)")
    fp8 = is_fp8(key_cache.dtype)
    _scale("k_scale", k_scale, device, fp8)
    _scale("v_scale", v_scale, device, fp8)
    _no_grad((("key_cache", key_cache), ("value_cache", value_cache)))
    if real and real_memory(qkv, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                            *(t for _, t in inputs)):
        if key_cache.numel() and strided_share(key_cache, value_cache):
            fail("value_cache", "memory shared with key_cache",
                 "a cache that shares no element with key_cache (K and V may interleave in one buffer)")
        others = (("qkv", qkv),) + tuple(inputs) + (("slot_mapping", slot_mapping), ("k_scale", k_scale),
                                                    ("v_scale", v_scale))
        for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
            for other, t in others:
                if t is not None and t.numel() and c.numel() and strided_share(c, t):
                    role = "an output" if other.endswith("_out") else "an input"
                    fail(name, f"memory shared with {other}", f"a cache that shares no element with {role}")
