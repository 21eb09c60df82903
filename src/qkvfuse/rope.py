"""Rotary-embedding tables and the mRoPE axis rule.

Two facts live here and nowhere else:

* :func:`build_cos_sin_cache` -- the ``[max_position, rotary_dim]`` table every backend reads. Row ``p`` is
  ``cos(p * inv_freq) * scale | sin(p * inv_freq) * scale`` with ``inv_freq`` and ``scale`` equal to Hugging Face
  transformers' rope initialisation for the same parameters (default, linear, yarn, llama3).
* :func:`mrope_axis_map` -- which of the three position rows (temporal, height, width) each rotary pair
  reads under multimodal RoPE, for both the contiguous (Qwen2-VL, GLM-4.5V) and the interleaved (Qwen3-VL)
  layout.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["build_cos_sin_cache", "compute_inv_freq", "mrope_axis_map", "SUPPORTED_ROPE_TYPES"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")

# Keys of a transformers ``rope_parameters`` dict that do not change the table for a given rotary_dim
# (they are read elsewhere, or describe the mRoPE layout).
_IGNORED_KEYS = {"rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved", "rope_type", "type"}


def _base_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    # Same expression and fp32 evaluation as transformers, so inv_freq matches it bit for bit.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base ** exponents)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def compute_inv_freq(
    rotary_dim: int, base: float, rope_scaling: Optional[Mapping[str, Any]] = None, max_position: Optional[int] = None
) -> Tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` (fp32) and the attention scale, as transformers computes them.

    ``rope_scaling`` is a transformers-style ``rope_parameters`` dict (``{"rope_type": "yarn", "factor": 4.0,
    ...}``) or ``None`` for plain RoPE. ``max_position`` stands in for ``max_position_embeddings`` where yarn
    needs it and the dict has no ``original_max_position_embeddings``.
    """
    params = dict(rope_scaling or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling: rope_type {rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
        )
    inv_freq = _base_inv_freq(rotary_dim, base)
    if rope_type == "default":
        return inv_freq, 1.0

    factor = params.get("factor")
    if factor is None and rope_type == "yarn" and params.get("original_max_position_embeddings") and max_position:
        # transformers' DeepSeek-V3 convention: the factor is the context extension ratio.
        factor = max_position / params["original_max_position_embeddings"]
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} needs a positive 'factor', got {factor!r}")
    factor = float(factor)

    if rope_type == "linear":
        return inv_freq / factor, 1.0

    if rope_type == "llama3":
        try:
            low_freq_factor = float(params["low_freq_factor"])
            high_freq_factor = float(params["high_freq_factor"])
            old_context_len = float(params["original_max_position_embeddings"])
        except KeyError as missing:
            raise ValueError(f"rope_scaling: llama3 needs key {missing.args[0]!r}") from None
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0

    # yarn
    original_max = params.get("original_max_position_embeddings") or max_position
    if original_max is None:
        raise ValueError("rope_scaling: yarn needs 'original_max_position_embeddings' (or max_position)")
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    truncate = params.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
    return inv_freq, float(attention_factor)


def build_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: Optional[Mapping[str, Any]] = None,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device | str] = None,
) -> torch.Tensor:
    """Build the cos/sin table read by :func:`qkvfuse.split_qkv_rmsnorm_rope`.

    Parameters
    ----------
    rotary_dim : int
        Number of rotated dims ``R`` (even, > 0). For partial rotary (GLM-4.x) this is
        ``int(head_dim * partial_rotary_factor)``. The fused op reads ``R`` from the table's width.
    max_position : int
        Number of rows; positions must lie in ``[0, max_position)``.
    base : float
        ``rope_theta``.
    rope_scaling : dict, optional
        transformers-style ``rope_parameters`` (``rope_type`` one of ``default``, ``linear``, ``yarn``,
        ``llama3`` with their keys). Keys describing other things (``rope_theta``, ``mrope_section``, ...)
        are ignored.
    dtype : torch.dtype
        fp32 (recommended: qkvfuse reads cos/sin as stored), bf16 or fp16.

    Returns
    -------
    torch.Tensor
        Shape ``(max_position, rotary_dim)``, contiguous. Row ``p`` is
        ``[cos(p*f_0) .. cos(p*f_{R/2-1}) | sin(p*f_0) .. sin(p*f_{R/2-1})] * scale``.
        The angle ``p * f_j`` is evaluated in float64 (an fp32 angle is off by up to 1.8e-2 in cos at
        position 262 144), from transformers' fp32 ``inv_freq``.
    """
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected a positive even int, got {rotary_dim!r}")
    if isinstance(max_position, bool) or not isinstance(max_position, int) or max_position <= 0:
        raise ValueError(f"max_position: expected a positive int, got {max_position!r}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1:
        raise ValueError(f"base: expected a finite number > 1 (rope_theta), got {base!r}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype: expected torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    if rope_scaling is not None and not isinstance(rope_scaling, Mapping):
        raise TypeError(f"rope_scaling: expected a dict or None, got {type(rope_scaling).__name__}")
    inv_freq, scale = compute_inv_freq(rotary_dim, float(base), rope_scaling, max_position)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    cache = torch.cat([angles.cos() * scale, angles.sin() * scale], dim=-1)
    return cache.to(dtype=dtype, device=device).contiguous()


@functools.lru_cache(maxsize=256)
def mrope_axis_map(half: int, mrope_section: Optional[Sequence[int]], interleaved: bool) -> Tuple[int, ...]:
    """Position row (0 temporal, 1 height, 2 width) read by each rotary pair ``j in [0, half)``.

    Contiguous sections (Qwen2-VL, GLM-4.5V): axis 0 for ``j < s_t``, 1 for ``j < s_t + s_h``, else 2.
    Interleaved (Qwen3-VL): axis 1 if ``j % 3 == 1 and j < 3 * s_h``, axis 2 if ``j % 3 == 2 and
    j < 3 * s_w``, else 0 -- transformers' ``freqs[..., offset:3*s:3]`` slicing, clipped at ``half``.
    ``mrope_section=None`` (plain RoPE) maps every pair to row 0.
    """
    if mrope_section is None:
        return (0,) * half
    s_t, s_h, s_w = mrope_section
    axes = []
    for j in range(half):
        if interleaved:
            if j % 3 == 1 and j < 3 * s_h:
                axes.append(1)
            elif j % 3 == 2 and j < 3 * s_w:
                axes.append(2)
            else:
                axes.append(0)
        else:
            axes.append(0 if j < s_t else 1 if j < s_t + s_h else 2)
    return tuple(axes)
