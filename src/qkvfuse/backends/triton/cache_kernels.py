"""The Triton kernel of the cache-writing split: the split of :mod:`.kernels` (in place, or into out= outputs), with
each token's K and V also stored in a paged KV cache, in the same program that computes them.

One program: ``BLOCK_T`` tokens x a block of ``Q_HEADS`` Q heads, or x a block of ``KV_HEADS`` KV heads. A Q
program is the split kernel's (``kernels._norm_rope_heads``, gated de-interleave included). A KV program norms
and rotates its K heads once, in fp32, stores them rounded into ``k_out`` (in place: ``qkv``'s own K columns) and,
from the same fp32 tile, into the cache (rounded to the cache's dtype, or quantised to FP8); then it copies its V
heads into the value cache (and, ``COPY_V``, into ``v_out``). So K is computed once and ``qkv`` is read in one
pass (each element by one program): no second pass over ``qkv`` or the cache.

Cache addressing (:mod:`qkvfuse._cache_mode`): element ``(token t, head h, dim d)`` goes to ``block * sb + h * sh
+ f(offset) + g(d)`` with ``block, offset = divmod(slot_mapping[t], block_size)``, all in int64. For NHD, HND and
``vec`` ``f`` and ``g`` are strides (the launcher passes ``vec``'s transposed K region as offset stride 1 and dim
stride ``block_size``); ``amx`` packs pairs (:func:`_cache_offsets`). A token past ``slot_mapping``'s end, or
whose slot is negative or not below the capacity, writes nothing to the caches (still its ``qkv`` row).

FP8 (:func:`_fp8_bits`) is encoded with integer operations on the fp32 bits, like ``kernels._round_for_store``:
the CPU interpreter's and a GPU's float8 conversions need not agree with torch's, this does, bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _cos_sin, _norm_rope_heads, _round_for_store

__all__ = ["split_qkv_rmsnorm_rope_cache_kernel", "fp8_kernel", "E4M3", "E5M2"]

# The FP8 constexpr of the kernels: 0 = the cache has qkv's dtype.
E4M3, E5M2 = 1, 2


@triton.jit
def _fp8_bits(x, scale, FP8: tl.constexpr, TRUNCATE: tl.constexpr):
    """The FP8 byte (an int32 in 0..255) of fp32 ``x`` stored with fp32 ``scale``: :func:`qkvfuse.reference.quantize`.

    ``x / scale`` (IEEE division, ``div_rn``: a GPU's plain ``/`` is approximate) saturated to the format's finite
    range and rounded to nearest even; ``TRUNCATE``: ``x * (1 / scale)`` saturated and truncated toward zero.
    NaN stays NaN (``0x7F`` with the sign: torch's encoding in both formats). The sign-magnitude encoding is
    built from the fp32 bits: normal results rebias the exponent and round the mantissa (carrying into the
    exponent), subnormal ones shift the mantissa with its implicit bit into units of the smallest subnormal.
    """
    MANT: tl.constexpr = 3 if FP8 == 1 else 2
    BIAS: tl.constexpr = 7 if FP8 == 1 else 15
    BOUND: tl.constexpr = 448.0 if FP8 == 1 else 57344.0
    SHIFT: tl.constexpr = 23 - MANT
    if TRUNCATE:
        y = x * tl.math.div_rn(tl.full([1], 1.0, tl.float32), scale)
    else:
        y = tl.math.div_rn(x, scale)
    y = tl.where(y > BOUND, BOUND, tl.where(y < -BOUND, -BOUND, y))  # comparisons keep NaN NaN
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    # Normal results: exponent field >= 1 - BIAS + 127.
    rebased = mag - ((127 - BIAS) << 23)
    if TRUNCATE:
        normal = rebased >> SHIFT
    else:
        normal = (rebased + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT
    # Subnormal results: the value in units of 2^(1 - BIAS - MANT) is m >> shift; at shift 25 every m < 2^24 gives
    # 0 (smaller values, fp32 subnormals included, are 0 too), so the shift is bounded and no operand overflows.
    m = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum((151 - BIAS - MANT) - exp, 1), 25)
    if TRUNCATE:
        sub = m >> shift
    else:
        sub = (m + ((1 << (shift - 1)) - 1) + ((m >> shift) & 1)) >> shift
    out = tl.where(exp >= 128 - BIAS, normal, sub)
    return tl.where(mag > 0x7F800000, 0x7F, out) | sign


@triton.jit
def fp8_kernel(x_ptr, scale_ptr, out_ptr, n, FP8: tl.constexpr, TRUNCATE: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i] = _fp8_bits(x[i], scale)`` as uint8 (lets the tests compare the encoding with torch's)."""
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    scale = tl.load(scale_ptr)
    tl.store(out_ptr + i, _fp8_bits(x, scale, FP8, TRUNCATE).to(tl.uint8), mask=i < n)


@triton.jit
def _cache_offsets(blk, off, h, d, block_stride, off_stride, head_stride, dim_stride, block_size,
                   HEAD_DIM: tl.constexpr, AMX: tl.constexpr, IS_KEY: tl.constexpr):
    """int64 element offsets ``[BLOCK_T, HEADS, BLOCK_D]`` of tokens at ``(blk, off)`` ([BLOCK_T] int64), heads
    ``h`` and dims ``d`` in one cache (:mod:`qkvfuse._cache_mode`'s index maps)."""
    base = blk[:, None, None] * block_stride + h.to(tl.int64)[None, :, None] * head_stride
    if AMX:
        if IS_KEY:  # region [block_size / 16, D / 2, 16, 2]
            o = (off // 16) * (16 * HEAD_DIM) + (off % 16) * 2
            dd = (d // 2) * 32 + d % 2
        else:  # region [D / 16, block_size / 2, 16, 2]
            o = (off // 2) * 32 + off % 2
            dd = (d // 16).to(tl.int64) * (16 * block_size) + (d % 16) * 2
    else:
        o = off * off_stride
        dd = d.to(tl.int64) * dim_stride
    return base + o[:, None, None] + dd[None, None, :]


@triton.jit
def _store_cache(cache_ptr, offs, x, scale_ptr, mask, FP8: tl.constexpr, TRUNCATE: tl.constexpr):
    """Store the tile ``x`` (fp32 to be rounded or quantised; or, ``x`` already in the cache's dtype, as is)."""
    if FP8:
        scale = tl.load(scale_ptr).to(tl.float32)
        tl.store(cache_ptr + offs, _fp8_bits(x.to(tl.float32), scale, FP8, TRUNCATE).to(tl.uint8), mask=mask)
    elif x.dtype == tl.float32:
        tl.store(cache_ptr + offs, _round_for_store(x, cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(cache_ptr + offs, x, mask=mask)


@triton.jit(do_not_specialize=["T", "num_slots", "max_position", "s_t", "s_h", "s_w"])
def split_qkv_rmsnorm_rope_cache_kernel(
    qkv_ptr, pos_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, q_b_ptr, k_b_ptr, q_out_ptr, k_out_ptr, v_out_ptr, gate_out_ptr,
    key_cache_ptr, value_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    T, num_slots, num_q_heads, num_kv_heads, eps, max_position, s_t, s_h, s_w,
    qkv_stride, pos_stride_axis, pos_stride_tok, cos_sin_stride, q_out_stride, k_out_stride, v_out_stride,
    gate_out_stride, slot_stride,
    capacity, block_size,
    kc_block_stride, kc_off_stride, kc_head_stride, kc_dim_stride,
    vc_block_stride, vc_off_stride, vc_head_stride, vc_dim_stride,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, NORM: tl.constexpr, Q_BIAS: tl.constexpr, K_BIAS: tl.constexpr,
    GEMMA: tl.constexpr, IS_NEOX: tl.constexpr, MROPE: tl.constexpr, MROPE_INTERLEAVED: tl.constexpr,
    Q_GATE: tl.constexpr, AMX: tl.constexpr, FP8: tl.constexpr, TRUNCATE: tl.constexpr, IN_PLACE: tl.constexpr,
    COPY_V: tl.constexpr,
):
    """Grid: ``(cdiv(T, BLOCK_T), cdiv(Hq, Q_HEADS) + cdiv(Hkv, KV_HEADS))``; see the module docstring.

    In place, ``q_out`` / ``gate_out`` are ``qkv``'s own Q (and gate) columns (the in-place views) or a scratch
    buffer (:func:`qkvfuse.backends.triton.launch.split_qkv_rmsnorm_rope_out`'s rule for wide gated regions) and
    ``k_out`` ``qkv``'s own K columns; out=, the caller's outputs. ``IN_PLACE``: some program writes what it reads
    (the barrier of ``kernels._norm_rope_heads``). ``COPY_V``: ``v_out`` is not ``qkv``'s own V columns, so the KV
    programs copy V there too. FP8 caches come as uint8 views, ``FP8`` naming the format (:data:`E4M3`,
    :data:`E5M2`); the scales are read here, never on the host.
    """
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < T
    block = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, Q_HEADS)
    k_col = (2 if Q_GATE else 1) * num_q_heads * HEAD_DIM  # first K column of a row
    cos, sin = _cos_sin(pos_ptr, pos_stride_axis, pos_stride_tok, cos_sin_ptr, cos_sin_stride, tok, tok_mask,
                        max_position, s_t, s_h, s_w, ROT_DIM, BLOCK_D, IS_NEOX, MROPE, MROPE_INTERLEAVED)
    if block < q_blocks:
        _norm_rope_heads(qkv_ptr, qkv_stride, q_out_ptr, q_out_stride, q_w_ptr, q_b_ptr, gate_out_ptr,
                         gate_out_stride, tok, tok_mask, block * Q_HEADS, num_q_heads, cos, sin, eps, HEAD_DIM,
                         ROT_DIM, BLOCK_D, Q_HEADS, NORM, Q_BIAS, GEMMA, IS_NEOX, Q_GATE, IN_PLACE)
    else:
        head0 = (block - q_blocks) * KV_HEADS
        k = _norm_rope_heads(qkv_ptr + k_col, qkv_stride, k_out_ptr, k_out_stride, k_w_ptr, k_b_ptr,
                             k_out_ptr, k_out_stride, tok, tok_mask, head0, num_kv_heads, cos, sin, eps, HEAD_DIM,
                             ROT_DIM, BLOCK_D, KV_HEADS, NORM, K_BIAS, GEMMA, IS_NEOX, False, IN_PLACE)
        # Slots: tokens past slot_mapping's end, negative or too large ones are not written (no host check on
        # a device, none under graph capture).
        has_slot = tok_mask & (tok < num_slots)
        slot = tl.load(slot_ptr + tok * slot_stride, mask=has_slot, other=-1).to(tl.int64)
        has_slot &= (slot >= 0) & (slot < capacity)
        slot = tl.where(has_slot, slot, 0)
        blk = slot // block_size
        off = slot % block_size
        d = tl.arange(0, BLOCK_D)
        h = head0 + tl.arange(0, KV_HEADS)
        head_mask = (h < num_kv_heads)[None, :, None] & (d < HEAD_DIM)[None, None, :]
        mask = has_slot[:, None, None] & head_mask
        k_offs = _cache_offsets(blk, off, h, d, kc_block_stride, kc_off_stride, kc_head_stride, kc_dim_stride,
                                block_size, HEAD_DIM, AMX, True)
        _store_cache(key_cache_ptr, k_offs, k, k_scale_ptr, mask, FP8, TRUNCATE)
        head_offs = h[None, :, None] * HEAD_DIM + d[None, None, :]
        v_src = qkv_ptr + k_col + num_kv_heads * HEAD_DIM + tok[:, None, None] * qkv_stride + head_offs
        if COPY_V:  # every token's V to v_out, the cache's rows below
            tok_heads = tok_mask[:, None, None] & head_mask
            v = tl.load(v_src, mask=tok_heads)
            tl.store(v_out_ptr + tok[:, None, None] * v_out_stride + head_offs, v, mask=tok_heads)
        else:
            v = tl.load(v_src, mask=mask)
        v_offs = _cache_offsets(blk, off, h, d, vc_block_stride, vc_off_stride, vc_head_stride, vc_dim_stride,
                                block_size, HEAD_DIM, AMX, False)
        _store_cache(value_cache_ptr, v_offs, v, v_scale_ptr, mask, FP8, TRUNCATE)
