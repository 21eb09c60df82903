"""The plugin's KV-cache write inside SGLang engines on CPU (the ``kv_cache`` option, on by default with
``attention``): bf16 activations with a bf16 pool and with an FP8 (``fp8_e4m3``) pool, the radix cache on.

The tiny Qwen3 as in test_sglang_engine (``torch_native`` attention, four requests of 5 to 40 tokens, 16-token
chunks, mixed chunks on, so steps mix extend and decode), served twice in each engine: the second pass hits the
radix cache (its prompts' prefixes are cached; only the last prompt token is prefilled). Inside the scheduler
every fused write is checked against SGLang's own writer run on the same K and V (``_support.sglang_kv_check``):
the bf16 pool's bytes identical; the FP8 pool's bytes identical except where SGLang's rounding of the
bf16-rounded K/V and qkvfuse's one rounding from fp32 fall on either side of a near tie (qkvfuse's byte is then
the rounding of a value within half a bf16 ulp of SGLang's input); nothing outside the written slots changes.
With the bf16 pool, greedy tokens equal the plugin off up to near ties (``assert_same_greedy``), logprobs close
before any parting.
"""

import pytest

from _support.sglang_engine import run_engines
from _support.vllm_engine import assert_same_greedy

ON = '{"attention": true, "add_rmsnorm": true}'
KV_CHECK = {"QKVFUSE_TEST_KV_CHECK": "1"}
RADIX = {"dtype": "bfloat16", "disable_radix_cache": False, "repeat": 2}
# bf16: the runs round activations at different points (qkvfuse once per op, SGLang after each step): a few bf16
# ulps of a logprob ~5 (the vLLM tests' bf16 margin).
TIE = 0.1
POOLS = {"bf16": {}, "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"}}

_runs = []


def _engines(tiny_dir):
    """SGLang off and the plugin on with a bf16 pool, then the plugin on with an FP8 pool (its writes are held to
    SGLang's writer by the near-tie rule inside the engine; an engine with the plugin off would only add a
    comparison of two differently rounded FP8 caches), in one child process."""
    if not _runs:
        _runs.extend(run_engines(tiny_dir("Qwen3"), [{"qkvfuse": None, **RADIX},
                                                     {"qkvfuse": ON, "env": KV_CHECK, **RADIX},
                                                     {"qkvfuse": ON, "env": KV_CHECK, **RADIX, **POOLS["fp8_e4m3"]}]))
    return _runs


@pytest.mark.parametrize("pool", list(POOLS))
def test_kv_cache_written_by_the_fused_op_with_radix_hits(tiny_dir, pool):
    off, on_bf16, on_fp8 = _engines(tiny_dir)
    on = on_bf16 if pool == "bf16" else on_fp8
    dtype = "torch.bfloat16" if pool == "bf16" else "torch.float8_e4m3fn"
    assert (f"qkvfuse: fused the KV-cache write of Qwen3Attention (MHATokenToKVPool {dtype}, "
            "TorchNativeAttnBackend)") in "\n".join(on.lines), on.lines
    assert not any("qkvfuse: left" in line for line in on.lines), on.lines
    assert on.counts["kv_writes"] == on.counts["attention"] > 0 and on.counts["rope"] == 0, on.counts
    assert on.counts["kv_bad"] == 0, on.counts
    # the second pass found its prompts in the radix cache
    assert on.counts["cached_tokens"] > 0, on.counts
    if pool == "fp8_e4m3":
        assert on.counts["kv_rows_differ"] > 0, on.counts  # SGLang's double rounding parts from qkvfuse's somewhere
        return
    assert on.counts["kv_rows_differ"] == 0, on.counts
    assert off.counts["cached_tokens"] > 0, off.counts
    assert_same_greedy(on.tokens, off, TIE)
    for got, want, a, b in zip(on.logprobs, off.logprobs, on.tokens, off.tokens):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        assert max([abs(x - y) for x, y in zip(got[:same], want[:same])], default=0.0) <= TIE
