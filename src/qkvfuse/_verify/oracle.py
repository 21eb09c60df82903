"""The float64 oracle and the unfused (transformers-style) baseline.

The oracle is deliberately naive and independent of :mod:`qkvfuse.reference`: it loops over heads and rotary
pairs, evaluates everything in float64 from the inputs *as stored* (cache values included), and spells out
the mRoPE axis rule again. It is slow; use it on test-sized inputs.

The unfused baseline is what the model code does without qkvfuse: each op in the working dtype with a
rounding after each one (RMSNorm rounds before the weight multiply; cos/sin are cast to the activation dtype).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..rope import mrope_axis_map

__all__ = ["oracle_split", "oracle_add_rmsnorm", "unfused_split", "unfused_add_rmsnorm"]


def _oracle_axis(j: int, sections: Sequence[int], interleaved: bool) -> int:
    s_t, s_h, s_w = sections
    if interleaved:  # Qwen3-VL: freqs[..., 1:3*s_h:3] from H, freqs[..., 2:3*s_w:3] from W, the rest T
        if j % 3 == 1 and j < 3 * s_h:
            return 1
        if j % 3 == 2 and j < 3 * s_w:
            return 2
        return 0
    if j < s_t:
        return 0
    return 1 if j < s_t + s_h else 2


def oracle_split(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight=None,
                 k_weight=None, q_bias=None, k_bias=None, eps=1e-6, is_neox=True, mrope_section=None,
                 mrope_interleaved=False):
    """float64 ``(q, k, v)`` of ``split_qkv_rmsnorm_rope`` for the same arguments."""
    x = qkv.detach().to("cpu", torch.float64)
    pos = positions.detach().to("cpu", torch.int64)
    table = cos_sin_cache.detach().to("cpu", torch.float64)
    D = head_dim
    half = table.shape[1] // 2
    outs = []
    for h in range(num_q_heads + 2 * num_kv_heads):
        head = x[:, h * D : (h + 1) * D].clone()
        if h >= num_q_heads + num_kv_heads:  # V: unchanged
            outs.append(head)
            continue
        is_q = h < num_q_heads
        weight, bias = (q_weight, q_bias) if is_q else (k_weight, k_bias)
        if weight is not None:
            rms = torch.sqrt((head * head).mean(dim=1, keepdim=True) + eps)
            head = head / rms * weight.detach().to("cpu", torch.float64)
            if bias is not None:
                head = head + bias.detach().to("cpu", torch.float64)
        rotated = head.clone()
        for j in range(half):
            p = pos if mrope_section is None else pos[_oracle_axis(j, mrope_section, mrope_interleaved)]
            c, s = table[p, j], table[p, half + j]
            ia, ib = (j, j + half) if is_neox else (2 * j, 2 * j + 1)
            rotated[:, ia] = head[:, ia] * c - head[:, ib] * s
            rotated[:, ib] = head[:, ib] * c + head[:, ia] * s
        outs.append(rotated)
    q = torch.cat(outs[:num_q_heads], dim=1)
    k = torch.cat(outs[num_q_heads : num_q_heads + num_kv_heads], dim=1)
    v = torch.cat(outs[num_q_heads + num_kv_heads :], dim=1)
    return q, k, v


def oracle_add_rmsnorm(x, residual, weight, eps=1e-6, bias=None):
    """float64 ``y`` of ``add_rmsnorm``, computed from the sum rounded to ``x.dtype`` (as the spec says)."""
    s = (x + residual) if residual is not None else x
    s64 = s.detach().to("cpu", torch.float64)
    rms = torch.sqrt((s64 * s64).mean(dim=1, keepdim=True) + eps)
    y = s64 / rms * weight.detach().to("cpu", torch.float64)
    return y + bias.detach().to("cpu", torch.float64) if bias is not None else y


# ---------------------------------------------------------------------------------------------------------
# Unfused baseline in the working dtype (what a transformers model computes).
# ---------------------------------------------------------------------------------------------------------
def _hf_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, bias: Optional[torch.Tensor]):
    dtype = x.dtype
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * weight.to(dtype)
    return y + bias.to(dtype) if bias is not None else y


def unfused_split(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight=None,
                  k_weight=None, q_bias=None, k_bias=None, eps=1e-6, is_neox=True, mrope_section=None,
                  mrope_interleaved=False):
    """``(q, k, v)`` the way transformers computes them: rounding to ``qkv.dtype`` after every op."""
    dtype = qkv.dtype
    T, D = qkv.shape[0], head_dim
    qw, kvw = num_q_heads * D, num_kv_heads * D
    q = qkv[:, :qw].reshape(T, num_q_heads, D)
    k = qkv[:, qw : qw + kvw].reshape(T, num_kv_heads, D)
    v = qkv[:, qw + kvw :].clone()
    if q_weight is not None:
        q = _hf_rmsnorm(q, q_weight, eps, q_bias)
        k = _hf_rmsnorm(k, k_weight, eps, k_bias)
    R = cos_sin_cache.shape[1]
    half = R // 2
    axes = torch.tensor(mrope_axis_map(half, tuple(mrope_section) if mrope_section else None, mrope_interleaved))
    pos = positions.long().to(qkv.device)
    rows = pos[None].expand(half, T) if mrope_section is None else pos[axes.to(pos.device)]
    cols = torch.arange(half, device=qkv.device)
    cos = cos_sin_cache[rows.t(), cols].to(dtype)[:, None, :]  # cast to the activation dtype, as transformers does
    sin = cos_sin_cache[rows.t(), cols + half].to(dtype)[:, None, :]

    def rope(t):
        rot, rest = t[..., :R], t[..., R:]
        if is_neox:
            a, b = rot[..., :half], rot[..., half:]
            out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1)

    return rope(q).reshape(T, qw), rope(k).reshape(T, kvw), v


def unfused_add_rmsnorm(x, residual, weight, eps=1e-6, bias=None):
    """``(y, residual_out)`` the way transformers computes them."""
    s = x + residual if residual is not None else x
    return _hf_rmsnorm(s, weight, eps, bias), s
