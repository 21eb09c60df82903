"""The plugin's KV-cache write on SGLang's own attention layers, built directly (no engine): the whole attention
forward (prepare, ``RadixAttention``, SGLang's ``torch_native`` backend on a real ``MHATokenToKVPool``) run by
SGLang's code, then by the fused layer, over a prefill of a prompt and two decode steps.

For Qwen3, Qwen3-MoE, GLM-4.7 and the gated Qwen3-Next / Qwen3.5 layers (these on the full-attention pool of a
``HybridLinearKVPool``, as their models hold it): the fused prepare writes the pool (its
bytes are SGLang's writer's on the same K and V, nothing else in the pool changes) and the attention runs with
``save_kv_cache=False``; the attention output equals SGLang's (fp32 within 1e-5 of its largest value). Then the rules: the
``intel_amx`` backend gets K/V as None in decode (its decode kernel would write them) and kept in extend; pools,
backends and options that do not qualify leave the write to SGLang (with the reason logged), and a ``verify`` or
``kv_cache: false`` layer never writes.
"""

import types

import pytest
import torch

from qkvfuse.integrations import sglang as plugin

from test_sglang_layers import GATED, LAYERS, MAX_POS, _gated_layer, _layer

PROMPT, SLOTS = 11, 64
CLASSES = ["qwen3", "qwen3-moe", "glm-4.7", "qwen3-next", "qwen3.5"]


def _build(name, dtype):
    if name not in GATED:
        return _layer(name, dtype)
    layer = _gated_layer(name, dtype)  # weights of the prepare only: the output projection given some too
    with torch.no_grad():
        weight = layer.o_proj.weight
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)).to(dtype) * 0.05)
    return layer


def _pool(layer, dtype, kv_dtype=None, start_layer=None):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    start = layer.attn.layer_id if start_layer is None else start_layer
    return MHATokenToKVPool(SLOTS, 1, kv_dtype or dtype, layer.num_kv_heads, layer.head_dim, 1, "cpu", False,
                            start_layer=start)


def _hybrid(pool, layer_id):
    """A ``HybridLinearKVPool`` whose full-attention sub-pool is ``pool`` (index 0) for layer ``layer_id``, as
    Qwen3-Next / Qwen3.5 engines hold it (its Mamba side left out: not used by full attention)."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    hybrid = HybridLinearKVPool.__new__(HybridLinearKVPool)
    hybrid.full_kv_pool, hybrid.use_mla, hybrid.full_attention_layer_id_mapping = pool, False, {layer_id: 0}
    hybrid.layer_transfer_counter, hybrid.start_layer = None, 0
    return hybrid


def _backend(pool, cls_name="TorchNativeAttnBackend"):
    from sglang.srt.layers.attention import intel_amx_backend, torch_native_backend

    req_to_token = torch.zeros(1, SLOTS, dtype=torch.int32)
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
                                   token_to_kv_pool=pool)
    if cls_name == "TorchNativeAttnBackend":
        return torch_native_backend.TorchNativeAttnBackend(runner)
    backend = intel_amx_backend.IntelAMXAttnBackend.__new__(intel_amx_backend.IntelAMXAttnBackend)
    backend.token_to_kv_pool, backend.req_to_token_pool = pool, runner.req_to_token_pool
    backend.use_mla, backend.swa_out_cache_loc = False, None
    return backend


def _steps(hidden_size, dtype):
    """(positions, hidden, forward batch fields) of a prefill of PROMPT tokens and two decode steps, the slots
    a scattered subset of the pool's."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    g = torch.Generator().manual_seed(3)
    slots = torch.randperm(SLOTS - 1, generator=g)[: PROMPT + 2] + 1  # slot 0: SGLang's padding slot
    steps = []
    for start, n, mode in ((0, PROMPT, ForwardMode.EXTEND), (PROMPT, 1, ForwardMode.DECODE),
                           (PROMPT + 1, 1, ForwardMode.DECODE)):
        batch = dict(forward_mode=mode, out_cache_loc=slots[start : start + n], req_pool_indices=torch.tensor([0]),
                     seq_lens=torch.tensor([start + n]), extend_prefix_lens=torch.tensor([start]),
                     extend_seq_lens=torch.tensor([n]), extend_prefix_lens_cpu=[start], extend_seq_lens_cpu=[n],
                     encoder_lens=None, global_num_token_non_padded_cpu=None, mha_return_lse=False)
        hidden = torch.randn(n, hidden_size, generator=g).to(dtype)
        steps.append((torch.arange(start, start + n), hidden, batch))
    return slots, steps


def _run(layer, backend, slots, steps, name):
    """The attention forward of each step (SGLang's, or the fused layer's); ``(outputs, [(k, v, save_kv_cache)]
    as the attention received them)``."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    backend.req_to_token_pool.req_to_token[0, : slots.numel()] = slots.to(torch.int32)
    seen, original = [], RadixAttention.forward

    def recorder(self, q, k, v, forward_batch, save_kv_cache=True, **kwargs):
        seen.append((None if k is None else k.clone(), None if v is None else v.clone(), save_kv_cache))
        return original(self, q, k, v, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    outs = []
    with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
        mp.setattr(RadixAttention, "forward", recorder)
        for positions, hidden, batch in steps:
            fb = types.SimpleNamespace(**batch)
            with forward_context(ForwardContext(attn_backend=backend)):
                if name in GATED:
                    out = layer.self_attention(positions=positions, hidden_states=hidden, forward_batch=fb)
                else:
                    out = layer(positions=positions, hidden_states=hidden, forward_batch=fb)
            outs.append(out.clone())
    return outs, seen


def _fuse(layer, **options):
    report = plugin.fuse_attention(layer, plugin.Options(attention=True, **options), context_len=MAX_POS)
    assert report.fused == {type(layer).__name__: 1}, report.lines()


@pytest.fixture
def layer_env(sglang_dist, monkeypatch):
    """SGLang's CUDA-only K/V write of Qwen3-MoE off (no pool of that kind here), Qwen3.5's gate multiply in
    PyTorch (SGLang's is a Triton kernel)."""
    from sglang.srt.models import qwen3_5, qwen3_moe

    monkeypatch.setattr(qwen3_moe, "enable_fused_set_kv_buffer", lambda forward_batch: False)
    monkeypatch.setattr(qwen3_5, "fused_sigmoid_mul", lambda out, gate, inplace=False, quant=False:
                        out * torch.sigmoid(gate.reshape(out.shape)))


@pytest.mark.parametrize("name", CLASSES)
def test_fused_layer_writes_the_pool_as_sglang_would(layer_env, name):
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    dtype = torch.float32
    layer = _build(name, dtype)
    slots, steps = _steps(layer.qkv_proj.input_size, dtype)
    pool_off, pool_on, pool_want = (_pool(layer, dtype, start_layer=0 if name in GATED else None)
                                    for _ in range(3))
    # the gated layers' models hold a HybridLinearKVPool: the full-attention sub-pool, layer ids translated
    outer = (lambda p: _hybrid(p, layer.attn.layer_id)) if name in GATED else (lambda p: p)
    want, seen_off = _run(layer, _backend(outer(pool_off)), slots, steps, name)
    assert all(s[2] for s in seen_off)  # SGLang's own forward: its attention writes the pool
    _fuse(layer)
    got, seen_on = _run(layer, _backend(outer(pool_on)), slots, steps, name)
    writer = outer(pool_want)
    for (k, v, save), (_, _, batch) in zip(seen_on, steps):
        assert save is False and k is not None and v is not None  # torch_native: K/V kept, its write skipped
        shape = (-1, layer.num_kv_heads, layer.head_dim)  # as RadixAttention views them
        writer.set_kv_buffer(layer.attn, KVWriteLoc(batch["out_cache_loc"]), k.view(shape), v.view(shape))
    for buf_on, buf_want, buf_off in zip(pool_on.k_buffer + pool_on.v_buffer,
                                         pool_want.k_buffer + pool_want.v_buffer,
                                         pool_off.k_buffer + pool_off.v_buffer):
        assert torch.equal(buf_on.view(torch.uint8), buf_want.view(torch.uint8))
        torch.testing.assert_close(buf_on, buf_off, rtol=2e-6, atol=2e-6)
    for a, b in zip(got, want):  # arithmetic-order noise of fp32 sums, relative to the output's scale
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def test_intel_amx_gets_no_kv_in_decode(layer_env):
    """``intel_amx``: extend keeps K/V (its kernel reads the new tokens from them), decode gets None (its kernel
    would write them); ``save_kv_cache=False`` in both. Its FP8 pools stay SGLang's."""
    layer = _build("qwen3", torch.bfloat16)
    slots, steps = _steps(layer.qkv_proj.input_size, torch.bfloat16)
    _fuse(layer)
    calls = []
    backend = _backend(_pool(layer, torch.bfloat16), "IntelAMXAttnBackend")

    def record(mode):
        def run(q, k, v, layer_, forward_batch, save_kv_cache=True, **kwargs):
            calls.append((mode, k is None, v is None, save_kv_cache))
            return q.new_zeros(q.shape[0], layer_.tp_q_head_num * layer_.v_head_dim)
        return run

    backend.forward_extend, backend.forward_decode = record("extend"), record("decode")
    _run(layer, backend, slots, steps, "qwen3")
    assert calls == [("extend", False, False, False), ("decode", True, True, False), ("decode", True, True, False)]
    assert backend.token_to_kv_pool.k_buffer[0][slots].abs().sum() > 0  # the fused op wrote every token's row

    fp8 = _backend(_pool(layer, torch.bfloat16, torch.float8_e4m3fn), "IntelAMXAttnBackend")
    plan = layer._qkvfuse_kv._decide(fp8, fp8.token_to_kv_pool, torch.empty(1, dtype=torch.bfloat16))
    assert plan == "an FP8 KV pool on IntelAMXAttnBackend (its kernels' own FP8 conversion)"


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_pool_rounds_once_and_saturates(layer_env, kv_dtype):
    """An FP8 pool (uint8 storage): the fused op stores the fp32 K/V rounded once to nearest even, saturated;
    SGLang's writer casts the activations (fp32 here: the same rounding) -- equal bytes, except that SGLang's cast
    of a value past e5m2's range gives inf where qkvfuse saturates (none here)."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    layer = _build("qwen3", torch.float32)
    slots, steps = _steps(layer.qkv_proj.input_size, torch.float32)
    _fuse(layer)
    pool, want = _pool(layer, torch.float32, kv_dtype), _pool(layer, torch.float32, kv_dtype)
    _, seen = _run(layer, _backend(pool), slots, steps, "qwen3")
    for (k, v, save), (_, _, batch) in zip(seen, steps):
        assert save is False
        shape = (-1, layer.num_kv_heads, layer.head_dim)
        want.set_kv_buffer(layer.attn, KVWriteLoc(batch["out_cache_loc"]), k.view(shape), v.view(shape))
    for a, b in zip(pool.k_buffer + pool.v_buffer, want.k_buffer + want.v_buffer):
        assert a.dtype == torch.uint8 and torch.equal(a, b)


def test_what_leaves_the_write_to_sglang(layer_env, monkeypatch):
    """A pool of another dtype or kind, another backend, the ``verify`` and ``kv_cache: false`` options: SGLang's
    attention writes (``save_kv_cache`` True as SGLang's code passes it), the reason logged once."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    layer = _build("qwen3", torch.float32)
    slots, steps = _steps(layer.qkv_proj.input_size, torch.float32)
    _fuse(layer)
    kv = layer._qkvfuse_kv
    x = torch.empty(1)
    fp16_pool = _pool(layer, torch.float16)
    assert kv._decide(_backend(fp16_pool), fp16_pool, x) == "KV pool dtype torch.float16 for torch.float32 activations"

    class OtherPool(MHATokenToKVPool):
        pass

    other = _pool(layer, torch.float32)
    other.__class__ = OtherPool
    assert kv._decide(_backend(other), other, x).startswith("KV pool OtherPool is not one qkvfuse writes")
    other.__class__ = MHATokenToKVPool
    other.use_hnd, other.kv_cache_layout = True, "hnd"
    assert "layout 'hnd'" in kv._decide(_backend(other), other, x)
    assert kv._decide(types.SimpleNamespace(), other, x) == (
        "attention backend SimpleNamespace is not one whose write qkvfuse takes over")

    for options in ({"kv_cache": False}, {"verify": True}):
        fresh = _build("qwen3", torch.float32)
        _fuse(fresh, **options)
        assert "_qkvfuse_kv" not in fresh.__dict__
        _, seen = _run(fresh, _backend(_pool(fresh, torch.float32)), slots, steps, "qwen3")
        assert all(s[2] for s in seen)

    logged = []
    monkeypatch.setattr(plugin, "_log_once", logged.append)
    plain = _build("qwen3", torch.float32)
    plugin.fuse_attention(plain, plugin.Options(attention=True), context_len=MAX_POS,
                          kv_untested="RadixAttention.forward differs")
    assert "_qkvfuse_kv" not in plain.__dict__
    assert logged == ["qkvfuse: left the KV-cache write of Qwen3Attention to SGLang: RadixAttention.forward differs"]
    _run(plain, _backend(_pool(plain, torch.float32)), slots, steps, "qwen3")
    fused = _build("qwen3", torch.float32)
    _fuse(fused)
    _run(fused, _backend(fp16_pool), slots, steps, "qwen3")  # a pool it does not write: the reason, once
    assert logged[1:] == ["qkvfuse: left the KV-cache write of Qwen3Attention to SGLang: KV pool dtype "
                          "torch.float16 for torch.float32 activations"]


def test_kv_sources_are_this_sglangs():
    assert plugin._kv_untested() is None
    assert set(plugin._KV_SOURCES) <= set(plugin.TESTED_SOURCES)
