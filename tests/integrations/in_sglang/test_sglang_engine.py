"""The plugin inside SGLang engines on CPU, tiny random-weight models: engines and refusals.

``sgl.Engine(device="cpu", attention_backend="torch_native")`` on SGLang's base platform, fp32, four concurrent
requests of different lengths (5 to 40 tokens) with 16-token prefill chunks and mixed chunks on, so steps mix
extend and decode; greedy, 8 new tokens. The plugin is loaded through its entry point in SGLang's scheduler
process and switched by ``$QKVFUSE_SGLANG``; the fused calls are counted inside that process. Tokens with the
plugin on must equal those with it off and transformers' ``generate()`` (up to the vLLM tests' near-tie rule);
the chosen tokens' logprobs close. With the plugin on the fused prepare also writes SGLang's KV pool (the
``kv_cache`` option's default), and every such write is checked inside the scheduler against SGLang's own
writer on the same K and V (``_support.sglang_kv_check``: the fp32 pool's bytes identical, nothing else in the
pool changed). The refusals leave SGLang's tokens and logprobs bit-identical.

Tensor parallelism is not tested here: on SGLang 0.5.23's base platform every TP group of size > 1 builds a
PyNccl communicator (``parallel_state.init_model_parallel_group``: unless NPU / XPU / mooncake or an out-of-tree
platform that declares no PyNccl), which needs a CUDA device (``ValueError: Expected a cuda device, but got:
cpu``); SGLang's gloo CPU engine (``SGLANG_USE_CPU_ENGINE=1``) needs a CPU ``sgl_kernel`` no registry has.
"""

import pytest
import torch

from _support.sglang_engine import run_engines
from _support.vllm_engine import assert_same_greedy, hf_generate

ON = '{"attention": true, "add_rmsnorm": true}'
OVERLAP = '{"attention": true, "shared_expert_overlap": true}'
KV_CHECK = {"QKVFUSE_TEST_KV_CHECK": "1"}  # each fused KV-cache write checked against SGLang's writer
LOGPROB_ATOL = 1e-4  # fp32: arithmetic-order noise (the tie margin of assert_same_greedy too)
MODELS = {  # tiny model -> (the attention class SGLang builds, its rotary description, the decoder class)
    "Qwen3": ("Qwen3Attention", "rotary 128, neox", "Qwen3DecoderLayer"),
    "Qwen3-MoE": ("Qwen3MoeAttention", "rotary 128, neox", "Qwen3MoeDecoderLayer"),
    "GLM-4.7": ("Glm4MoeAttention", "rotary 64, neox", "Glm4MoeDecoderLayer"),  # partial 0.5, QK-norm, bias
}

_runs = {}


def _off_on(tiny_dir, name):
    """SGLang with the plugin loaded but off, then on (attention + add+RMSNorm; GLM: ``1``, attention only),
    in one child process; cached for the test run (the refusal tests compare against the off run)."""
    if name not in _runs:
        settings = [{"qkvfuse": None}, {"qkvfuse": "1" if name == "GLM-4.7" else ON, "env": KV_CHECK}]
        if name == "GLM-4.7":  # and with the MoE block's shared-expert overlap (inline on CPU: SGLang's bits)
            settings.append({"qkvfuse": OVERLAP})
        _runs[name] = run_engines(tiny_dir(name), settings)
    return _runs[name][:2]


def _assert_close_runs(on, off):
    assert_same_greedy(on.tokens, off, LOGPROB_ATOL)
    for got, want, a, b in zip(on.logprobs, off.logprobs, on.tokens, off.tokens):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))  # steps before any parting
        assert max([abs(x - y) for x, y in zip(got[:same], want[:same])], default=0.0) <= LOGPROB_ATOL


@pytest.mark.parametrize("name", list(MODELS))
def test_tokens_equal_plugin_off_and_transformers(tiny_dir, name):
    attention, rotary, decoder = MODELS[name]
    off, on = _off_on(tiny_dir, name)
    assert off.lines == [] and off.counts["attention"] == off.counts["norm"] == 0 and off.counts["rope"] > 0
    assert f"qkvfuse: fused 2/2 {attention} (cpu, {rotary})" in "\n".join(on.lines), on.log[-3000:]
    if name == "GLM-4.7":  # QKVFUSE_SGLANG=1: attention only
        assert on.counts["attention"] > 0 and on.counts["norm"] == 0, on.counts
    else:
        assert f"qkvfuse: fused 4/4 {decoder} add+RMSNorm (cpu)" in "\n".join(on.lines), on.lines
        assert on.counts["attention"] > 0 and on.counts["norm"] > 0, on.counts
    assert not any("qkvfuse: left" in line for line in on.lines), on.lines
    # every fused prepare wrote the pool (SGLang's writer skipped), byte for byte as SGLang's writer would have
    assert (f"qkvfuse: fused the KV-cache write of {attention} (MHATokenToKVPool torch.float32, "
            "TorchNativeAttnBackend)") in "\n".join(on.lines), on.lines
    assert on.counts["kv_writes"] == on.counts["attention"] > 0, on.counts
    assert on.counts["kv_rows_differ"] == on.counts["kv_bad"] == 0, on.counts
    # every attention layer's prepare ran fused (2 per forward) and SGLang's own RoPE never (the batches SGLang
    # forms depend on when the requests arrive, so the counts of two engines need not be equal)
    assert on.counts["attention"] % 2 == 0 and on.counts["rope"] == 0, on.counts
    _assert_close_runs(on, off)
    assert_same_greedy(hf_generate(tiny_dir(name), torch.float32), off, LOGPROB_ATOL)


def test_glm_shared_expert_overlap_in_the_engine(tiny_dir):
    """``shared_expert_overlap`` patches the MoE block in the scheduler process (logged); on CPU it runs inline,
    so the tokens are SGLang's."""
    _off_on(tiny_dir, "GLM-4.7")
    off, overlap = _runs["GLM-4.7"][0], _runs["GLM-4.7"][2]
    assert ("qkvfuse: fused 1/1 Glm4MoeSparseMoeBlock shared-expert overlap (side stream on cuda/xpu/npu, inline "
            "on cpu)") in "\n".join(overlap.lines), overlap.lines
    _assert_close_runs(overlap, off)


def test_plugin_not_loaded_and_untested_code_are_bit_identical_to_sglang(tiny_dir):
    """``SGLANG_PLUGINS`` naming another plugin (qkvfuse's entry point never loaded), and an SGLang whose
    ``Qwen3Attention.forward_prepare_native`` hashes differently (sitecustomize edits TESTED_SOURCES in the
    scheduler): tokens and logprobs bit-identical to SGLang with the plugin off; the refusal is logged."""
    off = _off_on(tiny_dir, "Qwen3")[0]
    unloaded, untested = run_engines(tiny_dir("Qwen3"), [
        {"qkvfuse": "1", "env": {"SGLANG_PLUGINS": "not-qkvfuse"}},
        {"qkvfuse": "1", "env": {"QKVFUSE_TEST_UNTESTED": "Qwen3Attention.forward_prepare_native"}},
    ])
    for run in (unloaded, untested):
        assert (run.tokens, run.logprobs) == (off.tokens, off.logprobs)
        assert run.counts["attention"] == run.counts["norm"] == run.counts["kv_writes"] == 0, run.counts
        assert run.counts["rope"] > 0, run.counts
    assert unloaded.lines == []
    assert any("qkvfuse: left 2/2 Qwen3Attention to SGLang: Qwen3Attention.forward_prepare_native differs from "
               "the SGLang versions" in line for line in untested.lines), untested.lines
