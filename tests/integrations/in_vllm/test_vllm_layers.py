"""vLLM's own attention classes, built directly (no engine), fused by the plugin, and the
``verify`` option.

Covers what the tiny engines cannot run here: the language-model layers of Qwen3-VL (``Qwen3Attention`` with an
interleaved ``MRotaryEmbedding`` [24, 20, 20]) and GLM-4.5V (``Glm4MoeAttention`` without QK-norm, partial rotary,
sectioned mRoPE [8, 12, 12]) -- vLLM's Qwen3-VL / GLM-4.5V model modules import torchvision, whose only wheels here
are CUDA builds that fail to load beside a CPU torch. Positions are ``[3, T]`` with differing rows, as a strided
slice, and 1-D text positions. The attention kernel is replaced by a module that returns its ``(q, k, v)``, so the
fused forward is compared with vLLM's own forward on every element; ``torch.compile(fullgraph=True)`` traces the
fused forward without a graph break.
"""

import socket
import types

import pytest
import torch
from torch import nn

import qkvfuse
from qkvfuse.integrations import vllm as plugin

from _support.live_edits import set_eps, set_rotary

T = 11


class Capture(nn.Module):
    """Stands in for vLLM's ``Attention``: returns q, k, v side by side."""

    def forward(self, q, k, v):
        return torch.cat([q, k, v], dim=-1)


class Identity(nn.Module):
    def forward(self, x):
        return x, None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    config = VllmConfig()
    with set_current_vllm_config(config):
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_free_port()}", 0, "gloo")
            parallel_state.ensure_model_parallel_initialized(1, 1)
        yield config


_count = iter(range(10**6))


def _layer(kind: str, rope_parameters: dict, qk_norm: bool = True, dtype=torch.float32, head_dim: int = 128):
    """A vLLM attention layer (2 KV heads, 6 Q heads) with random weights; its ``attn`` (built as a
    :class:`Capture`: no attention backend is needed) and ``o_proj`` return their inputs."""
    from vllm.model_executor.models import glm4_moe, qwen3

    prefix = f"model.layers.{next(_count)}.self_attn"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qwen3, "Attention", lambda *args, **kwargs: Capture())
        mp.setattr(glm4_moe, "Attention", lambda *args, **kwargs: Capture())
        return _build(kind, rope_parameters, qk_norm, dtype, head_dim, prefix)


def _build(kind, rope_parameters, qk_norm, dtype, head_dim, prefix):
    if kind == "qwen3":
        from vllm.model_executor.models.qwen3 import Qwen3Attention

        layer = Qwen3Attention(hidden_size=96, num_heads=6, num_kv_heads=2, rope_parameters=rope_parameters,
                               max_position=512, head_dim=head_dim, prefix=prefix)
    else:
        from vllm.model_executor.models.glm4_moe import Glm4MoeAttention

        config = types.SimpleNamespace(rope_parameters=rope_parameters)
        layer = Glm4MoeAttention(config, hidden_size=96, num_heads=6, num_kv_heads=2, max_position_embeddings=512,
                                 head_dim=head_dim, qkv_bias=True, use_qk_norm=qk_norm, prefix=prefix)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.2) + (1 if p.dim() == 1 else 0))
    layer = layer.to(dtype)
    layer.qkv_proj.quant_method.process_weights_after_loading(layer.qkv_proj)  # what vLLM's loader does last
    layer.o_proj = Identity()
    return layer.eval()


LAYERS = {
    "qwen3-vl": ("qwen3", {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                           "mrope_interleaved": True}, True),
    "glm-4.5v": ("glm", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                         "mrope_section": [8, 12, 12]}, False),
    "glm-4.7": ("glm", {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}, True),
    "qwen3-yarn": ("qwen3", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                             "original_max_position_embeddings": 128}, True),
}


def _positions(mrope: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if not mrope:
        return torch.randint(0, 512, (T,), generator=g)
    return torch.randint(0, 512, (3, T + 5), generator=g)[:, 3 : T + 3]  # rows differ; a strided slice


def _fused(layer, vllm_config, verify=False):
    report = plugin.Report()
    plugin._fuse_attention(layer, type(layer).__name__, vllm_config, plugin.Options(attention=True, verify=verify),
                           None, report)
    assert report.fused == {type(layer).__name__: 1}, report.lines()
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_fused_forward_matches_vllms_forward(vllm_config, name, dtype):
    kind, rope, qk_norm = LAYERS[name]
    layer = _layer(kind, rope, qk_norm, dtype)
    mrope = "mrope_section" in rope
    cases = [_positions(mrope, s) for s in range(2)] + ([_positions(False, 5)] if mrope else [])  # + text-only
    hidden = [torch.randn(T, 96, generator=torch.Generator().manual_seed(s)).to(dtype) for s in range(len(cases))]
    with torch.inference_mode():
        want = [type(layer).forward(layer, p, h) for p, h in zip(cases, hidden)]
        _fused(layer, vllm_config)
        got = [layer(p, h) for p, h in zip(cases, hidden)]
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=3e-6, atol=3e-6)
        else:  # one bf16 rounding (qkvfuse) against vLLM's chain of them: within a couple of bf16 ulps
            torch.testing.assert_close(g, w, rtol=2 ** -6, atol=2 ** -6)


@pytest.mark.parametrize("name", ["qwen3-vl", "glm-4.7"])
def test_fused_forward_compiles_without_graph_breaks(vllm_config, name):
    kind, rope, qk_norm = LAYERS[name]
    layer = _fused(_layer(kind, rope, qk_norm), vllm_config)
    positions, hidden = _positions("mrope_section" in rope), torch.randn(T, 96)
    torch._dynamo.reset()
    with torch.inference_mode():
        eager = layer(positions, hidden)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(positions, hidden)
    assert torch.equal(compiled, eager)


def test_verify_option_passes_and_catches_a_wrong_result(vllm_config, monkeypatch):
    kind, rope, qk_norm = LAYERS["qwen3-vl"]
    layer = _fused(_layer(kind, rope, qk_norm, torch.bfloat16), vllm_config, verify=True)
    positions, hidden = _positions(True), torch.randn(T, 96).to(torch.bfloat16)
    with torch.inference_mode():
        layer(positions, hidden)  # within the accuracy rule
        state = layer._qkvfuse
        original = state.prep.inplace

        def off_by_a_bit(qkv, pos):
            q, k, v = original(qkv, pos)
            q[0, 0] += 0.25 * q[0, 0].abs() + 0.01
            return q, k, v

        monkeypatch.setattr(type(state.prep), "inplace", lambda self, qkv, pos: off_by_a_bit(qkv, pos))
        with pytest.raises(RuntimeError, match="qkvfuse verify: Qwen3Attention"):
            layer(positions, hidden)


# ------------------------------------------------------------------------------------------------------------
# A layer changed after fusing: the fused forward reads what vLLM's forward reads at that call.
# ------------------------------------------------------------------------------------------------------------
def _twin_layers(vllm_config, name="glm-4.7", dtype=torch.float32):
    """``(reference, fused)``: one vLLM layer and a deep copy of it fused by the plugin (after one call)."""
    import copy

    kind, rope, qk_norm = LAYERS[name]
    ref = _layer(kind, rope, qk_norm, dtype)
    fused = _fused(copy.deepcopy(ref), vllm_config)
    return ref, fused


def _check_same(ref, fused, seed, what, max_position=512):
    g = torch.Generator().manual_seed(seed)
    positions, hidden = torch.randint(0, max_position, (T,), generator=g), torch.randn(T, 96, generator=g)
    with torch.inference_mode():
        want = type(ref).forward(ref, positions, hidden)
        got = fused(positions, hidden)
    torch.testing.assert_close(got, want, rtol=3e-6, atol=3e-6, msg=lambda m: f"{what}: {m}")
    prep = fused._qkvfuse.prep
    if prep is not None:  # no recorded memory ranges to go stale: the kernels check each call's tensors
        assert not any("span" in field for field in type(prep.config)._fields), what
    return want


def _new_table(rot, base, rows=None):
    old = rot.base
    rot.base = base
    table = rot._compute_cos_sin_cache().to(rot.cos_sin_cache.dtype)
    rot.base = old
    return table[:rows].clone() if rows else table


def _edit_q_norm_data(layer):
    layer.q_norm.weight.data = layer.q_norm.weight.data * 1.5 + 0.1


def _edit_table_data(layer):
    layer.rotary_emb.cos_sin_cache.data = _new_table(layer.rotary_emb, 5e3)


def _edit_replace_rotary(layer):
    import copy

    rot = copy.deepcopy(layer.rotary_emb)
    rot.cos_sin_cache = _new_table(rot, 2e4)
    layer.rotary_emb = rot


def _edit_apply_then_update(layer):
    layer._apply(lambda t: t.clone())
    with torch.no_grad():
        layer.k_norm.weight.mul_(0.5)
        layer.rotary_emb.cos_sin_cache.mul_(0.9)


def _edit_replace_q_norm(layer):
    import copy

    norm = copy.deepcopy(layer.q_norm)
    with torch.no_grad():
        norm.weight.add_(0.3)
    layer.q_norm = norm


LAYER_EDITS = {"q_norm.weight.data = new": _edit_q_norm_data, "cos_sin_cache.data = new": _edit_table_data,
               "rotary_emb replaced": _edit_replace_rotary, "_apply(clone), then in place": _edit_apply_then_update,
               "q_norm replaced by a new RMSNorm": _edit_replace_q_norm}


def test_layer_edits_are_followed(vllm_config):
    """Each edit on both twins in turn: the fused layer equals vLLM's forward on the edited layer, takes the fused
    path, and its bound op's recorded memory ranges are the current tensors'."""
    ref, fused = _twin_layers(vllm_config)
    before = _check_same(ref, fused, 0, "before")
    for i, (what, edit) in enumerate(LAYER_EDITS.items()):
        for layer in (ref, fused):
            edit(layer)
        after = _check_same(ref, fused, 0, what)
        assert not torch.allclose(after, before), f"{what} does not change the output"
        assert fused._qkvfuse.prep is not None, what
        before = after


def test_a_freed_and_reused_table_address_is_not_an_overlap(vllm_config):
    """An engine death seen once: ``cos_sin_cache.data = new`` frees the old table, whose memory later holds the
    projection output. Made deterministic: qkv_proj writes into the old table's memory. Re-bound on the swap, the
    fused op compares qkv with the table it reads now (no stale byte range), and the result is vLLM's."""
    ref, fused = _twin_layers(vllm_config)
    _check_same(ref, fused, 0, "before")
    for layer in (ref, fused):
        old = layer.rotary_emb.cos_sin_cache.data
        layer.rotary_emb.cos_sin_cache.data = _new_table(layer.rotary_emb, 5e3)
        proj = layer.qkv_proj

        class IntoOldTable(nn.Module):
            def forward(self, x, proj=proj, old=old):
                out, bias = proj(x)
                reused = old.view(-1)[: out.numel()].view_as(out)
                reused.copy_(out)
                return reused, bias

        layer.qkv_proj = IntoOldTable()
    _check_same(ref, fused, 1, "qkv in the freed table's memory")


def test_a_layer_that_stops_qualifying_runs_vllms_code(vllm_config, monkeypatch):
    """A table shorter than max_model_len, or a rotary class qkvfuse does not reproduce, put in place at run time:
    vLLM's forward for that layer (equal to the reference), one log line; a qualifying table brings the fused
    path back."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    messages = []
    monkeypatch.setattr(plugin, "_logged", set())
    monkeypatch.setattr(plugin, "_log_once", messages.append)
    ref, fused = _twin_layers(vllm_config)
    fused._qkvfuse.max_model_len = 512
    _check_same(ref, fused, 0, "before")
    for layer in (ref, fused):
        layer.rotary_emb.cos_sin_cache.data = _new_table(layer.rotary_emb, 5e3, rows=300)
    _check_same(ref, fused, 2, "a 300-row table", max_position=300)  # where vLLM's own rotation is defined
    assert fused._qkvfuse.prep is None
    assert any("its rotary table has 300 rows, fewer than max_model_len 512" in m for m in messages), messages
    for layer in (ref, fused):
        layer.rotary_emb.cos_sin_cache.data = _new_table(layer.rotary_emb, 5e3)
    _check_same(ref, fused, 3, "a full table again")
    assert fused._qkvfuse.prep is not None

    class OwnRotation(RotaryEmbedding):
        def forward_native(self, positions, query, key=None):
            return super().forward_native(positions, query * 2, key)

        forward_cpu = forward_native

    for layer in (ref, fused):
        rot = layer.rotary_emb
        layer.rotary_emb = OwnRotation(rot.head_size, rot.rotary_dim, rot.max_position_embeddings, rot.base,
                                       rot.is_neox_style, rot.cos_sin_cache.dtype)
    _check_same(ref, fused, 4, "a rotary class that is not reproduced")
    assert fused._qkvfuse.prep is None
    assert any("rotary module OwnRotation is not one qkvfuse reproduces" in m for m in messages), messages


def test_decoder_norm_follows_data_swaps(vllm_config):
    """The add_rmsnorm option's RMSNorm: ``weight.data = new`` and ``_apply`` are seen (re-bound)."""
    import copy

    from vllm.model_executor.layers.layernorm import RMSNorm

    ref = RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.1 * torch.randn(96, generator=torch.Generator().manual_seed(1)))
    fused = copy.deepcopy(ref)
    fused._qkvfuse = plugin._Norm(fused, None)
    fused.forward = types.MethodType(plugin._fused_norm_forward, fused)

    def same(seed):
        g = torch.Generator().manual_seed(seed)
        x, r = torch.randn(T, 96, generator=g), torch.randn(T, 96, generator=g)
        with torch.inference_mode():
            want = ref(x.clone(), r.clone())
            got = fused(x.clone(), r.clone())
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        return want[0]

    first = same(0)
    for edit in (lambda n: setattr(n.weight, "data", n.weight.data * 2 - 0.5),
                 lambda n: (n._apply(lambda t: t.clone()), n.weight.data.mul_(0.25))):
        for norm in (ref, fused):
            edit(norm)
        assert not torch.allclose(same(0), first)
        bound = fused._qkvfuse.bound
        assert bound.config.weight.data_ptr() == fused.weight.data_ptr()


# ------------------------------------------------------------------------------------------------------------
# Gated attention: Qwen3NextAttention, the full-attention layer of Qwen3-Next and (built by vLLM's
# qwen3_5.py, which imports torchvision and cannot load here) Qwen3.5 / Qwen3.5-MoE with interleaved mRoPE.
# ------------------------------------------------------------------------------------------------------------
GATED = {
    "qwen3-next": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "qwen3.5": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}


class Seen(nn.Module):
    """Stands in for vLLM's ``Attention`` of a gated layer: records ``(q, k, v)`` and returns ``q`` (the forward
    then multiplies it by ``sigmoid(gate)``)."""

    def forward(self, q, k, v):
        self.seen = (q.clone(), k.clone(), v.clone())
        return q.clone()


def _gated_layer(rope_parameters: dict, dtype=torch.float32):
    """vLLM's ``Qwen3NextAttention`` (6 Q heads, 2 KV heads of 256, Gemma q/k norms with weights around 0) with
    random weights; its ``attn`` a :class:`Seen`, its ``o_proj`` the identity."""
    from vllm.model_executor.models import qwen3_next

    config = types.SimpleNamespace(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=256,
                                   rms_norm_eps=1e-6, max_position_embeddings=512, rope_parameters=rope_parameters)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qwen3_next, "Attention", lambda *args, **kwargs: Seen())
        layer = qwen3_next.Qwen3NextAttention(config, prefix=f"model.layers.{next(_count)}.self_attn")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():  # norm weights centred at 0, as Gemma-style checkpoints store them
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.2))
    layer = layer.to(dtype)
    layer.qkv_proj.quant_method.process_weights_after_loading(layer.qkv_proj)
    layer.o_proj = Identity()
    return layer.eval()


def _gated_fused(layer, vllm_config, verify=False):
    report = plugin.Report()
    plugin._fuse_attention(layer, "Qwen3NextAttention", vllm_config,
                           plugin.Options(attention=True, verify=verify), None, report)
    assert report.fused == {"Qwen3NextAttention": 1}, report.lines()
    return layer, report


def _gated_runs(layer, cases, hidden):
    """``[(output, (q, k, v))]`` of the layer's forward for each ``(positions, hidden)``."""
    out = []
    for p, h in zip(cases, hidden):
        y = layer(p, h)
        out.append((y, layer.attn.seen))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(GATED))
def test_gated_fused_forward_matches_vllms_forward(vllm_config, monkeypatch, name, dtype):
    """One bound ``QKNormRope(q_gate=True, gemma_norm=True)`` call per forward: output (attention times
    ``sigmoid(gate)``) and the q, k, v given to attention equal vLLM's own ``_project_qkv_gate`` path (fp32 within
    2e-6; bf16: every call passes the ``verify`` option's accuracy rule against a float64 oracle and vLLM's path,
    gate bit-exact, and the output is within a couple of bf16 ulps)."""
    rope = GATED[name]
    layer = _gated_layer(rope, dtype)
    mrope = "mrope_section" in rope
    cases = [_positions(mrope, s) for s in range(2)] + ([_positions(False, 5)] if mrope else [])  # + text-only
    hidden = [torch.randn(T, 96, generator=torch.Generator().manual_seed(s)).to(dtype) for s in range(len(cases))]
    calls, inplace = [], qkvfuse.QKNormRope.inplace
    monkeypatch.setattr(qkvfuse.QKNormRope, "inplace", lambda self, *a: calls.append(1) or inplace(self, *a))
    with torch.inference_mode():
        want = [(type(layer).forward(layer, p, h), layer.attn.seen) for p, h in zip(cases, hidden)]
        _, report = _gated_fused(layer, vllm_config, verify=dtype == torch.bfloat16)
        got = _gated_runs(layer, cases, hidden)
    assert len(calls) == len(cases)  # the fused path ran, once per forward
    detail = report.details["Qwen3NextAttention"]
    assert detail.endswith("rotary 64, neox" + (", mrope [11, 11, 10] interleaved" if mrope else "")), detail
    assert layer._qkvfuse.prep.config.q_gate and layer._qkvfuse.prep.config.gemma_norm
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2 ** -6)
    for (y, seen), (y_ref, seen_ref) in zip(got, want):
        assert torch.isfinite(y).all()
        for a, b in zip((y, *seen), (y_ref, *seen_ref)):
            torch.testing.assert_close(a, b, **tol)
        assert torch.equal(seen[2], seen_ref[2])  # v: a bit-exact view


def test_gated_verify_catches_a_wrong_gate(vllm_config, monkeypatch):
    layer, _ = _gated_fused(_gated_layer(GATED["qwen3.5"], torch.bfloat16), vllm_config, verify=True)
    state = layer._qkvfuse
    original = state.prep.inplace

    def wrong_gate(self, qkv, pos):
        q, k, v, gate = original(qkv, pos)
        gate[0, 0] += 1
        return q, k, v, gate

    monkeypatch.setattr(type(state.prep), "inplace", wrong_gate)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="fused gate is not a bit-exact copy"):
        layer(_positions(True), torch.randn(T, 96).to(torch.bfloat16))


def test_gated_fused_forward_compiles_without_graph_breaks(vllm_config):
    layer, _ = _gated_fused(_gated_layer(GATED["qwen3.5"]), vllm_config)
    positions, hidden = _positions(True), torch.randn(T, 96)
    torch._dynamo.reset()
    with torch.inference_mode():
        eager = layer(positions, hidden)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(positions, hidden)
    assert torch.equal(compiled, eager)


def test_gated_layer_is_left_where_vllms_own_kernel_runs(vllm_config):
    """On CUDA/XPU (NeoX, fp16/bf16 table, text-only or interleaved mRoPE) vLLM's ``fused_qk_rmsnorm_rope_gate``
    runs (its ``use_fused_qk_norm_rope_gate``): the plugin leaves the layer to it. Elsewhere (CPU here) it fuses."""
    layer = _gated_layer(GATED["qwen3.5"])
    assert layer.use_fused_qk_norm_rope_gate is False  # a CPU platform: vLLM's kernel does not run
    layer.use_fused_qk_norm_rope_gate = True  # what vLLM's rule gives on a CUDA platform
    report = plugin.Report()
    plugin._fuse_attention(layer, "Qwen3NextAttention", vllm_config, plugin.Options(attention=True), None, report)
    assert report.fused == {} and "forward" not in layer.__dict__
    assert "vLLM's own fused_qk_rmsnorm_rope_gate kernel runs for this layer" in report.reasons["Qwen3NextAttention"]


def test_gated_layer_with_untested_vllm_code_keeps_vllms_code(vllm_config, monkeypatch):
    """``fuse_model`` on a model holding the layer: a ``_project_qkv_gate`` whose source hash is not a tested
    one leaves the layer to vLLM (its forward bit-identical), with the reason in the report."""
    layer = _gated_layer(GATED["qwen3-next"])
    positions, hidden = _positions(False), torch.randn(T, 96)
    monkeypatch.setitem(plugin.TESTED_SOURCES, "Qwen3NextAttention._project_qkv_gate", ("0" * 16,))
    monkeypatch.setattr(vllm_config, "additional_config",
                        {"qkvfuse": {"attention": True}})
    with torch.inference_mode():
        want = type(layer).forward(layer, positions, hidden)
        report = plugin.fuse_model(nn.ModuleList([layer]), vllm_config)
        got = layer(positions, hidden)
    assert report.fused == {} and "forward" not in layer.__dict__ and torch.equal(got, want)
    assert report.reasons["Qwen3NextAttention"].startswith("Qwen3NextAttention._project_qkv_gate differs from the "
                                                           "vLLM versions"), report.reasons


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemma_decoder_norm_matches_vllms(vllm_config, dtype):
    """The ``add_rmsnorm`` option on a Qwen3-Next decoder norm (``GemmaRMSNorm``: ``1 + w`` in fp32): qkvfuse's
    ``AddRMSNorm(gemma_norm=True)`` equals vLLM's, with and without a residual; the residual bit-exact."""
    import copy

    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    ref = GemmaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(0.1 * torch.randn(96, generator=torch.Generator().manual_seed(1)))
    ref = ref.to(dtype)
    fused = copy.deepcopy(ref)
    assert plugin._norm_reason(fused, vllm_config, None) is None
    fused._qkvfuse = plugin._Norm(fused, None)
    fused.forward = types.MethodType(plugin._fused_norm_forward, fused)
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(T, 96, generator=g).to(dtype), torch.randn(T, 96, generator=g).to(dtype)
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x.clone()), ref(x.clone()), **tol)
        got, want = fused(x.clone(), r.clone()), ref(x.clone(), r.clone())
    torch.testing.assert_close(got[0], want[0], **tol)
    assert torch.equal(got[1], want[1])
    assert fused._qkvfuse.bound.config.gemma_norm


def test_tested_sources_are_this_vllms():
    """Every hash in TESTED_SOURCES is the installed vLLM's (0.32.0). qwen3_5.py cannot be imported here (it
    imports torchvision): its decoder layer's forward is Qwen3NextDecoderLayer's, inherited."""
    found = {}
    for module in ("qwen3", "qwen3_moe", "glm4_moe", "qwen3_next"):
        found.update(plugin._vllm_sources(module))
    assert set(plugin.TESTED_SOURCES) - set(found) == {"Qwen3_5DecoderLayer.forward"}
    tested = plugin.TESTED_SOURCES
    assert tested["Qwen3_5DecoderLayer.forward"] == tested["Qwen3NextDecoderLayer.forward"]
    for name, fn in found.items():
        assert plugin.source_hash(fn) in plugin.TESTED_SOURCES[name], name


# ------------------------------------------------------------------------------------------------------------
# Settings changed in place: vLLM's forwards read a norm's eps and the rotary settings on every call, so the
# fused forward must re-bind when one changes value (the module and its tensors stay the same objects).
# ------------------------------------------------------------------------------------------------------------
def _mrope_section_in_place(layer):
    layer.rotary_emb.mrope_section[:] = [20, 24, 20]  # the list the rotary module holds, edited in place


SETTING_EDITS = {  # name -> (layer, edit, whether the layer stays fused)
    "q/k eps 0.5": ("glm-4.7", set_eps(0.5, "q_norm", "k_norm"), True),
    "q eps only (unequal eps)": ("glm-4.7", set_eps(0.5, "q_norm"), False),
    "gptj rotation": ("glm-4.7", set_rotary(is_neox_style=False), True),
    "mrope section edited in place": ("qwen3-vl", _mrope_section_in_place, True),
    "mrope not interleaved": ("qwen3-vl", set_rotary(mrope_interleaved=False), True),
    "qwen3-vl q/k eps 0.5": ("qwen3-vl", set_eps(0.5, "q_norm", "k_norm"), True),
}


@pytest.mark.parametrize("what", list(SETTING_EDITS))
def test_settings_changed_in_place_are_followed(vllm_config, what):
    """After a first call, a setting changed on both twins (same modules, same tensors): the fused layer equals
    vLLM's forward on the edited layer (fused with the new setting, or vLLM's code where the layer no longer
    qualifies), and the edit changes vLLM's output (else the row proves nothing)."""
    name, edit, stays_fused = SETTING_EDITS[what]
    ref, fused = _twin_layers(vllm_config, name)
    mrope = "mrope_section" in LAYERS[name][1]
    cases = [_positions(mrope, 7)] + ([_positions(False, 8)] if mrope else [])
    hidden = torch.randn(T, 96, generator=torch.Generator().manual_seed(3))

    def run(layer):
        with torch.inference_mode():
            return [layer(p, hidden) if layer is fused else type(layer).forward(layer, p, hidden) for p in cases]

    before = run(ref)
    for got, want in zip(run(fused), before):
        torch.testing.assert_close(got, want, rtol=3e-6, atol=3e-6)
    for layer in (ref, fused):
        edit(layer)
    after = run(ref)
    assert not torch.allclose(after[0], before[0]), f"{what} does not change vLLM's output"
    for got, want in zip(run(fused), after):
        torch.testing.assert_close(got, want, rtol=3e-6, atol=3e-6, msg=lambda m: f"{what}: {m}")
    assert (fused._qkvfuse.prep is not None) == stays_fused, what


def test_gated_layer_follows_its_norms_eps(vllm_config):
    """Qwen3.5's gated attention (Gemma q/k norms): q/k eps set to 0.5 after a first call is followed."""
    import copy

    ref = _gated_layer(GATED["qwen3.5"])
    fused, _ = _gated_fused(copy.deepcopy(ref), vllm_config)
    positions, hidden = _positions(True, 1), torch.randn(T, 96, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        torch.testing.assert_close(fused(positions, hidden), type(ref).forward(ref, positions, hidden),
                                   rtol=2e-6, atol=2e-6)
        before = type(ref).forward(ref, positions, hidden)
        for layer in (ref, fused):
            set_eps(0.5, "q_norm", "k_norm")(layer)
        want = type(ref).forward(ref, positions, hidden)
        got = fused(positions, hidden)
    assert not torch.allclose(want, before)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert fused._qkvfuse.prep.config.eps == 0.5


@pytest.mark.parametrize("kind", ["RMSNorm", "GemmaRMSNorm"])
def test_decoder_norm_follows_its_eps(vllm_config, kind):
    """The add_rmsnorm option's norms (plain and Gemma): eps set to 5 after a first call is followed, with and
    without a residual."""
    import copy

    from vllm.model_executor.layers import layernorm

    ref = getattr(layernorm, kind)(96, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(0.1 * torch.randn(96, generator=torch.Generator().manual_seed(1))
                         + (1 if kind == "RMSNorm" else 0))
    fused = copy.deepcopy(ref)
    fused._qkvfuse = plugin._Norm(fused, None)
    fused.forward = types.MethodType(plugin._fused_norm_forward, fused)
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(T, 96, generator=g), torch.randn(T, 96, generator=g)

    def same():
        with torch.inference_mode():
            torch.testing.assert_close(fused(x.clone()), ref(x.clone()), rtol=2e-6, atol=2e-6)
            got, want = fused(x.clone(), r.clone()), ref(x.clone(), r.clone())
        torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
        assert torch.equal(got[1], want[1])
        return want[0]

    before = same()
    for norm in (ref, fused):
        norm.variance_epsilon = 5.0
    assert not torch.allclose(same(), before)
    assert fused._qkvfuse.bound.config.eps == 5.0


def test_compiled_fused_forward_follows_eps(vllm_config):
    """Under torch.compile the fused forward reads the norms' eps as the trace does (dynamo guards on it): a
    changed eps retraces and equals vLLM's forward."""
    ref, fused = _twin_layers(vllm_config, "glm-4.7")
    positions, hidden = _positions(False, 2), torch.randn(T, 96, generator=torch.Generator().manual_seed(5))
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        torch.testing.assert_close(compiled(positions, hidden), type(ref).forward(ref, positions, hidden),
                                   rtol=3e-6, atol=3e-6)
        for layer in (ref, fused):
            set_eps(0.5, "q_norm", "k_norm")(layer)
        torch.testing.assert_close(compiled(positions, hidden), type(ref).forward(ref, positions, hidden),
                                   rtol=3e-6, atol=3e-6)


# ------------------------------------------------------------------------------------------------------------
# Every tensor the fused forward hands to vLLM's code has vLLM's shape and a layout vLLM's kernels read.
# ------------------------------------------------------------------------------------------------------------
class Handed(nn.Module):
    """Stands in for vLLM's ``Attention``: keeps the q, k, v it is given (the tensors themselves, for their
    layout) and returns q (a gated forward multiplies it by ``sigmoid(gate)``)."""

    def forward(self, q, k, v):
        self.handed = (q, k, v)
        return q.clone()


@pytest.mark.parametrize("name", ["glm-4.7", "qwen3-vl", "qwen3-next", "qwen3.5"])
def test_fused_forward_hands_vllms_shapes_and_layouts_to_attention(vllm_config, name):
    """q, k, v given to vLLM's attention: vLLM's shapes and dtypes, the last dimension contiguous, and strides as
    vLLM's own forward gives them or as rows of the projection output (the ``qkv.split`` views vLLM's own
    Qwen3 / GLM forward hands on). The gate never leaves the fused forward (``attn * sigmoid(gate)`` there)."""
    gated = name in GATED
    layer = _gated_layer(GATED[name]) if gated else _layer(*LAYERS[name])
    layer.attn = Handed()
    positions = _positions("mrope_section" in (GATED[name] if gated else LAYERS[name][1]), 0)
    hidden = torch.randn(T, 96, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        qkv = layer.qkv_proj(hidden)[0]
        type(layer).forward(layer, positions, hidden)
        want = layer.attn.handed
        (_gated_fused(layer, vllm_config) if gated else _fused(layer, vllm_config))
        layer(positions, hidden)
        got = layer.attn.handed
    q_cols = 2 * layer.q_size if gated else layer.q_size
    rows = [t.stride() for t in qkv.split([q_cols, layer.kv_size, layer.kv_size], dim=-1)]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, i, g.shape, w.shape)
        assert g.stride(-1) == w.stride(-1) == 1, (name, i)
        assert g.stride() == w.stride() or g.stride() == rows[i], (name, i, g.stride(), w.stride())


def test_tested_sources_command_prints_this_vllms_hashes(capsys, monkeypatch):
    """``python -m qkvfuse.integrations.tested_sources`` in this venv: every guarded function with its hash here,
    all tested (Qwen3.5's module does not import here: listed as unreadable); a changed function reads NOT TESTED
    and fails ``--check``."""
    from qkvfuse.integrations import tested_sources

    assert tested_sources.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("vLLM 0.32.0 (qkvfuse tested 0.32.0)\n"), out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[3:] if line.startswith("  ")}
    assert set(rows) == set(plugin.TESTED_SOURCES), out
    for name, (digest, *status) in rows.items():
        if name == "Qwen3_5DecoderLayer.forward":
            assert status == ["unreadable", "here"], out
        else:
            assert status == ["tested"] and digest in plugin.TESTED_SOURCES[name], (name, out)
    monkeypatch.setitem(plugin.TESTED_SOURCES, "Qwen3Attention.forward", ("0" * 16,))
    assert tested_sources.main(["--check"]) == 1
    assert "Qwen3Attention.forward 0cd83a1ca6e0b9d9 NOT TESTED" in [" ".join(line.split()) for line in
                                                                    capsys.readouterr().out.splitlines()]
