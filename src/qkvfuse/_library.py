"""The bottom layer: the ``torch.library`` schemas of every qkvfuse op, their fake kernels, and kernel registration.

Nothing else of qkvfuse is imported here but :mod:`qkvfuse._checks` (the ops' per-call rules) and
:mod:`qkvfuse._rope_mode` (the rope code); backends register their launchers into these schemas, and the public
layer (:mod:`qkvfuse.ops`) checks what the schemas cannot carry and calls the ops. There is one call path: public
function (or bound object) -> ``torch.ops.qkvfuse.*`` -> the kernel the dispatcher picks, which checks its
arguments before it reads or writes anything.

Ops, defined in three namespaces with one schema each:

* ``split_qkv_rmsnorm_rope`` -- functional, returns ``(q, k, v, gate)``; ``gate`` is an empty placeholder unless
  the rope code has :data:`Q_GATE` (the gated layout of Qwen3-Next / Qwen3.5, ``[q_0 | g_0 | q_1 | g_1 | ... | K
  | V]``);
* ``split_qkv_rmsnorm_rope_out`` -- writes ``q_out, k_out, v_out`` (and ``gate_out``, given exactly with
  :data:`Q_GATE`);
* ``split_qkv_rmsnorm_rope_inplace`` -- rewrites the Q and K heads inside ``qkv``; with :data:`Q_GATE` it also
  de-interleaves the row's Q/gate region into ``[Q heads | gate heads]`` (:func:`inplace_views`);
* ``split_qkv_rmsnorm_rope_cache`` -- the in-place form that also writes each token's K (normed, rotated) and V
  into a paged KV cache in the same pass (:class:`CacheTarget`, :mod:`qkvfuse._cache_mode`);
* ``split_qkv_rmsnorm_rope_cache_out`` -- the out= form that also writes the cache: ``qkv`` is read only, the
  cache arguments sit where the in-place cache form has them, the outputs last as in ``split_qkv_rmsnorm_rope_out``;
* ``add_rmsnorm`` / ``add_rmsnorm_out`` -- fused residual add + RMSNorm (+ bias); without a residual the second
  output of the functional form is an empty placeholder;
* ``add_rmsnorm_inplace`` -- the engines' in-place form: ``y`` over ``x``, the rounded sum over ``residual``.

The norm ops' trailing ``gemma`` flag, like the split's :data:`GEMMA` bit, says the norm weight is stored centred
at 0 (Gemma, Qwen3-Next, Qwen3.5): the kernels multiply by ``1 + w`` in fp32, so nothing is derived from a weight
outside the call (in-place weight updates are always seen).

The namespace names the backend: ``qkvfuse`` is "auto" (the dispatcher picks by device: the native kernel for
``CPU``, Triton for ``CUDA``/``XPU``/``PrivateUse1``, the reference elsewhere), ``qkvfuse_reference`` the
plain-PyTorch specification on any device, ``qkvfuse_triton`` the Triton kernels (CPU tensors under
``TRITON_INTERPRET=1``). Distinct names, not overloads of one name: a ``torch.jit.trace`` graph records an op
by name and schema, so overloads with one schema would replay as the first. :func:`qkvfuse.backends.select_ops`
maps a ``backend=`` argument to a namespace.

The mutating forms bump the version counter of every tensor they write (an ``ADInplaceOrView`` kernel, as
``torch.library.custom_op`` registers), so autograd raises when it needs a tensor that was overwritten.

The split schema is lean (a call parses fewer arguments): ``head_dim`` is ``qkv.shape[1] // (num_q_heads +
2 * num_kv_heads)``, the rotary dim is ``cos_sin_cache.shape[1]``, and the rotation style and the mRoPE layout
travel in one int, ``rope`` (:func:`qkvfuse._rope_mode.encode_rope`), with the two layout flags :data:`Q_GATE` and
:data:`GEMMA`; gated, ``head_dim`` is ``qkv.shape[1] // (2 * num_q_heads + 2 * num_kv_heads)``. Every kernel --
the Python ones registered here, the fake kernels and the native CPU kernels -- checks its own arguments
(:mod:`qkvfuse._checks`), so a raw ``torch.ops`` call is as safe as a public one.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from . import _cache_mode, _checks, _rope_mode
from ._rope_mode import RopeMode

__all__ = ["NAMESPACES", "OPS", "Q_GATE", "GEMMA", "encode_rope", "decode_rope", "decode_flags", "SplitConfig",
           "config_of", "split_config", "CacheTarget", "CACHE_OPS", "impl_library", "register_kernels",
           "schema_kernels", "check_positions", "check_cache_values", "MAX_HEAD_DIM"]

# Backend choice -> the namespace of its ops ("auto": the dispatcher picks by device).
NAMESPACES = {"auto": "qkvfuse", "reference": "qkvfuse_reference", "triton": "qkvfuse_triton"}
OPS = ("split_qkv_rmsnorm_rope", "split_qkv_rmsnorm_rope_out", "split_qkv_rmsnorm_rope_inplace", "add_rmsnorm",
       "add_rmsnorm_out", "add_rmsnorm_inplace", "split_qkv_rmsnorm_rope_cache", "split_qkv_rmsnorm_rope_cache_out")
CACHE_OPS = ("split_qkv_rmsnorm_rope_cache", "split_qkv_rmsnorm_rope_cache_out")  # the ops that write a KV cache
MAX_HEAD_DIM = _checks.MAX_HEAD_DIM

# The rope code lives in the bottom module qkvfuse._rope_mode (qkvfuse._checks reads it too); re-exported here,
# where the schemas that carry it are.
Q_GATE, GEMMA = _rope_mode.Q_GATE, _rope_mode.GEMMA
encode_rope, decode_rope, decode_flags = _rope_mode.encode_rope, _rope_mode.decode_rope, _rope_mode.decode_flags


# --------------------------------------------------------------------------------------------------------
# Schemas.
# --------------------------------------------------------------------------------------------------------
_SPLIT_ARGS = ("Tensor positions, Tensor cos_sin_cache, Tensor? q_weight, Tensor? k_weight, Tensor? q_bias, "
               "Tensor? k_bias, int num_q_heads, int num_kv_heads, float eps, int rope")
_NORM_ARGS = "Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps"

_MUTATED = {"split_qkv_rmsnorm_rope_out": (11, 12, 13, 14), "split_qkv_rmsnorm_rope_inplace": (0,),
            "add_rmsnorm_out": (5, 6), "add_rmsnorm_inplace": (0, 1),
            "split_qkv_rmsnorm_rope_cache": (0, 11, 12),
            "split_qkv_rmsnorm_rope_cache_out": (11, 12, 17, 18, 19, 20)}  # argument indices each mutating form writes
_libs = {}
for _ns in NAMESPACES.values():
    _lib = _libs[_ns] = torch.library.Library(_ns, "DEF")
    _lib.define(f"split_qkv_rmsnorm_rope(Tensor qkv, {_SPLIT_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")
    _lib.define(f"split_qkv_rmsnorm_rope_out(Tensor qkv, {_SPLIT_ARGS}, Tensor(a!) q_out, Tensor(b!) k_out, "
                "Tensor(c!) v_out, Tensor(d!)? gate_out=None) -> ()")
    _lib.define(f"split_qkv_rmsnorm_rope_inplace(Tensor(a!) qkv, {_SPLIT_ARGS}) -> ()")
    _lib.define(f"split_qkv_rmsnorm_rope_cache(Tensor(a!) qkv, {_SPLIT_ARGS}, Tensor(b!) key_cache, "
                "Tensor(c!) value_cache, Tensor slot_mapping, int cache_mode, Tensor? k_scale=None, "
                "Tensor? v_scale=None) -> ()")
    _lib.define(f"split_qkv_rmsnorm_rope_cache_out(Tensor qkv, {_SPLIT_ARGS}, Tensor(a!) key_cache, "
                "Tensor(b!) value_cache, Tensor slot_mapping, int cache_mode, Tensor? k_scale, Tensor? v_scale, "
                "Tensor(c!) q_out, Tensor(d!) k_out, Tensor(e!) v_out, Tensor(f!)? gate_out=None) -> ()")
    _lib.define(f"add_rmsnorm({_NORM_ARGS}, bool gemma=False) -> (Tensor, Tensor)")
    _lib.define(f"add_rmsnorm_out({_NORM_ARGS}, Tensor(a!) y_out, Tensor(b!)? residual_out, bool gemma=False) -> ()")
    _lib.define("add_rmsnorm_inplace(Tensor(a!) x, Tensor(b!)? residual, Tensor weight, Tensor? bias, float eps, "
                "bool gemma=False) -> ()")


# --------------------------------------------------------------------------------------------------------
# The split's configuration: one object from the schema's arguments to every backend's launcher.
# --------------------------------------------------------------------------------------------------------
class SplitConfig(NamedTuple):
    """Everything a split kernel reads besides ``qkv``, ``positions`` and its outputs.

    The first fields are the split schema's arguments after ``qkv`` and ``positions``, in the schema's order
    (:meth:`schema_args`; checked at import), then what is derived from them once: ``head_dim`` (from ``qkv``'s
    width), the decoded rope code ``mode`` and ``inplace`` (the op is the in-place form: its outputs are
    :func:`inplace_views` of ``qkv``). The public layer builds one per bound object (:class:`qkvfuse.QKNormRope`'s
    ``config``); each Python kernel builds one from its schema arguments and passes it to its backend's launcher
    (:func:`register_kernels`), so adding an option adds a field here instead of a parameter to every layer.
    """

    cos_sin_cache: torch.Tensor
    q_weight: Optional[torch.Tensor]
    k_weight: Optional[torch.Tensor]
    q_bias: Optional[torch.Tensor]
    k_bias: Optional[torch.Tensor]
    num_q_heads: int
    num_kv_heads: int
    eps: float
    rope: int  # the schema's code of ``mode`` (_rope_mode.encode_rope)
    head_dim: int
    mode: RopeMode
    inplace: bool = False

    def schema_args(self) -> tuple:
        """The split ops' arguments after ``qkv`` and ``positions`` (before any outputs)."""
        return tuple(self[:_SCHEMA_ARGS])

    @property
    def q_gate(self) -> bool:
        return self.mode.q_gate

    @property
    def gemma_norm(self) -> bool:
        return self.mode.gemma

    @property
    def mrope(self) -> bool:
        return bool(self.mode.mrope_section)

    @property
    def device(self) -> torch.device:
        return self.cos_sin_cache.device

    @property
    def width(self) -> int:
        """``qkv``'s width (gated: each Q head followed by its gate head)."""
        return ((2 if self.mode.q_gate else 1) * self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim


_SCHEMA_ARGS = len(_SPLIT_ARGS.split(",")) - 1  # without positions
assert SplitConfig._fields[:_SCHEMA_ARGS] == tuple(a.split()[-1] for a in _SPLIT_ARGS.split(",")[1:]), (
    "SplitConfig's first fields are the split schema's arguments, in its order")


def config_of(static_args: tuple, head_dim: int, inplace: bool = False) -> SplitConfig:
    """The :class:`SplitConfig` of a split op's arguments after ``qkv`` and ``positions`` (checked ones)."""
    # tuple.__new__ skips the generated keyword __new__ (a Python kernel builds one per call); the schema fixes the
    # number of static arguments, so the fields line up.
    return tuple.__new__(SplitConfig, (*static_args, head_dim, _rope_mode.decode_mode(static_args[-1]), inplace))


class CacheTarget(NamedTuple):
    """The cache-writing split's cache arguments, as its schema takes them (after the split's own): each launcher
    of ``split_qkv_rmsnorm_rope_cache`` gets one. ``cache_mode`` is :func:`qkvfuse._cache_mode.encode_cache`'s
    code; ``k_scale`` / ``v_scale`` are 0-d fp32 tensors for FP8 caches, else None."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    cache_mode: int
    k_scale: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None

    @property
    def layout(self) -> int:
        return self.cache_mode & 15

    @property
    def truncate(self) -> bool:
        return bool(self.cache_mode & _cache_mode.TRUNCATE)

    @property
    def fp8(self) -> bool:
        return _cache_mode.is_fp8(self.key_cache.dtype)

    @property
    def capacity(self) -> int:
        """Slots in the cache: ``num_blocks * block_size``."""
        blocks, block_size, _, _ = _cache_mode.cache_dims(self.layout, self.key_cache)
        return blocks * block_size


def split_config(num_q_heads: int, num_kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor,
                 q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
                 q_bias: Optional[torch.Tensor] = None, k_bias: Optional[torch.Tensor] = None, eps: float = 1e-6,
                 is_neox: bool = True, mrope_section: Optional[Sequence[int]] = None,
                 mrope_interleaved: bool = False, q_gate: bool = False, gemma_norm: bool = False,
                 inplace: bool = False, qkv=None, positions=None, backend=None) -> SplitConfig:
    """The :class:`SplitConfig` of the public split's keywords (checked ones: :mod:`qkvfuse.ops` checks them
    first). A call's other keywords (``qkv``, ``positions``, ``backend``) are accepted and ignored, so a case's
    keyword dict passes through whole: ``split_config(**kwargs).schema_args()`` are a raw op's arguments."""
    mode = RopeMode(bool(is_neox), tuple(mrope_section or ()), bool(mrope_interleaved) and bool(mrope_section),
                    bool(q_gate), bool(gemma_norm))
    return SplitConfig(cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads, num_kv_heads, float(eps),
                       mode.code(), head_dim, mode, inplace)


def _version_bumping_kernel(op, mutated):
    after = torch._C._after_ADInplaceOrView_keyset

    def kernel(keyset, *args):
        written = [args[i] for i in mutated if i < len(args) and args[i] is not None]  # defaults are not passed
        # increment_version skips inference tensors silently; torch's in-place ops refuse to write them outside
        # inference mode, and so does this (the native C++ kernel gets the same from TensorImpl::bump_version).
        if not torch.is_inference_mode_enabled() and any(t.is_inference() for t in written):
            raise RuntimeError("Inplace update to inference tensor outside InferenceMode is not allowed. You can "
                               "make a clone to get a normal tensor before doing inplace update.")
        torch.autograd.graph.increment_version(written)
        return op.redispatch(keyset & after, *args)

    return kernel


def register_version_kernels(backend: str) -> torch.library.Library:
    """Register the Python ``ADInplaceOrView`` kernels of ``backend``'s mutating ops; the returned library may be
    ``_destroy()``-ed by a backend that registers its own (the native CPU library does, in C++)."""
    ns = NAMESPACES[backend]
    lib = torch.library.Library(ns, "IMPL")
    for op, mutated in _MUTATED.items():
        lib.impl(op, _version_bumping_kernel(getattr(getattr(torch.ops, ns), op).default, mutated), "ADInplaceOrView",
                 with_keyset=True)
    return lib


version_libraries = {backend: register_version_kernels(backend) for backend in NAMESPACES}


def head_dim_of(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_gate: bool = False) -> int:
    return qkv.shape[1] // ((2 if q_gate else 1) * num_q_heads + 2 * num_kv_heads)


def split_outputs(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_gate: bool = False):
    """Fresh ``(q, k, v, gate)`` outputs for ``qkv``; ``gate`` is an empty placeholder unless ``q_gate``."""
    T, D = qkv.shape[0], head_dim_of(qkv, num_q_heads, num_kv_heads, q_gate)
    return (qkv.new_empty((T, num_q_heads * D)), qkv.new_empty((T, num_kv_heads * D)),
            qkv.new_empty((T, num_kv_heads * D)), qkv.new_empty((T, num_q_heads * D) if q_gate else (0,)))


def inplace_views(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_gate: bool = False):
    """``qkv``'s ``(q, k, v)`` column views after the in-place form (one op), ``(q, k, v, gate)`` when ``q_gate``:
    the gated in-place form leaves each row as ``[Q heads | gate heads | K heads | V heads]``, so all four are
    column views with ``qkv``'s row stride (unit last stride)."""
    D = head_dim_of(qkv, num_q_heads, num_kv_heads, q_gate)
    q, kv = num_q_heads * D, num_kv_heads * D
    if q_gate:
        q_, g, k, v = qkv.split_with_sizes([q, q, kv, kv], dim=1)
        return q_, k, v, g
    return tuple(qkv.split_with_sizes([q, kv, kv], dim=1))


def inplace_outputs(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_gate: bool = False):
    """:func:`inplace_views` in a launcher's output order: ``(q_out, k_out, v_out, gate_out)``, ``gate_out`` None
    unless ``q_gate``."""
    views = inplace_views(qkv, num_q_heads, num_kv_heads, q_gate)
    return (*views[:3], views[3] if len(views) == 4 else None)


def norm_outputs(x: torch.Tensor, residual: Optional[torch.Tensor]):
    return torch.empty_like(x), (torch.empty_like(x) if residual is not None else x.new_empty((0,)))


# The fake kernels check what the real kernels check, except the overlap rule (fake tensors have no memory).
for _ns, _lib in _libs.items():

    @torch.library.register_fake(f"{_ns}::split_qkv_rmsnorm_rope", lib=_lib)
    def _split_fake(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads, num_kv_heads,
                    eps, rope):
        _checks.check_split(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads,
                            num_kv_heads, eps, rope, real=False)
        return split_outputs(qkv, num_q_heads, num_kv_heads, bool(rope & Q_GATE))

    @torch.library.register_fake(f"{_ns}::split_qkv_rmsnorm_rope_out", lib=_lib)
    def _split_out_fake(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads,
                        num_kv_heads, eps, rope, q_out, k_out, v_out, gate_out=None):
        _checks.check_split(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads,
                            num_kv_heads, eps, rope, outs=(q_out, k_out, v_out, gate_out), real=False)

    @torch.library.register_fake(f"{_ns}::split_qkv_rmsnorm_rope_inplace", lib=_lib)
    def _split_inplace_fake(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads,
                            num_kv_heads, eps, rope):
        _checks.check_split(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads,
                            num_kv_heads, eps, rope, inplace=True, real=False)

    @torch.library.register_fake(f"{_ns}::split_qkv_rmsnorm_rope_cache", lib=_lib)
    def _split_cache_fake(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads,
                          num_kv_heads, eps, rope, key_cache, value_cache, slot_mapping, cache_mode, k_scale=None,
                          v_scale=None):
        head_dim = _checks.check_split(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias,
                                       num_q_heads, num_kv_heads, eps, rope, inplace=True, real=False)
        _checks.check_cache(qkv, key_cache, value_cache, slot_mapping, cache_mode, k_scale, v_scale, num_kv_heads,
                            head_dim, real=False)

    @torch.library.register_fake(f"{_ns}::split_qkv_rmsnorm_rope_cache_out", lib=_lib)
    def _split_cache_out_fake(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads,
                              num_kv_heads, eps, rope, key_cache, value_cache, slot_mapping, cache_mode, k_scale,
                              v_scale, q_out, k_out, v_out, gate_out=None):
        head_dim = _checks.check_split(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias,
                                       num_q_heads, num_kv_heads, eps, rope, outs=(q_out, k_out, v_out, gate_out),
                                       real=False)
        _checks.check_cache(qkv, key_cache, value_cache, slot_mapping, cache_mode, k_scale, v_scale, num_kv_heads,
                            head_dim, real=False)

    @torch.library.register_fake(f"{_ns}::add_rmsnorm", lib=_lib)
    def _norm_fake(x, residual, weight, bias, eps, gemma=False):
        _checks.check_norm(x, residual, weight, bias, real=False)
        return norm_outputs(x, residual)

    @torch.library.register_fake(f"{_ns}::add_rmsnorm_out", lib=_lib)
    def _norm_out_fake(x, residual, weight, bias, eps, y_out, residual_out, gemma=False):
        _checks.check_norm(x, residual, weight, bias, outs=(y_out, residual_out), real=False)

    @torch.library.register_fake(f"{_ns}::add_rmsnorm_inplace", lib=_lib)
    def _norm_inplace_fake(x, residual, weight, bias, eps, gemma=False):
        _checks.check_norm(x, residual, weight, bias, inplace=True, real=False)


# --------------------------------------------------------------------------------------------------------
# Registration. A backend gives three launchers:
#   split_out(qkv, positions, config, q_out, k_out, v_out, gate_out)   (config: a SplitConfig)
#   norm_out(x, residual, weight, bias, eps, gemma, y_out, residual_out)
#   split_cache(qkv, positions, config, q_out, k_out, v_out, gate_out, target)   (target: a CacheTarget)
# (qkvfuse.reference's functions are the specification), adapted here to the schemas: functional and in-place
# forms derived from the out= form (the in-place cache form gets the in-place views and config.inplace, its out=
# form the caller's outputs); the norm kernels accept outputs that exactly alias their own inputs; the gated
# in-place form's outputs are inplace_views, which overlap the interleaved input (config.inplace tells the
# launcher: the split kernels read a token's Q/gate region before they write it).
# --------------------------------------------------------------------------------------------------------
SplitOut = Callable[..., None]
NormOut = Callable[..., None]
SplitCache = Callable[..., None]


def impl_library(backend: str) -> torch.library.Library:
    """A fresh ``IMPL`` library for the ops of ``backend`` (a key of :data:`NAMESPACES`); its owner may
    ``_destroy()`` it to take its kernels back."""
    return torch.library.Library(NAMESPACES[backend], "IMPL")


def register_kernels(lib: torch.library.Library, dispatch_key: str, split_out: SplitOut, norm_out: NormOut,
                     split_cache: SplitCache, ops: Sequence[str] = OPS) -> None:
    """Register a backend's launchers (see above) for the ops ``ops`` (default: all) of ``lib``'s namespace on
    ``dispatch_key``."""
    for op, kernel in schema_kernels(split_out, norm_out, split_cache).items():
        if op in ops:
            lib.impl(op, kernel, dispatch_key)


_CACHE_INPUTS = ("cos_sin_cache", "q_weight", "k_weight", "q_bias", "k_bias")  # the caches' overlap rule's names


def schema_kernels(split_out: SplitOut, norm_out: NormOut, split_cache: SplitCache) -> dict:
    """``{op name: kernel with the op's schema}`` for each of :data:`OPS`, from a backend's launchers."""

    # Each kernel checks its own arguments (qkvfuse._checks), then runs: a raw torch.ops call is as safe as a
    # public one.
    def run(qkv, positions, config, q_out, k_out, v_out, gate_out):
        check_positions(positions, config.cos_sin_cache.shape[0])  # before any output is written
        split_out(qkv, positions, config, q_out, k_out, v_out, gate_out)

    def out(qkv, positions, cache, q_w, k_w, q_b, k_b, hq, hkv, eps, rope, q_out, k_out, v_out, gate_out=None):
        static = (cache, q_w, k_w, q_b, k_b, hq, hkv, eps, rope)
        outs = (q_out, k_out, v_out, gate_out)
        head_dim = _checks.check_split(qkv, positions, *static, outs=outs)
        run(qkv, positions, config_of(static, head_dim), *outs)

    def functional(qkv, positions, cache, q_w, k_w, q_b, k_b, hq, hkv, eps, rope):
        static = (cache, q_w, k_w, q_b, k_b, hq, hkv, eps, rope)
        config = config_of(static, _checks.check_split(qkv, positions, *static))
        outs = split_outputs(qkv, hq, hkv, config.q_gate)
        run(qkv, positions, config, *outs[:3], outs[3] if config.q_gate else None)
        return outs

    def inplace(qkv, positions, cache, q_w, k_w, q_b, k_b, hq, hkv, eps, rope):
        static = (cache, q_w, k_w, q_b, k_b, hq, hkv, eps, rope)
        config = config_of(static, _checks.check_split(qkv, positions, *static, inplace=True), inplace=True)
        run(qkv, positions, config, *inplace_outputs(qkv, hq, hkv, config.q_gate))

    def cache_run(qkv, positions, static, key_cache, value_cache, slot_mapping, cache_mode, k_scale, v_scale, outs):
        # outs None: the in-place form (its views are the outputs)
        cs, hq, hkv = static[0], static[5], static[6]
        head_dim = _checks.check_split(qkv, positions, *static, inplace=outs is None, outs=outs)
        named_outs = () if outs is None else tuple(zip(("q_out", "k_out", "v_out", "gate_out"), outs))
        _checks.check_cache(qkv, key_cache, value_cache, slot_mapping, cache_mode, k_scale, v_scale, hkv, head_dim,
                            inputs=(("positions", positions), *zip(_CACHE_INPUTS, static[:5]), *named_outs))
        config = config_of(static, head_dim, inplace=outs is None)
        target = CacheTarget(key_cache, value_cache, slot_mapping, cache_mode, k_scale, v_scale)
        check_positions(positions, cs.shape[0])  # before anything is written
        check_cache_values(target, qkv.shape[0])
        if outs is None:
            outs = inplace_outputs(qkv, hq, hkv, config.q_gate)
        split_cache(qkv, positions, config, *outs, target)

    def cache(qkv, positions, cs, q_w, k_w, q_b, k_b, hq, hkv, eps, rope, key_cache, value_cache, slot_mapping,
              cache_mode, k_scale=None, v_scale=None):
        cache_run(qkv, positions, (cs, q_w, k_w, q_b, k_b, hq, hkv, eps, rope), key_cache, value_cache,
                  slot_mapping, cache_mode, k_scale, v_scale, None)

    def cache_out(qkv, positions, cs, q_w, k_w, q_b, k_b, hq, hkv, eps, rope, key_cache, value_cache, slot_mapping,
                  cache_mode, k_scale, v_scale, q_out, k_out, v_out, gate_out=None):
        cache_run(qkv, positions, (cs, q_w, k_w, q_b, k_b, hq, hkv, eps, rope), key_cache, value_cache,
                  slot_mapping, cache_mode, k_scale, v_scale, (q_out, k_out, v_out, gate_out))

    def norm_checked_out(x, residual, weight, bias, eps, y_out, residual_out, gemma=False):
        _checks.check_norm(x, residual, weight, bias, outs=(y_out, residual_out))
        norm_out(x, residual, weight, bias, eps, gemma, y_out, residual_out)

    def norm_functional(x, residual, weight, bias, eps, gemma=False):
        _checks.check_norm(x, residual, weight, bias)
        y, residual_out = norm_outputs(x, residual)
        norm_out(x, residual, weight, bias, eps, gemma, y, residual_out if residual is not None else None)
        return y, residual_out

    def norm_inplace(x, residual, weight, bias, eps, gemma=False):
        _checks.check_norm(x, residual, weight, bias, inplace=True)
        norm_out(x, residual, weight, bias, eps, gemma, x, residual)

    return {"split_qkv_rmsnorm_rope": functional, "split_qkv_rmsnorm_rope_out": out,
            "split_qkv_rmsnorm_rope_inplace": inplace, "split_qkv_rmsnorm_rope_cache": cache,
            "split_qkv_rmsnorm_rope_cache_out": cache_out,
            "add_rmsnorm": norm_functional,
            "add_rmsnorm_out": norm_checked_out, "add_rmsnorm_inplace": norm_inplace}


# --------------------------------------------------------------------------------------------------------
# The position range rule, shared by the Python kernels. CPU kernels raise before writing any output (no
# host sync is involved); accelerator kernels clamp positions into the table and never read outside it, and
# check only when QKVFUSE_CHECK_POSITIONS=1 (a host sync per call; read once, at import).
# --------------------------------------------------------------------------------------------------------
CHECK_POSITIONS_ON_ACCELERATORS = os.environ.get("QKVFUSE_CHECK_POSITIONS", "") == "1"


def positions_error(lo: int, hi: int, max_position: int) -> ValueError:
    return ValueError(f"positions: expected values in [0, {max_position}) (cos_sin_cache rows), "
                      f"got values in [{lo}, {hi}]")


def check_positions(positions: torch.Tensor, max_position: int) -> None:
    """Raise :func:`positions_error` for positions outside ``[0, max_position)``, where that costs no host sync
    (CPU tensors), or on accelerators when ``QKVFUSE_CHECK_POSITIONS=1`` outside graph capture."""
    if positions.numel() == 0:
        return
    if positions.device.type != "cpu":
        if not CHECK_POSITIONS_ON_ACCELERATORS:
            return
        capturing = getattr(torch.get_device_module(positions.device), "is_current_stream_capturing", None)
        if capturing is not None and capturing():
            return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= max_position:
        raise positions_error(lo, hi, max_position)


def _data_checked(t: torch.Tensor) -> bool:
    """Whether a value rule may read ``t``'s data here: always on CPU (no sync); on accelerators only with
    ``QKVFUSE_CHECK_POSITIONS=1`` and outside graph capture (a host sync)."""
    if t.device.type == "cpu":
        return True
    if not CHECK_POSITIONS_ON_ACCELERATORS:
        return False
    capturing = getattr(torch.get_device_module(t.device), "is_current_stream_capturing", None)
    return not (capturing is not None and capturing())


def slots_error(hi: int, capacity: int) -> ValueError:
    return ValueError(f"slot_mapping: expected values < {capacity} (the cache's num_blocks * block_size) or "
                      f"negative (not written), got {hi}")


def check_cache_values(target: CacheTarget, num_tokens: int) -> None:
    """The value rules of the cache-writing split, by :func:`check_positions`' rule (CPU: always, before anything
    is written; accelerators: with ``QKVFUSE_CHECK_POSITIONS=1``, where a bad slot is otherwise skipped): the
    first ``num_tokens`` slots below the cache's capacity, FP8 scales positive and finite."""
    slots = target.slot_mapping[:num_tokens]
    if slots.numel() and _data_checked(slots):
        hi = int(slots.max())
        if hi >= target.capacity:
            raise slots_error(hi, target.capacity)
    for name, scale in (("k_scale", target.k_scale), ("v_scale", target.v_scale)):
        if scale is not None and _data_checked(scale):
            value = float(scale.reshape(()))
            if not 0.0 < value < float("inf"):
                raise ValueError(f"{name}: expected a positive finite scale, got {value}")
