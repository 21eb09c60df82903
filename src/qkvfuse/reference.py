"""The reference backend: the specification of every qkvfuse op, in plain PyTorch.

Every fast backend is checked against these functions (and all of them against an independent float64
oracle, ``qkvfuse.testing.oracle``). They assume validated input (``qkvfuse.ops`` validates once, at the
public boundary) and write into caller-provided outputs, which may exactly alias their own slice of the input.

Semantics of ``split_qkv_rmsnorm_rope``. Per token ``t`` and head ``h``, ``x = qkv[t, h*D:(h+1)*D]`` in fp32:

* Q and K heads, when norm weights are given: ``y = x * rsqrt(mean(x^2) + eps) * w (+ b)``, all fp32.
  V heads are copied unchanged.
* Rotary over the first ``R = cos_sin_cache.shape[1]`` dims, ``half = R / 2``, pair index ``j in [0, half)``:
  ``c_j = cache[p, j]``, ``s_j = cache[p, half + j]`` with ``p = positions[t]`` (RoPE) or
  ``p = positions[axis(j), t]`` (mRoPE, ``axis`` from :func:`qkvfuse.rope.mrope_axis_map`). Cache values are
  used as stored (a bf16 cache is upcast, never recomputed).
* NeoX pairs ``(j, j + half)``, GPT-J pairs ``(2j, 2j + 1)``: ``out_a = y_a*c - y_b*s``, ``out_b = y_b*c + y_a*s``.
* Dims ``R..D`` pass through normalised but unrotated (partial rotary; GLM-4.x uses ``R = D/2``).
* All arithmetic in fp32; one rounding to the output dtype at the end.
* Gemma norm weights (``gemma``; Qwen3-Next, Qwen3.5): ``w`` is stored centred at 0 and the heads are multiplied
  by ``1 + w`` (computed in fp32), exactly as the models' ``(1.0 + weight.float())``.
* Gated layout (``q_gate``; Qwen3-Next, Qwen3.5): the Q region of a row is ``[q_0 | g_0 | q_1 | g_1 | ...]``
  (``2 * num_q_heads * D`` values), then K and V as usual; ``q`` is the Q heads, normed and rotated as above,
  ``gate`` the gate heads copied bit-exact, both ``[T, num_q_heads * D]``.

Semantics of ``add_rmsnorm``: ``s = x + residual`` rounded to ``x.dtype`` (bit-exact with the unfused add;
``s = x`` without residual), then ``y = s * rsqrt(mean(s^2) + eps) * w (+ b)`` in fp32 from the rounded ``s``,
rounded once (``w`` is ``1 + weight`` in fp32 for Gemma norms, ``gemma``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ._cache_mode import FP8_MAX, HND, NHD, VEC, cache_dims, decode_cache, is_fp8
from .rope import mrope_axis_map

__all__ = ["split_qkv_rmsnorm_rope_out", "split_qkv_rmsnorm_rope_cache", "add_rmsnorm_out", "quantize",
           "write_cache"]


def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                   gemma: bool = False) -> torch.Tensor:
    w = 1.0 + weight.float() if gemma else weight.float()
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w
    return y + bias.float() if bias is not None else y


def _cos_sin(positions: torch.Tensor, cache: torch.Tensor, mrope_section: Sequence[int], interleaved: bool):
    """cos, sin of shape ``[T, half]`` in fp32, gathered per pair from the right position row."""
    half = cache.shape[1] // 2
    table = cache.float()
    # Clamped like every backend's kernel: the public range check is skipped under torch.compile.
    positions = positions.long().clamp(0, cache.shape[0] - 1)
    if not mrope_section:
        rows = positions
        return table[rows, :half], table[rows, half:]
    axes = torch.tensor(mrope_axis_map(half, tuple(mrope_section), interleaved), device=positions.device)
    rows = positions[axes].t()  # [T, half]: position used by pair j of token t
    cols = torch.arange(half, device=cache.device)
    return table[rows, cols], table[rows, cols + half]


def _rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``y [T, H, D]`` (fp32) and return the result."""
    half = cos.shape[-1]
    rot = 2 * half
    c, s = cos[:, None, :], sin[:, None, :]
    if is_neox:
        a, b = y[..., :half], y[..., half:rot]
        rotated = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    else:
        a, b = y[..., 0:rot:2], y[..., 1:rot:2]
        rotated = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    return torch.cat([rotated, y[..., rot:]], dim=-1)


def _split_fp32(qkv: torch.Tensor, positions: torch.Tensor, config):
    """``(q, k, v, gate)`` of the split before the final rounding: q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` fp32,
    v (``[T, Hkv * D]``, a view of ``qkv``'s V columns, which no form rewrites) and gate (``[T, Hq * D]``, a copy
    read before any output is written, or None)."""
    num_q_heads, num_kv_heads, head_dim, eps = config.num_q_heads, config.num_kv_heads, config.head_dim, config.eps
    q_weight, k_weight, q_bias, k_bias = config.q_weight, config.k_weight, config.q_bias, config.k_bias
    is_neox, mrope_section, mrope_interleaved, q_gate, gemma = config.mode
    T = qkv.shape[0]
    q_width, kv_width = num_q_heads * head_dim, num_kv_heads * head_dim
    q_region = (2 if q_gate else 1) * q_width
    if q_gate:
        q_gate_heads = qkv[:, :q_region].reshape(T, num_q_heads, 2, head_dim)
        q = q_gate_heads[:, :, 0].float()
        gate = q_gate_heads[:, :, 1].reshape(T, q_width).clone()  # read before any output is written
    else:
        q = qkv[:, :q_width].float().reshape(T, num_q_heads, head_dim)
    k = qkv[:, q_region : q_region + kv_width].float().reshape(T, num_kv_heads, head_dim)
    if q_weight is not None:
        q = _rms_norm_fp32(q, q_weight, q_bias, eps, gemma)
        k = _rms_norm_fp32(k, k_weight, k_bias, eps, gemma)
    cos, sin = _cos_sin(positions, config.cos_sin_cache, mrope_section, mrope_interleaved)
    v = qkv[:, q_region + kv_width :]  # no form writes V's columns with anything but V
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox), v, (gate if q_gate else None)


def split_qkv_rmsnorm_rope_out(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    config,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    gate_out: Optional[torch.Tensor],
) -> None:
    """Reference ``split_qkv_rmsnorm_rope`` writing into ``q_out, k_out, v_out`` (and ``gate_out`` when
    ``config.q_gate``; see the module docstring). ``config`` is a :class:`qkvfuse._library.SplitConfig`: the
    table, the norm weights and biases, the head geometry, ``eps`` and the decoded rope mode."""
    q, k, v, gate = _split_fp32(qkv, positions, config)
    _write_split(q, k, v, gate, q_out, k_out, v_out, gate_out)


def _write_split(q, k, v, gate, q_out, k_out, v_out, gate_out) -> None:
    # Q, K, V and the gate were read into copies, so writing them back is safe when outputs alias qkv (the
    # in-place forms, the gated one de-interleaving the Q/gate region).
    q_out.copy_(q.reshape(q_out.shape))
    k_out.copy_(k.reshape(k_out.shape))
    if gate is not None:
        gate_out.copy_(gate)
    v_out.copy_(v)  # a no-op when v_out is qkv's own V slice


def split_qkv_rmsnorm_rope_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    config,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    gate_out: Optional[torch.Tensor],
    target,
) -> None:
    """Reference ``split_qkv_rmsnorm_rope_cache``: :func:`split_qkv_rmsnorm_rope_out` into the in-place views,
    and each token's K (from the same fp32 values) and V stored in the cache ``target`` (a
    :class:`qkvfuse._library.CacheTarget`; see :func:`write_cache`)."""
    q, k, v, gate = _split_fp32(qkv, positions, config)
    _write_split(q, k, v, gate, q_out, k_out, v_out, gate_out)
    write_cache(k, v.reshape(k.shape), target)


# Integer dtypes of each element size: the cache is written through a bit view (index_put on any dtype, FP8
# included, and the bits of a same-dtype cache are exactly the rounded values').
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: Optional[torch.Tensor], truncate: bool) -> torch.Tensor:
    """``x`` (fp32) as stored in a cache of ``dtype``: rounded once to ``dtype`` when it is not FP8; for FP8,
    ``x / scale`` saturated to the format's finite range and rounded to nearest even, or (``truncate``, vLLM-CPU's
    writer) ``x * (1 / scale)`` saturated and truncated toward zero."""
    if not is_fp8(dtype):
        return x.to(dtype)
    bound = FP8_MAX[dtype]
    scale = scale.reshape(()).float()
    y = (x * torch.reciprocal(scale) if truncate else x / scale).clamp(-bound, bound)
    stored = y.to(dtype)
    if truncate:
        # FP8 is sign-magnitude: one step of the magnitude bits toward zero where rounding went away from it.
        bits = stored.view(torch.uint8)
        away = stored.float().abs() > y.abs()
        stored = torch.where(away, bits - 1, bits).view(dtype)
    return stored


def write_cache(k: torch.Tensor, v: torch.Tensor, target) -> None:
    """Store ``k`` (fp32, ``[T, Hkv, D]``) and ``v`` (``[T, Hkv, D]``, qkv's dtype) in the cache ``target``: token
    ``t < len(slot_mapping)`` with ``slot_mapping[t] >= 0`` goes to block ``slot // block_size``, offset ``slot %
    block_size``, in the layout of ``target.cache_mode`` (:mod:`qkvfuse._cache_mode`). Slots are assumed below the
    capacity (checked before). Duplicate slots: one of the tokens' rows is stored (index_put)."""
    key_cache, value_cache, slot_mapping = target.key_cache, target.value_cache, target.slot_mapping
    layout, truncate = decode_cache(target.cache_mode)
    n = min(k.shape[0], slot_mapping.shape[0])
    slots = slot_mapping[:n].long()
    tokens = (slots >= 0).nonzero().flatten()
    slots = slots[tokens]
    _, block_size, _, _ = cache_dims(layout, key_cache)
    blocks, offsets = slots // block_size, slots % block_size
    dtype = key_cache.dtype
    k_rows = quantize(k[tokens], dtype, target.k_scale, truncate)
    v_rows = quantize(v[tokens].float(), dtype, target.v_scale, truncate) if is_fp8(dtype) else v[tokens]
    _store(key_cache, layout, True, blocks, offsets, k_rows)
    _store(value_cache, layout, False, blocks, offsets, v_rows)


def _store(cache: torch.Tensor, layout: int, is_key: bool, blocks, offsets, rows: torch.Tensor) -> None:
    """``rows [n, Hkv, D]`` (the cache's dtype) into ``cache`` at ``(blocks, offsets)``, in ``layout``."""
    bits = _BITS[cache.element_size()]
    c, r = cache.view(bits), rows.view(bits)
    if layout == NHD:
        c[blocks, offsets] = r
    elif layout == HND or (layout == VEC and not is_key):
        c[blocks, :, offsets] = r
    else:
        nb, heads, block_size, dim = c.shape
        s0, s1 = c.stride(0), c.stride(1)
        if layout == VEC:  # K region [D, block_size]
            c.as_strided((nb, heads, dim, block_size), (s0, s1, block_size, 1))[blocks, :, :, offsets] = r
        elif is_key:  # amx: K region [block_size/16, D/2, 16, 2]
            packed = c.as_strided((nb, heads, block_size // 16, dim // 2, 16, 2), (s0, s1, 16 * dim, 32, 2, 1))
            packed[blocks, :, offsets // 16, :, offsets % 16, :] = r.reshape(r.shape[0], heads, dim // 2, 2)
        else:  # amx: V region [D/16, block_size/2, 16, 2]
            packed = c.as_strided((nb, heads, dim // 16, block_size // 2, 16, 2), (s0, s1, 16 * block_size, 32, 2, 1))
            packed[blocks, :, :, offsets // 2, :, offsets % 2] = r.reshape(r.shape[0], heads, dim // 16, 16)


def add_rmsnorm_out(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    gemma: bool,
    y_out: torch.Tensor,
    residual_out: Optional[torch.Tensor],
) -> None:
    """Reference ``add_rmsnorm`` writing into ``y_out`` and (with a residual) ``residual_out``."""
    s = x + residual if residual is not None else x
    y = _rms_norm_fp32(s.float(), weight, bias, eps, gemma)
    if residual_out is not None:
        residual_out.copy_(s)
    y_out.copy_(y)
