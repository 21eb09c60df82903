"""Run SGLang engines on tiny random-weight models (helpers for tests/integrations/in_sglang and the benchmark).

SGLang runs here on its base platform (``device="cpu", attention_backend="torch_native"``: its own CPU backend
needs a CPU ``sgl_kernel`` build no registry has). Each ``sgl.Engine`` starts a scheduler subprocess (spawned:
the model, and so the plugin's work, live there), so a run is a child Python process that starts the engines one
after another and prints one ``RESULT`` line per engine; the plugin is switched per engine by ``$QKVFUSE_SGLANG``
in the environment the scheduler inherits. ``sitecustomize.py`` beside the stand-in ``vllm`` package
(``tests/_support/sglang_stubs``) counts the fused calls inside the scheduler when ``$QKVFUSE_TEST_COUNTS`` names
a folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, NamedTuple, Optional, Sequence

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUBS_DIR = os.path.join(TESTS_DIR, "_support", "sglang_stubs")

# The vLLM tests' prompts: with a 16-token chunk and mixed chunks on, the long prompts are prefilled in chunks
# while the short ones decode, so steps mix extend and decode tokens.
from .vllm_engine import NEW_TOKENS, PROMPTS, STEP_TOKENS  # noqa: E402

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "SGLANG_ENABLE_TORCH_COMPILE": "0"}


def child_env(extra: Optional[dict] = None) -> dict:
    """The environment of a child engine process: the stand-in ``vllm`` and tests/ on ``PYTHONPATH``."""
    env = {**os.environ, **OFFLINE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([STUBS_DIR, TESTS_DIR] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                 else []))
    env.pop("QKVFUSE_SGLANG", None)
    env.update(extra or {})
    return env


class Run(NamedTuple):
    tokens: List[List[int]]  # greedy tokens per prompt (per prompt and pass with "repeat")
    logprobs: List[List[float]]  # the chosen tokens' logprobs
    gaps: List[List[float]]  # logprob(chosen) - logprob(runner-up) per step: how close greedy was to a tie
    lines: List[str]  # the plugin's "qkvfuse: fused/left ..." log lines (all scheduler processes)
    counts: Dict[str, int]  # calls inside the scheduler process(es): fused "attention" / "norm", SGLang's "rope"
    log: str


def run_engines(model_dir: str, engines: Sequence[dict], timeout: int = 900) -> List[Run]:
    """Start one engine per entry of ``engines`` (``{"qkvfuse": env value or None, "dtype": ..., "env": {...},
    "repeat": passes, **sgl.Engine kwargs}``) in one child process, one after another, each generating
    :data:`PROMPTS` (``repeat`` times, one pass after another: the results of all passes in order)."""
    with tempfile.TemporaryDirectory() as counts_dir:
        spec = json.dumps({"model_dir": model_dir, "engines": list(engines), "counts_dir": counts_dir})
            # one pipe for stdout and stderr, the schedulers' included: each engine's log lines stay in order
        proc = subprocess.run([sys.executable, "-m", "_support.sglang_engine", spec], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=child_env(), timeout=timeout, cwd=TESTS_DIR)
    log = proc.stdout
    assert proc.returncode == 0, log[-6000:]
    runs, segment = [], []
    for line in log.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            text = "\n".join(segment)
            runs.append(Run(r["tokens"], r["logprobs"], r["gaps"], plugin_lines(text), r["counts"], text))
            segment = []
        else:
            segment.append(line)
    assert len(runs) == len(engines), log[-6000:]
    return runs


def _generate(engine_kwargs: dict, model_dir: str, counts_dir: str, index: int) -> dict:
    import sglang as sgl

    kwargs = dict(engine_kwargs)
    env_value = kwargs.pop("qkvfuse", None)
    extra_env = kwargs.pop("env", {})
    repeat = kwargs.pop("repeat", 1)  # generate the prompts again (radix-cache hits when the cache is on)
    counts_file = os.path.join(counts_dir, f"engine{index}")
    saved = dict(os.environ)
    os.environ.pop("QKVFUSE_SGLANG", None)
    if env_value is not None:
        os.environ["QKVFUSE_SGLANG"] = env_value
    os.environ["QKVFUSE_TEST_COUNTS"] = counts_file
    os.environ.update(extra_env)
    # mem_fraction_static: the share of free host memory that SGLang's weights + KV may take (others' processes
    # move "free" between its two readings); max_total_tokens keeps the KV cache small. log_level "info" is
    # SGLang's default: the plugin's line must show at it.
    base = dict(model_path=model_dir, skip_tokenizer_init=True, device="cpu", attention_backend="torch_native",
                tp_size=1, mem_fraction_static=0.2, max_total_tokens=2048, disable_cuda_graph=True, dtype="float32",
                random_seed=0, chunked_prefill_size=STEP_TOKENS, enable_mixed_chunk=True, disable_radix_cache=True,
                log_level="info")
    base.update(kwargs)
    engine = sgl.Engine(**base)
    try:
        passes = [engine.generate(input_ids=[list(p) for p in PROMPTS],
                                  sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS,
                                                   "ignore_eos": True},
                                  return_logprob=True, top_logprobs_num=2) for _ in range(repeat)]
    finally:
        engine.shutdown()
        os.environ.clear()
        os.environ.update(saved)
    outs = [o for p in passes for o in p]  # every pass's outputs, in order
    tokens, logprobs, gaps = [], [], []
    for o in outs:
        tokens.append(list(o["output_ids"]))
        chosen = o["meta_info"]["output_token_logprobs"]
        tops = o["meta_info"]["output_top_logprobs"]
        logprobs.append([c[0] for c in chosen])
        gaps.append([c[0] - max((t[0] for t in top if t[1] != c[1]), default=float("-inf"))
                     for c, top in zip(chosen, tops)])
    counts = {"attention": 0, "norm": 0, "rope": 0, "kv_writes": 0}
    for name in os.listdir(counts_dir):
        if name.startswith(f"engine{index}."):
            with open(os.path.join(counts_dir, name)) as f:
                for key, value in json.load(f).items():
                    counts[key] = counts.get(key, 0) + value
    counts["cached_tokens"] = sum(int(o["meta_info"].get("cached_tokens", 0)) for o in outs)
    return {"tokens": tokens, "logprobs": logprobs, "gaps": gaps, "counts": counts}


def main(argv: List[str]) -> int:
    spec = json.loads(argv[0])
    for i, engine_kwargs in enumerate(spec["engines"]):
        result = _generate(engine_kwargs, spec["model_dir"], spec["counts_dir"], i)
        print("RESULT " + json.dumps(result), flush=True)
    return 0


def plugin_lines(log: str) -> List[str]:
    """The plugin's log lines (``qkvfuse: fused ...`` / ``qkvfuse: left ...``) in an engine's output."""
    return [line for line in log.splitlines() if "qkvfuse: fused " in line or "qkvfuse: left " in line]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
