"""Preset geometry: internal consistency, and a few published values spelled out."""

import pytest

from qkvfuse.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_is_consistent(name):
    p = PRESETS[name]
    assert p.head_dim % 2 == 0 and 0 < p.rotary_dim <= p.head_dim and p.rotary_dim % 2 == 0
    assert p.num_q_heads % p.num_kv_heads == 0
    if p.mrope_section is not None:
        assert sum(p.mrope_section) == p.rotary_dim // 2
    if p.is_moe:
        assert p.num_experts_per_tok <= p.num_experts and p.moe_intermediate_size > 0
    assert p.full_attention_interval >= 1 and p.full_attention_layers
    assert len(p.full_attention_layers) == p.num_layers // p.full_attention_interval
    assert p.qkv_width == ((2 if p.q_gate else 1) * p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim


def test_published_values():
    glm = get_preset("glm-4.7")
    assert (glm.num_q_heads, glm.num_kv_heads, glm.head_dim, glm.rotary_dim) == (96, 8, 128, 64)
    assert glm.qkv_width == (96 + 16) * 128 and glm.qkv_bias and glm.qk_norm and glm.rms_norm_eps == 1e-5
    assert not get_preset("GLM-4.5-Air").qk_norm
    vl = get_preset("Qwen3-VL-8B")
    assert vl.mrope_section == (24, 20, 20) and vl.mrope_interleaved and vl.rope_theta == 5e6
    assert get_preset("GLM-4.5V").mrope_section == (8, 12, 12) and not get_preset("GLM-4.5V").mrope_interleaved
    assert get_preset("Qwen3-235B-A22B").num_kv_heads == 4
    assert get_preset("GLM-4.7").replace(rope_theta=1e4).rope_theta == 1e4  # "?" values stay overridable


def test_unknown_preset_lists_known_ones():
    with pytest.raises(KeyError, match="Qwen3-8B"):
        get_preset("llama")


GATED = ("Qwen3-Next-80B-A3B", "Qwen3.5-9B", "Qwen3.5-27B", "Qwen3.5-35B-A3B", "Qwen3.5-397B-A17B")


def test_gated_attention_presets():
    """The full-attention layers of Qwen3-Next / Qwen3.5: gated Q, Gemma norms, head_dim 256, NeoX rotary 64."""
    for name in GATED:
        p = get_preset(name)
        assert p.q_gate and p.gemma_norm and p.qk_norm and not p.qkv_bias, name
        assert (p.head_dim, p.rotary_dim, p.is_neox, p.rope_theta, p.rms_norm_eps) == (256, 64, True, 1e7, 1e-6)
        assert p.full_attention_interval == 4 and p.full_attention_layers[:2] == (3, 7)
        assert p.max_position == 262144
        # Qwen3.5 is natively multimodal: interleaved mRoPE [11, 11, 10]; Qwen3-Next is text-only RoPE.
        if name.startswith("Qwen3.5"):
            assert p.mrope_section == (11, 11, 10) and p.mrope_interleaved, name
        else:
            assert p.mrope_section is None
    geometry = {name: (get_preset(name).hidden_size, get_preset(name).num_layers, get_preset(name).num_q_heads,
                       get_preset(name).num_kv_heads) for name in GATED}
    assert geometry == {"Qwen3-Next-80B-A3B": (2048, 48, 16, 2), "Qwen3.5-9B": (4096, 32, 16, 4),
                        "Qwen3.5-27B": (5120, 64, 24, 4), "Qwen3.5-35B-A3B": (2048, 40, 16, 2),
                        "Qwen3.5-397B-A17B": (4096, 60, 32, 2)}
    moe = {name: (p.num_experts, p.num_shared_experts, p.num_experts_per_tok)
           for name in GATED if (p := get_preset(name)).is_moe}
    assert moe == {"Qwen3-Next-80B-A3B": (512, 1, 10), "Qwen3.5-35B-A3B": (256, 1, 8),
                   "Qwen3.5-397B-A17B": (512, 1, 10)}
    assert get_preset("Qwen3-Next-80B-A3B").qkv_width == (2 * 16 + 2 * 2) * 256
    assert len(get_preset("Qwen3-Next-80B-A3B").full_attention_layers) == 12
    assert not get_preset("Qwen3-8B").q_gate and get_preset("Qwen3-8B").full_attention_layers == tuple(range(36))


def test_gated_presets_match_the_transformers_config_classes():
    """Field names and defaults of transformers' config classes (the published checkpoints' own classes)."""
    transformers = pytest.importorskip("transformers")
    for cls, name in ((transformers.Qwen3NextConfig, "Qwen3-Next-80B-A3B"),
                      (transformers.Qwen3_5TextConfig, "Qwen3.5-9B"),
                      (transformers.Qwen3_5MoeTextConfig, "Qwen3.5-35B-A3B")):
        c, p = cls(), get_preset(name)
        assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
            p.hidden_size, p.num_layers, p.num_q_heads, p.num_kv_heads, p.head_dim), name
        assert int(c.head_dim * c.rope_parameters["partial_rotary_factor"]) == p.rotary_dim, name
        assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == list(p.full_attention_layers)
        assert not c.attention_bias and c.rms_norm_eps == p.rms_norm_eps
        if p.is_moe:
            assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (
                p.num_experts, p.num_experts_per_tok, p.moe_intermediate_size), name


def test_qwen3_5_text_rotary_is_always_interleaved_mrope():
    """Why every Qwen3.5 preset has mRoPE: transformers' Qwen3.5 text rotary modules default to sections
    [11, 11, 10] and always interleave them (``mrope_interleaved`` is not read)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    for rotary, cfg in ((modeling_qwen3_5.Qwen3_5TextRotaryEmbedding, transformers.Qwen3_5TextConfig()),
                        (modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding, transformers.Qwen3_5MoeTextConfig())):
        assert tuple(rotary(cfg).mrope_section) == get_preset("Qwen3.5-27B").mrope_section
