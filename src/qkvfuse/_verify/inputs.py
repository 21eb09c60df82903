"""Random inputs for one configuration, and NaN-poisoned output buffers."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from ..presets import ModelPreset
from ..rope import build_cos_sin_cache

__all__ = ["SplitCase", "make_split_inputs", "make_norm_inputs", "poisoned_like", "poisoned_split_outputs"]


@dataclasses.dataclass(frozen=True)
class SplitCase:
    """One configuration of ``split_qkv_rmsnorm_rope`` (what a parametrised test or a verify row runs)."""

    T: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    dtype: torch.dtype = torch.bfloat16
    norm: bool = True
    bias: bool = False
    is_neox: bool = True
    mrope_section: Optional[Tuple[int, int, int]] = None
    mrope_interleaved: bool = False
    image: bool = True  # with mRoPE: rows differ (image tokens); False: equal rows (text / decode)
    pos_dtype: torch.dtype = torch.int64
    cache_dtype: torch.dtype = torch.float32
    weight_dtype: Optional[torch.dtype] = None  # None: fp32
    row_pad: int = 0  # extra elements per qkv row (strided rows)
    max_position: int = 4096
    eps: float = 1e-6
    q_gate: bool = False  # Qwen3-Next / Qwen3.5 gated layout: [q_0 | g_0 | q_1 | g_1 | ... | K | V]
    gemma_norm: bool = False  # norm weights centred at 0, applied as 1 + w

    @classmethod
    def from_preset(cls, preset: ModelPreset, T: int, **changes) -> "SplitCase":
        fields = dict(num_q_heads=preset.num_q_heads, num_kv_heads=preset.num_kv_heads, head_dim=preset.head_dim,
                      rotary_dim=preset.rotary_dim, norm=preset.qk_norm, is_neox=preset.is_neox,
                      mrope_section=preset.mrope_section, mrope_interleaved=preset.mrope_interleaved,
                      eps=preset.rms_norm_eps, q_gate=preset.q_gate, gemma_norm=preset.gemma_norm)
        fields.update(changes)
        return cls(T=T, **fields)

    @property
    def width(self) -> int:
        """qkv's width: ``(Hq + 2 Hkv) * D``, gated ``(2 Hq + 2 Hkv) * D``."""
        return ((2 if self.q_gate else 1) * self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim


def make_split_inputs(case: SplitCase, seed: int = 0, device="cpu") -> Dict[str, object]:
    """Keyword arguments for ``split_qkv_rmsnorm_rope(**kwargs)`` (and the oracle) for ``case``.

    Inputs have a spread of magnitudes per head (so a norm bug shows), weights near 1 with noise (Gemma norms:
    the stored weights are centred at 0, so ``1 + w`` is near 1), positions spread over the table; with mRoPE and
    ``image=True`` the three rows differ as for image tokens. ``q_gate`` and ``gemma_norm`` are in the kwargs only
    when set (callers that predate them keep working on the other cases); the gated width's Q and gate slots are
    drawn like any head, each with its own magnitude.
    """
    g = torch.Generator().manual_seed(seed)
    T, W = case.T, case.width
    scale = torch.exp(torch.randn(T, W // case.head_dim, 1, generator=g))  # per-head magnitude spread
    base = (torch.randn(T, W // case.head_dim, case.head_dim, generator=g) * scale).reshape(T, W)
    buf = torch.full((T, W + case.row_pad), float("nan"))
    buf[:, :W] = base
    qkv = buf.to(case.dtype).to(device)[:, :W]  # sliced after the move: padded rows stay padded on any device
    maxp = case.max_position
    if case.mrope_section is None:
        positions = torch.randint(0, maxp, (T,), generator=g)
    elif case.image:
        start = torch.randint(0, maxp // 2, (1,), generator=g)
        positions = torch.stack([
            start.expand(T),  # temporal
            start + torch.randint(0, maxp // 2, (T,), generator=g),  # height
            start + torch.randint(0, maxp // 2, (T,), generator=g),  # width
        ])
    else:
        positions = torch.randint(0, maxp, (T,), generator=g).expand(3, T)
    cache = build_cos_sin_cache(case.rotary_dim, maxp, 1e4, dtype=case.cache_dtype)
    wdtype = case.weight_dtype or torch.float32
    kwargs: Dict[str, object] = dict(
        qkv=qkv, positions=positions.to(case.pos_dtype).to(device), cos_sin_cache=cache.to(device),
        num_q_heads=case.num_q_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
        eps=case.eps, is_neox=case.is_neox, mrope_section=case.mrope_section,
        mrope_interleaved=case.mrope_interleaved,
    )
    if case.q_gate:
        kwargs["q_gate"] = True
    if case.gemma_norm:
        kwargs["gemma_norm"] = True
    if case.norm:
        centre = 0.0 if case.gemma_norm else 1.0
        for name in ("q_weight", "k_weight"):
            kwargs[name] = (centre + 0.2 * torch.randn(case.head_dim, generator=g)).to(wdtype).to(device)
        if case.bias:
            for name in ("q_bias", "k_bias"):
                kwargs[name] = (0.1 * torch.randn(case.head_dim, generator=g)).to(wdtype).to(device)
    return kwargs


def make_norm_inputs(T: int, H: int, dtype: torch.dtype, residual: bool = True, bias: bool = False,
                     seed: int = 0, row_pad: int = 0, device="cpu", gemma_norm: bool = False) -> Dict[str, object]:
    """Keyword arguments for ``add_rmsnorm(**kwargs)`` (and its oracle). ``gemma_norm``: the weight is centred at
    0 and ``gemma_norm=True`` is in the kwargs (absent otherwise)."""
    g = torch.Generator().manual_seed(seed)

    def rows(scale):
        buf = torch.full((T, H + row_pad), float("nan"))
        buf[:, :H] = torch.randn(T, H, generator=g) * scale
        return buf.to(dtype).to(device)[:, :H]

    centre = 0.0 if gemma_norm else 1.0
    kwargs: Dict[str, object] = dict(x=rows(1.0), residual=rows(3.0) if residual else None,
                                     weight=(centre + 0.2 * torch.randn(H, generator=g)).to(device), eps=1e-6)
    if gemma_norm:
        kwargs["gemma_norm"] = True
    if bias:
        kwargs["bias"] = (0.1 * torch.randn(H, generator=g)).to(device)
    return kwargs


def poisoned_like(t: torch.Tensor, row_pad: int = 0) -> torch.Tensor:
    """A NaN-filled tensor of ``t``'s shape and dtype (optionally with a wider row stride), never zeros."""
    T, W = t.shape
    return torch.full((T, W + row_pad), float("nan"), dtype=t.dtype, device=t.device)[:, :W]


def poisoned_split_outputs(kwargs: Dict[str, object], row_pad: int = 0):
    """NaN-poisoned ``out=`` tensors for split kwargs: ``(q, k, v)``, gated ``(q, k, v, gate)`` (row stride
    ``+row_pad``), on qkv's device."""
    qkv = kwargs["qkv"]
    T, D = qkv.shape[0], kwargs["head_dim"]
    hq, hkv = kwargs["num_q_heads"], kwargs["num_kv_heads"]
    heads = (hq, hkv, hkv, hq) if kwargs.get("q_gate") else (hq, hkv, hkv)
    return tuple(poisoned_like(torch.empty(T, n * D, dtype=qkv.dtype, device=qkv.device), row_pad) for n in heads)
