"""SGLang engine latency, plugin on vs off (``make bench-sglang``;
``PYTHONPATH=bench:tests/_support/sglang_stubs python -m qkvfuse_bench.sglang`` from the repository root, in
``.venv-sglang``).

Two ``sgl.Engine`` instances on SGLang's CPU base platform (``device="cpu", attention_backend="torch_native"``),
one with ``QKVFUSE_SGLANG={"attention": true, "add_rmsnorm": true}`` and one without, each in a worker process of
its own (an engine's scheduler inherits the environment; one engine per process keeps SGLang's process-wide
state apart), alive side by side; rounds interleaved, the order flipped each round, round 0 a warm-up. Models:
2 layers with the published Qwen3-8B and GLM-4.7 attention geometry (the vLLM benchmark's configs: dummy
weights, vocab 10 240, bf16, GLM with 16 of its 160 routed experts). Per round: ms per prefill of 512 tokens
(one new token) and per decode step at batch 1 (16-token prompt: 17 new tokens minus 1, over 16). Random token
ids per round; radix cache off. ``--tiny`` shrinks the models and the prompt (a smoke run of this script, not a
measurement). SGLang's base platform imports ``vllm._custom_ops``: run with the tests' stand-in on
``PYTHONPATH`` (``make bench-sglang`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

ON = json.dumps({"attention": True, "add_rmsnorm": True})


def configs(tiny: bool = False) -> Dict[str, dict]:
    """The models (transformers ``config.json`` dicts); ``tiny``: the same kinds, shrunk."""
    from .vllm import _configs

    out = _configs()
    if tiny:
        for cfg in out.values():
            cfg.update(vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=1024)
            if "n_routed_experts" in cfg:
                cfg.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    return out


def _engine(model_dir: str):
    import sglang as sgl

    return sgl.Engine(model_path=model_dir, load_format="dummy", skip_tokenizer_init=True, device="cpu",
                      attention_backend="torch_native", dtype="bfloat16", disable_cuda_graph=True,
                      disable_radix_cache=True, mem_fraction_static=0.2, max_total_tokens=4096, random_seed=0,
                      log_level="warning")


def _worker(spec: dict) -> int:
    """One engine; reads ``prefill`` / ``decode`` commands (with token ids) on stdin, answers ``MS <value>``."""
    engine = _engine(spec["model_dir"])

    def timed(ids: List[int], new_tokens: int) -> float:
        params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
        t0 = time.perf_counter()
        engine.generate(input_ids=[ids], sampling_params=params)
        return (time.perf_counter() - t0) * 1e3

    print("READY", flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["phase"] == "prefill":
                ms = timed(cmd["ids"], 1)
            else:
                first = timed(cmd["ids"], 1)
                ms = (timed(cmd["ids"], 17) - first) / 16
            print(f"MS {ms}", flush=True)
    finally:
        engine.shutdown()
    return 0


class _Worker:
    def __init__(self, model_dir: str, qkvfuse_env: str):
        env = dict(os.environ)
        env.pop("QKVFUSE_SGLANG", None)
        if qkvfuse_env:
            env["QKVFUSE_SGLANG"] = qkvfuse_env
        # The worker runs this module by name: it needs bench/ on its path however the parent found it.
        bench_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (bench_dir, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "qkvfuse_bench.sglang", "--worker",
                                      json.dumps({"model_dir": model_dir})], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self._read("READY")

    def _read(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise RuntimeError(f"SGLang benchmark worker exited ({self.proc.wait()}) before {prefix!r}")

    def run(self, phase: str, ids: List[int]) -> float:
        self.proc.stdin.write(json.dumps({"phase": phase, "ids": ids}) + "\n")
        self.proc.stdin.flush()
        return float(self._read("MS "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def latency_rows(names, rounds: int, tiny: bool = False, log=print) -> List[Dict[str, object]]:
    import torch

    rows = []
    g = torch.Generator().manual_seed(0)
    prefill_len = 64 if tiny else 512
    for name in names:
        cfg = configs(tiny)[name]
        with tempfile.TemporaryDirectory() as model_dir:
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(cfg, f)
            t0 = time.perf_counter()
            workers = {"on": _Worker(model_dir, ON), "off": _Worker(model_dir, "")}
            log(f"{name}: engines ready in {time.perf_counter() - t0:.0f} s")
            samples = {(k, p): [] for k in workers for p in ("prefill", "decode")}
            try:
                for r in range(rounds + 1):  # round 0 warms up
                    order = list(workers) if r % 2 else list(reversed(list(workers)))
                    for key in order:
                        vocab = cfg["vocab_size"]
                        long = torch.randint(3, vocab, (prefill_len,), generator=g).tolist()
                        short = torch.randint(3, vocab, (16,), generator=g).tolist()
                        prefill = workers[key].run("prefill", long)
                        decode = workers[key].run("decode", short)
                        if r:
                            samples[(key, "prefill")].append(prefill)
                            samples[(key, "decode")].append(decode)
            finally:
                for w in workers.values():
                    w.close()
            for phase in ("prefill", "decode"):
                on, off = samples[("on", phase)], samples[("off", phase)]
                row = {"part": "latency", "engine": "sglang", "model": name, "phase": phase,
                       "on_ms": statistics.median(on), "off_ms": statistics.median(off),
                       "off_over_on": statistics.median(b / a for a, b in zip(on, off)), "rounds": rounds,
                       "tiny": tiny}
                rows.append(row)
                log(f"{name} {phase:8s} off {row['off_ms']:9.2f} ms  on {row['on_ms']:9.2f} ms  "
                    f"off/on x{row['off_over_on']:.3f}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qkvfuse_bench.sglang", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds after one warm-up round (at least 3 to report)")
    parser.add_argument("--model", action="append", choices=list(configs()), help="models (default both)")
    parser.add_argument("--tiny", action="store_true", help="shrunk models and prompt: a smoke run, not a measurement")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(json.loads(args.worker))
    from qkvfuse.benchmarks.report import unwritable

    reason = args.json and unwritable(args.json)
    if reason:  # before the run, not after it
        parser.error(f"--json {args.json}: {reason}")
    from qkvfuse.benchmarks.timing import machine_info

    print(json.dumps(machine_info()))
    rows = latency_rows(args.model or list(configs()), args.rounds, args.tiny)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
