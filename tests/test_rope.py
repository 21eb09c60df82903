"""Cos/sin tables and the mRoPE axis rule against transformers' own rope code."""


import pytest
import torch
from transformers import Glm4MoeConfig, Qwen3Config
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

import qkvfuse
from qkvfuse.rope import compute_inv_freq, mrope_axis_map

ROPE_PARAMS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                    "mscale_all_dim": 0.8, "beta_fast": 16, "beta_slow": 2},
    "yarn-no-truncate": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192,
                         "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
}


def _hf_rotary(kind: str, head_dim: int, partial: float, theta: float, max_pos: int):
    params = dict(ROPE_PARAMS[kind], rope_theta=theta)
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
        config = Glm4MoeConfig(head_dim=head_dim, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                               partial_rotary_factor=partial, rope_parameters=params, max_position_embeddings=max_pos)
        return Glm4MoeRotaryEmbedding(config), params
    config = Qwen3Config(head_dim=head_dim, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters=params, max_position_embeddings=max_pos)
    return Qwen3RotaryEmbedding(config), params


@pytest.mark.parametrize("kind", list(ROPE_PARAMS))
@pytest.mark.parametrize("head_dim,partial", [(128, 1.0), (128, 0.5), (64, 1.0)])
def test_inv_freq_and_scale_match_transformers(kind, head_dim, partial):
    rotary, params = _hf_rotary(kind, head_dim, partial, 1e6, 40960)
    rotary_dim = int(head_dim * partial)
    inv_freq, scale = compute_inv_freq(rotary_dim, 1e6, params, 40960)
    assert torch.equal(inv_freq, rotary.inv_freq), "inv_freq must equal transformers' bit for bit"
    assert scale == pytest.approx(rotary.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("kind", list(ROPE_PARAMS))
def test_cache_matches_transformers_rotary_module(kind):
    """Same table as transformers' rotary module, within the error of its fp32 angle (which grows with p)."""
    max_pos = 4096
    rotary, params = _hf_rotary(kind, 128, 0.5, 1e6, max_pos)
    cache = qkvfuse.build_cos_sin_cache(64, max_pos, 1e6, params)
    positions = torch.arange(max_pos)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    half = 32
    angle = positions[0, :, None].double() * rotary.inv_freq.double()
    tol = 2e-6 + angle * 2.0**-23 * rotary.attention_scaling
    assert ((cache[:, :half].double() - cos[0, :, :half].double()).abs() <= tol).all()
    assert ((cache[:, half:].double() - sin[0, :, :half].double()).abs() <= tol).all()


def test_cache_angle_is_float64():
    """At Qwen3-VL's context length an fp32 angle is off by ~1e-2 in cos; the table must not be."""
    p = 262143
    cache = qkvfuse.build_cos_sin_cache(128, p + 1, 5e6)
    inv_freq, _ = compute_inv_freq(128, 5e6)
    exact = torch.cos(torch.tensor(float(p), dtype=torch.float64) * inv_freq.double())
    assert (cache[p, :64].double() - exact).abs().max() < 1e-6


def test_cache_dtype_device_and_layout():
    cache = qkvfuse.build_cos_sin_cache(64, 10, 1e4, dtype=torch.bfloat16)
    assert cache.shape == (10, 64) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert torch.equal(cache[0, :32], torch.ones(32, dtype=torch.bfloat16))
    assert torch.equal(cache[0, 32:], torch.zeros(32, dtype=torch.bfloat16))


@pytest.mark.parametrize("bad,exc,arg", [
    (dict(rotary_dim=63), ValueError, "rotary_dim"),
    (dict(rotary_dim=0), ValueError, "rotary_dim"),
    (dict(max_position=0), ValueError, "max_position"),
    (dict(base=1.0), ValueError, "base"),
    (dict(base=float("inf")), ValueError, "base"),
    (dict(dtype=torch.int32), TypeError, "dtype"),
    (dict(rope_scaling={"rope_type": "longrope"}), ValueError, "rope_scaling"),
    (dict(rope_scaling={"rope_type": "linear"}), ValueError, "rope_scaling"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ValueError, "rope_scaling"),
    (dict(rope_scaling="yarn"), TypeError, "rope_scaling"),
])
def test_cache_builder_rejects_bad_arguments(bad, exc, arg):
    kwargs = dict(rotary_dim=64, max_position=16, base=1e4)
    kwargs.update(bad)
    with pytest.raises(exc, match=arg):
        qkvfuse.build_cos_sin_cache(**kwargs)


def test_mrope_axis_map_matches_transformers_recomposition():
    """Tag each frequency slot with its source row and run transformers' own recomposition code on it."""
    from transformers import Glm4vMoeTextConfig, Qwen3VLTextConfig
    from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    for cls, cfg_cls, section, interleaved, head_dim, partial in (
        (Qwen3VLTextRotaryEmbedding, Qwen3VLTextConfig, [24, 20, 20], True, 128, 1.0),
        (Glm4vMoeTextRotaryEmbedding, Glm4vMoeTextConfig, [8, 12, 12], False, 128, 0.5),
    ):
        params = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": section}
        if partial != 1.0:
            params["partial_rotary_factor"] = partial
        config = cfg_cls(head_dim=head_dim, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters=params)
        rotary = cls(config)
        half = int(head_dim * partial) // 2
        tagged = torch.arange(3, dtype=torch.float32)[:, None, None, None].expand(3, 1, 1, half).clone()
        recomposed = rotary.recomposition_frequencies(tagged)[0, 0, :half]
        assert tuple(int(a) for a in recomposed) == mrope_axis_map(half, tuple(section), interleaved)


def test_mrope_axis_map_rule_examples():
    assert mrope_axis_map(4, None, False) == (0, 0, 0, 0)
    assert mrope_axis_map(6, (2, 2, 2), False) == (0, 0, 1, 1, 2, 2)
    assert mrope_axis_map(6, (2, 2, 2), True) == (0, 1, 2, 0, 1, 2)
    # Qwen3-VL [24, 20, 20]: T,H,W repeating for 60 slots, then T for the last 4.
    axes = mrope_axis_map(64, (24, 20, 20), True)
    assert axes[:60] == (0, 1, 2) * 20 and axes[60:] == (0,) * 4
