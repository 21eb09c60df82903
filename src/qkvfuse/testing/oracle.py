"""The float64 oracle and the unfused (transformers-style) baseline.

The oracle is deliberately naive and independent of :mod:`qkvfuse.reference`: it loops over heads and rotary
pairs, evaluates everything in float64 from the inputs *as stored* (cache values included), and spells out
the mRoPE axis rule again. It is slow; use it on test-sized inputs.

The unfused baseline is what the model code does without qkvfuse: each op in the working dtype with a
rounding after each one (RMSNorm rounds before the weight multiply; cos/sin are cast to the activation dtype).
For the gated Gemma models (Qwen3-Next, Qwen3.5) it is their own unfused path: ``torch.chunk`` of each
``[q_h | gate_h]`` pair, ``Qwen3_5RMSNorm`` (normalise in fp32, multiply by ``1 + w`` in fp32, one cast), then
the same RoPE in the dtype with cos/sin in the dtype; the gate is a copy.
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
                 mrope_interleaved=False, q_gate=False, gemma_norm=False):
    """What :func:`qkvfuse.split_qkv_rmsnorm_rope` should return, in float64.

    Every value is read as stored (``qkv``, the weights and the cos/sin table are widened to float64, never
    rounded again), so the result is the exact answer up to float64 error, not another rounding of it.

    Parameters
    ----------
    qkv : torch.Tensor
        Packed projection, shape ``(T, (num_q_heads + 2 * num_kv_heads) * head_dim)``, layout
        ``[Q heads | K heads | V heads]``; with ``q_gate``, ``(T, (2 * num_q_heads + 2 * num_kv_heads) * head_dim)``,
        layout ``[q_0 | g_0 | q_1 | g_1 | ... | K heads | V heads]``. Any float dtype, any device.
    positions : torch.Tensor
        Integer, shape ``(T,)``; ``(3, T)`` with ``mrope_section`` (rows temporal, height, width).
    cos_sin_cache : torch.Tensor
        Shape ``(max_position, rotary_dim)``; row ``p`` is ``[cos | sin]`` of position ``p``. The rotary dim is
        read from it; dims of a head past it pass through.
    num_q_heads, num_kv_heads, head_dim : int
        Head geometry.
    q_weight, k_weight : torch.Tensor, optional
        RMSNorm weights, shape ``(head_dim,)``; ``None`` for no QK-norm.
    q_bias, k_bias : torch.Tensor, optional
        Post-norm bias, shape ``(head_dim,)``.
    eps : float
        RMSNorm epsilon.
    is_neox : bool
        Rotate-half pairs ``(j, j + R/2)`` (True) or interleaved pairs ``(2j, 2j + 1)``.
    mrope_section : sequence of 3 ints, optional
        ``(s_t, s_h, s_w)``, summing to ``rotary_dim // 2``.
    mrope_interleaved : bool
        Qwen3-VL's interleaved axis layout instead of contiguous sections.
    q_gate : bool
        The gated layout of Qwen3-Next / Qwen3.5 (Q head ``h`` is slot ``2h`` of the row, its gate slot ``2h + 1``).
    gemma_norm : bool
        The weights are stored centred at 0: heads are multiplied by ``1 + w``.

    Returns
    -------
    (q, k, v) or (q, k, v, gate) : tuple of torch.Tensor
        float64 on CPU; ``q`` ``(T, num_q_heads * head_dim)``, ``k`` and ``v`` ``(T, num_kv_heads * head_dim)``,
        ``gate`` ``(T, num_q_heads * head_dim)``.

    Notes
    -----
    Python loops over heads and rotary pairs: seconds for a few thousand tokens of a large model. Pass a slice of
    rows (with the matching slice of ``positions``) to judge a sample.
    """
    x = qkv.detach().to("cpu", torch.float64)
    pos = positions.detach().to("cpu", torch.int64)
    table = cos_sin_cache.detach().to("cpu", torch.float64)
    D = head_dim
    half = table.shape[1] // 2
    # Slot (D-wide column block of qkv) of each head, in the order q heads, k heads, v heads (and gate heads).
    q_slots = [2 * h if q_gate else h for h in range(num_q_heads)]
    first_kv = (2 if q_gate else 1) * num_q_heads
    slots = q_slots + list(range(first_kv, first_kv + 2 * num_kv_heads))
    outs = []
    for h, slot in enumerate(slots):
        head = x[:, slot * D : (slot + 1) * D].clone()
        if h >= num_q_heads + num_kv_heads:  # V: unchanged
            outs.append(head)
            continue
        is_q = h < num_q_heads
        weight, bias = (q_weight, q_bias) if is_q else (k_weight, k_bias)
        if weight is not None:
            rms = torch.sqrt((head * head).mean(dim=1, keepdim=True) + eps)
            w = weight.detach().to("cpu", torch.float64)
            head = head / rms * (1.0 + w if gemma_norm else w)
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
    if not q_gate:
        return q, k, v
    gate = torch.cat([x[:, (2 * h + 1) * D : (2 * h + 2) * D] for h in range(num_q_heads)], dim=1)
    return q, k, v, gate


def oracle_add_rmsnorm(x, residual, weight, eps=1e-6, bias=None, gemma_norm=False):
    """What :func:`qkvfuse.add_rmsnorm` should return as ``y``, in float64.

    The sum ``x + residual`` is taken in ``x``'s dtype first (the op's specification rounds it, since it is also
    the ``residual_out`` output); the norm, weight and bias are then evaluated in float64.

    Parameters
    ----------
    x : torch.Tensor
        Shape ``(T, hidden)``, any float dtype.
    residual : torch.Tensor or None
        Shape and dtype of ``x``; ``None`` for a plain RMSNorm.
    weight : torch.Tensor
        Shape ``(hidden,)``.
    eps : float
        RMSNorm epsilon.
    bias : torch.Tensor, optional
        Shape ``(hidden,)``, added after the weight.
    gemma_norm : bool
        The weight is stored centred at 0: ``y`` is multiplied by ``1 + weight``.

    Returns
    -------
    y : torch.Tensor
        float64 on CPU, shape ``(T, hidden)``.
    """
    s = (x + residual) if residual is not None else x
    s64 = s.detach().to("cpu", torch.float64)
    rms = torch.sqrt((s64 * s64).mean(dim=1, keepdim=True) + eps)
    w = weight.detach().to("cpu", torch.float64)
    y = s64 / rms * (1.0 + w if gemma_norm else w)
    return y + bias.detach().to("cpu", torch.float64) if bias is not None else y


# ---------------------------------------------------------------------------------------------------------
# Unfused baseline in the working dtype (what a transformers model computes).
# ---------------------------------------------------------------------------------------------------------
def _hf_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, bias: Optional[torch.Tensor],
                gemma_norm: bool = False):
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma_norm:  # Qwen3_5RMSNorm / Qwen3NextRMSNorm: (x * (1 + w)) in fp32, one cast (no bias in the models)
        y = (normed * (1.0 + weight.float())).to(dtype)
    else:
        y = normed.to(dtype) * weight.to(dtype)
    return y + bias.to(dtype) if bias is not None else y


def unfused_split(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight=None,
                  k_weight=None, q_bias=None, k_bias=None, eps=1e-6, is_neox=True, mrope_section=None,
                  mrope_interleaved=False, q_gate=False, gemma_norm=False):
    """``(q, k, v)`` (gated: ``(q, k, v, gate)``) the way transformers computes them, unfused.

    Each step in ``qkv``'s dtype with a rounding after it: RMSNorm in fp32, rounded before the weight multiply
    (Gemma-style: ``1 + w`` in fp32, one rounding); cos/sin cast to the activation dtype; the rotation in the
    dtype. The baseline of :func:`check_split_outputs`: a kernel's largest error may exceed this path's by one
    ulp at most (rule 1 of :mod:`qkvfuse.testing.accuracy`).

    Parameters
    ----------
    qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, ...
        Every argument as for :func:`oracle_split`; ``qkv``, ``positions`` and the weights on one device.

    Returns
    -------
    (q, k, v) or (q, k, v, gate) : tuple of torch.Tensor
        In ``qkv``'s dtype and on its device, shapes as :func:`oracle_split`'s; ``v`` and ``gate`` are copies.
    """
    dtype = qkv.dtype
    T, D = qkv.shape[0], head_dim
    qw, kvw = num_q_heads * D, num_kv_heads * D
    q_region = 2 * qw if q_gate else qw
    if q_gate:  # Qwen3NextAttention: torch.chunk(q_proj(x).view(..., -1, head_dim * 2), 2, dim=-1)
        q, gate = torch.chunk(qkv[:, :q_region].reshape(T, num_q_heads, 2 * D), 2, dim=-1)
        gate = gate.reshape(T, qw)
    else:
        q = qkv[:, :qw].reshape(T, num_q_heads, D)
    k = qkv[:, q_region : q_region + kvw].reshape(T, num_kv_heads, D)
    v = qkv[:, q_region + kvw :].clone()
    if q_weight is not None:
        q = _hf_rmsnorm(q, q_weight, eps, q_bias, gemma_norm)
        k = _hf_rmsnorm(k, k_weight, eps, k_bias, gemma_norm)
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

    out = rope(q).reshape(T, qw), rope(k).reshape(T, kvw), v
    return out + (gate.clone(),) if q_gate else out


def unfused_add_rmsnorm(x, residual, weight, eps=1e-6, bias=None, gemma_norm=False):
    """``(y, residual_out)`` the way transformers computes them, unfused.

    ``s = x + residual`` in the dtype, then RMSNorm in fp32, rounded to the dtype before the weight multiply
    (Gemma-style: ``1 + weight`` in fp32, one rounding), then the bias in the dtype.

    Parameters
    ----------
    x, residual, weight, eps, bias, gemma_norm
        As for :func:`oracle_add_rmsnorm`, on one device.

    Returns
    -------
    (y, residual_out) : tuple of torch.Tensor
        In ``x``'s dtype, shape ``(T, hidden)``; ``residual_out`` is ``s``.
    """
    s = x + residual if residual is not None else x
    return _hf_rmsnorm(s, weight, eps, bias, gemma_norm), s
