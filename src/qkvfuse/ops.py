"""Public ops: validation (once, here) and the call into ``torch.ops.qkvfuse.*``.

Every call takes one path: public function or bound object -> the validator below -> ``torch.ops.qkvfuse.<op>``
(the namespace the backend rule picks, :func:`qkvfuse.backends.select_ops`) -> the kernel the dispatcher
picks. Nothing decides by itself that a call may skip the dispatcher, so tracers, modes, the profiler,
``torch.compile`` and ``torch.export`` all see the op, and the result never depends on which is active.

Per-call cost is cut by design, not by a second path: :class:`QKNormRope` and :class:`AddRMSNorm` are bound
per-layer objects (vLLM's ``RotaryEmbedding`` / FlashInfer's plan-run idea) that validate their static
configuration once; a call checks only what changes per call (the activations, positions and outputs) and
passes a lean schema (:mod:`qkvfuse._library`). The functional ops build the same configuration per call.

Rules that hold on every backend:

* Inference only: with grad mode on, an input that requires grad raises ``RuntimeError`` naming it (the ops
  have no autograd formula; a silently missing gradient is never an outcome).
* Outputs (``out=``, the in-place target) may not share an element with an input other than exactly aliasing
  their own slice of it, nor with each other; outputs that share no element -- e.g. q/k/v views of one packed
  buffer -- are accepted. Decided exactly for the row-strided 2-D layouts the API takes (:func:`_share_elements`).
  Tensors without real memory (fake, meta) and traced code under ``torch.compile`` skip this check.
* Positions outside ``[0, cos_sin_cache.shape[0])``: CPU kernels raise ``ValueError`` before writing any
  output; accelerator kernels clamp them into the table (never reading outside it) and check only with
  ``QKVFUSE_CHECK_POSITIONS=1`` (a host sync per call), so no call syncs the host by default.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from . import _library
from ._library import MAX_HEAD_DIM, encode_rope
from .backends import select_ops

__all__ = ["split_qkv_rmsnorm_rope", "split_qkv_rmsnorm_rope_", "add_rmsnorm", "add_rmsnorm_", "QKNormRope",
           "AddRMSNorm", "MAX_HEAD_DIM"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64)


class _Ops(NamedTuple):
    split: object
    split_out: object
    split_inplace: object
    norm: object
    norm_out: object
    norm_inplace: object


# One bundle of ops per backend choice (see qkvfuse._library.NAMESPACES).
_OPS = {name: _Ops(*(getattr(getattr(torch.ops, ns), op).default for op in _library.OPS))
        for name, ns in _library.NAMESPACES.items()}


def _ops_for(backend: Optional[str], device: torch.device) -> _Ops:
    return _OPS[select_ops(backend, device.type)]


# --------------------------------------------------------------------------------------------------------
# Validation helpers: messages name the argument, the value and the expectation.
# --------------------------------------------------------------------------------------------------------
def _fail(arg: str, got, expected: str, exc=ValueError):
    raise exc(f"{arg}: expected {expected}, got {got}")


def _check_int(arg: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(arg, repr(value), f"an int >= {minimum}", TypeError if not isinstance(value, int) else ValueError)


def _check_tensor(arg: str, t, device: torch.device, anchor: str) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(arg, type(t).__name__, "a torch.Tensor", TypeError)
    if t.device != device:
        _fail(arg, f"a tensor on {t.device}", f"a tensor on {device} (the device of {anchor})")


def _check_vector(arg: str, t, length: int, device: torch.device, anchor: str) -> None:
    _check_tensor(arg, t, device, anchor)
    if t.dtype not in _FLOATS:
        _fail(arg, f"dtype {t.dtype}", f"torch.float32 or the activations' dtype (one of {list(_FLOATS)})", TypeError)
    if t.dim() != 1 or t.shape[0] != length:
        _fail(arg, f"shape {tuple(t.shape)}", f"shape ({length},)")


def _check_eps(eps) -> float:
    # A chained comparison rather than math.isfinite: it also traces under torch.compile(dynamic=True).
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        _fail("eps", repr(eps), "a finite number >= 0", TypeError if not isinstance(eps, (int, float)) else ValueError)
    return float(eps)


def _check_rows(arg: str, t: torch.Tensor, width: int) -> None:
    row, col = t.stride()
    if (col != 1 or row < width) and t.numel():
        _fail(arg, f"strides {t.stride()}", f"a contiguous last dim (stride 1) and row stride >= {width}")


def _io_dtypes(weights) -> Tuple[torch.dtype, ...]:
    """Activation dtypes these norm weights allow: fp32 weights serve every dtype, others only their own."""
    own = {w.dtype for w in weights if w is not None and w.dtype != torch.float32}
    return tuple(own) if len(own) == 1 else (_FLOATS if not own else ())


def _check_io_dtype(arg: str, t: torch.Tensor, io_dtypes, weights) -> None:
    if t.dtype not in _FLOATS:
        _fail(arg, f"dtype {t.dtype}", "torch.float32, torch.bfloat16 or torch.float16", TypeError)
    if t.dtype not in io_dtypes:
        name, w = next((n, w) for n, w in weights if w is not None and w.dtype not in (torch.float32, t.dtype))
        _fail(name, f"dtype {w.dtype}", f"torch.float32 or {arg}'s dtype {t.dtype}", TypeError)


def _sizes_differ(a, b) -> bool:
    """``a != b`` for two sizes. Symbolic sizes that tracing cannot decide (``torch.compile`` with an unbacked
    token dim) are asserted equal at run time instead (``torch._check``), so the validator never guards on them."""
    if not torch.compiler.is_compiling():
        return a != b
    torch._check(a == b, lambda: "positions: expected as many tokens as qkv")
    return False


def _check_no_grad(named) -> None:
    """Inference only: no input may require grad (call it when grad mode is on; the ops have no autograd
    formula)."""
    for name, t in named:
        if t is not None and t.requires_grad:
            raise RuntimeError(
                f"{name}: expected a tensor that does not require grad (qkvfuse ops are inference only: call "
                f"them under torch.no_grad() or torch.inference_mode(), or detach), got one that requires grad")


# --------------------------------------------------------------------------------------------------------
# The exact overlap rule.
# --------------------------------------------------------------------------------------------------------
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _real_memory(*tensors) -> bool:
    """True when every tensor is a plain tensor (or parameter) with memory to compare: not traced by dynamo, not
    meta, not a subclass (fake, functional, distributed tensors have no comparable data pointers)."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        # type() identity, not isinstance: tensor subclasses' isinstance goes through a Python metaclass hook.
        if t is not None and (type(t) not in _PLAIN or t.is_meta):
            return False
    return True


def _rows(t: torch.Tensor) -> Optional[Tuple[int, int, int, int]]:
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


def _share_elements(ra, rb) -> bool:
    """Whether two tensors whose byte ranges intersect share a byte, given their :func:`_rows` layouts. Exact
    for row layouts with one row stride (e.g. column slices of one buffer); for other layouts (None) the
    intersecting ranges count as sharing."""
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


def _entry(name: str, t: torch.Tensor, rows):
    """A :func:`_spans` entry: ``(name, tensor, rows layout or None, byte span)``."""
    if rows is None:
        return name, t, None, _span(t)
    first, row_stride, count, width = rows
    return name, t, rows, (first, first + (count - 1) * row_stride + width)


def _spans(named):
    """The :func:`_entry` of each non-empty tensor among ``(name, tensor or None)``."""
    return [_entry(name, t, _rows(t)) for name, t in named if t is not None and t.numel()]


def _meet(a, b) -> bool:
    """Two :func:`_spans` entries share an element."""
    return a[3][0] < b[3][1] and b[3][0] < a[3][1] and _share_elements(a[2], b[2])


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and (a.shape[0] <= 1 or a.stride() == b.stride()))


def _check_outputs(outs, inputs, own) -> None:
    """``outs`` share no element with an input (both lists of :func:`_spans` entries) -- except
    output ``name`` exactly aliasing ``own(name)`` = (its input's name, the view it may be; called only on a
    conflict) -- nor with each other."""
    if not outs:
        return
    lo, hi = min(o[3][0] for o in outs), max(o[3][1] for o in outs)
    for src in inputs:
        if src[3][1] <= lo or src[3][0] >= hi:
            continue
        for out in outs:
            if not _meet(out, src):
                continue
            own_name, own_view = own(out[0])
            if src[0] == own_name and _same_view(out[1], own_view):
                continue
            _fail(out[0], f"memory shared with {src[0]}",
                  f"no element shared with an input other than exactly aliasing its own slice of {own_name}")
    for k, out in enumerate(outs):
        for other in outs[k + 1 :]:
            if _meet(out, other):
                _fail(out[0], f"memory shared with {other[0]}", "outputs that share no element with each other")


def _check_out_tuple(out, names, shapes, like: torch.Tensor, like_name: str, real: bool) -> list:
    """Check ``out`` (tensors with ``like``'s device and dtype, these shapes, a unit last stride and
    non-overlapping rows); with ``real`` (their memory can be compared: :func:`_real_memory`) return the
    :func:`_spans` entries of its non-empty tensors, read from the checked layout (this runs on every call with
    ``out=``)."""
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        got = f"{len(out)} tensors" if isinstance(out, (tuple, list)) else type(out).__name__
        _fail("out", got, f"a tuple of {len(names)} tensors ({', '.join(names)})", TypeError)
    device, dtype, size_of = like.device, like.dtype, like.element_size()
    entries = []
    for name, t, shape in zip(names, out, shapes):
        if t is None:
            _fail(name, "None", f"a tensor (out= takes all of {', '.join(names)})", TypeError)
        _check_tensor(name, t, device, like_name)
        if t.dtype != dtype:
            _fail(name, f"dtype {t.dtype}", f"dtype {dtype} ({like_name}'s)", TypeError)
        if t.shape != shape:
            _fail(name, f"shape {tuple(t.shape)}", f"shape {shape}")
        rows, width = shape
        row_stride, col_stride = t.stride()
        if col_stride != 1 or row_stride < width:
            if rows and width:
                _fail(name, f"strides {t.stride()}", f"a contiguous last dim (stride 1) and row stride >= {width}")
            continue
        if real and rows and width:  # the layout just checked is a row layout: no second read of it
            entries.append(_entry(name, t, (t.data_ptr(), row_stride * size_of if rows > 1 else 0, rows,
                                            width * size_of)))
    return entries


# --------------------------------------------------------------------------------------------------------
# split_qkv_rmsnorm_rope: static configuration (validated once per bound object) and per-call checks.
# --------------------------------------------------------------------------------------------------------
class _SplitConfig(NamedTuple):
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    width: int
    widths: Tuple[int, int, int]  # q, k, v column widths
    cos_sin_cache: torch.Tensor
    q_weight: Optional[torch.Tensor]
    k_weight: Optional[torch.Tensor]
    q_bias: Optional[torch.Tensor]
    k_bias: Optional[torch.Tensor]
    eps: float
    mrope: bool
    device: torch.device
    anchor: str  # the argument that fixed the device, for messages
    io_dtypes: Tuple[torch.dtype, ...]
    ops: _Ops
    static_spans: Optional[list]  # bound objects: (name, tensor, byte span) of the table, weights and biases
    static_args: tuple  # the ops' arguments after qkv and positions


def _static_spans(c) -> list:
    """Byte spans of a split configuration's tensors (the table, norm weights, biases)."""
    if c.static_spans is not None:
        return c.static_spans
    return _spans((("cos_sin_cache", c.cos_sin_cache), ("q_weight", c.q_weight), ("k_weight", c.k_weight),
                   ("q_bias", c.q_bias), ("k_bias", c.k_bias)))


def _split_config(num_q_heads, num_kv_heads, head_dim, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, eps,
                  is_neox, mrope_section, mrope_interleaved, backend, device=None, anchor="cos_sin_cache",
                  bound=False):
    _check_int("num_q_heads", num_q_heads)
    _check_int("num_kv_heads", num_kv_heads)
    _check_int("head_dim", head_dim, 2)
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        _fail("head_dim", head_dim, f"an even int <= {MAX_HEAD_DIM}")
    if not isinstance(cos_sin_cache, torch.Tensor):
        _fail("cos_sin_cache", type(cos_sin_cache).__name__, "a torch.Tensor", TypeError)
    device = cos_sin_cache.device if device is None else device
    _check_tensor("cos_sin_cache", cos_sin_cache, device, anchor)
    if cos_sin_cache.dtype not in _FLOATS:
        _fail("cos_sin_cache", f"dtype {cos_sin_cache.dtype}", "torch.float32, torch.bfloat16 or torch.float16",
              TypeError)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[0] < 1:
        _fail("cos_sin_cache", f"shape {tuple(cos_sin_cache.shape)}", "shape (max_position >= 1, rotary_dim)")
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        _fail("cos_sin_cache", f"rotary_dim (shape[1]) = {rotary_dim}",
              f"an even rotary_dim in [2, head_dim={head_dim}]")
    if cos_sin_cache.stride(1) != 1 or cos_sin_cache.stride(0) < rotary_dim:
        _fail("cos_sin_cache", f"strides {cos_sin_cache.stride()}",
              "a contiguous last dim and row stride >= rotary_dim")
    sections: Tuple[int, ...] = ()
    if mrope_section is not None:
        if not isinstance(mrope_section, (tuple, list)) or len(mrope_section) != 3 or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in mrope_section):
            _fail("mrope_section", repr(mrope_section), "three non-negative ints (s_t, s_h, s_w)", TypeError)
        sections = tuple(mrope_section)
        if sum(sections) != rotary_dim // 2:
            _fail("mrope_section", f"{sections} (sum {sum(sections)})",
                  f"sections summing to rotary_dim // 2 = {rotary_dim // 2}")
    if not isinstance(mrope_interleaved, bool):
        _fail("mrope_interleaved", repr(mrope_interleaved), "a bool", TypeError)
    if not isinstance(is_neox, bool):
        _fail("is_neox", repr(is_neox), "a bool", TypeError)
    if (q_weight is None) != (k_weight is None):
        given, missing = ("q_weight", "k_weight") if k_weight is None else ("k_weight", "q_weight")
        _fail(missing, "None", f"a tensor since {given} is given (QK-norm takes both q_weight and k_weight, or "
              "neither)")
    if q_weight is not None:
        _check_vector("q_weight", q_weight, head_dim, device, anchor)
        _check_vector("k_weight", k_weight, head_dim, device, anchor)
    for name, bias in (("q_bias", q_bias), ("k_bias", k_bias)):
        if bias is not None:
            if q_weight is None:
                _fail(name, "a bias without norm weights", "q_weight and k_weight when a norm bias is given")
            _check_vector(name, bias, head_dim, device, anchor)
    if (q_bias is None) != (k_bias is None):
        given, missing = ("q_bias", "k_bias") if k_bias is None else ("k_bias", "q_bias")
        _fail(missing, "None", f"a tensor since {given} is given (a post-norm bias for Q and K: both or neither)")
    eps = _check_eps(eps)
    kv_width = num_kv_heads * head_dim
    tensors = (cos_sin_cache, q_weight, k_weight, q_bias, k_bias)
    c = _SplitConfig(num_q_heads, num_kv_heads, head_dim, (num_q_heads + 2 * num_kv_heads) * head_dim,
                     (num_q_heads * head_dim, kv_width, kv_width), *tensors, eps, bool(sections), device, anchor,
                     _io_dtypes(tensors[1:]), _ops_for(backend, device), None,
                     (*tensors, num_q_heads, num_kv_heads, eps, encode_rope(is_neox, sections, mrope_interleaved)))
    # A bound object's tensors are held by reference: their spans are computed once (replacing a tensor's
    # storage under a bound object, e.g. `weight.data = ...`, needs a new object).
    return c._replace(static_spans=_static_spans(c)) if bound and _real_memory(*tensors) else c


def _check_qkv(qkv, device: Optional[torch.device] = None, anchor: str = "") -> None:
    """The checks of ``qkv`` before the configuration's: its type, and its device against a bound object's
    (``device``) or else its dtype (the functional ops check it before the configuration; a bound call's
    :func:`_check_split_call` checks the dtype against the weights)."""
    if not isinstance(qkv, torch.Tensor):
        _fail("qkv", type(qkv).__name__, "a torch.Tensor", TypeError)
    if device is not None:
        if qkv.device != device:
            _fail("qkv", f"a tensor on {qkv.device}", f"a tensor on {device} (the device of {anchor})")
    elif qkv.dtype not in _FLOATS:
        _fail("qkv", f"dtype {qkv.dtype}", "torch.float32, torch.bfloat16 or torch.float16", TypeError)


def _check_split_call(c: _SplitConfig, qkv, positions) -> None:
    """Per-call checks of ``qkv`` and ``positions`` against a validated configuration."""
    shape = qkv.shape
    if len(shape) != 2 or shape[1] != c.width:
        _fail("qkv", f"shape {tuple(qkv.shape)}",
              f"shape (T, {c.width}) = (T, (num_q_heads + 2*num_kv_heads) * head_dim) for "
              f"num_q_heads={c.num_q_heads}, num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}")
    _check_rows("qkv", qkv, c.width)
    if qkv.dtype not in c.io_dtypes:
        _check_io_dtype("qkv", qkv, c.io_dtypes, (("q_weight", c.q_weight), ("k_weight", c.k_weight),
                                                  ("q_bias", c.q_bias), ("k_bias", c.k_bias)))
    _check_tensor("positions", positions, c.device, c.anchor)
    if positions.dtype not in _INTS:
        _fail("positions", f"dtype {positions.dtype}", "torch.int32 or torch.int64", TypeError)
    T, p_shape = shape[0], positions.shape
    if c.mrope:
        if len(p_shape) != 2 or p_shape[0] != 3 or _sizes_differ(p_shape[1], T):
            _fail("positions", f"shape {tuple(p_shape)}",
                  f"shape (3, {T}) (temporal, height, width) with mrope_section")
    elif len(p_shape) != 1 or _sizes_differ(p_shape[0], T):
        hint = " (3-D positions need mrope_section)" if len(p_shape) == 2 else ""
        _fail("positions", f"shape {tuple(p_shape)}", f"shape ({T},) for RoPE{hint}")
    if torch.is_grad_enabled():
        _check_no_grad((("qkv", qkv), ("q_weight", c.q_weight), ("k_weight", c.k_weight), ("q_bias", c.q_bias),
                        ("k_bias", c.k_bias), ("cos_sin_cache", c.cos_sin_cache)))




_SPLIT_OUTS = ("q_out", "k_out", "v_out")


def _run_split(c: _SplitConfig, qkv, positions, out):
    _check_split_call(c, qkv, positions)
    if out is None:
        return c.ops.split(qkv, positions, *c.static_args)
    T, kv = qkv.shape[0], c.num_kv_heads * c.head_dim
    real = _real_memory(qkv, *out) if isinstance(out, (tuple, list)) else False
    entries = _check_out_tuple(out, _SPLIT_OUTS, ((T, c.num_q_heads * c.head_dim), (T, kv), (T, kv)), qkv, "qkv",
                               real)
    if real:
        _check_outputs(entries,
                       _spans((("qkv", qkv), ("positions", positions))) + _static_spans(c),
                       lambda name: ("qkv", qkv.split_with_sizes(c.widths, 1)[_SPLIT_OUTS.index(name)]))
    c.ops.split_out(qkv, positions, *c.static_args, *out)
    return tuple(out)


def _run_split_(c: _SplitConfig, qkv, positions):
    _check_split_call(c, qkv, positions)
    if _real_memory(qkv) and qkv.numel():
        target = _spans((("qkv", qkv),))[0]
        for src in _spans((("positions", positions),)) + _static_spans(c):
            if _meet(target, src):
                _fail("qkv", f"memory shared with {src[0]}", "an in-place target that shares no element with another "
                      "input")
    c.ops.split_inplace(qkv, positions, *c.static_args)
    return qkv.split_with_sizes(c.widths, 1)


class QKNormRope:
    """A bound split + QK-RMSNorm + RoPE/mRoPE for one attention layer: static configuration validated once.

    Parameters
    ----------
    num_q_heads, num_kv_heads, head_dim : int
        Head geometry; ``head_dim`` even, at most 512.
    cos_sin_cache : torch.Tensor
        Shape ``(max_position, rotary_dim)``, fp32/bf16/fp16 (keep it fp32 for accuracy). Row ``p`` is
        ``[cos(p*f_0..f_{R/2-1}) | sin(p*f_0..f_{R/2-1})]`` (:func:`qkvfuse.build_cos_sin_cache`). **The rotary
        dim is read from this table** (even, at most ``head_dim``); dims past it pass through unrotated. Its
        device is the device every call's tensors must be on.
    q_weight, k_weight : torch.Tensor, optional
        RMSNorm weights, shape ``(head_dim,)``, shared by all heads, fp32 or the activations' dtype. Both or
        neither (no QK-norm, e.g. GLM-4.5-Air).
    q_bias, k_bias : torch.Tensor, optional
        Post-norm bias, shape ``(head_dim,)``: ``y = norm(x) * w + b`` (not the projection bias). Both or neither.
    eps : float
        RMSNorm epsilon.
    is_neox : bool
        NeoX rotate-half pairs ``(j, j + R/2)`` (Qwen3, GLM-4-MoE) or GPT-J interleaved pairs ``(2j, 2j+1)``.
    mrope_section : tuple of 3 ints, optional
        ``(s_t, s_h, s_w)`` summing to ``rotary_dim // 2``; calls then take positions of shape ``(3, T)``.
    mrope_interleaved : bool
        Qwen3-VL interleaved layout (True) or contiguous sections (Qwen2-VL, GLM-4.5V).
    backend : str, optional
        ``"reference"``, ``"cpu"``, ``"triton"`` or ``"auto"`` (default; also ``QKVFUSE_BACKEND``), resolved once
        here for the cache's device.

    The tensors are held by reference: in-place updates of the weights are seen; replacing them needs a new
    object. Calls: ``q, k, v = prep(qkv, positions)`` (fresh outputs), ``prep(qkv, positions, out=(q, k, v))``
    and ``prep.inplace(qkv, positions)``, with the semantics of :func:`split_qkv_rmsnorm_rope` and
    :func:`split_qkv_rmsnorm_rope_`.
    """

    __slots__ = ("config",)

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor, *,
                 q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
                 q_bias: Optional[torch.Tensor] = None, k_bias: Optional[torch.Tensor] = None, eps: float = 1e-6,
                 is_neox: bool = True, mrope_section: Optional[Sequence[int]] = None, mrope_interleaved: bool = False,
                 backend: Optional[str] = None):
        self.config = _split_config(num_q_heads, num_kv_heads, head_dim, cos_sin_cache, q_weight, k_weight, q_bias,
                                    k_bias, eps, is_neox, mrope_section, mrope_interleaved, backend, bound=True)

    def __call__(self, qkv: torch.Tensor, positions: torch.Tensor, *,
                 out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None):
        """``(q, k, v)`` of ``qkv [T, (Hq+2Hkv)*D]`` at ``positions [T]`` (or ``[3, T]``); see
        :func:`split_qkv_rmsnorm_rope` for shapes, ``out`` and the semantics."""
        c = self.config
        _check_qkv(qkv, c.device, c.anchor)
        return _run_split(c, qkv, positions, out)

    def inplace(self, qkv: torch.Tensor, positions: torch.Tensor):
        """Rewrite the Q and K heads inside ``qkv`` and return its ``(q, k, v)`` views; see
        :func:`split_qkv_rmsnorm_rope_`."""
        c = self.config
        _check_qkv(qkv, c.device, c.anchor)
        return _run_split_(c, qkv, positions)

    def __repr__(self) -> str:
        c = self.config
        return (f"QKNormRope(num_q_heads={c.num_q_heads}, num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
                f"rotary_dim={c.cos_sin_cache.shape[1]}, qk_norm={c.q_weight is not None}, mrope={c.mrope})")


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
        Preallocated ``(q, k, v)`` outputs with ``qkv``'s dtype, contiguous last dim, any row stride (e.g.
        column views of one packed ``[T, (Hq+2Hkv)*D]`` buffer). Each may exactly alias its own slice of
        ``qkv``; sharing any other element with an input or another output raises.
    backend : str, optional
        ``"reference"``, ``"cpu"``, ``"triton"`` or ``"auto"`` (default; also ``QKVFUSE_BACKEND``).

    Returns
    -------
    (q, k, v) : tuple of torch.Tensor
        Shapes ``(T, num_q_heads * head_dim)``, ``(T, num_kv_heads * head_dim)`` twice, ``qkv``'s dtype.
        All arithmetic is fp32 with one rounding at the end. NaN/Inf inputs propagate (a NaN in a head makes
        that head's normalised output NaN); they are not checked, which would cost a pass over the data.

    For a layer called many times, :class:`QKNormRope` validates the static arguments once.
    """
    _check_qkv(qkv)
    c = _split_config(num_q_heads, num_kv_heads, head_dim, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, eps,
                      is_neox, mrope_section, mrope_interleaved, backend, qkv.device, "qkv")
    return _run_split(c, qkv, positions, out)


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
    V is left untouched. ``qkv`` may not share an element with another input. The write bumps ``qkv``'s
    version counter, as any in-place torch op does.
    """
    _check_qkv(qkv)
    c = _split_config(num_q_heads, num_kv_heads, head_dim, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, eps,
                      is_neox, mrope_section, mrope_interleaved, backend, qkv.device, "qkv")
    return _run_split_(c, qkv, positions)


# --------------------------------------------------------------------------------------------------------
# add_rmsnorm.
# --------------------------------------------------------------------------------------------------------
class _NormConfig(NamedTuple):
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    eps: float
    hidden: int
    device: torch.device
    anchor: str
    io_dtypes: Tuple[torch.dtype, ...]
    ops: _Ops
    static_spans: Optional[list]  # bound objects: the :func:`_spans` entries of the weight and bias


def _norm_config(weight, eps, bias, backend, device=None, anchor="weight", hidden=None,
                 bound=False) -> _NormConfig:
    if not isinstance(weight, torch.Tensor):
        _fail("weight", type(weight).__name__, "a torch.Tensor", TypeError)
    device = weight.device if device is None else device
    hidden = weight.shape[0] if hidden is None and weight.dim() == 1 else hidden
    _check_vector("weight", weight, hidden if hidden is not None else -1, device, anchor)
    if bias is not None:
        _check_vector("bias", bias, hidden, device, anchor)
    spans = _spans((("weight", weight), ("bias", bias))) if bound and _real_memory(weight, bias) else None
    return _NormConfig(weight, bias, _check_eps(eps), hidden, device, anchor, _io_dtypes((weight, bias)),
                       _ops_for(backend, device), spans)


def _check_x(x) -> None:
    if not isinstance(x, torch.Tensor):
        _fail("x", type(x).__name__, "a torch.Tensor", TypeError)
    if x.dtype not in _FLOATS:
        _fail("x", f"dtype {x.dtype}", "torch.float32, torch.bfloat16 or torch.float16", TypeError)
    if x.dim() != 2 or x.shape[1] < 1:
        _fail("x", f"shape {tuple(x.shape)}", "shape (T, H) with H >= 1")


def _check_norm_call(c: _NormConfig, x, residual) -> None:
    """Per-call checks of ``x`` and ``residual`` against a validated configuration."""
    if x.shape[1] != c.hidden:
        _fail("x", f"shape {tuple(x.shape)}", f"shape (T, {c.hidden}) (weight's length)")
    _check_rows("x", x, c.hidden)
    if x.dtype not in c.io_dtypes:
        _check_io_dtype("x", x, c.io_dtypes, (("weight", c.weight), ("bias", c.bias)))
    if residual is not None:
        _check_tensor("residual", residual, c.device, c.anchor)
        if residual.dtype != x.dtype:
            _fail("residual", f"dtype {residual.dtype}", f"dtype {x.dtype} (x's)", TypeError)
        if residual.shape != x.shape:
            _fail("residual", f"shape {tuple(residual.shape)}", f"shape {tuple(x.shape)} (x's)")
        _check_rows("residual", residual, c.hidden)
    if torch.is_grad_enabled():
        _check_no_grad((("x", x), ("residual", residual), ("weight", c.weight), ("bias", c.bias)))


def _norm_static_spans(c: _NormConfig) -> list:
    return c.static_spans if c.static_spans is not None else _spans((("weight", c.weight), ("bias", c.bias)))


def _run_norm(c: _NormConfig, x, residual, out):
    _check_norm_call(c, x, residual)
    if out is None:
        y, residual_out = c.ops.norm(x, residual, c.weight, c.bias, c.eps)
        return y, (residual_out if residual is not None else x)
    shape = tuple(x.shape)
    if residual is None:
        if isinstance(out, (tuple, list)) and len(out) == 2 and out[1] is None:
            out = (out[0],)
        out = out[:1] if isinstance(out, (tuple, list)) else out
        names, shapes = ("y_out",), (shape,)
    else:
        names, shapes = ("y_out", "residual_out"), (shape, shape)
    real = _real_memory(x, *out) if isinstance(out, (tuple, list)) else False
    entries = _check_out_tuple(out, names, shapes, x, "x", real)
    y, residual_out = (out[0], None) if residual is None else out
    if real:
        _check_outputs(entries,
                       _spans((("x", x), ("residual", residual))) + _norm_static_spans(c),
                       lambda name: ("x", x) if name == "y_out" else ("residual", residual))
    c.ops.norm_out(x, residual, c.weight, c.bias, c.eps, y, residual_out)
    return y, (residual_out if residual is not None else x)


def _plain_rows(t, c: _NormConfig, shape, dtype) -> bool:
    """``t`` is a plain tensor of ``shape`` and ``dtype`` on the configuration's device, in rows with a
    contiguous last dim: the common in-place call, accepted by one read of each attribute."""
    if type(t) is not torch.Tensor or t.shape != shape or t.dtype != dtype or t.device != c.device:
        return False
    row, col = t.stride()
    return col == 1 and row >= shape[1]


def _row_span(t, shape) -> Tuple[int, int]:
    """Byte range of a row-layout tensor (:func:`_plain_rows`) with ``shape``, ``numel() > 0``."""
    start = t.data_ptr()
    return start, start + ((shape[0] - 1) * t.stride(0) + shape[1]) * t.element_size()


def _check_x_on(c: _NormConfig, x) -> None:
    """:func:`_check_x` and ``x`` on the configuration's device."""
    _check_x(x)
    if x.device != c.device:
        _fail("x", f"a tensor on {x.device}", f"a tensor on {c.device} (the device of {c.anchor})")


def _run_norm_(c: _NormConfig, x, residual):
    # The in-place call engines make once per decoder norm: a valid call is accepted by one read of each
    # attribute (_plain_rows) and disjoint byte ranges; anything else (a wrong argument, a subclass, ranges
    # that meet) takes the full checks, which raise with their messages -- the same rules, decided once.
    shape, dtype = (x.shape, x.dtype) if type(x) is torch.Tensor else ((), None)
    if (len(shape) == 2 and shape[1] == c.hidden and dtype in c.io_dtypes and _plain_rows(x, c, shape, dtype)
            and (residual is None or _plain_rows(residual, c, shape, dtype))):
        if torch.is_grad_enabled():
            _check_no_grad((("x", x), ("residual", residual), ("weight", c.weight), ("bias", c.bias)))
        fast = shape[0] > 0 and not x.is_meta and not torch.compiler.is_compiling()
        if fast:
            x0, x1 = _row_span(x, shape)
            r0, r1 = _row_span(residual, shape) if residual is not None else (x1, x1)
            fast = (x1 <= r0 or r1 <= x0) and all((e <= x0 or s >= x1) and (e <= r0 or s >= r1)
                                                  for s, e in (sp[3] for sp in _norm_static_spans(c)))
        if fast or shape[0] == 0 or not _real_memory(x, residual):
            c.ops.norm_inplace(x, residual, c.weight, c.bias, c.eps)
            return x, (residual if residual is not None else x)
    _check_x_on(c, x)
    _check_norm_call(c, x, residual)
    if _real_memory(x, residual):
        targets = _spans((("x", x), ("residual", residual)))
        if len(targets) == 2 and _meet(*targets):
            _fail("residual", "memory shared with x", "an in-place target that shares no element with x")
        for target in targets:
            for src in _norm_static_spans(c):
                if _meet(target, src):
                    _fail(target[0], f"memory shared with {src[0]}",
                          "an in-place target that shares no element with another input")
    c.ops.norm_inplace(x, residual, c.weight, c.bias, c.eps)
    return x, (residual if residual is not None else x)


class AddRMSNorm:
    """A bound residual add + RMSNorm (+ post-norm bias) for one norm layer: static configuration validated once.

    Parameters
    ----------
    weight : torch.Tensor
        Shape ``(H,)``, fp32 or the activations' dtype; its device is the device every call's tensors must be on.
    eps : float
        RMSNorm epsilon.
    bias : torch.Tensor, optional
        Post-norm bias, shape ``(H,)``: ``y = norm(s) * weight + bias``.
    backend : str, optional
        As for :class:`QKNormRope`.

    Calls: ``y, residual_out = norm(x, residual)`` and ``norm(x, residual, out=(y, residual_out))`` with the
    semantics of :func:`add_rmsnorm`, and ``norm.inplace(x, residual)``, the in-place form engines use (``y`` over
    ``x``, the rounded sum over ``residual``: :func:`add_rmsnorm_`).
    """

    __slots__ = ("config",)

    def __init__(self, weight: torch.Tensor, eps: float = 1e-6, bias: Optional[torch.Tensor] = None, *,
                 backend: Optional[str] = None):
        self.config = _norm_config(weight, eps, bias, backend, bound=True)

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, *,
                 out: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None):
        c = self.config
        _check_x_on(c, x)
        return _run_norm(c, x, residual, out)

    def inplace(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """``y`` over ``x`` and the rounded sum over ``residual``; returns ``(x, residual)``. See
        :func:`add_rmsnorm_`."""
        return _run_norm_(self.config, x, residual)

    def __repr__(self) -> str:
        return f"AddRMSNorm(hidden={self.config.hidden}, eps={self.config.eps}, bias={self.config.bias is not None})"


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
    _check_x(x)
    c = _norm_config(weight, eps, bias, backend, x.device, "x", x.shape[1])
    return _run_norm(c, x, residual, out)


def add_rmsnorm_(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float = 1e-6,
    bias: Optional[torch.Tensor] = None,
    *,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`add_rmsnorm` (vLLM's ``fused_add_rms_norm`` form): ``y`` is written over ``x`` and the
    rounded sum ``x + residual`` over ``residual``.

    Same arguments and values as :func:`add_rmsnorm` (without ``out``). ``x`` and ``residual`` may not share an
    element with each other or with ``weight``/``bias``. Returns ``(x, residual)`` (``(x, x)`` without a
    residual: a plain in-place RMSNorm); both version counters are bumped, as by any in-place torch op. Every
    row is read before it is written, so no extra buffer is used.
    """
    _check_x(x)
    c = _norm_config(weight, eps, bias, backend, x.device, "x", x.shape[1])
    return _run_norm_(c, x, residual)
