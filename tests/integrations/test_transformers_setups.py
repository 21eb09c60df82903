"""apply_qkvfuse in less common setups: torch.autocast over an fp32 model, and accelerate offloading.

Autocast: an fp32 model under ``torch.autocast("cpu", dtype=torch.bfloat16)`` gets bf16 projection outputs
while its residual stream stays fp32 (transformers adds them with type promotion and normalises in fp32). The
patched decoder layers run their own unfused add+norm for such calls (one warning); the fused attention prepare
still runs on bf16 qkv with fp32 norm weights. The patched logits are judged with the bf16 rule of
``test_transformers.py`` (``qkvfuse.testing.accuracy``): against the same weights in float64, patched RMS error
<= MODEL_BF16_RMS_FACTOR x and max error <= MODEL_BF16_MAX_FACTOR x the unpatched model's under the same
autocast.

Offloading: a model with parameters on the meta device, an accelerate hook, or an hf_device_map with CPU/disk
offload is refused at patch time, before anything changes.

A dtype the fused ops do not take (``model.double()`` after patching, to compute a reference): every layer runs
its own code for those calls, with one warning per model, and gives the unpatched float64 model's logits exactly;
cast back, the model is fused again.
"""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from qkvfuse._verify import models as vm
from qkvfuse.testing.accuracy import MODEL_BF16_MAX_FACTOR, MODEL_BF16_RMS_FACTOR, MODEL_FP32_LOGIT_RTOL
from qkvfuse._verify.tiny_models import TINY_MODELS, attention_layers, build_tiny_model, clone_model, tiny_prompt
from qkvfuse.integrations import transformers as hf

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with vm.single_thread():
        yield


def _layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


# ------------------------------------------------------------------------------------------------------------
# torch.autocast over an fp32 model.
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["Qwen3", "GLM-4.7", "Qwen3-Next"])
def test_bf16_autocast_over_fp32_model(name, op_calls):
    model = build_tiny_model(name)
    assert next(model.parameters()).dtype == torch.float32
    ids = tiny_prompt(2, 9)
    with torch.no_grad():
        exact = clone_model(model, torch.float64)(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            unpatched = model(ids).logits.double()
            hf.apply_qkvfuse(model)
            hf._warned_unfused.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                patched = model(ids).logits.double()
                again = model(ids).logits.double()
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning) and "qkvfuse" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]  # one warning for every layer and both forwards
    assert "autocast" in str(ours[0].message)
    # The fused prepare ran in every layer of both forwards; the add+norm fell back.
    assert op_calls == {"split": 2 * attention_layers(model), "norm": 0}
    assert torch.equal(patched, again)
    assert torch.isfinite(patched).all()
    max_p, max_u = float((patched - exact).abs().max()), float((unpatched - exact).abs().max())
    rms_p, rms_u = (float((x - exact).pow(2).mean().sqrt()) for x in (patched, unpatched))
    assert rms_p <= MODEL_BF16_RMS_FACTOR * rms_u, (rms_p, rms_u)
    assert max_p <= MODEL_BF16_MAX_FACTOR * max_u, (max_p, max_u)
    # Outside autocast the same patched model fuses both ops again.
    op_calls.update(split=0, norm=0)
    with torch.no_grad():
        model(ids)
    assert op_calls == {"split": attention_layers(model), "norm": _layers(model)}


def test_mixed_dtype_attention_output_uses_the_unpatched_add_and_norm(monkeypatch, op_calls):
    """Without autocast, an attention output whose dtype differs from the residual's (e.g. a user hook casting
    it) gets exactly the unpatched layer's promoted add and norm."""
    model = build_tiny_model("Qwen3")
    ids = tiny_prompt(2, 7)
    layers = model.model.layers
    handles = [layer.self_attn.register_forward_hook(lambda m, a, out: (out[0].bfloat16(), out[1]))
               for layer in layers]
    with torch.no_grad():
        unpatched = model(ids).logits
        hf.apply_qkvfuse(model, backend="reference")
        hf._warned_unfused.clear()
        with pytest.warns(RuntimeWarning, match="torch.bfloat16 and a residual of dtype torch.float32"):
            patched = model(ids).logits
    for handle in handles:
        handle.remove()
    assert op_calls["norm"] == 0 and op_calls["split"] == _layers(model)
    scale = unpatched.abs().max().item()
    # The add+norm are the unpatched code; the fused prepare differs by fp32 rounding, then bf16 rounding.
    assert (patched - unpatched).abs().max().item() <= 2e-2 * scale


# ------------------------------------------------------------------------------------------------------------
# A dtype the ops do not take.
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_float64_after_patching_runs_the_model_code(name, op_calls):
    unpatched, patched = build_tiny_model(name), hf.apply_qkvfuse(build_tiny_model(name), backend="cpu")
    inputs = vm.model_inputs(unpatched, name, batch=2, length=8)
    for model in (unpatched, patched):
        model.set_experts_implementation("eager")  # transformers' grouped-mm experts have no float64 path
        model.double()
    hf._warned_unfused.clear()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, again = patched(**inputs).logits, patched(**inputs).logits
    ours = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "qkvfuse" in str(w.message)]
    assert len(ours) == 1, ours  # one for the model: every layer, both forwards
    assert "unfused code for activations of dtype torch.float64" in ours[0], ours
    assert op_calls == {"split": 0, "norm": 0}
    with torch.no_grad():
        want = unpatched(**inputs).logits
    assert got.dtype == torch.float64
    assert torch.equal(got, want) and torch.equal(again, want)
    for model in (unpatched, patched):
        model.float()
    with torch.no_grad():
        got, want = patched(**inputs).logits, unpatched(**inputs).logits
    assert op_calls == {"split": attention_layers(patched), "norm": _layers(patched)}
    assert vm.relative_error(got, want) <= MODEL_FP32_LOGIT_RTOL


# ------------------------------------------------------------------------------------------------------------
# Offloading.
# ------------------------------------------------------------------------------------------------------------
def _assert_refused_and_untouched(model, ids, expected, match):
    with pytest.raises(NotImplementedError, match=match):
        hf.apply_qkvfuse(model)
    assert not hf.is_patched(model)
    for layer in model.model.layers:
        assert "forward" not in vars(layer) and "forward" not in vars(layer.self_attn)
        assert not hasattr(layer.self_attn, "_qkvfuse")
    if expected is not None:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)


def test_meta_parameter_is_refused():
    model = build_tiny_model("Qwen3")
    q = model.model.layers[0].self_attn.q_proj
    q.weight = torch.nn.Parameter(torch.empty(q.weight.shape, device="meta"))
    _assert_refused_and_untouched(model, None, None, "offloaded.*meta device")


def test_accelerate_hook_is_refused():
    model = build_tiny_model("GLM-4.7")
    ids = tiny_prompt(1, 6)
    with torch.no_grad():
        expected = model(ids).logits
    model.model.layers[1].mlp._hf_hook = object()  # what accelerate's add_hook_to_module sets
    _assert_refused_and_untouched(model, ids, expected, "offloaded.*_hf_hook")


@pytest.mark.parametrize("device_map, refused", [
    ({"": "cpu"}, False),
    ({"model.embed_tokens": 0, "model.layers": 0, "model.norm": "cpu", "lm_head": "cpu"}, True),
    ({"model": "cpu", "lm_head": "disk"}, True),
])
def test_hf_device_map_with_offload_is_refused(device_map, refused):
    model = build_tiny_model("Qwen3")
    ids = tiny_prompt(1, 6)
    with torch.no_grad():
        expected = model(ids).logits
    model.hf_device_map = device_map
    if refused:
        _assert_refused_and_untouched(model, ids, expected, "offloaded.*hf_device_map")
    else:
        hf.apply_qkvfuse(model)
        assert hf.is_patched(model)


def test_real_accelerate_cpu_offload_is_refused(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    model = build_tiny_model("Qwen3")
    ids = tiny_prompt(1, 6)
    with torch.no_grad():
        expected = model(ids).logits
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    _assert_refused_and_untouched(model, ids, None, "offloaded")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)
