"""Tiny random-weight transformers models with the published attention geometry (no downloads).

Tests, ``python -m qkvfuse verify`` and examples build their models here, from :mod:`qkvfuse.presets` (the
gated-attention families from ``_GATED_PRESETS`` below): head_dim (128; 256 gated), the Hq/Hkv ratio, rotary
dim, rope theta, mRoPE sections, QK-norm, q/k/v bias, eps and routed scaling come from the preset; depth,
hidden size, vocabulary, expert counts and the number of KV heads are shrunk.
``head_dim``, the rope parameters and ``partial_rotary_factor`` are always passed explicitly because the
transformers config classes' defaults differ from the published models.

Random weights make two things fragile that real checkpoints are not, and the builders remove both:

* transformers initialises norm weights to 1 and biases to 0, which would hide a swapped q/k norm weight or a
  dropped bias: every norm weight and bias is perturbed;
* MoE top-k is discontinuous, so an expert choice decided by a near-tie would flip between two correct runs
  (see ``pin_routing``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Dict, Optional

import torch

from ..presets import ModelPreset, get_preset

__all__ = ["TinyModelSpec", "TINY_MODELS", "tiny_config", "build_tiny_model", "clone_model", "tiny_prompt",
           "tiny_image_prompt", "image_token_count", "attention_layers", "copy_routing_pins"]


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """One tiny model: the transformers class it instantiates and the preset whose geometry it keeps."""

    name: str
    preset: str
    model_class: str
    image: bool = False  # a vision tower (Qwen3-VL, GLM-4.5V): prompts may carry an image
    gated: bool = False  # gated full attention + Gated DeltaNet layers (Qwen3-Next, Qwen3.5): q_gate, gemma_norm


TINY_MODELS: Dict[str, TinyModelSpec] = {
    s.name: s
    for s in (
        TinyModelSpec("Qwen3", "Qwen3-8B", "Qwen3ForCausalLM"),
        TinyModelSpec("Qwen3-MoE", "Qwen3-30B-A3B", "Qwen3MoeForCausalLM"),
        TinyModelSpec("Qwen3-VL", "Qwen3-VL-8B", "Qwen3VLForConditionalGeneration", image=True),
        TinyModelSpec("GLM-4.7", "GLM-4.7", "Glm4MoeForCausalLM"),
        TinyModelSpec("GLM-4.5-Air", "GLM-4.5-Air", "Glm4MoeForCausalLM"),
        TinyModelSpec("GLM-4.5V", "GLM-4.5V", "Glm4vMoeForConditionalGeneration", image=True),
        TinyModelSpec("GLM-4.6V", "GLM-4.5V", "Glm46VForConditionalGeneration", image=True),
        TinyModelSpec("Qwen3-VL-MoE", "Qwen3-30B-A3B", "Qwen3VLMoeForConditionalGeneration", image=True),
        TinyModelSpec("Qwen3-Next", "Qwen3-Next-80B-A3B", "Qwen3NextForCausalLM", gated=True),
        TinyModelSpec("Qwen3.5", "Qwen3.5-9B", "Qwen3_5ForConditionalGeneration", image=True, gated=True),
        TinyModelSpec("Qwen3.5-MoE", "Qwen3.5-35B-A3B", "Qwen3_5MoeForCausalLM", gated=True),
    )
}


def _gated(name, hidden, layers, hq, hkv, experts=0, experts_per_tok=0, **kw) -> ModelPreset:
    return ModelPreset(name=name, hidden_size=hidden, num_layers=layers, num_q_heads=hq, num_kv_heads=hkv,
                       head_dim=256, rotary_dim=64, rope_theta=1e7, qk_norm=True, qkv_bias=False,
                       rms_norm_eps=1e-6, max_position=262144, num_experts=experts,
                       num_shared_experts=1 if experts else 0, num_experts_per_tok=experts_per_tok,
                       moe_intermediate_size=512 if experts else 0, **kw)


# The full-attention geometry of the gated-attention models (Qwen3-Next, Qwen3.5; issue 22, shared/README.md):
# head_dim 256, rotary 64, theta 1e7. Kept here, not in qkvfuse.presets, until the presets describe the gated
# layout (the op suites iterate every preset as an ungated layout).
_GATED_PRESETS: Dict[str, ModelPreset] = {
    p.name: p
    for p in (
        _gated("Qwen3-Next-80B-A3B", 2048, 48, 16, 2, experts=512, experts_per_tok=10),
        _gated("Qwen3.5-9B", 4096, 32, 16, 4, mrope_section=(11, 11, 10), mrope_interleaved=True),
        _gated("Qwen3.5-35B-A3B", 2048, 40, 16, 2, experts=256, experts_per_tok=8, mrope_section=(11, 11, 10),
               mrope_interleaved=True),
    )
}
# Gated DeltaNet (linear-attention) layers of the tiny gated models: small heads that transformers' torch
# fallback (no flash-linear-attention, no causal-conv1d) runs on CPU. Three linear layers, then one full.
_LINEAR_ATTENTION = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4)

VOCAB = 256
# Multimodal special tokens live at the top of the tiny vocabulary (the published ids are ~151k).
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4
TEXT_VOCAB = VOCAB - 8  # prompts draw plain text tokens below the special ones
# One image of 4 x 6 patches, merged 2 x 2 into 1 x 2 x 3 = 6 LLM tokens whose height and width rows differ.
IMAGE_GRID_THW = (1, 4, 6)
_PATCH, _MERGE, _TEMPORAL_PATCH, _CHANNELS = 4, 2, 2, 3


def _rope_parameters(preset: ModelPreset) -> dict:
    params = {"rope_type": "default", "rope_theta": preset.rope_theta,
              "partial_rotary_factor": preset.partial_rotary_factor}
    if preset.mrope_section is not None:
        params["mrope_section"] = list(preset.mrope_section)
    return params


def _text_fields(preset: ModelPreset, num_layers: int, hidden_size: int, num_kv_heads: int,
                 initializer_range: float) -> dict:
    ratio = preset.num_q_heads // preset.num_kv_heads
    return dict(
        vocab_size=VOCAB, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=ratio * num_kv_heads, num_key_value_heads=num_kv_heads, head_dim=preset.head_dim,
        rms_norm_eps=preset.rms_norm_eps, rope_parameters=_rope_parameters(preset),
        max_position_embeddings=1024, initializer_range=initializer_range, attention_bias=preset.qkv_bias,
        intermediate_size=2 * hidden_size, tie_word_embeddings=False,
    )


def tiny_config(name: str, *, num_layers: int = 2, hidden_size: int = 64, num_kv_heads: int = 1,
                num_experts: int = 8, experts_per_tok: int = 2, initializer_range: float = 0.1,
                preset: Optional[ModelPreset] = None):
    """A transformers config for the tiny version of ``name`` (a key of :data:`TINY_MODELS`).

    Parameters
    ----------
    name : str
        ``"Qwen3"``, ``"Qwen3-MoE"``, ``"Qwen3-VL"``, ``"GLM-4.7"``, ``"GLM-4.5-Air"``, ``"GLM-4.5V"``,
        ``"GLM-4.6V"``, ``"Qwen3-VL-MoE"``, ``"Qwen3-Next"``, ``"Qwen3.5"`` or ``"Qwen3.5-MoE"``.
    num_layers, hidden_size, num_kv_heads : int
        Shrunk sizes; the number of query heads is ``num_kv_heads`` times the preset's Hq/Hkv ratio. The gated
        families (Qwen3-Next, Qwen3.5) get 4 layers for the default 2: three Gated DeltaNet layers, then one
        full-attention layer (``full_attention_interval=4``).
    num_experts, experts_per_tok : int
        Routed experts for the MoE families (GLM keeps one shared expert; its first layer stays dense, as
        ``first_k_dense_replace`` makes the published models' first layers dense).
    initializer_range : float
        Weight init std. 0.1 keeps attention scores O(1) without QK-norm (GLM-4.5-Air) at hidden 64, so the
        rotary positions visibly change the logits.
    preset : ModelPreset, optional
        Override the preset (e.g. a full-size attention geometry); defaults to the spec's preset.
    """
    import transformers

    spec = _spec(name)
    preset = preset or _GATED_PRESETS.get(spec.preset) or get_preset(spec.preset)
    if spec.gated and num_layers == 2:
        num_layers = 4  # three Gated DeltaNet layers and one full-attention layer
    text = _text_fields(preset, num_layers, hidden_size, num_kv_heads, initializer_range)
    if spec.name == "Qwen3":
        return transformers.Qwen3Config(**text)
    if spec.name == "Qwen3-MoE":
        return transformers.Qwen3MoeConfig(**text, num_experts=num_experts, num_experts_per_tok=experts_per_tok,
                                           moe_intermediate_size=hidden_size // 2, norm_topk_prob=True,
                                           decoder_sparse_step=1, mlp_only_layers=[])
    if spec.name.startswith("GLM"):
        moe = dict(n_routed_experts=num_experts, num_experts_per_tok=experts_per_tok, n_shared_experts=1,
                   moe_intermediate_size=hidden_size // 2, routed_scaling_factor=preset.routed_scaling_factor,
                   n_group=1, topk_group=1, first_k_dense_replace=min(1, num_layers - 1), norm_topk_prob=True)
        if spec.name in ("GLM-4.5V", "GLM-4.6V"):
            vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=_PATCH,
                          image_size=_PATCH * 4, spatial_merge_size=_MERGE, temporal_patch_size=_TEMPORAL_PATCH,
                          out_hidden_size=hidden_size, in_channels=_CHANNELS, initializer_range=initializer_range)
            ids = _mm_token_ids("image_start_token_id", "image_end_token_id")
            if spec.name == "GLM-4.6V":  # GLM-4.5V's text model (glm4v_moe_text) and GLM-4.1V's vision tower
                return transformers.Glm46VConfig(text_config={**text, **moe, "model_type": "glm4v_moe_text"},
                                                 vision_config={**vision, "model_type": "glm4v_vision"}, **ids)
            return transformers.Glm4vMoeConfig(text_config={**text, **moe}, vision_config=vision, **ids)
        return transformers.Glm4MoeConfig(**text, **moe, use_qk_norm=preset.qk_norm)
    if spec.name in ("Qwen3-Next", "Qwen3.5-MoE"):
        moe = dict(num_experts=num_experts, num_experts_per_tok=experts_per_tok, moe_intermediate_size=hidden_size // 2,
                   shared_expert_intermediate_size=hidden_size // 2)
        if spec.name == "Qwen3-Next":
            return transformers.Qwen3NextConfig(**text, **_LINEAR_ATTENTION, **moe, norm_topk_prob=True,
                                                decoder_sparse_step=1, mlp_only_layers=[])
        return transformers.Qwen3_5MoeTextConfig(**text, **_LINEAR_ATTENTION, **moe)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=_PATCH,
                  spatial_merge_size=_MERGE, temporal_patch_size=_TEMPORAL_PATCH, out_hidden_size=hidden_size,
                  num_position_embeddings=16, in_channels=_CHANNELS, initializer_range=initializer_range)
    ids = _mm_token_ids("vision_start_token_id", "vision_end_token_id")
    if spec.name == "Qwen3.5":
        return transformers.Qwen3_5Config(text_config={**text, **_LINEAR_ATTENTION}, vision_config=vision, **ids)
    if spec.name == "Qwen3-VL-MoE":
        moe = dict(num_experts=num_experts, num_experts_per_tok=experts_per_tok, moe_intermediate_size=hidden_size // 2,
                   decoder_sparse_step=1, mlp_only_layers=[])
        return transformers.Qwen3VLMoeConfig(text_config={**text, **moe}, vision_config={**vision,
                                             "deepstack_visual_indexes": [0]}, **ids)
    # Qwen3-VL: one vision block whose DeepStack features are added after text layer 0, between layers.
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=_PATCH,
                  spatial_merge_size=_MERGE, temporal_patch_size=_TEMPORAL_PATCH, out_hidden_size=hidden_size,
                  num_position_embeddings=16, deepstack_visual_indexes=[0], in_channels=_CHANNELS,
                  initializer_range=initializer_range)
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision,
                                      **_mm_token_ids("vision_start_token_id", "vision_end_token_id"))


def _mm_token_ids(start_key: str, end_key: str) -> dict:
    return {"image_token_id": IMAGE_TOKEN, "video_token_id": VIDEO_TOKEN, start_key: VISION_START,
            end_key: VISION_END}


def _spec(name: str) -> TinyModelSpec:
    if name not in TINY_MODELS:
        raise KeyError(f"unknown tiny model {name!r}; known: {', '.join(TINY_MODELS)}")
    return TINY_MODELS[name]


# Routers without a bias (softmax top-k): pinned by routing every token to every expert.
_SOFTMAX_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen3VLMoeTextTopKRouter", "Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter")


@torch.no_grad()
def _perturb_and_pin(model: torch.nn.Module, seed: int, pin_routing: bool) -> None:
    g = torch.Generator().manual_seed(seed + 1)

    def noise(t: torch.Tensor, scale: float) -> torch.Tensor:
        return (torch.randn(t.shape, generator=g) * scale).to(t.dtype)

    for module_name, module in model.named_modules():
        cls = type(module).__name__
        if cls.endswith("RMSNorm") or isinstance(module, torch.nn.LayerNorm):
            module.weight.add_(noise(module.weight, 0.1))
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            module.bias.copy_(noise(module.bias, 0.1))
        if not pin_routing:
            continue
        if hasattr(module, "e_score_correction_bias"):
            # GLM selects experts by score + correction bias but weights them by the score alone: a ladder of
            # biases wider than the sigmoid's range fixes the selection for every token while the weights stay
            # token-dependent, so no near-tie can flip an expert between two runs.
            n = module.e_score_correction_bias.shape[0]
            module.e_score_correction_bias.copy_(2.0 * torch.arange(n, 0, -1, dtype=torch.float32))
        elif cls in _SOFTMAX_ROUTERS:
            # Softmax routing has no bias: route every token to every expert (top-k = E), which keeps the
            # weights continuous in the input.
            module.top_k = module.num_experts


def build_tiny_model(name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, pin_routing: bool = True,
                     attn_implementation: str = "sdpa", config=None, model_class: Optional[str] = None,
                     **config_changes) -> torch.nn.Module:
    """Build the tiny random-weight model ``name`` in eval mode (see :func:`tiny_config` for the sizes).

    Parameters
    ----------
    dtype : torch.dtype
        Passed as ``dtype=`` at construction, never through ``model.to(dtype)``: a cast after construction
        would also downcast GLM's fp32 router bias. Weights are drawn in fp32 and rounded to ``dtype``, so two
        models with the same seed hold the same values up to that rounding.
    seed : int
        Seeds the weight initialisation and the norm/bias perturbation.
    pin_routing : bool
        Make MoE expert selection token-independent (GLM: a correction-bias ladder; Qwen3-MoE: top-k = all
        experts) so that comparisons of two correct models cannot differ by a flipped expert.
    attn_implementation : str
        ``"sdpa"`` (default; causal without an explicit mask) or ``"eager"``.
    config : transformers config, optional
        A ready config (``config_changes`` are then passed to :func:`tiny_config` only when it is None).
    model_class : str, optional
        Another transformers class for the config (e.g. ``"Qwen3_5ForCausalLM"`` on the text config of
        ``"Qwen3.5"``); default: the spec's.
    """
    import transformers

    spec = _spec(name)
    config = config if config is not None else tiny_config(name, **config_changes)
    config._attn_implementation = attn_implementation
    model_cls = getattr(transformers, model_class or spec.model_class)
    torch.manual_seed(seed)
    model = model_cls._from_config(config, dtype=torch.float32)
    _perturb_and_pin(model, seed, pin_routing)
    if dtype != torch.float32:
        model = clone_model(model, dtype)
    return model.eval()


def clone_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` built with ``dtype=`` at construction, holding the same weights rounded to ``dtype``.

    ``dtype=torch.float64`` gives the high-precision reference model the bf16 checks compare against (its
    MoE experts run transformers' per-expert loop, which has a float64 path). Buffers transformers keeps in
    fp32 (GLM's ``e_score_correction_bias``) stay fp32; ``top_k`` pins made by :func:`build_tiny_model` are
    carried over.
    """
    # _from_config writes dtype (and the experts implementation) into the config: give the twin its own.
    config = copy.deepcopy(model.config)
    # transformers' grouped-mm experts kernel has no float64 path; the per-expert loop does.
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    twin = type(model)._from_config(config, dtype=dtype, **extra)
    twin.load_state_dict(model.state_dict())
    copy_routing_pins(model, twin)
    return twin.eval()


def copy_routing_pins(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Carry :func:`build_tiny_model`'s ``top_k`` pins of ``src``'s softmax routers over to ``dst`` (a copy with the
    same module tree; the pins are not part of a state dict or checkpoint)."""
    for a, b in zip(src.modules(), dst.modules()):
        if type(a).__name__ in _SOFTMAX_ROUTERS:
            b.top_k = a.top_k


def tiny_prompt(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Random text token ids ``[batch, length]`` (int64) below the multimodal special tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TEXT_VOCAB, (batch, length), generator=g)


def tiny_image_prompt(model: torch.nn.Module, text_before: int = 5, text_after: int = 4, seed: int = 0,
                      dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """Model inputs for one prompt holding one small image (Qwen3-VL, GLM-4.5V tiny models).

    Returns ``input_ids [1, T]``, ``attention_mask``, ``mm_token_type_ids`` (1 on image tokens),
    ``pixel_values [patches, C * temporal_patch * patch^2]`` in ``dtype`` (default: the model's) and
    ``image_grid_thw [1, 3]``; the image becomes ``IMAGE_GRID_THW``'s 6 LLM tokens whose height and width
    position rows differ.
    """
    g = torch.Generator().manual_seed(seed)
    t, h, w = IMAGE_GRID_THW
    n_image = t * h * w // (_MERGE * _MERGE)
    ids = torch.cat([
        torch.randint(0, TEXT_VOCAB, (text_before,), generator=g), torch.tensor([VISION_START]),
        torch.full((n_image,), IMAGE_TOKEN), torch.tensor([VISION_END]),
        torch.randint(0, TEXT_VOCAB, (text_after,), generator=g),
    ])[None]
    dtype = dtype or next(model.parameters()).dtype
    pixels = torch.randn(t * h * w, _CHANNELS * _TEMPORAL_PATCH * _PATCH * _PATCH, generator=g).to(dtype)
    return {
        "input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMAGE_TOKEN).int(),
        "pixel_values": pixels, "image_grid_thw": torch.tensor([IMAGE_GRID_THW]),
    }


def image_token_count() -> int:
    """Number of LLM tokens :func:`tiny_image_prompt`'s image occupies."""
    t, h, w = IMAGE_GRID_THW
    return t * h * w // (_MERGE * _MERGE)



def attention_layers(model: torch.nn.Module) -> int:
    """Number of decoder layers with a ``self_attn`` (each does one fused prepare per forward once patched): all of
    them, except the Gated DeltaNet layers of Qwen3-Next / Qwen3.5 (3 of every 4)."""
    text = model.config.get_text_config()
    return sum(kind != "linear_attention" for kind in (getattr(text, "layer_types", None)
                                                      or ["full_attention"] * text.num_hidden_layers))
