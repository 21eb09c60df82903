"""The spec against transformers' own building blocks on identical inputs (fp32).

Each test takes transformers' RMSNorm, rotary module and ``apply_rotary_pos_emb`` for a model family, feeds
them the same q/k, and compares with qkvfuse's reference (and every other backend) fed a cos/sin table built
from the *same* rotary module, so the comparison isolates split + norm + rotation.
"""

import pytest
import torch
from transformers import Glm4MoeConfig, Glm4vMoeTextConfig, Qwen3Config, Qwen3VLTextConfig
from transformers.models.glm4_moe import modeling_glm4_moe as glm4_moe
from transformers.models.glm4v_moe import modeling_glm4v_moe as glm4v_moe
from transformers.models.qwen3 import modeling_qwen3 as qwen3
from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl

import qkvfuse

T, HQ, HKV, D = 9, 4, 2, 128
MAX_POS = 512


def _table_from_rotary(rotary, x):
    """cos/sin table [MAX_POS, R] taken from transformers' rotary module itself (1-D positions)."""
    positions = torch.arange(MAX_POS)[None]
    if isinstance(rotary, (qwen3_vl.Qwen3VLTextRotaryEmbedding, glm4v_moe.Glm4vMoeTextRotaryEmbedding)):
        positions = positions[None].expand(3, 1, MAX_POS)
    cos, sin = rotary(x, positions)
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)


def _family(name):
    eps = 1e-6
    if name == "qwen3":
        cfg = Qwen3Config(head_dim=D, hidden_size=256, num_attention_heads=HQ, num_key_value_heads=HKV,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=eps)
        return cfg, qwen3.Qwen3RotaryEmbedding(cfg), qwen3.Qwen3RMSNorm, qwen3.apply_rotary_pos_emb, None, False
    if name == "glm4_moe":
        eps = 1e-5
        cfg = Glm4MoeConfig(head_dim=D, hidden_size=256, num_attention_heads=HQ, num_key_value_heads=HKV,
                            partial_rotary_factor=0.5, use_qk_norm=True, rms_norm_eps=eps,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
        return cfg, glm4_moe.Glm4MoeRotaryEmbedding(cfg), glm4_moe.Glm4MoeRMSNorm, glm4_moe.apply_rotary_pos_emb, None, False
    if name == "qwen3_vl":
        cfg = Qwen3VLTextConfig(head_dim=D, hidden_size=256, num_attention_heads=HQ, num_key_value_heads=HKV,
                                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20]})
        return (cfg, qwen3_vl.Qwen3VLTextRotaryEmbedding(cfg), qwen3_vl.Qwen3VLTextRMSNorm,
                qwen3_vl.apply_rotary_pos_emb, (24, 20, 20), True)
    eps = 1e-5
    cfg = Glm4vMoeTextConfig(head_dim=D, hidden_size=256, num_attention_heads=HQ, num_key_value_heads=HKV,
                             partial_rotary_factor=0.5, rms_norm_eps=eps,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 12, 12],
                                              "partial_rotary_factor": 0.5})
    return (cfg, glm4v_moe.Glm4vMoeTextRotaryEmbedding(cfg), glm4v_moe.Glm4vMoeTextRMSNorm,
            glm4v_moe.apply_rotary_pos_emb, (8, 12, 12), False)


@pytest.mark.parametrize("family,qk_norm", [("qwen3", True), ("glm4_moe", True), ("glm4_moe", False),
                                            ("qwen3_vl", True), ("glm4v_moe", False)])
def test_matches_transformers_building_blocks(backend, family, qk_norm):
    cfg, rotary, norm_cls, apply_rope, section, interleaved = _family(family)
    eps = cfg.rms_norm_eps
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=g) * 3
    if section is None:
        positions = torch.randint(0, MAX_POS, (T,), generator=g)
        hf_positions = positions[None]
    else:  # image tokens: the three rows differ
        positions = torch.stack([torch.full((T,), 5), 5 + torch.randint(0, 200, (T,), generator=g),
                                 5 + torch.randint(0, 200, (T,), generator=g)])
        hf_positions = positions[:, None, :]

    q = qkv[:, : HQ * D].view(1, T, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(1, T, HKV, D)
    kwargs = {}
    if qk_norm:
        q_norm, k_norm = norm_cls(D, eps=eps), norm_cls(D, eps=eps)
        with torch.no_grad():
            q_norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=g))
            k_norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=g))
        q, k = q_norm(q), k_norm(k)
        kwargs = dict(q_weight=q_norm.weight.detach(), k_weight=k_norm.weight.detach(), eps=eps)
    cos, sin = rotary(qkv, hf_positions)
    with torch.no_grad():
        q_hf, k_hf = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    q_hf = q_hf.transpose(1, 2).reshape(T, HQ * D)
    k_hf = k_hf.transpose(1, 2).reshape(T, HKV * D)

    table = _table_from_rotary(rotary, qkv)
    q_ours, k_ours, v_ours = qkvfuse.split_qkv_rmsnorm_rope(
        qkv, positions, table, HQ, HKV, D, is_neox=True, mrope_section=section, mrope_interleaved=interleaved,
        backend=backend, **kwargs)
    torch.testing.assert_close(q_ours, q_hf, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(k_ours, k_hf, rtol=2e-5, atol=2e-5)
    assert torch.equal(v_ours, qkv[:, (HQ + HKV) * D :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_matches_transformers_rmsnorm(backend, dtype):
    """Residual output is bit-exact with transformers' add; y matches its RMSNorm within the spec's rounding."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 512, generator=g)).to(dtype)
    residual = (torch.randn(6, 512, generator=g) * 4).to(dtype)
    norm = qwen3.Qwen3RMSNorm(512, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(512, generator=g))
        s = x + residual
        y_hf = norm(s)
    y, res = qkvfuse.add_rmsnorm(x, residual, norm.weight.detach(), 1e-6, backend=backend)
    assert torch.equal(res, s)
    # transformers rounds before the weight multiply (two roundings); qkvfuse rounds once.
    tol = 1e-5 if dtype == torch.float32 else 2 * 2.0**-8
    torch.testing.assert_close(y.float(), y_hf.float(), rtol=tol, atol=tol)
