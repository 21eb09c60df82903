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

from .rope import mrope_axis_map

__all__ = ["split_qkv_rmsnorm_rope_out", "add_rmsnorm_out"]


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
    q = _rotate(q, cos, sin, is_neox)
    k = _rotate(k, cos, sin, is_neox)
    # Q, K and the gate were read into copies above, so writing them back is safe when outputs alias qkv (the
    # in-place forms, the gated one de-interleaving the Q/gate region).
    q_out.copy_(q.reshape(T, q_width))
    k_out.copy_(k.reshape(T, kv_width))
    if q_gate:
        gate_out.copy_(gate)
    v_out.copy_(qkv[:, q_region + kv_width :])  # a no-op when v_out is qkv's own V slice


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
