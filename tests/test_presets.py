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
