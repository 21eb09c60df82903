"""Triton kernels of both qkvfuse op families, from one source (GPUs, Ascend NPUs, and the CPU interpreter).

Shared pieces: :func:`_rms_scale` (fp32 RMS statistics), :func:`_round_for_store` (the one rounding, to nearest
even, done with integer bit operations so that the CPU interpreter rounds exactly like a GPU) and
:func:`_mrope_axis` (the mRoPE axis rule of :func:`qkvfuse.rope.mrope_axis_map`, evaluated per rotary lane;
``tests/backends/test_triton.py`` checks the two agree for every section split).

Portability: only core ``tl`` operations (loads/stores with masks, ``where``, ``sum``, ``rsqrt``, bitcasts,
scalar ``if`` and, for the in-place form only, ``debug_barrier``). No inline assembly, no ``tl.extra`` libdevice, no atomics, no warp shuffles, no
``tl.reshape``/``tl.split`` pair tricks: the rotation partner of each lane is loaded again from memory (it
sits in the same cache lines), which works for any head_dim and any rotary_dim without lane exchanges. Kernels
assume validated input (``qkvfuse.ops``) and never branch on user errors.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["split_qkv_rmsnorm_rope_kernel", "add_rmsnorm_kernel", "mrope_axis_kernel"]


@triton.jit
def _round_for_store(y, DTYPE: tl.constexpr):
    """fp32 ``y`` rounded once to ``DTYPE``, to nearest even.

    bf16 is rounded with integer arithmetic on the fp32 bits and produced by a bitcast: the CPU interpreter's
    fp32 -> bf16 conversion truncates (and flushes subnormals), a GPU's rounds to nearest even; this way both
    give the bits of ``torch.Tensor.to(torch.bfloat16)``, NaN kept NaN (quietened), overflow to inf.
    """
    if DTYPE == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        quiet_nan = (bits | 0x400000) & 0xFFFF0000
        bits = tl.where(y != y, quiet_nan, rounded)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = y.to(DTYPE)
    return out


@triton.jit
def _rms_scale(x, n, eps, AXIS: tl.constexpr):
    """``rsqrt(mean(x^2) + eps)`` over ``AXIS`` of fp32 ``x`` (masked lanes hold 0), kept as a size-1 axis."""
    return tl.expand_dims(tl.rsqrt(tl.sum(x * x, axis=AXIS) / n + eps), AXIS)


@triton.jit
def _mrope_axis(j, s_t, s_h, s_w, INTERLEAVED: tl.constexpr):
    """Position row (0 temporal, 1 height, 2 width) of rotary pair ``j`` -- rope.mrope_axis_map's rule."""
    if INTERLEAVED:
        r = j % 3
        axis = tl.where((r == 1) & (j < 3 * s_h), 1, tl.where((r == 2) & (j < 3 * s_w), 2, 0))
    else:
        axis = tl.where(j < s_t, 0, tl.where(j < s_t + s_h, 1, 2))
    return axis


@triton.jit
def mrope_axis_kernel(out_ptr, half, s_t, s_h, s_w, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):
    """Writes ``_mrope_axis(j)`` for ``j < half`` (lets the tests compare the in-kernel rule with rope.py)."""
    j = tl.arange(0, BLOCK)
    tl.store(out_ptr + j, _mrope_axis(j, s_t, s_h, s_w, INTERLEAVED).to(tl.int32), mask=j < half)


@triton.jit
def _norm_rope_heads(src_ptr, src_stride, dst_ptr, dst_stride, w_ptr, b_ptr, gate_ptr, gate_stride, tok, tok_mask,
                     head0, num_heads, cos, sin, eps, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                     GEMMA: tl.constexpr, IS_NEOX: tl.constexpr, GATE: tl.constexpr, IN_PLACE: tl.constexpr):
    """RMSNorm (optional) + rotation of heads ``head0 .. head0 + HEADS`` for the tokens ``tok`` ([BLOCK_T]).

    The tile is ``[BLOCK_T, HEADS, BLOCK_D]`` in fp32; ``cos``/``sin`` are ``[BLOCK_T, BLOCK_D]`` per lane.
    Every lane computes ``out_d = y_d * c + sign_d * y_partner(d) * s`` from its own value and its partner's,
    loaded again, so no lane exchange (shuffle, reshape) is needed and no lane sits idle in a branch: a
    partial-rotary head is the same code with ``where(d < ROT_DIM, rotated, y)``. ``GEMMA``: the weights are
    stored centred at 0 and the heads multiplied by ``1 + w`` (fp32).

    ``GATE`` (the gated Q layout): source head ``h`` sits at ``2 * h * HEAD_DIM`` of the row and is followed by
    its gate head, which is copied bit-exact to ``gate_ptr`` (head ``h`` at ``h * HEAD_DIM``, row stride
    ``gate_stride``); destination heads are dense (``h * HEAD_DIM``).

    ``IN_PLACE`` (``dst`` -- or, gated, ``dst`` and ``gate`` -- overwrite what this program reads): a lane's
    partner may live in another thread or warp, so every thread must have read its values (gate included) before
    any thread overwrites them; one block-wide barrier (uniform: the whole program takes the same branch) orders
    the reads before the writes. It orders this program's accesses only: writes into another program's input
    are the launcher's to avoid.

    Returns the fp32 result tile before its rounding (the cache kernel quantises K from it; callers that only
    store ignore it).
    """
    HALF: tl.constexpr = ROT_DIM // 2
    d = tl.arange(0, BLOCK_D)
    if IS_NEOX:  # pairs (j, j + HALF)
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
    else:  # GPT-J pairs (2j, 2j + 1)
        partner = d ^ 1
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    rotary = d < ROT_DIM
    partner = tl.where(rotary, partner, d)
    h = head0 + tl.arange(0, HEADS)
    # [BLOCK_T, HEADS, BLOCK_D] offsets; tok is int64 so row offsets cannot overflow at large T x width.
    SRC_HEAD: tl.constexpr = 2 * HEAD_DIM if GATE else HEAD_DIM  # distance between source heads
    row = tok[:, None, None] * src_stride + h[None, :, None] * SRC_HEAD
    mask = tok_mask[:, None, None] & (h < num_heads)[None, :, None] & (d < HEAD_DIM)[None, None, :]
    x = tl.load(src_ptr + row + d[None, None, :], mask=mask, other=0.0).to(tl.float32)
    x_p = tl.load(src_ptr + row + partner[None, None, :], mask=mask, other=0.0).to(tl.float32)
    if GATE:
        gate = tl.load(src_ptr + row + HEAD_DIM + d[None, None, :], mask=mask)  # as stored: a bit-exact copy
    if NORM:
        scale = _rms_scale(x, HEAD_DIM, eps, 2)
        w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        w_p = tl.load(w_ptr + partner, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        if GEMMA:
            w += 1.0
            w_p += 1.0
        y = x * scale * w[None, None, :]
        y_p = x_p * scale * w_p[None, None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, None, :]
            y_p += tl.load(b_ptr + partner, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, None, :]
    else:
        y = x
        y_p = x_p
    out = tl.where(rotary[None, None, :], y * cos[:, None, :] + sign[None, None, :] * y_p * sin[:, None, :], y)
    if IN_PLACE:
        tl.debug_barrier()
    dst_row = tok[:, None, None] * dst_stride + h[None, :, None] * HEAD_DIM
    tl.store(dst_ptr + dst_row + d[None, None, :], _round_for_store(out, dst_ptr.dtype.element_ty), mask=mask)
    if GATE:
        gate_row = tok[:, None, None] * gate_stride + h[None, :, None] * HEAD_DIM
        tl.store(gate_ptr + gate_row + d[None, None, :], gate, mask=mask)
    return out


@triton.jit
def _cos_sin(pos_ptr, pos_stride_axis, pos_stride_tok, cache_ptr, cache_stride, tok, tok_mask, max_position,
             s_t, s_h, s_w, ROT_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_NEOX: tl.constexpr,
             MROPE: tl.constexpr, MROPE_INTERLEAVED: tl.constexpr):
    """``cos, sin`` of shape ``[BLOCK_T, BLOCK_D]`` (fp32): the values each lane's rotation pair uses.

    Positions are read once per token (one row for RoPE, three for mRoPE) with the token mask, and clamped into
    ``[0, max_position)`` here, so a bad position (unchecked under graph capture) never reads outside the table.
    """
    HALF: tl.constexpr = ROT_DIM // 2
    d = tl.arange(0, BLOCK_D)
    if IS_NEOX:
        j = tl.where(d < HALF, d, d - HALF)
    else:
        j = d // 2
    rotary = d < ROT_DIM
    j = tl.where(rotary, j, 0)
    p = tl.load(pos_ptr + tok * pos_stride_tok, mask=tok_mask, other=0).to(tl.int64)
    p = tl.minimum(tl.maximum(p, 0), max_position - 1)
    if MROPE:
        p_h = tl.load(pos_ptr + pos_stride_axis + tok * pos_stride_tok, mask=tok_mask, other=0).to(tl.int64)
        p_w = tl.load(pos_ptr + 2 * pos_stride_axis + tok * pos_stride_tok, mask=tok_mask, other=0).to(tl.int64)
        p_h = tl.minimum(tl.maximum(p_h, 0), max_position - 1)
        p_w = tl.minimum(tl.maximum(p_w, 0), max_position - 1)
        axis = _mrope_axis(j, s_t, s_h, s_w, MROPE_INTERLEAVED)[None, :]
        pos = tl.where(axis == 0, p[:, None], tl.where(axis == 1, p_h[:, None], p_w[:, None]))
    else:
        pos = p[:, None] + tl.zeros([BLOCK_D], dtype=tl.int64)[None, :]
    offs = pos * cache_stride + j[None, :]
    mask = tok_mask[:, None] & rotary[None, :]
    cos = tl.load(cache_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    sin = tl.load(cache_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit(do_not_specialize=["T", "max_position", "s_t", "s_h", "s_w"])
def split_qkv_rmsnorm_rope_kernel(
    qkv_ptr, pos_ptr, cache_ptr, q_w_ptr, k_w_ptr, q_b_ptr, k_b_ptr, q_out_ptr, k_out_ptr, v_out_ptr, gate_out_ptr,
    T, num_q_heads, num_kv_heads, eps, max_position, s_t, s_h, s_w,
    qkv_stride, pos_stride_axis, pos_stride_tok, cache_stride, q_out_stride, k_out_stride, v_out_stride,
    gate_out_stride,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, V_BLOCK: tl.constexpr, NORM: tl.constexpr, Q_BIAS: tl.constexpr,
    K_BIAS: tl.constexpr, GEMMA: tl.constexpr, IS_NEOX: tl.constexpr, MROPE: tl.constexpr,
    MROPE_INTERLEAVED: tl.constexpr, Q_GATE: tl.constexpr, IN_PLACE: tl.constexpr,
):
    """One program: ``BLOCK_T`` tokens x a block of ``Q_HEADS`` Q heads, ``KV_HEADS`` K heads or ``V_BLOCK`` V columns.

    Grid: ``(cdiv(T, BLOCK_T), cdiv(Hq, Q_HEADS) + cdiv(Hkv, KV_HEADS) + cdiv(Hkv * D, V_BLOCK))``, the V blocks
    left out when ``v_out`` is qkv's own V slice. T, eps, positions and the mRoPE sections are runtime values (no
    recompilation per batch size). ``Q_GATE``: the row's Q region is ``[q_0 | g_0 | q_1 | g_1 | ...]`` (``2 * Hq *
    D`` wide); a Q program also copies its heads' gates into ``gate_out``, and K and V start after that region.
    ``GEMMA``: q/k weights centred at 0 (``1 + w``).
    """
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < T
    block = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, Q_HEADS)
    kv_blocks = tl.cdiv(num_kv_heads, KV_HEADS)
    k_col = (2 if Q_GATE else 1) * num_q_heads * HEAD_DIM  # first K column of a row
    if block < q_blocks + kv_blocks:
        cos, sin = _cos_sin(pos_ptr, pos_stride_axis, pos_stride_tok, cache_ptr, cache_stride, tok, tok_mask,
                            max_position, s_t, s_h, s_w, ROT_DIM, BLOCK_D, IS_NEOX, MROPE, MROPE_INTERLEAVED)
        if block < q_blocks:
            _norm_rope_heads(qkv_ptr, qkv_stride, q_out_ptr, q_out_stride, q_w_ptr, q_b_ptr, gate_out_ptr,
                             gate_out_stride, tok, tok_mask, block * Q_HEADS, num_q_heads, cos, sin, eps, HEAD_DIM,
                             ROT_DIM, BLOCK_D, Q_HEADS, NORM, Q_BIAS, GEMMA, IS_NEOX, Q_GATE, IN_PLACE)
        else:
            _norm_rope_heads(qkv_ptr + k_col, qkv_stride, k_out_ptr, k_out_stride, k_w_ptr, k_b_ptr, k_out_ptr,
                             k_out_stride, tok, tok_mask, (block - q_blocks) * KV_HEADS, num_kv_heads, cos, sin,
                             eps, HEAD_DIM, ROT_DIM, BLOCK_D, KV_HEADS, NORM, K_BIAS, GEMMA, IS_NEOX, False,
                             IN_PLACE)
    else:  # V heads: a bit-exact copy (blocks only launched when v_out is not qkv's own V slice)
        v_width = num_kv_heads * HEAD_DIM
        col = (block - q_blocks - kv_blocks) * V_BLOCK + tl.arange(0, V_BLOCK)
        mask = tok_mask[:, None] & (col < v_width)[None, :]
        src = qkv_ptr + k_col + v_width + tok[:, None] * qkv_stride + col[None, :]
        tl.store(v_out_ptr + tok[:, None] * v_out_stride + col[None, :], tl.load(src, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["T"])
def add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, res_out_ptr, T, H, eps,
    x_stride, res_stride, y_stride, res_out_stride,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    GEMMA: tl.constexpr, SINGLE_TILE: tl.constexpr,
):
    """``BLOCK_T`` rows per program. ``s = round(x + residual)`` (stored as residual_out), ``y = norm(s) * w + b``
    (``GEMMA``: ``w`` stored centred at 0, ``y = norm(s) * (1 + w) + b`` with ``1 + w`` in fp32).

    Rows that fit one tile (``SINGLE_TILE``) are read once. Wider rows take two passes over ``BLOCK_H`` chunks:
    the first stores ``s`` and sums squares, the second reads ``s`` back (from ``residual_out``, which may alias
    ``residual``, so it is not recomputed) -- the same lanes that wrote each chunk read it, so no barrier is needed.
    """
    row = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = row < T
    cols = tl.arange(0, BLOCK_H)
    dtype = x_ptr.dtype.element_ty
    if SINGLE_TILE:
        mask = row_mask[:, None] & (cols < H)[None, :]
        s = tl.load(x_ptr + row[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row[:, None] * res_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s_rounded = _round_for_store(s + r, dtype)
            tl.store(res_out_ptr + row[:, None] * res_out_stride + cols[None, :], s_rounded, mask=mask)
            s = s_rounded.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        if GEMMA:
            w += 1.0
        y = s * _rms_scale(s, H, eps, 1)
        y *= w[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + row[:, None] * y_stride + cols[None, :], _round_for_store(y, dtype), mask=mask)
    else:
        sum_sq = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            c = start + cols
            mask = row_mask[:, None] & (c < H)[None, :]
            s = tl.load(x_ptr + row[:, None] * x_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row[:, None] * res_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
                s_rounded = _round_for_store(s + r, dtype)
                tl.store(res_out_ptr + row[:, None] * res_out_stride + c[None, :], s_rounded, mask=mask)
                s = s_rounded.to(tl.float32)
            sum_sq += s * s
        scale = tl.expand_dims(tl.rsqrt(tl.sum(sum_sq, axis=1) / H + eps), 1)
        for start in range(0, H, BLOCK_H):
            c = start + cols
            mask = row_mask[:, None] & (c < H)[None, :]
            if HAS_RESIDUAL:
                s = tl.load(res_out_ptr + row[:, None] * res_out_stride + c[None, :], mask=mask, other=0.0)
            else:
                s = tl.load(x_ptr + row[:, None] * x_stride + c[None, :], mask=mask, other=0.0)
            w = tl.load(w_ptr + c, mask=c < H, other=0.0).to(tl.float32)
            if GEMMA:
                w += 1.0
            y = s.to(tl.float32) * scale * w[None, :]
            if HAS_BIAS:
                y += tl.load(b_ptr + c, mask=c < H, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + row[:, None] * y_stride + c[None, :], _round_for_store(y, dtype), mask=mask)
