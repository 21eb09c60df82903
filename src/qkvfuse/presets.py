"""Published model geometry: the one place qkvfuse keeps the shapes of the models it targets.

Values are the published ``config.json`` fields. GLM-4.7's ``rope_theta`` has conflicting public evidence;
every field of a preset can be overridden with :meth:`ModelPreset.replace`.

Qwen3-Next and Qwen3.5 presets describe their *full-attention* layers (one in ``full_attention_interval`` = 4; the
others are Gated DeltaNet linear attention, which qkvfuse does not touch): gated Q (``q_gate``), Gemma-style QK and
decoder norms (``gemma_norm``), head_dim 256 with NeoX partial rotary 64. The field names and defaults follow the
transformers 5.23 config classes (``Qwen3NextConfig``, ``Qwen3_5TextConfig``, ``Qwen3_5MoeTextConfig``: ``head_dim``
256, ``partial_rotary_factor`` 0.25, ``layer_types`` from ``full_attention_interval`` 4). Qwen3.5 models are natively
multimodal and their text rotary module (``Qwen3_5TextRotaryEmbedding``) always applies interleaved mRoPE with
``mrope_section`` [11, 11, 10] (text tokens have equal T/H/W rows), so every Qwen3.5 preset has it; Qwen3-Next
is text-only, plain RoPE. Less certain values, overridable: Qwen3.5-27B's dense ``intermediate_size`` (17408) and
the expert sizes (512 from the config classes' defaults; 1024 for Qwen3.5-397B-A17B, from SGLang's
per-rank intermediate 256 at TP4).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

__all__ = ["ModelPreset", "PRESETS", "get_preset"]


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """Attention (and MoE) geometry of one published model.

    ``rotary_dim`` is ``int(head_dim * partial_rotary_factor)``; ``mrope_section`` is ``None`` for plain RoPE.
    MoE fields are 0 for dense models; ``intermediate_size`` is the dense MLP (or the dense layers of an MoE
    model), ``moe_intermediate_size`` one routed expert.

    Gated attention (Qwen3-Next, Qwen3.5): ``q_gate`` -- ``q_proj`` emits a gate head after each Q head, so the
    packed row is ``(2 * num_q_heads + 2 * num_kv_heads) * head_dim`` wide (:attr:`qkv_width`; the op's
    ``q_gate``); ``gemma_norm`` -- QK-norm and decoder norm weights are stored centred at 0 and applied as
    ``1 + w`` (the ops' ``gemma_norm``); ``full_attention_interval`` -- layer ``i`` is a full-attention layer (the
    one qkvfuse serves) when ``(i + 1) % full_attention_interval == 0`` (transformers' ``layer_types`` rule);
    1 means every layer.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    qk_norm: bool
    qkv_bias: bool
    rms_norm_eps: float
    max_position: int
    is_neox: bool = True
    mrope_section: Optional[Tuple[int, int, int]] = None
    mrope_interleaved: bool = False
    intermediate_size: int = 0
    num_experts: int = 0
    num_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    q_gate: bool = False
    gemma_norm: bool = False
    full_attention_interval: int = 1

    @property
    def qkv_width(self) -> int:
        """Width of one packed ``[q (and gate) | k | v]`` row: the op's ``qkv.shape[1]``."""
        return ((2 if self.q_gate else 1) * self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def full_attention_layers(self) -> Tuple[int, ...]:
        """Indices of the full-attention layers (all of them unless ``full_attention_interval > 1``)."""
        n = self.full_attention_interval
        return tuple(i for i in range(self.num_layers) if (i + 1) % n == 0)

    @property
    def partial_rotary_factor(self) -> float:
        return self.rotary_dim / self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def replace(self, **changes) -> "ModelPreset":
        return dataclasses.replace(self, **changes)


def _glm(name, hidden, layers, qk_norm, experts, moe_inter, scale, first_dense, max_pos, theta=1e6, **kw):
    return ModelPreset(
        name=name, hidden_size=hidden, num_layers=layers, num_q_heads=96, num_kv_heads=8, head_dim=128,
        rotary_dim=64, rope_theta=theta, qk_norm=qk_norm, qkv_bias=True, rms_norm_eps=1e-5,
        max_position=max_pos, num_experts=experts, num_shared_experts=1, num_experts_per_tok=8,
        moe_intermediate_size=moe_inter, routed_scaling_factor=scale, first_k_dense_replace=first_dense, **kw,
    )


def _qwen3(name, hidden, layers, hq, hkv, inter=0, experts=0, moe_inter=0, **kw):
    kw.setdefault("max_position", 40960)
    kw.setdefault("rope_theta", 1e6)
    return ModelPreset(
        name=name, hidden_size=hidden, num_layers=layers, num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
        rotary_dim=128, qk_norm=True, qkv_bias=False, rms_norm_eps=1e-6, intermediate_size=inter,
        num_experts=experts, num_experts_per_tok=8 if experts else 0, moe_intermediate_size=moe_inter, **kw,
    )


def _qwen3_next(name, hidden, layers, hq, hkv, inter=0, experts=0, top_k=0, moe_inter=0, **kw):
    """Qwen3-Next / Qwen3.5: the full-attention layers' geometry (every 4th layer)."""
    return ModelPreset(
        name=name, hidden_size=hidden, num_layers=layers, num_q_heads=hq, num_kv_heads=hkv, head_dim=256,
        rotary_dim=64, rope_theta=1e7, qk_norm=True, qkv_bias=False, rms_norm_eps=1e-6, max_position=262144,
        intermediate_size=inter, num_experts=experts, num_shared_experts=1 if experts else 0,
        num_experts_per_tok=top_k, moe_intermediate_size=moe_inter, q_gate=True, gemma_norm=True,
        full_attention_interval=4, **kw,
    )


# Qwen3.5's text rotary module always interleaves mRoPE (see the module docstring).
_QWEN3_5_MROPE = dict(mrope_section=(11, 11, 10), mrope_interleaved=True)

PRESETS: Dict[str, ModelPreset] = {
    p.name: p
    for p in (
        _qwen3("Qwen3-8B", 4096, 36, 32, 8, inter=12288),
        _qwen3("Qwen3-32B", 5120, 64, 64, 8, inter=25600),
        _qwen3("Qwen3-30B-A3B", 2048, 48, 32, 4, experts=128, moe_inter=768),
        _qwen3("Qwen3-235B-A22B", 4096, 94, 64, 4, experts=128, moe_inter=1536),
        _qwen3("Qwen3-VL-8B", 4096, 36, 32, 8, inter=12288, rope_theta=5e6, max_position=262144,
               mrope_section=(24, 20, 20), mrope_interleaved=True),
        _glm("GLM-4.5", 5120, 92, True, 160, 1536, 2.5, 3, 131072),
        _glm("GLM-4.5-Air", 4096, 46, False, 128, 1408, 1.0, 1, 131072),
        _glm("GLM-4.6", 5120, 92, True, 160, 1536, 2.5, 3, 202752),
        _glm("GLM-4.7", 5120, 92, True, 160, 1536, 2.5, 3, 202752),
        _glm("GLM-4.5V", 4096, 46, False, 128, 1408, 1.0, 1, 65536, theta=1e4,
             mrope_section=(8, 12, 12), mrope_interleaved=False),
        _qwen3_next("Qwen3-Next-80B-A3B", 2048, 48, 16, 2, experts=512, top_k=10, moe_inter=512),
        _qwen3_next("Qwen3.5-9B", 4096, 32, 16, 4, inter=12288, **_QWEN3_5_MROPE),
        _qwen3_next("Qwen3.5-27B", 5120, 64, 24, 4, inter=17408, **_QWEN3_5_MROPE),
        _qwen3_next("Qwen3.5-35B-A3B", 2048, 40, 16, 2, experts=256, top_k=8, moe_inter=512, **_QWEN3_5_MROPE),
        _qwen3_next("Qwen3.5-397B-A17B", 4096, 60, 32, 2, experts=512, top_k=10, moe_inter=1024, **_QWEN3_5_MROPE),
    )
}


def get_preset(name: str) -> ModelPreset:
    """Look up a preset by name (case-insensitive); raises ``KeyError`` listing the known names."""
    for key, preset in PRESETS.items():
        if key.lower() == name.lower():
            return preset
    raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
