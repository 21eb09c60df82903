"""SGLang's own attention classes, built directly (no engine), fused by the plugin: layer parity.

Each case builds an SGLang 0.5.23 attention layer with random weights, runs SGLang's own prepare method (the
class's code: split, ``apply_qk_norm``, the rotary module) and then the plugin's fused method on the same
instance, on the same inputs: Qwen3 (``Qwen3Attention.forward_prepare_native``), Qwen3-MoE
(``Qwen3MoeAttention.apply_qk_norm_rope`` through ``forward_prepare_native``), GLM-4.7 (``Glm4MoeAttention.
forward_prepare``: partial rotary 0.5, QK-norm, qkv bias), GLM-4.5-Air (no QK-norm), and the language-model
layers of Qwen3-VL (``Qwen3Attention`` with interleaved mRoPE [24, 20, 20]) and GLM-4.5V (``Glm4MoeAttention``,
no QK-norm, sectioned mRoPE [8, 12, 12] of rotary 64), whose positions are ``[3, T]`` with rows that differ
(a strided slice) and also 1-D text positions. fp32: within 2e-6; bf16: qkvfuse's accuracy rule against a
float64 oracle with SGLang's own path as the unfused baseline. Then the qualification rules and re-binding.
"""

import types

import pytest
import torch

from qkvfuse.testing.accuracy import check_split_outputs
from qkvfuse.testing.oracle import oracle_split
from qkvfuse.integrations import sglang as plugin

from _support.live_edits import set_eps, set_rotary

T, HIDDEN, HQ, HKV, D, MAX_POS = 11, 96, 6, 2, 128, 512

LAYERS = {  # name -> (class, rope_theta, rope_scaling, partial rotary, qk_norm)
    "qwen3": ("Qwen3Attention", 1e6, None, 1.0, True),
    "qwen3-moe": ("Qwen3MoeAttention", 1e6, None, 1.0, True),
    "glm-4.7": ("Glm4MoeAttention", 1e6, None, 0.5, True),
    "glm-4.5-air": ("Glm4MoeAttention", 1e6, None, 0.5, False),
    "qwen3-vl": ("Qwen3Attention", 5e6, {"rope_type": "default", "mrope_section": [24, 20, 20],
                                          "mrope_interleaved": True}, 1.0, True),
    "glm-4.5v": ("Glm4MoeAttention", 1e4, {"rope_type": "default", "mrope_section": [8, 12, 12]}, 0.5, False),
    "qwen3-yarn": ("Qwen3Attention", 1e6, {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 128}, 1.0, True),
}
_count = iter(range(10**6))


def _layer(name: str, dtype=torch.float32):
    """An SGLang attention layer (6 Q heads, 2 KV heads, head_dim 128) with random weights."""
    from sglang.srt.models.glm4_moe import Glm4MoeAttention
    from sglang.srt.models.qwen3 import Qwen3Attention
    from sglang.srt.models.qwen3_moe import Qwen3MoeAttention

    cls, theta, scaling, partial, qk_norm = LAYERS[name]
    prefix = f"model.layers.{next(_count)}.self_attn"
    common = dict(hidden_size=HIDDEN, num_heads=HQ, num_kv_heads=HKV, head_dim=D, rope_theta=theta,
                  rope_scaling=scaling, max_position_embeddings=MAX_POS, prefix=prefix)
    if cls == "Qwen3Attention":
        layer = Qwen3Attention(rms_norm_eps=1e-6, **common)
    elif cls == "Qwen3MoeAttention":
        layer = Qwen3MoeAttention(rms_norm_eps=1e-6, **common)
    else:
        layer = Glm4MoeAttention(partial_rotary_factor=partial, rms_norm_eps=1e-5, use_qk_norm=qk_norm,
                                 attention_bias=True, **common)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.2) + (1 if p.dim() == 1 else 0))
    return layer.to(dtype).eval()


@pytest.fixture
def no_kv_pool(monkeypatch):
    """Qwen3-MoE's prepare asks the KV pool whether SGLang's fused K/V write is on (CUDA only): no pool here."""
    from sglang.srt.models import qwen3_moe

    monkeypatch.setattr(qwen3_moe, "enable_fused_set_kv_buffer", lambda forward_batch: False)


def _prepare(layer, positions, hidden):
    """``(q, k, v)`` from the layer's prepare method (SGLang's own, or the plugin's once fused)."""
    name = type(layer).__name__
    if name == "Qwen3Attention":
        return layer.forward_prepare_native(positions, hidden)
    out = (layer.forward_prepare_native if name == "Qwen3MoeAttention" else layer.forward_prepare)(
        positions, hidden, types.SimpleNamespace())
    return out[2][:3]


def _positions(mrope: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    if not mrope:
        return torch.randint(0, MAX_POS, (T,), generator=g)
    wide = torch.randint(0, MAX_POS, (3, T + 5), generator=g)
    positions = wide[:, 3 : T + 3]  # rows differ (an image's t/h/w); a strided slice, as SGLang's buffers are
    assert not positions.is_contiguous() and not torch.equal(positions[1], positions[2])
    return positions


def _fuse(layer, **kwargs):
    report = plugin.fuse_attention(layer, plugin.Options(attention=True, **kwargs), context_len=MAX_POS)
    assert report.fused == {type(layer).__name__: 1}, report.lines()
    return report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_fused_prepare_matches_sglangs_prepare(sglang_dist, no_kv_pool, name, dtype):
    layer = _layer(name, dtype)
    mrope = LAYERS[name][2] is not None and "mrope_section" in LAYERS[name][2]
    cases = [_positions(mrope, s) for s in range(2)] + ([_positions(False, 5)] if mrope else [])  # + text-only
    hidden = [torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(s)).to(dtype)
              for s in range(len(cases))]
    with torch.inference_mode():
        sources = [layer.qkv_proj(h)[0] for h in hidden]
        want = [tuple(t.clone() for t in _prepare(layer, p, h)) for p, h in zip(cases, hidden)]
        report = _fuse(layer)
        got = [_prepare(layer, p, h) for p, h in zip(cases, hidden)]
    rot = layer.rotary_emb
    assert report.details[type(layer).__name__].startswith(f"cpu, rotary {rot.rotary_dim}, neox")
    for (q, k, v), (wq, wk, wv), positions, qkv in zip(got, want, cases, sources):
        assert torch.isfinite(q).all() and torch.isfinite(k).all()
        assert torch.equal(v, wv)
        if dtype == torch.float32:
            torch.testing.assert_close(q, wq, rtol=2e-6, atol=2e-6)
            torch.testing.assert_close(k, wk, rtol=2e-6, atol=2e-6)
        else:
            qk_norm = LAYERS[name][4]
            mrope_pos = mrope and positions.dim() == 2
            oracle = oracle_split(qkv, positions, rot.cos_sin_cache, HQ, HKV, D,
                                  q_weight=layer.q_norm.weight.detach() if qk_norm else None,
                                  k_weight=layer.k_norm.weight.detach() if qk_norm else None,
                                  eps=layer.q_norm.variance_epsilon if qk_norm else 1e-6, is_neox=True,
                                  mrope_section=rot.mrope_section if mrope_pos else None,
                                  mrope_interleaved=bool(getattr(rot, "mrope_interleaved", False)))
            result = check_split_outputs((q, k, v), oracle, (wq, wk, wv), qkv, HQ, HKV, D)
            assert result.ok, result


def test_qwen3_moe_fused_prepare_leaves_the_kv_write_to_the_attention(sglang_dist, no_kv_pool):
    """SGLang's own fused kernels set ``_used_fused_qk_norm_rope_last_call`` so that ``forward_core`` writes
    K/V to the cache; the plugin's prepare does the same (the rotary module never writes it)."""
    layer = _layer("qwen3-moe")
    _fuse(layer)
    with torch.inference_mode():
        _prepare(layer, _positions(False, 0), torch.randn(T, HIDDEN))
    assert layer._used_fused_qk_norm_rope_last_call is True


def test_empty_batch_and_a_layer_that_no_longer_qualifies(sglang_dist, no_kv_pool):
    import copy

    layer = _layer("glm-4.7")
    _fuse(layer)

    class OtherRope(type(layer.rotary_emb)):
        def forward_native(self, *args, **kwargs):
            return super().forward_native(*args, **kwargs)

    with torch.inference_mode():
        assert layer.forward_prepare(_positions(False, 0)[:0], torch.randn(0, HIDDEN), None)[2] is None  # SGLang's
        # SGLang replaces the rotary module by one qkvfuse does not reproduce: the layer falls back to SGLang's code
        other = copy.deepcopy(layer.rotary_emb)
        other.__class__ = OtherRope
        layer.rotary_emb = other
        positions, hidden = _positions(False, 1), torch.randn(T, HIDDEN)
        want = tuple(t.clone() for t in type(layer).forward_prepare(layer, positions, hidden, None)[2][:3])
        got = layer.forward_prepare(positions, hidden, None)[2][:3]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_rebinds_when_weights_table_or_rotary_module_change(sglang_dist, no_kv_pool):
    """``param.data = new`` (same identity, new storage), an in-place copy, and a new rotary module: the fused
    prepare reads what SGLang's own would at that call."""
    from sglang.srt.layers.rotary_embedding import get_rope

    layer = _layer("qwen3")
    reference = _layer("qwen3")  # a twin that keeps SGLang's code
    reference.load_state_dict(layer.state_dict())
    _fuse(layer)
    positions, hidden = _positions(False, 2), torch.randn(T, HIDDEN)

    def check():
        with torch.inference_mode():
            got = _prepare(layer, positions, hidden)
            want = _prepare(reference, positions, hidden)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-6)

    check()
    bound = layer._qkvfuse
    check()
    assert layer._qkvfuse is bound  # nothing changed: no rebuild
    for target in (layer, reference):
        target.q_norm.weight.data = torch.full((D,), 0.5)  # new storage, same Parameter
    check()
    with torch.no_grad():
        for target in (layer, reference):
            target.k_norm.weight.mul_(2)  # in place: the bound op reads it by reference
    check()
    for target in (layer, reference):
        target.rotary_emb = get_rope(D, rotary_dim=D, max_position=MAX_POS, base=1e4)  # another theta
    check()


def test_a_table_shorter_than_the_context_is_left_to_sglang(sglang_dist):
    layer = _layer("qwen3")
    report = plugin.fuse_attention(layer, plugin.Options(attention=True), context_len=4 * MAX_POS)
    assert report.fused == {} and "forward_prepare_native" not in layer.__dict__
    assert "rotary table of 512 positions < context length 2048" in report.lines()[-1], report.lines()
    assert report.lines()[-1].startswith("qkvfuse: left 1/1 Qwen3Attention to SGLang: ")


def test_glm_interleaved_mrope_and_competing_fusions_are_refused(sglang_dist):
    layer = _layer("glm-4.5v")
    layer.rotary_emb.mrope_interleaved_glm = True
    report = plugin.fuse_attention(layer, plugin.Options(attention=True), context_len=MAX_POS)
    assert report.fused == {} and "mrope_interleaved_glm" in report.reasons["Glm4MoeAttention"]
    layer = _layer("qwen3-moe")
    layer.use_fused_qk_norm_rope_cpu = True  # sgl-kernel's CPU kernel would run for this layer
    report = plugin.fuse_attention(layer, plugin.Options(attention=True), context_len=MAX_POS)
    assert report.fused == {} and "use_fused_qk_norm_rope_cpu" in report.reasons["Qwen3MoeAttention"]


def test_untested_sglang_code_is_refused(sglang_dist, monkeypatch):
    model = torch.nn.Module()
    model.attn = _layer("qwen3")
    monkeypatch.setitem(plugin.TESTED_SOURCES, "apply_qk_norm", ("0" * 16,))
    report = plugin.fuse_model(model, plugin.Options(attention=True), context_len=MAX_POS)
    assert report.fused == {} and "forward_prepare_native" not in model.attn.__dict__
    assert report.lines() == ["qkvfuse: fused 0/1 Qwen3Attention",
                              "qkvfuse: left 1/1 Qwen3Attention to SGLang: apply_qk_norm differs from the SGLang "
                              "versions qkvfuse was tested with (0.5.23); its code is left in place"]


def test_tested_sources_are_this_sglangs():
    """Every hash in TESTED_SOURCES is the installed SGLang's (0.5.23): none is stale or misspelt."""
    found = {}
    for module in ("qwen3", "qwen3_moe", "glm4_moe", "qwen3_next", "qwen3_5"):
        found.update(plugin._sglang_sources(module))
    assert set(found) == set(plugin.TESTED_SOURCES)
    for name, fn in found.items():
        assert plugin.source_hash(fn) in plugin.TESTED_SOURCES[name], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_rmsnorm_matches_sglangs_rmsnorm(sglang_dist, dtype):
    from sglang.srt.layers.layernorm import RMSNorm

    from qkvfuse.testing.accuracy import check_norm_outputs
    from qkvfuse.testing.oracle import oracle_add_rmsnorm

    layer = types.SimpleNamespace()
    hidden = 256
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = (1 + 0.3 * torch.randn(hidden)).to(dtype)
    fused = RMSNorm(hidden, eps=1e-5)
    fused.weight.data = norm.weight.data.clone()
    layer.input_layernorm, layer.post_attention_layernorm = fused, RMSNorm(hidden, eps=1e-5).to(dtype)
    report = plugin.Report()
    plugin._fuse_norms(layer, "Qwen3DecoderLayer", plugin.Options(add_rmsnorm=True), None, report)
    assert report.fused == {"Qwen3DecoderLayer add+RMSNorm": 2}
    x, residual = torch.randn(T, hidden).to(dtype), torch.randn(T, hidden).to(dtype)
    with torch.inference_mode():
        want_y, want_r = norm(x.clone(), residual.clone())
        got_y, got_r = fused(x.clone(), residual.clone())
        alone = fused(x.clone())
        torch.testing.assert_close(alone, norm(x.clone()), rtol=2e-6 if dtype == torch.float32 else 2 ** -7,
                                   atol=2e-6 if dtype == torch.float32 else 2 ** -7)
    if dtype == torch.float32:
        torch.testing.assert_close(got_y, want_y, rtol=2e-6, atol=2e-6)
        assert torch.equal(got_r, want_r)
    else:
        oracle = oracle_add_rmsnorm(x, residual, norm.weight.detach(), 1e-5)
        result = check_norm_outputs((got_y, got_r), oracle, (want_y, want_r), x, residual)
        assert result.ok, result


# ------------------------------------------------------------------------------------------------------------
# Gated attention: Qwen3-Next's and Qwen3.5's full-attention decoder layers, whose
# forward_prepare_native splits [q_gate | k | v], applies the Gemma q/k norms and the (partial) rotation and
# returns (q, k, v, gate).
# ------------------------------------------------------------------------------------------------------------
GATED = {"qwen3-next": "Qwen3HybridAttentionDecoderLayer", "qwen3.5": "Qwen3_5AttentionDecoderLayer"}
GATED_HQ, GATED_HKV, GATED_D = 8, 1, 256  # the tiny Qwen3-Next's full-attention heads


def _gated_layer(name: str, dtype=torch.float32):
    """SGLang's decoder layer (8 Q heads, 1 KV head of 256, rotary 64, theta 1e7; Qwen3.5: interleaved mRoPE
    [11, 11, 10]) with random weights, its MoE block and stage boundaries left out (not used by the prepare)."""
    import transformers
    from torch import nn

    from _support.vllm_engine import tiny_qwen3_next_config
    from sglang.srt.models import qwen3_5, qwen3_next

    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    with pytest.MonkeyPatch.context() as mp:
        if name == "qwen3-next":
            config = tiny_qwen3_next_config()
            mp.setattr(qwen3_next, "Qwen2MoeSparseMoeBlock", lambda *args, **kwargs: nn.Identity())
            mp.setattr(qwen3_next, "append_stages", lambda *args, **kwargs: (None, None))
            extra = {}
        else:
            config = transformers.Qwen3_5TextConfig(
                vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=GATED_HQ, num_key_value_heads=GATED_HKV, head_dim=GATED_D,
                layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=MAX_POS,
                rope_parameters={**rope, "mrope_section": [11, 11, 10], "mrope_interleaved": True})
            config.full_attention_interval = 4  # SGLang's Qwen3.5 config carries it
            extra = {"build_stages": False}
        config.rope_theta, config.max_position_embeddings = 1e7, MAX_POS  # as SGLang's config loader sets them
        module = qwen3_next if name == "qwen3-next" else qwen3_5
        layer = getattr(module, GATED[name])(config, layer_id=3, prefix=f"model.layers.{next(_count)}", **extra)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if n.startswith(("qkv_proj", "q_norm", "k_norm")):  # norm weights centred at 0 (Gemma-style)
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.2))
    return layer.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(GATED))
def test_gated_fused_prepare_matches_sglangs_prepare(sglang_dist, monkeypatch, name, dtype):
    """One bound ``QKNormRope(q_gate=True, gemma_norm=True)`` call per prepare; q, k (fp32 within 2e-6; bf16
    qkvfuse's accuracy rule against a float64 oracle, SGLang's path as the unfused baseline), v and gate
    bit-exact (Qwen3.5's gate ``[T, Hq, D]`` as SGLang's)."""
    import qkvfuse
    from qkvfuse.integrations._engine_common import ungated as _ungated

    layer = _gated_layer(name, dtype)
    mrope = name == "qwen3.5"
    cases = [_positions(mrope, s) for s in range(2)] + ([_positions(False, 5)] if mrope else [])
    hidden = [torch.randn(T, 256, generator=torch.Generator().manual_seed(s)).to(dtype) for s in range(len(cases))]
    calls, inplace = [], qkvfuse.QKNormRope.inplace
    monkeypatch.setattr(qkvfuse.QKNormRope, "inplace", lambda self, *a: calls.append(1) or inplace(self, *a))
    with torch.inference_mode():
        sources = [layer.qkv_proj(h)[0] for h in hidden]
        want = [tuple(t.clone() for t in layer.forward_prepare_native(p, h)) for p, h in zip(cases, hidden)]
        # bf16: the verify option too (the accuracy rule on every fused call, inside the plugin)
        report = plugin.fuse_attention(layer, plugin.Options(attention=True, verify=dtype == torch.bfloat16),
                                       context_len=MAX_POS)
        got = [layer.forward_prepare_native(p, h) for p, h in zip(cases, hidden)]
    assert report.fused == {GATED[name]: 1}, report.lines()
    assert report.details[GATED[name]].endswith(
        "rotary 64, neox" + (", mrope [11, 11, 10] interleaved" if mrope else "")), report.details
    assert len(calls) == len(cases)
    rot = layer.rotary_emb
    for (q, k, v, gate), (wq, wk, wv, wgate), positions, qkv in zip(got, want, cases, sources):
        assert gate.shape == wgate.shape and torch.equal(gate, wgate) and torch.equal(v, wv)
        if dtype == torch.float32:
            torch.testing.assert_close(q, wq, rtol=2e-6, atol=2e-6)
            torch.testing.assert_close(k, wk, rtol=2e-6, atol=2e-6)
        else:
            mrope_pos = mrope and positions.dim() == 2
            source, _ = _ungated(qkv, GATED_HQ, GATED_D)
            oracle = oracle_split(source, positions, rot.cos_sin_cache, GATED_HQ, GATED_HKV, GATED_D,
                                  q_weight=layer.q_norm.weight.double() + 1, k_weight=layer.k_norm.weight.double() + 1,
                                  eps=layer.q_norm.variance_epsilon, is_neox=True,
                                  mrope_section=rot.mrope_section if mrope_pos else None, mrope_interleaved=True)
            result = check_split_outputs((q, k, v), oracle, (wq, wk, wv), source, GATED_HQ, GATED_HKV, GATED_D)
            assert result.ok, result


def test_qwen3_5_layer_is_left_where_sglangs_own_kernel_runs(sglang_dist, monkeypatch):
    """Qwen3.5 on CUDA runs SGLang's fused_qk_gemma_rmsnorm_rope_gate (on HIP/XPU/CPU engines its fused
    norm+gate kernel): left to SGLang. On the base platform here its native prepare runs: fused."""
    from sglang.srt.models import qwen3_5

    layer = _gated_layer("qwen3.5")
    monkeypatch.setattr(qwen3_5, "_is_cuda", True)
    report = plugin.fuse_attention(layer, plugin.Options(attention=True), context_len=MAX_POS)
    assert report.fused == {} and "forward_prepare_native" not in layer.__dict__
    assert "fused_qk_gemma_rmsnorm_rope_gate kernel runs for this layer (_is_cuda)" in \
        report.reasons["Qwen3_5AttentionDecoderLayer"]


def test_gated_layer_with_untested_sglang_code_keeps_sglangs_code(sglang_dist, monkeypatch):
    monkeypatch.setitem(plugin.TESTED_SOURCES, "Qwen3HybridAttentionDecoderLayer.self_attention", ("0" * 16,))
    layer = _gated_layer("qwen3-next")
    report = plugin.fuse_model(torch.nn.ModuleList([layer]), plugin.Options(attention=True), context_len=MAX_POS)
    assert report.fused == {} and "forward_prepare_native" not in layer.__dict__
    assert report.reasons["Qwen3HybridAttentionDecoderLayer"].startswith(
        "Qwen3HybridAttentionDecoderLayer.self_attention differs from the SGLang versions"), report.reasons


# ------------------------------------------------------------------------------------------------------------
# Settings changed in place: SGLang's forwards read a norm's eps and the rotary settings on every call, so the
# fused prepare must re-bind when one changes value (the module and its tensors stay the same objects).
# ------------------------------------------------------------------------------------------------------------
def _mrope_section_in_place(layer):
    section = layer.rotary_emb.mrope_section
    if isinstance(section, list):
        section[:] = [20, 24, 20]  # the list the rotary module holds, edited in place
    else:
        layer.rotary_emb.mrope_section = (20, 24, 20)


SETTING_EDITS = {  # name -> (layer, edit, whether the layer stays fused)
    "q/k eps 0.5": ("qwen3", set_eps(0.5, "q_norm", "k_norm"), True),
    "q eps only (unequal eps)": ("qwen3", set_eps(0.5, "q_norm"), False),
    "glm-4.7 q/k eps 0.5": ("glm-4.7", set_eps(0.5, "q_norm", "k_norm"), True),
    "gptj rotation": ("qwen3", set_rotary(is_neox_style=False), True),
    "mrope section edited in place": ("qwen3-vl", _mrope_section_in_place, True),
    "mrope not interleaved": ("qwen3-vl", set_rotary(mrope_interleaved=False), True),
}


@pytest.mark.parametrize("what", list(SETTING_EDITS))
def test_settings_changed_in_place_are_followed(sglang_dist, what):
    """After a first call, a setting changed on both twins (same modules, same tensors): the fused prepare equals
    SGLang's own prepare on the edited layer (fused with the new setting, or SGLang's code where the layer no
    longer qualifies), and the edit changes SGLang's result (else the row proves nothing)."""
    name, edit, stays_fused = SETTING_EDITS[what]
    layer, reference = _layer(name), _layer(name)
    reference.load_state_dict(layer.state_dict())
    _fuse(layer)
    mrope = LAYERS[name][2] is not None and "mrope_section" in LAYERS[name][2]
    cases = [_positions(mrope, 7)] + ([_positions(False, 8)] if mrope else [])
    hidden = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(3))

    def run(target):
        with torch.inference_mode():
            return [torch.cat([t.reshape(T, -1) for t in _prepare(target, p, hidden)], dim=-1) for p in cases]

    before = run(reference)
    for got, want in zip(run(layer), before):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    for target in (layer, reference):
        edit(target)
    after = run(reference)
    assert not torch.allclose(after[0], before[0]), f"{what} does not change SGLang's result"
    for got, want in zip(run(layer), after):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6, msg=lambda m: f"{what}: {m}")
    assert (layer._qkvfuse.prep is not None) == stays_fused, what


@pytest.mark.parametrize("name", list(GATED))
def test_gated_layer_follows_its_norms_eps(sglang_dist, name):
    """Qwen3-Next's / Qwen3.5's gated prepare (Gemma q/k norms): q/k eps set to 0.5 after a first call is
    followed."""
    layer, reference = _gated_layer(name), _gated_layer(name)
    reference.load_state_dict(layer.state_dict())
    plugin.fuse_attention(layer, plugin.Options(attention=True), context_len=MAX_POS)
    positions = _positions(name == "qwen3.5", 1)
    hidden = torch.randn(T, 256, generator=torch.Generator().manual_seed(4))

    def run(target):
        with torch.inference_mode():
            return torch.cat([t.reshape(T, -1) for t in target.forward_prepare_native(positions, hidden)], dim=-1)

    torch.testing.assert_close(run(layer), run(reference), rtol=2e-6, atol=2e-6)
    before = run(reference)
    for target in (layer, reference):
        set_eps(0.5, "q_norm", "k_norm")(target)
    want = run(reference)
    assert not torch.allclose(want, before)
    torch.testing.assert_close(run(layer), want, rtol=2e-6, atol=2e-6)
    assert layer._qkvfuse.prep.config.eps == 0.5


def test_decoder_norm_follows_its_eps(sglang_dist):
    """The add_rmsnorm option's RMSNorm: eps set to 5 after a first call is followed, with and without a
    residual."""
    from sglang.srt.layers.layernorm import RMSNorm

    hidden = 256
    norm = RMSNorm(hidden, eps=1e-6)
    norm.weight.data = 1 + 0.3 * torch.randn(hidden, generator=torch.Generator().manual_seed(1))
    layer = types.SimpleNamespace(input_layernorm=RMSNorm(hidden, eps=1e-6),
                                  post_attention_layernorm=RMSNorm(hidden, eps=1e-6))
    layer.input_layernorm.weight.data = norm.weight.data.clone()
    report = plugin.Report()
    plugin._fuse_norms(layer, "Qwen3DecoderLayer", plugin.Options(add_rmsnorm=True), None, report)
    fused = layer.input_layernorm
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(T, hidden, generator=g), torch.randn(T, hidden, generator=g)

    def same():
        with torch.inference_mode():
            torch.testing.assert_close(fused(x.clone()), norm(x.clone()), rtol=2e-6, atol=2e-6)
            got, want = fused(x.clone(), r.clone()), norm(x.clone(), r.clone())
        torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
        assert torch.equal(got[1], want[1])
        return want[0]

    before = same()
    for target in (norm, fused):
        target.variance_epsilon = 5.0
    assert not torch.allclose(same(), before)
    assert fused._qkvfuse.bound.config.eps == 5.0


# ------------------------------------------------------------------------------------------------------------
# Every tensor a fused prepare returns has SGLang's shape and a layout SGLang's kernels read.
# ------------------------------------------------------------------------------------------------------------
def _split_views(qkv, sizes):
    """The strides of SGLang's own ``qkv.split`` views (what its fused QK-norm kernels return as q, k, v)."""
    return [t.stride() for t in qkv.split(sizes, dim=-1)]


def _assert_sglang_layout(got, want, split_strides, what):
    """Each returned tensor has SGLang's shape and innermost stride; where SGLang's own is contiguous, ours is too,
    unless it is one of the projection-output split views SGLang's own fused kernels hand on (q, k, v); a 3-D
    gate is a strided view as SGLang's (its ``fused_sigmoid_mul`` reads it by its strides)."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, (what, i)
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, (what, i, g.shape, w.shape)
        assert g.stride(-1) == w.stride(-1) == 1, (what, i, g.stride(), w.stride())
        if i < 3:
            assert g.stride() == w.stride() or g.stride() == split_strides[i], (what, i, g.stride(), w.stride())
        elif w.is_contiguous():
            assert g.is_contiguous(), (what, "gate", g.stride(), w.stride())


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe", "glm-4.7", "qwen3-vl"])
def test_fused_prepare_returns_sglangs_shapes_and_layouts(sglang_dist, no_kv_pool, name):
    layer = _layer(name)
    mrope = LAYERS[name][2] is not None and "mrope_section" in LAYERS[name][2]
    positions, hidden = _positions(mrope, 0), torch.randn(T, HIDDEN)
    with torch.inference_mode():
        qkv = layer.qkv_proj(hidden)[0]
        want = _prepare(layer, positions, hidden)
        _fuse(layer)
        got = _prepare(layer, positions, hidden)
    _assert_sglang_layout(got, want, _split_views(qkv, [layer.q_size, layer.kv_size, layer.kv_size]), name)


_SIGMOID_MUL = """
import json, sys, torch
from sglang.kernels.ops.elementwise.elementwise import fused_sigmoid_mul
saved = torch.load(sys.argv[1])
out = {}
for key in ("sglang", "fused"):
    gate, attn = saved[key], saved["attn"]
    want = attn * torch.sigmoid(gate.reshape(attn.shape).float())
    out[key] = [(fused_sigmoid_mul(attn, gate) - want).abs().max().item(), list(gate.stride())]
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", list(GATED))
def test_gated_prepare_returns_sglangs_layouts_and_fused_sigmoid_mul_reads_the_gate(sglang_dist, name, tmp_path):
    """The gated classes: shapes and layouts as SGLang's own prepare returns them, and SGLang's Triton
    ``fused_sigmoid_mul`` (its HIP gating kernel; under ``TRITON_INTERPRET=1`` on CPU) gives ``attn *
    sigmoid(gate)`` from the fused gate as from SGLang's own."""
    import json
    import os
    import subprocess
    import sys

    layer = _gated_layer(name)
    positions, hidden = _positions(name == "qwen3.5", 0), torch.randn(T, 256)
    with torch.inference_mode():
        qkv = layer.qkv_proj(hidden)[0]
        want = layer.forward_prepare_native(positions, hidden)
        plugin.fuse_attention(layer, plugin.Options(attention=True), context_len=MAX_POS)
        got = layer.forward_prepare_native(positions, hidden)
    # q too is a row of the projection output (at the row's start, the gate beside it): SGLang's own fused
    # kernels hand its non-gated layers' q, k, v to attention as such rows
    _assert_sglang_layout(got, want, _split_views(qkv, [2 * layer.q_size, layer.kv_size, layer.kv_size]), name)
    attn = torch.randn(T, GATED_HQ * GATED_D, generator=torch.Generator().manual_seed(9))
    path = tmp_path / "gates.pt"
    torch.save({"attn": attn, "sglang": want[3], "fused": got[3]}, path)  # views saved with their strides
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _SIGMOID_MUL, str(path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    assert errors["fused"][1] == list(got[3].stride()), errors  # the kernel saw the fused gate's layout
    assert errors["sglang"][0] < 1e-5 and errors["fused"][0] < 1e-5, errors


def test_tested_sources_command_prints_this_sglangs_hashes(capsys, monkeypatch):
    """``python -m qkvfuse.integrations.tested_sources`` in this venv: every guarded function with its hash here,
    all tested; a changed function reads NOT TESTED and fails ``--check``."""
    from qkvfuse.integrations import tested_sources

    assert tested_sources.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert "SGLang 0.5.23 (qkvfuse tested 0.5.23)\n" in out, out
    rows = [line.split() for line in out.split("SGLang 0.5.23", 1)[1].splitlines()[2:]]
    assert {row[0] for row in rows} == set(plugin.TESTED_SOURCES), out
    for name, digest, status in rows:
        assert status == "tested" and digest in plugin.TESTED_SOURCES[name], (name, out)
    monkeypatch.setitem(plugin.TESTED_SOURCES, "apply_qk_norm", ("0" * 16,))
    assert tested_sources.main(["--check"]) == 1
    assert "apply_qk_norm d896736d964d464b NOT TESTED" in [" ".join(line.split()) for line in
                                                         capsys.readouterr().out.splitlines()]
