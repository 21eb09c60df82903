"""The plugin inside a running vLLM-CPU engine whose model is edited after load.

One engine with the plugin off (the reference) and one with it on (``{"attention": true, "add_rmsnorm": true}``)
receive the same edits through ``llm.apply_model``, in the order of ``_support.vllm_live.EDITS`` (weights swapped
by ``.data =``, ``model._apply`` then in-place updates, a replaced rotary module, swapped tables, one shorter than
``max_model_len``), with a greedy generation of the same prompts before and after each. Each edit must change the
plugin-off tokens (else the row proves nothing); after each, the plugin-on tokens and logprobs equal the
plugin-off ones (up to near ties, as in test_vllm_engine). A separate pair of engines serves a prompt past the
rotary table (``max_model_len`` above ``max_position_embeddings``): the attention layers are left to vLLM at load,
with a log line, and the engine keeps serving. About 1.5 minutes of CPU (four engines).
"""

import pytest

from _support import vllm_live
from _support.vllm_engine import PROMPTS, assert_same_greedy, generate, generate_with_edits
from qkvfuse.integrations import vllm as plugin

ON = {"attention": True, "add_rmsnorm": True}
TIE = 1e-4  # fp32: test_vllm_engine.LOGPROB_ATOL["float32"]


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


def _assert_equal_runs(on, off, what):
    assert_same_greedy(on.tokens, off, TIE)
    for got, want, a, b in zip(on.logprobs, off.logprobs, on.tokens, off.tokens):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))  # steps before any parting
        err = max([abs(x - y) for x, y in zip(got[:same], want[:same])], default=0.0)
        assert err <= TIE, f"{what}: logprobs differ by {err}"


def test_edits_of_the_running_model_are_followed(tiny_dir, plugin_log):
    model_dir = tiny_dir("Qwen3")
    names = list(vllm_live.EDITS)
    edits = list(vllm_live.EDITS.values())
    off = generate_with_edits(model_dir, "float32", {"attention": False}, edits, probe=vllm_live.fused_state)
    on = generate_with_edits(model_dir, "float32", ON, edits, probe=vllm_live.fused_state)
    assert off[0][0].fused == {} and on[0][0].fused == {"Qwen3Attention": 2, "RMSNorm": 4}
    problems = []  # every row is judged (one engine pair serves them all), then the failing ones are listed
    for step, ((off_run, _), (on_run, fused)) in enumerate(zip(off, on)):
        what = "before any edit" if step == 0 else names[step - 1]
        if step and off_run.tokens == off[step - 1][0].tokens:
            problems.append(f"{what}: the edit does not change vLLM's tokens")
        try:
            _assert_equal_runs(on_run, off_run, what)
        except AssertionError as exc:
            problems.append(f"{what}: plugin on != off: {exc}")
        # the fused path ran, except while the table is shorter than max_model_len (vLLM's code then)
        shorter = "shorter" in what
        if fused != [not shorter, not shorter]:
            problems.append(f"{what}: fused path taken per layer {fused}, expected {not shorter}")
    assert not problems, "\n".join(problems)
    assert any("Qwen3Attention runs vLLM's code after a change to the running model: its rotary table has 64 "
               "rows, fewer than max_model_len 128" in m for m in plugin_log), plugin_log


def test_prompt_past_the_rotary_table_is_left_to_vllm(tiny_dir, tmp_path, monkeypatch, plugin_log):
    """max_position_embeddings 256, max_model_len 400 (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1), a 300-token prompt beside a
    short one: qkvfuse leaves the attention layers to vLLM at load (log line), fuses the norms, and the engine
    serves both. Only the short prompt's tokens are compared: past its table vLLM-CPU's own rotation reads
    memory beyond the table (its kernel does not bound-check positions), so two plugin-off engines already give
    different tokens for the long prompt."""
    from qkvfuse._verify.tiny_models import build_tiny_model, tiny_config

    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    config = tiny_config("Qwen3")
    config.max_position_embeddings = 256
    model_dir = str(tmp_path / "qwen3-256")
    build_tiny_model("Qwen3", config=config).save_pretrained(model_dir)
    prompts = [PROMPTS[1], tuple((5 * i) % 200 + 3 for i in range(300))]
    runs = {}
    for label, entry in (("off", {"attention": False}), ("on", ON)):
        runs[label] = generate(model_dir, "float32", entry, prompts=prompts, max_model_len=400,
                               enable_prefix_caching=False)
    assert runs["on"].fused == {"RMSNorm": 4}, runs["on"].fused
    assert any("left 2/2 Qwen3Attention to vLLM: its rotary table has 256 rows, fewer than max_model_len 400" in m
               for m in plugin_log), plugin_log
    assert [len(t) for t in runs["on"].tokens] == [8, 8]
    short = runs["on"]._replace(tokens=runs["on"].tokens[:1], logprobs=runs["on"].logprobs[:1])
    _assert_equal_runs(short, runs["off"], "the short prompt beside one past the rotary table")
