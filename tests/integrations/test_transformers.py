"""apply_qkvfuse on transformers' own modeling code: tiny random-weight models, patched vs unpatched.

Every family (Qwen3, Qwen3-MoE, Qwen3-VL with an image, GLM-4.7, GLM-4.5-Air, GLM-4.5V with an
image), GLM-4.6V and Qwen3-VL-MoE (with an image), and the gated-attention families (Qwen3-Next,
Qwen3.5 with an image, Qwen3.5-MoE: 3 Gated DeltaNet layers + 1 full-attention layer) is checked with the
harness of ``qkvfuse._verify.models`` (the same checks ``verify`` prints) and the tolerances of
``qkvfuse.testing.accuracy``:

* fp32 prefill logits within MODEL_FP32_LOGIT_RTOL (1e-4) of max|unpatched logits|;
* fp32 greedy generation of 24 tokens with the KV cache: identical tokens, every step's logits within 1e-4
  (dynamic cache for every family, static cache for Qwen3-VL and GLM-4.7);
* bf16 prefill: against the same weights in float64, patched RMS error <= 1.10 x the unpatched bf16 model's
  and max error <= 2 x;
* a left-padded batch of two prompts of lengths 9 and 5 matches each prompt run alone;
* remove_qkvfuse restores bit-identical logits.

MoE routing is pinned by the builders (GLM: correction-bias ladder; Qwen3-MoE: top-k = all experts) so a
near-tie cannot flip an expert between two correct runs (the other softmax routers alike). Models run on one
thread (5-20x less CPU here). The backend is whatever the public ops pick (the native CPU kernel when it builds;
QKVFUSE_BACKEND honoured), plus one pass over every fast backend for the trickiest layouts; a gated family on a
backend whose gated kernel has not landed yet is skipped with that backend's message (``conftest.py``).
"""

import dataclasses
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from qkvfuse._verify import models as vm
from qkvfuse.testing.accuracy import MODEL_FP32_LOGIT_RTOL
from qkvfuse._verify.tiny_models import (TINY_MODELS, attention_layers, build_tiny_model, image_token_count,
                                         tiny_config, tiny_image_prompt, tiny_prompt)
from qkvfuse.integrations import transformers as hf
from qkvfuse.presets import get_preset

FAMILIES = list(TINY_MODELS)
IMAGE_FAMILIES = [name for name, spec in TINY_MODELS.items() if spec.image]
GATED_FAMILIES = [name for name, spec in TINY_MODELS.items() if spec.gated]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with vm.single_thread():
        yield


@pytest.fixture
def position_spy(monkeypatch):
    """Every ``positions`` tensor the patched attention layers hand to the fused op, in call order."""
    seen = []
    flat = hf._flat_positions

    def spy(captured, batch, seq, mrope):
        out = flat(captured, batch, seq, mrope)
        seen.append((captured.clone(), out.clone()))
        return out

    monkeypatch.setattr(hf, "_flat_positions", spy)
    return seen


def _layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


# ------------------------------------------------------------------------------------------------------------
# Logits to logits, every family.
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_fp32_matches_unpatched(name, op_calls):
    model = build_tiny_model(name)
    report = vm.check_prefill(name, model=model)
    assert report, report.detail
    # One fused prepare and one fused add+norm per decoder layer, for the one patched forward.
    assert op_calls == {"split": attention_layers(model), "norm": _layers(model)}


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generation_fp32_identical(name):
    report = vm.check_generation(name, new_tokens=24)
    assert report.tokens_identical, report.detail
    assert report, report.detail


@pytest.mark.parametrize("name", ["Qwen3-VL", "GLM-4.7"])
def test_greedy_generation_with_static_cache(name):
    report = vm.check_generation(name, new_tokens=12, cache_implementation="static")
    assert report, report.detail


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_no_worse_than_unpatched_against_float64(name):
    report = vm.check_bf16(name)
    assert report, report.detail


@pytest.mark.parametrize("name", FAMILIES)
def test_padded_batch_matches_each_prompt_alone(name):
    report = vm.check_padded_batch(name, lengths=(9, 5))
    assert report, report.detail


@pytest.mark.parametrize("name", FAMILIES)
def test_remove_restores_bit_identical_outputs(name):
    report = vm.check_undo(name)
    assert report, report.detail


@pytest.mark.parametrize("name", ["Qwen3", "GLM-4.7", "Qwen3.5"])
def test_torch_compile_right_after_apply_and_of_a_deep_copy(name):
    """``torch.compile(model, fullgraph=True)`` as the first thing after ``apply_qkvfuse`` (no eager forward), and
    of a ``copy.deepcopy`` of the patched model: the cos/sin table exists before tracing (building it cannot be
    traced), one compile serves three prompt lengths (dynamic), and the logits are the eager patched model's."""
    import copy

    model = build_tiny_model(name)
    hf.apply_qkvfuse(model)
    for target in (model, copy.deepcopy(model)):
        compiles = []

        def counting(gm, example_inputs):
            compiles.append(gm)
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(target, backend=counting, fullgraph=True, dynamic=True)
        with torch.no_grad():
            for length in (5, 9, 13):
                ids = tiny_prompt(1, length, seed=length)
                got = compiled(ids).logits
                torch.testing.assert_close(got, target(ids).logits, rtol=0, atol=0)
        assert len(compiles) == 1, f"{len(compiles)} compiles"
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["Qwen3-VL", "GLM-4.7"])
def test_torch_compile_of_a_patched_model(name):
    """``torch.compile(model, fullgraph=True)`` after ``apply_qkvfuse``: one graph holding every layer's fused
    ops (the patch adds no graph break), inductor's logits equal the eager patched model's, which equal the
    unpatched model's; projection weights replaced after compiling are used (a recompile, not stale views)."""
    model = build_tiny_model(name)
    ids = tiny_prompt(2, 7)
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    with torch.no_grad():
        unpatched = model(ids).logits
        hf.apply_qkvfuse(model)
        eager = model(ids).logits
        torch._dynamo.reset()
        torch.compile(model, backend=recording_backend, fullgraph=True)(ids)
        torch._dynamo.reset()
        compiled_model = torch.compile(model, fullgraph=True)
        compiled = compiled_model(ids).logits
        attn = next(m for m in model.modules() if "self_attn" in m._modules).self_attn
        attn.v_proj.weight = nn.Parameter(attn.v_proj.weight * 1.5)  # V: no QK-norm to undo the scale
        changed_eager = model(ids).logits
        changed_compiled = compiled_model(ids).logits
        torch._dynamo.reset()
    assert len(graphs) == 1, f"{len(graphs)} graphs"
    assert sum("qkvfuse.split_qkv_rmsnorm_rope" in t for t in graphs[0]) == attention_layers(model), graphs[0]
    assert sum("qkvfuse.add_rmsnorm" in t for t in graphs[0]) == _layers(model), graphs[0]
    scale = unpatched.abs().max().item()
    assert (eager - unpatched).abs().max().item() <= MODEL_FP32_LOGIT_RTOL * scale
    assert (compiled - eager).abs().max().item() <= MODEL_FP32_LOGIT_RTOL * scale
    assert (changed_eager - eager).abs().max().item() > 1e-3  # the change matters
    assert (changed_compiled - changed_eager).abs().max().item() <= MODEL_FP32_LOGIT_RTOL * scale


@pytest.mark.parametrize("name", ["Qwen3-VL", "GLM-4.7", "Qwen3.5"])
def test_fast_backends_on_models(name, fast_backend):
    report = vm.check_prefill(name, backend=fast_backend)
    assert report, report.detail


# ------------------------------------------------------------------------------------------------------------
# Positions: where they come from, and a proof that dropping the height/width rows is caught.
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", IMAGE_FAMILIES)
def test_image_positions_reach_the_fused_op(name, position_spy):
    model = build_tiny_model(name)
    inputs = tiny_image_prompt(model)
    prompt_len = inputs["input_ids"].shape[1]
    hf.apply_qkvfuse(model)
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    layers = attention_layers(model)
    assert len(position_spy) == 3 * layers  # prefill + 2 decode steps (the last token is never fed back)

    # Prefill: the image tokens' temporal, height and width rows differ, as transformers' get_rope_index made them.
    _, prefill = position_spy[0]
    image = (inputs["input_ids"][0] == model.config.image_token_id).nonzero().flatten()
    assert len(image) == image_token_count()
    t, h, w = prefill[:, image]
    assert not torch.equal(t, h) and not torch.equal(h, w) and not torch.equal(t, w)
    text = (inputs["input_ids"][0] != model.config.image_token_id).nonzero().flatten()
    assert torch.equal(prefill[0, text], prefill[1, text]) and torch.equal(prefill[1, text], prefill[2, text])

    # Decode: cache_len + rope_delta on all three rows (rope_delta < 0: 6 image tokens span 3 positions).
    delta = int(model.model.rope_deltas.flatten()[0])
    assert delta < 0
    for step in (1, 2):
        _, decode = position_spy[step * layers]
        assert torch.equal(decode, torch.full((3, 1), prompt_len + step - 1 + delta))


@pytest.mark.parametrize("name", IMAGE_FAMILIES)
def test_mutation_temporal_row_only_is_caught(name, monkeypatch):
    """Feeding the fused op only the temporal row (the SGLang #35345 bug) must fail the logits check."""
    assert vm.check_prefill(name)
    flat = hf._flat_positions

    def temporal_only(captured, batch, seq, mrope):
        out = flat(captured, batch, seq, mrope)
        return out[:1].expand_as(out).contiguous() if mrope else out

    monkeypatch.setattr(hf, "_flat_positions", temporal_only)
    report = vm.check_prefill(name)
    assert not report.ok
    assert report.max_err > 10 * MODEL_FP32_LOGIT_RTOL


def test_mutation_wrong_mrope_layout_is_caught(monkeypatch):
    """Qwen3-VL read as contiguous sections (as if mrope_interleaved were honoured and false) must fail."""
    family = hf.SUPPORTED_MODELS["qwen3_vl"]
    monkeypatch.setitem(hf.SUPPORTED_MODELS, "qwen3_vl",
                        dataclasses.replace(family, mrope_interleaved=False))
    report = vm.check_prefill("Qwen3-VL")
    assert not report.ok and report.max_err > 10 * MODEL_FP32_LOGIT_RTOL


@pytest.mark.parametrize("name", GATED_FAMILIES)
def test_mutation_plain_norm_weights_are_caught(name, monkeypatch):
    """The gated families' QK and decoder norm weights read as plain RMSNorm weights (w instead of 1 + w) must
    fail the logits check: the tiny models' Gemma weights are centred at 0, so the flag is visible."""
    assert vm.check_prefill(name)
    model_type = tiny_config(name).model_type
    monkeypatch.setitem(hf.SUPPORTED_MODELS, model_type,
                        dataclasses.replace(hf.SUPPORTED_MODELS[model_type], gemma_norm=False))
    report = vm.check_prefill(name)
    assert not report.ok and report.max_err > 10 * MODEL_FP32_LOGIT_RTOL


def _qwen3_5_variant(name):
    """The Qwen3.5 classes the tiny specs do not build: the text-only Qwen3_5ForCausalLM (model_type
    qwen3_5_text), and Qwen3_5MoeForConditionalGeneration (the MoE text model under Qwen3.5's vision tower)."""
    import transformers

    if name == "Qwen3.5":
        return build_tiny_model(name, config=tiny_config(name).text_config, model_class="Qwen3_5ForCausalLM"), False
    vl = tiny_config("Qwen3.5")
    config = transformers.Qwen3_5MoeConfig(
        text_config=tiny_config(name).to_dict(), vision_config=vl.vision_config.to_dict(),
        **{k: getattr(vl, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                        "vision_end_token_id")})
    return build_tiny_model(name, config=config, model_class="Qwen3_5MoeForConditionalGeneration"), True


@pytest.mark.parametrize("name", ["Qwen3.5", "Qwen3.5-MoE"], ids=["Qwen3_5ForCausalLM",
                                                                 "Qwen3_5MoeForConditionalGeneration"])
def test_other_qwen3_5_classes(name):
    """Prefill and greedy generation with the KV cache, patched vs unpatched (an image for the MoE VL model)."""
    model, image = _qwen3_5_variant(name)
    inputs = tiny_image_prompt(model) if image else {"input_ids": tiny_prompt(2, 9)}
    report = vm.check_prefill(name, model=model, inputs=inputs)
    assert report, report.detail
    one_prompt = inputs if image else {"input_ids": inputs["input_ids"][:1]}
    report = vm.check_generation(name, model=model, new_tokens=6, inputs=one_prompt)
    assert report.tokens_identical and report, report.detail


def test_qwen3_vl_config_mrope_interleaved_is_ignored():
    """transformers never reads mrope_interleaved for Qwen3-VL; neither does the patch."""
    config = tiny_config("Qwen3-VL")
    config.text_config.rope_parameters["mrope_interleaved"] = False
    model = build_tiny_model("Qwen3-VL", config=config)
    assert vm.check_prefill("Qwen3-VL", model=model)


def test_positions_one_row_broadcast_over_batch(position_spy):
    """Qwen3 without explicit ids hands the rotary module [1, T] for a batch of B: expanded to B*T."""
    model = build_tiny_model("Qwen3")
    ids = tiny_prompt(3, 7)
    report = vm.check_prefill("Qwen3", model=model, inputs={"input_ids": ids})
    assert report, report.detail
    captured, flat = position_spy[0]
    assert captured.shape == (1, 7)
    assert torch.equal(flat, torch.arange(7).repeat(3))


def test_stale_positions_are_never_used():
    """Positions live only for one text-model forward: an attention layer called on its own raises."""
    model = build_tiny_model("Qwen3")
    hf.apply_qkvfuse(model)
    with torch.no_grad():
        model(input_ids=tiny_prompt(1, 4))
        attn = model.model.layers[0].self_attn
        with pytest.raises(RuntimeError, match="no positions were captured"):
            attn(hidden_states=torch.randn(1, 4, model.config.hidden_size), position_embeddings=None,
                 attention_mask=None)


def test_yarn_rope_parameters_are_honoured():
    config = tiny_config("Qwen3")
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                              "original_max_position_embeddings": 256}
    model = build_tiny_model("Qwen3", config=config)
    ids = tiny_prompt(1, 8)
    positions = torch.arange(600, 608)[None]  # beyond the original context, where yarn changes the table
    report = vm.check_prefill("Qwen3", model=model, inputs={"input_ids": ids, "position_ids": positions})
    assert report, report.detail


def test_unsupported_rope_type_raises():
    config = tiny_config("Qwen3")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}
    model = build_tiny_model("Qwen3", config=config)
    with pytest.raises(NotImplementedError, match="rope_parameters"):
        hf.apply_qkvfuse(model)
    assert not hf.is_patched(model)


# ------------------------------------------------------------------------------------------------------------
# Weights, re-patching, errors.
# ------------------------------------------------------------------------------------------------------------
def _param_bytes(model) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def test_qkv_weights_are_views_not_copies():
    model = build_tiny_model("GLM-4.7")
    before = _param_bytes(model)
    hf.apply_qkvfuse(model)
    assert _param_bytes(model) == before
    for layer in model.model.layers:
        attn = layer.self_attn
        fused = attn._qkvfuse
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert proj.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
            assert proj.bias.untyped_storage().data_ptr() == fused.bias.untyped_storage().data_ptr()
    hf.remove_qkvfuse(model)
    assert _param_bytes(model) == before
    for proj in (model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj):
        assert proj.weight.is_contiguous() and proj.weight.untyped_storage().nbytes() == proj.weight.nbytes


@pytest.mark.parametrize("name", ["GLM-4.7"] + GATED_FAMILIES)
def test_weight_changes_after_patching_are_used(name):
    """After a first patched forward (bound ops built): load_state_dict writes through the views; a replaced
    tensor breaks them and is re-fused; in-place ``param.data.copy_`` of q_proj and of the norm weights (the
    Gemma-style weights, centred at 0, of the gated families: the kernel adds 1 per call, nothing derived is
    cached) are read by the next forward."""
    model = build_tiny_model(name)
    donor = build_tiny_model(name, seed=5)
    inputs = vm.model_inputs(model, name, batch=2, length=6)
    hf.apply_qkvfuse(model)
    with torch.no_grad():
        before = model(**inputs).logits
    model.load_state_dict(donor.state_dict())
    layer = [m for m in model.modules() if "self_attn" in m._modules][-1]
    attn = layer.self_attn
    attn.k_proj.weight.data = attn.k_proj.weight.data * 1.5
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        if attn.v_proj.bias is not None:
            attn.v_proj.bias.data = attn.v_proj.bias.data + 0.25
        attn.q_proj.weight.data.copy_(attn.q_proj.weight * 0.5 + 0.02 * torch.randn(attn.q_proj.weight.shape,
                                                                                      generator=g))
        norms = [layer.post_attention_layernorm] + ([attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else [])
        for norm in norms:
            norm.weight.data.copy_(norm.weight + 0.3 * torch.randn(norm.weight.shape, generator=g))
        patched = model(**inputs).logits
    assert vm.relative_error(patched, before) > 1e-3  # the edits matter
    hf.remove_qkvfuse(model)
    with torch.no_grad():
        unpatched = model(**inputs).logits
    assert vm.relative_error(patched, unpatched) <= MODEL_FP32_LOGIT_RTOL


def test_model_cast_after_patching_refuses_weights():
    """model.to(dtype) turns the q/k/v views into separate tensors; the next forward re-concatenates them.

    (Build bf16 models with dtype= instead: the cast also rounds the GLM router bias and the rotary inv_freq.)
    """
    ids = {"input_ids": tiny_prompt(2, 6)}
    late, early = build_tiny_model("Qwen3"), build_tiny_model("Qwen3")
    hf.apply_qkvfuse(late).to(torch.bfloat16)
    # A cast before patching also rounds transformers' inv_freq to bf16: qkvfuse keeps the fp32 frequencies.
    with pytest.warns(RuntimeWarning, match="inv_freq is stored in torch.bfloat16"):
        hf.apply_qkvfuse(early.to(torch.bfloat16))
    with torch.no_grad():
        assert torch.equal(late(**ids).logits, early(**ids).logits)
    attn = late.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn._qkvfuse.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", ["Qwen3", "GLM-4.5V"])
def test_eager_attention_implementation(name):
    model = build_tiny_model(name, attn_implementation="eager")
    report = vm.check_prefill(name, model=model)
    assert report, report.detail


def test_patching_twice_is_harmless():
    model = build_tiny_model("Qwen3-VL")
    inputs = tiny_image_prompt(model)
    with torch.no_grad():
        original = model(**inputs).logits
        hf.apply_qkvfuse(model)
        state = model._qkvfuse_patch
        once = model(**inputs).logits
        hf.apply_qkvfuse(model)
        assert model._qkvfuse_patch is state
        assert torch.equal(model(**inputs).logits, once)
        # Other options re-patch from the original model, never on top of the patch.
        hf.apply_qkvfuse(model, fuse_add_rmsnorm=False)
        assert all("forward" not in vars(layer) for layer in model.model.language_model.layers)
        assert vm.relative_error(model(**inputs).logits, original) <= MODEL_FP32_LOGIT_RTOL
        hf.remove_qkvfuse(model)
        hf.remove_qkvfuse(model)  # undoing an unpatched model does nothing
        assert torch.equal(model(**inputs).logits, original)


def test_fuse_add_rmsnorm_off_uses_only_the_prepare_op(op_calls):
    model = build_tiny_model("GLM-4.5-Air")
    ids = {"input_ids": tiny_prompt(2, 6)}
    with torch.no_grad():
        ref = model(**ids).logits
        hf.apply_qkvfuse(model, fuse_add_rmsnorm=False)
        got = model(**ids).logits
    assert op_calls == {"split": _layers(model), "norm": 0}
    assert vm.relative_error(got, ref) <= MODEL_FP32_LOGIT_RTOL


def test_unknown_model_class_raises_listing_supported():
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(TypeError) as err:
        hf.apply_qkvfuse(model)
    for supported in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3VLForConditionalGeneration",
                      "Glm4MoeForCausalLM", "Glm4vMoeForConditionalGeneration"):
        assert supported in str(err.value)
    with pytest.raises(TypeError, match=r"LlamaForCausalLM \(config.model_type=.llama.\) is not supported"):
        hf.apply_qkvfuse(model)


def test_glm46v_with_a_text_model_qkvfuse_does_not_fuse_raises():
    """GLM-4.6V's text stack is AutoModel of its text_config: a glm4v_moe_text one is fused (the GLM-4.6V rows
    of the tables above), a dense glm4v_text one (Glm4vTextModel) is refused naming the text model type."""
    config = tiny_config("GLM-4.6V")
    text = config.text_config.to_dict()
    config.text_config = type(config)(text_config={**text, "model_type": "glm4v_text"}).text_config
    model = build_tiny_model("GLM-4.6V", config=config)
    assert type(model.model.language_model).__name__ == "Glm4vTextModel"
    with pytest.raises(TypeError, match=r"text_config.model_type='glm4v_text' is not"):
        hf.apply_qkvfuse(model)
    assert not hf.is_patched(model)


def test_quantised_projection_raises_and_leaves_model_untouched():
    class PackedLinear(nn.Linear):  # stands in for a quantised layer, which subclasses nn.Linear
        pass

    model = build_tiny_model("Qwen3")
    attn = model.model.layers[1].self_attn
    packed = PackedLinear(attn.v_proj.in_features, attn.v_proj.out_features, bias=False)
    attn.v_proj = packed
    with pytest.raises(TypeError, match=r"v_proj is a .*PackedLinear, not torch.nn.Linear"):
        hf.apply_qkvfuse(model)
    assert not hf.is_patched(model)
    assert all("forward" not in vars(m) for m in model.modules())


def test_invalid_backend_raises_before_patching():
    model = build_tiny_model("Qwen3")
    with pytest.raises(ValueError, match="backend"):
        hf.apply_qkvfuse(model, backend="no-such-backend")
    assert not hf.is_patched(model)


# ------------------------------------------------------------------------------------------------------------
# GLM shared-expert overlap (qkvfuse.moe.glm4).
# ------------------------------------------------------------------------------------------------------------
def _moe_blocks(model):
    return [m for m in model.modules() if type(m).__name__ == "Glm4MoeMoE"]


def test_shared_expert_overlap_patches_and_unpatches_every_glm_moe_block():
    model = build_tiny_model("GLM-4.7")
    ids = {"input_ids": tiny_prompt(2, 6)}
    with torch.no_grad():
        ref = model(**ids).logits
        hf.apply_qkvfuse(model, shared_expert_overlap=True)  # CPU: runs inline, same result
        blocks = _moe_blocks(model)
        assert blocks and all("forward" in vars(b) for b in blocks)
        got = model(**ids).logits
        hf.remove_qkvfuse(model)
        assert all("forward" not in vars(b) for b in blocks)
        assert torch.equal(model(**ids).logits, ref)
    assert vm.relative_error(got, ref) <= MODEL_FP32_LOGIT_RTOL


def test_shared_expert_overlap_from_environment(monkeypatch):
    monkeypatch.setenv("QKVFUSE_SHARED_EXPERT_OVERLAP", "1")
    glm = hf.apply_qkvfuse(build_tiny_model("GLM-4.5-Air"))
    assert all("forward" in vars(b) for b in _moe_blocks(glm))
    qwen = hf.apply_qkvfuse(build_tiny_model("Qwen3-MoE"))  # no shared expert: the global switch is ignored
    assert hf.is_patched(qwen)
    with pytest.raises(ValueError, match="shared_expert_overlap"):
        hf.apply_qkvfuse(build_tiny_model("Qwen3"), shared_expert_overlap=True)


def test_shared_expert_overlap_without_moe_module_raises(monkeypatch):
    import qkvfuse.moe

    monkeypatch.setitem(sys.modules, "qkvfuse.moe.glm4", None)
    monkeypatch.delattr(qkvfuse.moe, "glm4", raising=False)
    model = build_tiny_model("GLM-4.7")
    with pytest.raises(NotImplementedError, match="qkvfuse.moe.glm4"):
        hf.apply_qkvfuse(model, shared_expert_overlap=False)
    assert not hf.is_patched(model)


# ------------------------------------------------------------------------------------------------------------
# The published GLM-4.7 attention geometry.
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_glm47_real_attention_geometry():
    """96 query / 8 KV heads x 128, rotary 64, hidden 5120, 1 layer, the published 202 752-row rope table.

    128 tokens x 104 heads = 13 312 token-heads: above the ~10 240 where a partial-rotary fused kernel broke in
    public (vLLM #51049).
    """
    preset = get_preset("GLM-4.7")
    config = tiny_config("GLM-4.7", num_layers=1, hidden_size=preset.hidden_size,
                         num_kv_heads=preset.num_kv_heads, num_experts=2, experts_per_tok=1)
    config.max_position_embeddings = preset.max_position
    model = build_tiny_model("GLM-4.7", config=config)
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.out_features, attn.k_proj.out_features) == (96 * 128, 8 * 128)
    report = vm.check_prefill("GLM-4.7", model=model, inputs={"input_ids": tiny_prompt(1, 128)})
    assert report, report.detail
    report = vm.check_generation("GLM-4.7", model=model, new_tokens=8, inputs={"input_ids": tiny_prompt(1, 16)})
    assert report, report.detail


@pytest.mark.parametrize("name", ["Qwen3", "GLM-4.7"])
def test_grad_mode_runs_the_unfused_layers_with_gradients_of_the_unpatched_model(name, op_calls):
    """The fused ops are inference only: a forward that records autograd takes transformers' own layers (one
    warning), so the loss and every gradient equal the unpatched model's; under no_grad the fused path runs."""
    model = build_tiny_model(name)
    reference = build_tiny_model(name)
    hf.apply_qkvfuse(model)
    ids = tiny_prompt(1, 6)
    hf._warned_unfused.clear()
    with pytest.warns(RuntimeWarning, match="inference only"):
        loss = model(ids).logits.float().square().mean()
    loss.backward()
    ref_loss = reference(ids).logits.float().square().mean()
    ref_loss.backward()
    assert op_calls == {"split": 0, "norm": 0}
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for n, p in reference.named_parameters():
        if p.grad is not None:
            assert grads[n] is not None, n
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    with torch.no_grad():
        model(ids)
    assert op_calls == {"split": attention_layers(model), "norm": _layers(model)}
