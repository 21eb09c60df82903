"""A patched model behaves like the unpatched one in what users do with it besides a forward, or refuses clearly.

Each edit is one test, run on every family (tiny random Qwen3, Qwen3-MoE, Qwen3-VL, GLM-4.7,
GLM-4.5-Air, GLM-4.5V, GLM-4.6V, Qwen3-VL-MoE, and the gated-attention Qwen3-Next, Qwen3.5, Qwen3.5-MoE; fp32)
with the reference and native CPU backends, and with Triton (interpreted: about 20x slower) on Qwen3, GLM-4.5V
and Qwen3.5 (plain RoPE with QK-norm; mRoPE without QK-norm; gated, Gemma norms and interleaved mRoPE). The
gated families skip on a backend whose gated kernel has not landed (``conftest.py``). Two models with the same
seed are edited alike, one patched by ``apply_qkvfuse``; the unpatched one is the reference:

* logits within MODEL_FP32_LOGIT_RTOL (1e-4) of max|unpatched|, and greedy tokens identical;
* ``op_calls`` shows whether the fused ops ran (honoured on the fused path) or not (transformers' unfused code,
  with one warning naming why);
* what is refused raises with its message.

| row | the patched model |
|---|---|
| q_proj replaced by a new ``nn.Linear`` | adopted: fused weight re-derived, fused path |
| q/k/v wrapped (LoRA-style, peft) | that layer runs unfused (one warning), the others fused |
| hooks on projections / norms, global hooks | the layers concerned run unfused (one warning), hooks fire |
| ``train()`` + backward, gradient checkpointing | forwards recording autograd run unfused: the same gradients |
| prompt past ``max_position_embeddings`` | the cos/sin table grows; fused path |
| deepcopy, pickle, torch.save/load, save/from_pretrained | the copy is patched (or loads plain) and equal |
| inner model then outer (and the reverse) | one patch; fused once per layer |
| user subclasses | accepted (dispatch on ``config.model_type``); an overridden forward is refused |
| ``torch.compile`` | one QKV GEMM per layer in the graph |
"""

import copy
import io
import pickle
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from qkvfuse._verify import models as vm
from qkvfuse.testing.accuracy import MODEL_FP32_LOGIT_RTOL
from qkvfuse._verify.tiny_models import (TINY_MODELS, attention_layers, build_tiny_model, copy_routing_pins,
                                         tiny_config)
from qkvfuse.backends import BACKEND_NAMES
from qkvfuse.integrations import transformers as hf

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

FAMILIES = list(TINY_MODELS)
INTERPRETED = ("Qwen3", "GLM-4.5V", "Qwen3.5")  # the Triton interpreter only on these
CASES = [pytest.param(n, b, id=f"{n}-{b}") for n in FAMILIES for b in BACKEND_NAMES
         if b != "triton" or n in INTERPRETED]


def cases(test):
    """Parametrise ``test`` over (family, backend); ``backend`` goes through the suite's fixture (skip/require)."""
    return pytest.mark.parametrize("name, backend", CASES, indirect=["backend"])(test)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with vm.single_thread():
        yield


@pytest.fixture(autouse=True)
def _fresh_warnings():
    hf._warned_unfused.clear()  # each test sees the first warning of its own reasons
    yield
    hf._warned_unfused.clear()


# ------------------------------------------------------------------------------------------------------------
# Helpers.
# ------------------------------------------------------------------------------------------------------------
def _layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def _text_model(model):
    return next(m for m in model.modules() if hasattr(m, "rotary_emb") and hasattr(m, "layers"))


def _attn(model, i=0):
    """The ``i``-th attention module (Qwen3-Next / Qwen3.5: of the full-attention layers; the Gated DeltaNet
    layers have none)."""
    return [layer.self_attn for layer in _text_model(model).layers if "self_attn" in layer._modules][i]


def _has_qk_norm(attn) -> bool:
    return hasattr(attn, "q_norm") and getattr(attn, "use_qk_norm", True)


def _twins(name, backend, **config_changes):
    """``(unpatched, patched, inputs)``: two models with the same weights, the second patched."""
    config = tiny_config(name)
    for key, value in config_changes.items():
        setattr(config.get_text_config(), key, value)
    unpatched = build_tiny_model(name, config=copy.deepcopy(config))
    patched = hf.apply_qkvfuse(build_tiny_model(name, config=copy.deepcopy(config)), backend=backend)
    return unpatched, patched, vm.model_inputs(unpatched, name, batch=2, length=8)


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _assert_same(got, want, what=""):
    err = vm.relative_error(got, want)
    assert err <= MODEL_FP32_LOGIT_RTOL, f"{what}: relative error {err:.2e}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{what}: tokens differ"


def _assert_same_generation(patched, unpatched, inputs, new_tokens=3):
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        got, want = patched.generate(**inputs, **kwargs), unpatched.generate(**inputs, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for step, (g, w) in enumerate(zip(got.logits, want.logits)):
        _assert_same(g, w, f"step {step}")


def _unfused_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
            and "runs transformers' unfused code" in str(w.message)]


def _run_recording_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, _unfused_warnings(caught)


# ------------------------------------------------------------------------------------------------------------
# Module edits after patching.
# ------------------------------------------------------------------------------------------------------------
@cases
def test_replaced_projection_is_adopted(name, backend, op_calls):
    """A plain nn.Linear put in place of q_proj (and v_proj) after patching: the fused weight is re-derived from
    the new modules, the fused path keeps running, no warning."""
    unpatched, patched, inputs = _twins(name, backend)
    for model in (unpatched, patched):
        attn = _attn(model, -1)
        for proj_name in ("q_proj", "v_proj"):
            old = getattr(attn, proj_name)
            torch.manual_seed(7)
            new = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
            setattr(attn, proj_name, new)
    got, caught = _run_recording_warnings(lambda: _logits(patched, inputs))
    assert caught == []
    assert op_calls["split"] == attention_layers(patched)
    _assert_same(got, _logits(unpatched, inputs))
    _assert_same(_logits(unpatched, inputs), _logits(hf.remove_qkvfuse(patched), inputs), "removed")


class _Wrapper(nn.Module):
    """What an adapter library does to a projection: the base layer plus a learned delta."""

    def __init__(self, base: nn.Linear, seed: int):
        super().__init__()
        self.base_layer = base
        torch.manual_seed(seed)
        self.delta = nn.Linear(base.in_features, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.delta(x)


@cases
def test_wrapped_projection_runs_unfused(name, backend, op_calls):
    unpatched, patched, inputs = _twins(name, backend)
    for model in (unpatched, patched):
        attn = _attn(model, 0)
        attn.k_proj = _Wrapper(attn.k_proj, seed=3)
    got, caught = _run_recording_warnings(lambda: _logits(patched, inputs))
    assert len(caught) == 1 and "k_proj is a" in caught[0] and "_Wrapper, not a plain torch.nn.Linear" in caught[0]
    assert op_calls["split"] == attention_layers(patched) - 1  # the other layers stay fused
    _assert_same(got, _logits(unpatched, inputs))


@cases
def test_hooks_fire_and_are_honoured(name, backend, op_calls):
    """Forward hooks (a steering hook changing q_proj's output), pre-hooks on a norm or v_proj, a hook on the
    post-attention norm: each fires as often as unpatched, and the logits are the unpatched model's."""
    unpatched, patched, inputs = _twins(name, backend)
    fired = {id(unpatched): [], id(patched): []}
    for model in (unpatched, patched):
        log = fired[id(model)]
        attn, layer = _attn(model, 0), _text_model(model).layers[-1]
        attn.q_proj.register_forward_hook(lambda m, args, out, log=log: (log.append("q"), out * 1.25)[1])
        (attn.k_norm if _has_qk_norm(attn) else attn.v_proj).register_forward_pre_hook(
            lambda m, args, log=log: log.append("pre"))
        layer.post_attention_layernorm.register_forward_hook(lambda m, args, out, log=log: log.append("norm"))
    got, caught = _run_recording_warnings(lambda: _logits(patched, inputs))
    want = _logits(unpatched, inputs)
    assert sorted(fired[id(patched)]) == sorted(fired[id(unpatched)]) == ["norm", "pre", "q"]
    assert any("Attention runs" in w and "has forward hooks or pre-hooks" in w for w in caught), caught
    assert any("post_attention_layernorm has forward hooks" in w for w in caught), caught
    # Layer 0's attention and the last layer's add+norm ran unfused; everything else fused.
    assert op_calls == {"split": attention_layers(patched) - 1, "norm": _layers(patched) - 1}
    _assert_same(got, want)


@pytest.mark.parametrize("name, backend", [("Qwen3", "cpu"), ("GLM-4.5V", "reference")], indirect=["backend"])
def test_global_module_hook_runs_unfused(name, backend, op_calls):
    unpatched, patched, inputs = _twins(name, backend)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m).__name__) if isinstance(m, nn.Linear) else None)
    try:
        got, caught = _run_recording_warnings(lambda: _logits(patched, inputs))
        patched_linears, seen[:] = len(seen), []
        want = _logits(unpatched, inputs)
    finally:
        handle.remove()
    assert patched_linears == len(seen)
    assert op_calls == {"split": 0, "norm": 0}
    assert any("global module forward hook" in w for w in caught), caught
    _assert_same(got, want)
    _logits(patched, inputs)  # hook removed: fused again
    assert op_calls == {"split": attention_layers(patched), "norm": _layers(patched)}


def test_replaced_norm_of_another_class_runs_unfused(op_calls):
    unpatched, patched, inputs = _twins("Qwen3", "cpu")
    for model in (unpatched, patched):
        attn = _attn(model, 1)
        norm = nn.RMSNorm(attn.q_norm.weight.shape[0], eps=attn.q_norm.variance_epsilon)
        with torch.no_grad():
            norm.weight.copy_(attn.q_norm.weight * 0.5)
        attn.q_norm = norm
    got, caught = _run_recording_warnings(lambda: _logits(patched, inputs))
    assert any("q_norm/k_norm were replaced by RMSNorm/Qwen3RMSNorm" in w for w in caught), caught
    assert op_calls["split"] == attention_layers(patched) - 1
    _assert_same(got, _logits(unpatched, inputs))


# ------------------------------------------------------------------------------------------------------------
# Training.
# ------------------------------------------------------------------------------------------------------------
def _grads(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).logits.float().square().mean()
    loss.backward()
    attn = _attn(model, 0)
    named = {"q_proj": attn.q_proj.weight, "embed": _text_model(model).embed_tokens.weight}
    if hasattr(attn, "q_norm"):
        named["q_norm"] = attn.q_norm.weight
    return loss.detach(), {k: v.grad for k, v in named.items()}


@cases
def test_training_gets_the_unpatched_gradients(name, backend, op_calls):
    """train() after patching, loss.backward(): a forward recording autograd runs transformers' layers (one
    warning), so the loss and the gradients of q_proj, q_norm and the embedding are the unpatched model's."""
    _check_training(name, backend, None, op_calls)


@pytest.mark.parametrize("name, backend", [pytest.param(n, b, id=f"{n}-{b}") for n in ("Qwen3", "GLM-4.7")
                                           for b in ("reference", "cpu")], indirect=["backend"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["ckpt", "ckpt-reentrant"])
def test_gradient_checkpointing_gets_the_unpatched_gradients(name, backend, reentrant, op_calls):
    """With gradient checkpointing the layers' own checkpointed forwards run; reentrant checkpointing runs the
    forward under no_grad (fused attention) and the recompute with grad (unfused): the same gradients."""
    _check_training(name, backend, reentrant, op_calls)


def _check_training(name, backend, checkpointing, op_calls):
    unpatched, patched, inputs = _twins(name, backend)
    for model in (unpatched, patched):
        model.train()
        if checkpointing is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    hf.apply_qkvfuse(patched, backend=backend)  # already patched (in eval mode): unchanged
    (loss, grads), caught = _run_recording_warnings(lambda: _grads(patched, inputs))
    ref_loss, ref_grads = _grads(unpatched, inputs)
    assert caught and all("autograd" in w or "checkpointing" in w for w in caught), caught
    if not checkpointing:
        assert op_calls == {"split": 0, "norm": 0}
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for key, ref in ref_grads.items():
        assert ref is not None and grads[key] is not None, key
        torch.testing.assert_close(grads[key], ref, rtol=1e-4, atol=1e-6, msg=key)
    op_calls.update(split=0, norm=0)
    _logits(patched, inputs)  # train mode, no grad: fused
    assert op_calls["split"] == attention_layers(patched)


def test_patching_in_train_mode_is_accepted(op_calls):
    unpatched, _, inputs = _twins("GLM-4.7", "cpu")
    model = build_tiny_model("GLM-4.7").train()
    hf.apply_qkvfuse(model, backend="cpu")
    assert model.training and hf.is_patched(model)
    _assert_same(_logits(model, inputs), _logits(unpatched.train(), inputs))
    assert op_calls["split"] == attention_layers(model)


# ------------------------------------------------------------------------------------------------------------
# Positions past max_position_embeddings.
# ------------------------------------------------------------------------------------------------------------
@cases
def test_prompt_longer_than_max_position_embeddings(name, backend, op_calls):
    unpatched, patched, inputs = _twins(name, backend, max_position_embeddings=6)
    assert inputs["input_ids"].shape[1] > 6
    rope = _text_model(patched)._qkvfuse_rope
    assert rope.rows == 6
    _assert_same(_logits(patched, inputs), _logits(unpatched, inputs))
    assert op_calls["split"] == attention_layers(patched)
    assert rope.rows > 6
    _assert_same_generation(patched, unpatched, inputs)


def test_table_growth_keeps_the_rows_and_frequencies():
    model = build_tiny_model("GLM-4.7")
    hf.apply_qkvfuse(model)
    rope = _text_model(model)._qkvfuse_rope
    small = rope.table(torch.device("cpu")).clone()
    rope.cover(torch.tensor([[3 * rope.rows]]))
    grown = rope.table(torch.device("cpu"))
    assert grown.shape[0] > 3 * small.shape[0]
    torch.testing.assert_close(grown[:small.shape[0]], small, rtol=0, atol=2e-7)


# ------------------------------------------------------------------------------------------------------------
# Copies.
# ------------------------------------------------------------------------------------------------------------
def _torch_roundtrip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@cases
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_are_patched_and_equal(name, backend, how, op_calls):
    unpatched, patched, inputs = _twins(name, backend)
    _logits(patched, inputs)
    twin = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)),
            "torch.save": _torch_roundtrip}[how](patched)
    assert hf.is_patched(twin)
    op_calls.update(split=0, norm=0)
    want = _logits(unpatched, inputs)
    _assert_same(_logits(twin, inputs), want, how)
    assert op_calls["split"] == attention_layers(twin)
    # The copy owns its weights (views into its own fused tensor), and the original still works.
    attn, twin_attn = _attn(patched), _attn(twin)
    assert twin_attn.q_proj.weight.data_ptr() == twin_attn._qkvfuse.weight.data_ptr()
    assert twin_attn.q_proj.weight.data_ptr() != attn.q_proj.weight.data_ptr()
    _assert_same(_logits(patched, inputs), want, "original")
    if how == "deepcopy":
        _assert_same_generation(twin, unpatched, inputs, new_tokens=2)
    _assert_same(_logits(hf.remove_qkvfuse(twin), inputs), want, "copy removed")


@pytest.mark.parametrize("name", FAMILIES)
def test_save_pretrained_round_trip(name, tmp_path, op_calls):
    """The checkpoint of a patched model loads plain and equal; patching the loaded model gives the same logits
    (the public ops' default backend: the native CPU kernel when it builds, QKVFUSE_BACKEND honoured)."""
    unpatched, patched, inputs = _twins(name, None)
    want = _logits(unpatched, inputs)
    patched.save_pretrained(tmp_path)
    loaded = type(patched).from_pretrained(tmp_path, dtype=torch.float32).eval()
    copy_routing_pins(unpatched, loaded)  # the routing pin is not part of the checkpoint
    assert not hf.is_patched(loaded)
    assert torch.equal(_logits(loaded, inputs), want)
    hf.apply_qkvfuse(loaded)
    _assert_same(_logits(loaded, inputs), want)


# ------------------------------------------------------------------------------------------------------------
# Nesting and subclasses.
# ------------------------------------------------------------------------------------------------------------
@cases
@pytest.mark.parametrize("order", ["inner-outer", "outer-inner"])
def test_nested_patching_is_idempotent(name, backend, order, op_calls):
    unpatched, _, inputs = _twins(name, backend)
    model = build_tiny_model(name)
    want = _logits(unpatched, inputs)
    inner = model.model
    first, second = (inner, model) if order == "inner-outer" else (model, inner)
    hf.apply_qkvfuse(first, backend=backend)
    hf.apply_qkvfuse(second, backend=backend)
    assert hf.is_patched(model) and hf.is_patched(inner)
    assert [m for m in model.modules() if "_qkvfuse_patch" in vars(m)] == [first]  # one patch
    _assert_same(_logits(model, inputs), want)
    assert op_calls == {"split": attention_layers(model), "norm": _layers(model)}
    hf.remove_qkvfuse(second)
    assert not hf.is_patched(model) and not hf.is_patched(inner)
    assert torch.equal(_logits(model, inputs), want)


def test_nested_patching_with_other_options_repatches(op_calls):
    unpatched, _, inputs = _twins("Qwen3", "cpu")
    model = build_tiny_model("Qwen3")
    hf.apply_qkvfuse(model, backend="cpu")
    hf.apply_qkvfuse(model.model, backend="reference", fuse_add_rmsnorm=False)
    assert [m for m in model.modules() if "_qkvfuse_patch" in vars(m)] == [model.model]
    _assert_same(_logits(model, inputs), _logits(unpatched, inputs))
    assert op_calls == {"split": attention_layers(model), "norm": 0}


@cases
def test_user_subclasses_are_supported(name, backend, op_calls):
    """Dispatch is on config.model_type: a user subclass of the model class, and of the decoder layer class
    (transformers re-wraps each subclass's forward for gradient checkpointing), are patched."""
    unpatched, _, inputs = _twins(name, backend)
    model = build_tiny_model(name)
    model.__class__ = type("MyModel", (type(model),), {})
    for layer in _text_model(model).layers:
        layer.__class__ = type("MyLayer", (type(layer),), {})
    hf.apply_qkvfuse(model, backend=backend)
    _assert_same(_logits(model, inputs), _logits(unpatched, inputs))
    assert op_calls == {"split": attention_layers(model), "norm": _layers(model)}


def test_subclass_overriding_forward_is_refused():
    model = build_tiny_model("Qwen3")
    attn = _attn(model, 1)

    class MyAttention(type(attn)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    attn.__class__ = MyAttention
    with pytest.raises(TypeError, match="MyAttention overrides Qwen3Attention.forward"):
        hf.apply_qkvfuse(model)
    assert not hf.is_patched(model)


def test_foreign_instance_forward_is_refused():
    model = build_tiny_model("Qwen3")
    layer = model.model.layers[0]
    layer.forward = layer.forward  # what another patcher leaves behind
    with pytest.raises(TypeError, match="forward set on the instance"):
        hf.apply_qkvfuse(model)
    assert not hf.is_patched(model)


# ------------------------------------------------------------------------------------------------------------
# torch.compile.
# ------------------------------------------------------------------------------------------------------------
def _compiled_linear_weights(model, inputs):
    """The weight inputs of every linear in the one graph of ``torch.compile(model, fullgraph=True)`` (dynamo
    names them by source), and the logits of running that graph."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append([str(getattr(node.args[1], "name", node.args[1])) for node in gm.graph.nodes
                       if node.op == "call_function" and "linear" in str(node.target)])
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            logits = torch.compile(model, backend=recording_backend, fullgraph=True)(**inputs).logits
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    return graphs[0], logits


@pytest.mark.parametrize("name, backend", [pytest.param(n, "cpu", id=f"{n}-cpu") for n in FAMILIES]
                         + [pytest.param("Qwen3", "triton", id="Qwen3-triton")], indirect=["backend"])
def test_torch_compile_does_one_qkv_gemm_per_layer(name, backend):
    unpatched, patched, inputs = _twins(name, backend)
    if TINY_MODELS[name].image:  # the vision tower graph-breaks in transformers itself: text prompts here
        inputs = {"input_ids": inputs["input_ids"][:, :8]}
    weights, got = _compiled_linear_weights(patched, inputs)
    assert sum("qkvfuse_weight" in w for w in weights) == attention_layers(patched), weights  # one GEMM per layer
    assert not [w for w in weights if any(p in w for p in ("q_proj", "k_proj", "v_proj"))], weights
    _assert_same(got, _logits(unpatched, inputs))


def test_torch_compile_sees_replaced_modules_and_parameters(op_calls):
    """After compiling, a q_proj replaced by a new nn.Linear and a k_proj weight replaced by a new Parameter are
    used (dynamo's guards retrace; the trace-time sync re-derives the fused weight), still one GEMM per layer."""
    unpatched, patched, inputs = _twins("Qwen3", "cpu")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(patched, backend="eager", fullgraph=True)
        with torch.no_grad():
            compiled(**inputs)
            for model in (unpatched, patched):
                attn = _attn(model, 1)
                torch.manual_seed(3)
                attn.q_proj = nn.Linear(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)
                _attn(model, 0).k_proj.weight = nn.Parameter(_attn(model, 0).k_proj.weight * 1.5)
            got = compiled(**inputs).logits
    finally:
        torch._dynamo.reset()
    _assert_same(got, _logits(unpatched, inputs))
    assert _attn(patched, 1)._qkvfuse.projections[0] is _attn(patched, 1).q_proj


# ------------------------------------------------------------------------------------------------------------
# peft.
# ------------------------------------------------------------------------------------------------------------
@cases
def test_peft_lora_added_after_patching(name, backend, op_calls):
    """LoRA on q/k/v (peft) after patching: the wrapped layers run unfused (one warning naming the wrapper), so
    the outputs are the unpatched model's with the same adapter; merge_and_unload brings the fused path back."""
    peft = pytest.importorskip("peft")
    unpatched, patched, inputs = _twins(name, backend)
    plain = _logits(unpatched, inputs)
    config = peft.LoraConfig(target_modules=["q_proj", "k_proj", "v_proj"], r=4, lora_alpha=8)
    models = []
    for model in (unpatched, patched):
        torch.manual_seed(11)
        model = peft.get_peft_model(model, copy.deepcopy(config))
        torch.manual_seed(12)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)  # B starts at zero: make the adapter matter
        models.append(model.eval())
    lora_ref, lora = models
    got, caught = _run_recording_warnings(lambda: _logits(lora, inputs))
    assert any("peft.tuners.lora" in w and "not a plain torch.nn.Linear" in w for w in caught), caught
    assert op_calls["split"] == 0
    want = _logits(lora_ref, inputs)
    assert vm.relative_error(want, plain) > 1e-3  # the adapter matters
    _assert_same(got, want)
    merged_ref, merged = lora_ref.merge_and_unload(), lora.merge_and_unload()
    assert hf.is_patched(merged)
    _assert_same(_logits(merged, inputs), _logits(merged_ref, inputs), "merged")
    assert op_calls["split"] == attention_layers(merged)


# ------------------------------------------------------------------------------------------------------------
# A model changed while it serves: storage swaps, _apply, a replaced rotary module.
# ------------------------------------------------------------------------------------------------------------
def _fresh(t, seed):
    """New values for a norm weight: around 1, different per seed."""
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.5 * torch.randn(t.shape, generator=g)).to(t.dtype)


def _swap_data(model, which):
    """``weight.data = new`` (same Parameter, new storage) on every layer's ``which`` norms."""
    for i, layer in enumerate(_text_model(model).layers):
        attn = layer._modules.get("self_attn")  # None in a Gated DeltaNet layer
        norms = {"qk_norm": [attn.q_norm, attn.k_norm] if _has_qk_norm(attn) else [],
                 "post_attention_layernorm": [layer.post_attention_layernorm],
                 "input_layernorm": [layer.input_layernorm]}[which]
        for j, norm in enumerate(norms):
            norm.weight.data = _fresh(norm.weight, 100 * i + j)


def _apply_then_update(model, _which=None):
    """``model._apply(clone)`` (what ``.to()`` / offload-reload do: new storage under every parameter), then
    in-place updates of the norms the fused paths read."""
    model._apply(lambda t: t.clone())
    with torch.no_grad():
        for i, layer in enumerate(_text_model(model).layers):
            attn = layer._modules.get("self_attn")  # None in a Gated DeltaNet layer
            norms = [layer.post_attention_layernorm] + ([attn.q_norm, attn.k_norm] if _has_qk_norm(attn) else [])
            for j, norm in enumerate(norms):
                norm.weight.mul_(_fresh(norm.weight, 7 + 100 * i + j))


def _replace_rotary(model, rope_update):
    """A new rotary module of the same class whose config's rope_parameters are updated by ``rope_update``."""
    text = _text_model(model)
    config = copy.deepcopy(text.rotary_emb.config)
    config.rope_parameters = {**config.rope_parameters, **rope_update}
    text.rotary_emb = type(text.rotary_emb)(config=config)


def _assert_spans_current(model):
    """No bound object keeps memory ranges of its tensors that a storage swap could leave pointing at freed memory:
    the kernels take the overlap check on each call's tensors, so a bound configuration records none."""
    bound = [m._qkvfuse._bound.value for m in model.modules()
             if getattr(m.__dict__.get("_qkvfuse"), "_bound", None) is not None]
    assert bound
    for b in bound:
        assert not any("span" in field for field in type(b.config)._fields), b


_LIVE_EDITS = {
    "q_norm-k_norm.data": lambda m: _swap_data(m, "qk_norm"),
    "post_attention_layernorm.data": lambda m: _swap_data(m, "post_attention_layernorm"),
    "input_layernorm.data": lambda m: _swap_data(m, "input_layernorm"),
    "_apply-then-in-place": _apply_then_update,
    "rotary_emb-replaced": lambda m: _replace_rotary(m, {"rope_theta": 777.0}),
}


@pytest.mark.parametrize("edit", list(_LIVE_EDITS))
@pytest.mark.parametrize("name, backend", [pytest.param(n, b, id=f"{n}-{b}") for n in FAMILIES
                                           for b in ("reference", "cpu")], indirect=["backend"])
def test_live_edits_are_followed(name, backend, edit, op_calls):
    """After a first forward (bound objects built), the same edit on both twins: the patched model gives the
    unpatched model's new logits on the fused path (no warning); the edit changes them (else this proves
    nothing). qk_norm edits on models without QK-norm are skipped."""
    unpatched, patched, inputs = _twins(name, backend)
    if edit.startswith("q_norm") and not _has_qk_norm(_attn(unpatched)):
        pytest.skip("no QK-norm in this model")
    before = _logits(unpatched, inputs)
    _assert_same(_logits(patched, inputs), before, "before")
    for model in (unpatched, patched):
        _LIVE_EDITS[edit](model)
    want = _logits(unpatched, inputs)
    assert vm.relative_error(want, before) > 1e-3, "the edit does not change the unpatched logits"
    op_calls["split"] = 0
    got, caught = _run_recording_warnings(lambda: _logits(patched, inputs))
    assert caught == []
    assert op_calls["split"] == attention_layers(patched)
    _assert_same(got, want, edit)
    _assert_spans_current(patched)
    _assert_same_generation(patched, unpatched, inputs)


@pytest.mark.parametrize("name", ["Qwen3", "GLM-4.5V"])
def test_replaced_rotary_that_cannot_be_reproduced_runs_unfused(name, op_calls):
    """A rotary module qkvfuse cannot reproduce (dynamic NTK) put in place: transformers' unfused attention with
    one warning; putting back a reproducible one brings the fused path back."""
    unpatched, patched, inputs = _twins(name, "cpu")
    _logits(patched, inputs)
    original = _text_model(patched).rotary_emb
    for model in (unpatched, patched):
        _replace_rotary(model, {"rope_type": "dynamic", "factor": 4.0})
    op_calls["split"] = 0
    got, caught = _run_recording_warnings(lambda: _logits(patched, inputs))
    assert any("rotary_emb was replaced by a" in w and "cannot reproduce" in w for w in caught), caught
    assert op_calls["split"] == 0
    _assert_same(got, _logits(unpatched, inputs))
    assert "forward" not in original.__dict__  # the capture left the module it replaced
    _text_model(patched).rotary_emb = original
    _text_model(unpatched).rotary_emb = copy.deepcopy(original)
    got = _logits(patched, inputs)
    assert op_calls["split"] == attention_layers(patched)
    _assert_same(got, _logits(unpatched, inputs))
    assert _logits(hf.remove_qkvfuse(patched), inputs).shape == got.shape
    assert not any("forward" in m.__dict__ for m in patched.modules())


# ------------------------------------------------------------------------------------------------------------
# Scalars a fused call uses, changed in place after a first forward: the norms' eps, GLM's use_qk_norm, the
# rotary module's mRoPE sections and cos/sin scaling. transformers reads each per call; so does the patch.
# ------------------------------------------------------------------------------------------------------------
def _set_eps(norm, value):
    setattr(norm, "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps", value)


def _qk_eps(model, value=0.5):
    for layer in _text_model(model).layers:
        attn = layer._modules.get("self_attn")
        if attn is not None and _has_qk_norm(attn):
            _set_eps(attn.q_norm, value)
            _set_eps(attn.k_norm, value)


def _decoder_eps(model, value=5.0):
    for layer in _text_model(model).layers:
        _set_eps(layer.post_attention_layernorm, value)


def _mrope_section(model):
    """All but one frequency of height and width move to time, in place in the list the rotary module reads (moving
    only a few would move the lowest frequencies of interleaved layouts, too slow to show at these positions)."""
    section = _text_model(model).rotary_emb.mrope_section
    section[:] = [sum(section) - 2, 1, 1]


def _qk_norm_off(model):
    for layer in _text_model(model).layers:
        layer.self_attn.use_qk_norm = False


_SCALAR_EDITS = {
    "q_norm-k_norm-eps": (_qk_eps, ("Qwen3", "GLM-4.7", "Qwen3-Next")),
    "post_attention_layernorm-eps": (_decoder_eps, ("Qwen3", "GLM-4.7", "Qwen3-Next")),
    "mrope_section": (_mrope_section, ("Qwen3-VL", "GLM-4.5V", "Qwen3.5")),
    "use_qk_norm-off": (_qk_norm_off, ("GLM-4.7",)),
}


@pytest.mark.parametrize("edit, name, backend", [
    pytest.param(e, n, b, id=f"{e}-{n}-{b}") for e, (_, names) in _SCALAR_EDITS.items() for n in names
    for b in BACKEND_NAMES if b != "triton" or n in INTERPRETED], indirect=["backend"])
def test_scalar_edits_are_followed(edit, name, backend, op_calls):
    """The same edit on both twins after a first forward (bound ops built): the patched model gives the unpatched
    model's new logits on the fused path, without a warning, in prefill and generation."""
    unpatched, patched, inputs = _twins(name, backend)
    before = _logits(unpatched, inputs)
    _assert_same(_logits(patched, inputs), before, "before")
    for model in (unpatched, patched):
        _SCALAR_EDITS[edit][0](model)
    want = _logits(unpatched, inputs)
    assert vm.relative_error(want, before) > 1e-3, "the edit does not change the unpatched logits"
    op_calls.update(split=0, norm=0)
    got, caught = _run_recording_warnings(lambda: _logits(patched, inputs))
    assert caught == []
    assert op_calls == {"split": attention_layers(patched), "norm": _layers(patched)}
    _assert_same(got, want, edit)
    _assert_same_generation(patched, unpatched, inputs)


def test_q_and_k_norms_with_different_eps_run_unfused(op_calls):
    """One eps per fused call: a layer whose q_norm and k_norm eps differ runs transformers' code (one warning);
    equal again, it is fused again with the new eps."""
    unpatched, patched, inputs = _twins("Qwen3", "cpu")
    _logits(patched, inputs)
    for model in (unpatched, patched):
        _attn(model, 1).k_norm.variance_epsilon = 0.25
    op_calls["split"] = 0
    got, caught = _run_recording_warnings(lambda: _logits(patched, inputs))
    assert len(caught) == 1 and "q_norm and k_norm have different eps" in caught[0], caught
    assert op_calls["split"] == attention_layers(patched) - 1
    _assert_same(got, _logits(unpatched, inputs))
    for model in (unpatched, patched):
        _attn(model, 1).q_norm.variance_epsilon = 0.25
    op_calls["split"] = 0
    _assert_same(_logits(patched, inputs), _logits(unpatched, inputs))
    assert op_calls["split"] == attention_layers(patched)


@pytest.mark.parametrize("name", ["Qwen3", "Qwen3-VL"])
def test_changed_rotary_scaling_runs_unfused(name, op_calls):
    """A rotary module whose ``attention_scaling`` changed in place no longer matches the table qkvfuse builds from
    the config: the attention layers run transformers' code (one warning) until it is set back."""
    unpatched, patched, inputs = _twins(name, "cpu")
    _logits(patched, inputs)
    for model in (unpatched, patched):
        _text_model(model).rotary_emb.attention_scaling = 1.25
    op_calls["split"] = 0
    got, caught = _run_recording_warnings(lambda: _logits(patched, inputs))
    assert len(caught) == 1 and "rotary_emb changed in place" in caught[0] and "cannot reproduce" in caught[0], caught
    assert op_calls["split"] == 0
    _assert_same(got, _logits(unpatched, inputs))
    for model in (unpatched, patched):
        _text_model(model).rotary_emb.attention_scaling = 1.0
    got = _logits(patched, inputs)
    assert op_calls["split"] == attention_layers(patched)
    _assert_same(got, _logits(unpatched, inputs))


@pytest.mark.parametrize("name, edit", [("Qwen3", "q_norm-k_norm-eps"), ("Qwen3", "post_attention_layernorm-eps"),
                                        pytest.param("GLM-4.5V", "mrope_section", marks=pytest.mark.slow)])
def test_torch_compile_follows_scalar_edits(name, edit):
    """A compiled patched model reads the same scalars: dynamo guards on them and retraces after the edit (the
    vision tower of an image model does not compile in one graph: that model may break graphs)."""
    unpatched, patched, inputs = _twins(name, "cpu")
    before = _logits(unpatched, inputs)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(patched, backend="eager", fullgraph=not TINY_MODELS[name].image)
        with torch.no_grad():
            compiled(**inputs)
            for model in (unpatched, patched):
                _SCALAR_EDITS[edit][0](model)
            got = compiled(**inputs).logits
    finally:
        torch._dynamo.reset()
    want = _logits(unpatched, inputs)
    assert vm.relative_error(want, before) > 1e-3, "the edit does not change the unpatched logits"
    _assert_same(got, want, edit)

