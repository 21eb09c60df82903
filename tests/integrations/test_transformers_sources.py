"""apply_qkvfuse fuses only the transformers code it was tested with (the engine plugins' tested-source guard).

Every transformers function whose behaviour a fused forward replaces or reproduces -- the attention and decoder
layer forwards, the model module's ``apply_rotary_pos_emb`` / ``rotate_half``, the rotary module's forward (and
mRoPE recomposition), the norms' forward -- must hash to a version in ``TESTED_SOURCES``. A class whose code does
not keeps transformers' own forward, with one warning per class at patch time, and the model computes exactly
what it computes unpatched (here: with the altered code).
"""

import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers

from qkvfuse._verify import models as vm
from qkvfuse._verify.tiny_models import TINY_MODELS, attention_layers, build_tiny_model
from qkvfuse.integrations import transformers as hf

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with vm.single_thread():
        yield


def _text_model(model):
    return next(m for m in model.modules() if hasattr(m, "rotary_emb") and hasattr(m, "layers"))


def _apply_recording(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf.apply_qkvfuse(model, backend="cpu")
    return [str(w.message) for w in caught
            if issubclass(w.category, RuntimeWarning) and "keeps transformers' own forward" in str(w.message)]


def test_installed_transformers_is_a_tested_version():
    """The tested set names the installed version: bumping transformers means re-hashing (``source_hashes``)."""
    assert transformers.__version__ in hf.TESTED_TRANSFORMERS, (
        f"transformers {transformers.__version__} is not in TESTED_TRANSFORMERS {hf.TESTED_TRANSFORMERS}: run the "
        f"transformers tests under it and add qkvfuse.integrations.transformers.source_hashes(model) of each family")


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_every_family_is_tested_code(name):
    """Each family's sources hash to a tested version: patching warns about nothing and fuses every layer."""
    model = build_tiny_model(name)
    hashes = hf.source_hashes(model)
    untested = {k: v for k, v in hashes.items() if v not in hf.TESTED_SOURCES.get(k, ())}
    assert not untested, untested
    assert _apply_recording(model) == []
    state = model._qkvfuse_patch
    assert len(state.attentions) == attention_layers(model)
    assert len(state.layers) == model.config.get_text_config().num_hidden_layers


def _scaled_output(original, scale=1.5):
    """A stand-in for a transformers method or function that computes something else (so a fallback that still
    ran qkvfuse's reproduction of the original would show), with its own source."""
    def altered(*args, **kwargs):
        out = original(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0] * scale,) + tuple(out[1:])
        return out * scale

    return altered


def _module_of(model, attr):
    """The modeling module of the model's attention class (e.g. ``modeling_qwen3``)."""
    attn = next(layer.self_attn for layer in _text_model(model).layers if "self_attn" in layer._modules)
    return sys.modules[type(attn).__module__]


# (family, what is altered, the layer classes expected to keep their code, fused ops expected per forward)
_ALTERATIONS = {
    # the rotation the fused prepare reproduces: the attention keeps its code, the add+norm is still fused
    "Qwen3-apply_rotary_pos_emb": ("Qwen3", "function", "apply_rotary_pos_emb", {"attention"}),
    # the mRoPE layout of the rotary module (contiguous sections)
    "GLM-4.5V-recomposition_frequencies": ("GLM-4.5V", "rotary", "recomposition_frequencies", {"attention"}),
    # the Gemma RMSNorm: both the fused QK-norm and the fused post-attention norm reproduce it
    "Qwen3-Next-RMSNorm.forward": ("Qwen3-Next", "norm", "forward", {"attention", "layer"}),
    # the decoder layer's forward (the fused add+norm replaces it): the attention stays fused
    "GLM-4.7-DecoderLayer.forward": ("GLM-4.7", "layer", "forward", {"layer"}),
}


@pytest.mark.parametrize("case", list(_ALTERATIONS))
def test_altered_source_keeps_the_model_code(case, monkeypatch, op_calls):
    name, where, attr, kept = _ALTERATIONS[case]
    unpatched, patched = build_tiny_model(name), build_tiny_model(name)
    inputs = vm.model_inputs(unpatched, name, batch=2, length=8)
    with torch.no_grad():
        original = unpatched(**inputs).logits
    layer = _text_model(patched).layers[-1]  # the last layer has attention in every family (Qwen3-Next: 1 in 4)
    owner = {"function": _module_of(patched, attr), "rotary": type(_text_model(patched).rotary_emb),
             "norm": type(layer.post_attention_layernorm), "layer": type(layer)}[where]
    monkeypatch.setattr(owner, attr, _scaled_output(getattr(owner, attr)))

    caught = _apply_recording(patched)
    kept_classes = {"attention": type(layer.self_attn).__name__, "layer": type(layer).__name__}
    assert len(caught) == len(kept), caught  # one warning per class, however many layers
    for what in kept:
        prefix = f"apply_qkvfuse: {kept_classes[what]} keeps transformers' own forward"
        assert any(msg.startswith(prefix) and "differs from the transformers versions qkvfuse was tested with" in msg
                   for msg in caught), caught
    assert hf.is_patched(patched)
    with torch.no_grad():
        want = unpatched(**inputs).logits
        got = patched(**inputs).logits
    assert vm.relative_error(want, original) > 1e-3, "the alteration does not change the outputs (proves nothing)"
    layers = patched.config.get_text_config().num_hidden_layers
    assert op_calls == {"split": 0 if "attention" in kept else attention_layers(patched),
                        "norm": 0 if "layer" in kept else layers}
    if kept == {"attention", "layer"}:
        assert torch.equal(got, want)  # nothing fused: the model's own code throughout
    else:
        assert vm.relative_error(got, want) <= 1e-4
    hf.remove_qkvfuse(patched)
    with torch.no_grad():
        assert torch.equal(patched(**inputs).logits, want)


def test_hash_is_the_engine_plugins_rule():
    """sha256 of the dedented source, 16 hex digits (the vLLM / SGLang plugins hash their engine code so)."""
    import hashlib
    import inspect
    import textwrap

    fn = type(build_tiny_model("Qwen3").model.layers[0]).forward
    want = hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()[:16]
    assert hf.source_hash(fn) == want


def test_altered_moe_block_keeps_its_forward(monkeypatch, op_calls):
    """shared_expert_overlap replaces the GLM MoE block's forward: an altered one is left in place (one warning),
    while the attention and add+norm, whose code is tested, are fused."""
    unpatched, patched = build_tiny_model("GLM-4.7"), build_tiny_model("GLM-4.7")
    inputs = vm.model_inputs(unpatched, "GLM-4.7", batch=2, length=8)
    block_cls = next(type(m) for m in patched.modules() if type(m).__name__ == "Glm4MoeMoE")
    assert hf.source_hashes(patched)["Glm4MoeMoE.forward"] in hf.TESTED_SOURCES["Glm4MoeMoE.forward"]
    monkeypatch.setattr(block_cls, "forward", _scaled_output(block_cls.forward))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf.apply_qkvfuse(patched, backend="cpu", shared_expert_overlap=True)
    ours = [str(w.message) for w in caught if "keeps transformers' own forward" in str(w.message)]
    assert len(ours) == 1 and ours[0].startswith("apply_qkvfuse: Glm4MoeMoE keeps"), ours
    blocks = [m for m in patched.modules() if type(m) is block_cls]
    assert blocks and not any("forward" in vars(b) for b in blocks)
    assert patched._qkvfuse_patch.moe_blocks == []
    with torch.no_grad():
        got, want = patched(**inputs).logits, unpatched(**inputs).logits
    assert op_calls == {"split": attention_layers(patched), "norm": patched.config.num_hidden_layers}
    assert vm.relative_error(got, want) <= 1e-4
