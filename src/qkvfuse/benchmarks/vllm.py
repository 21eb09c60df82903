"""Benchmarks against vLLM, run in the vLLM venv (``make bench-vllm``; ``python -m qkvfuse.benchmarks.vllm``).

``--part norm``: qkvfuse's in-place add+RMSNorm (:meth:`qkvfuse.AddRMSNorm.inplace`, :func:`qkvfuse.add_rmsnorm_`,
the bare op) against vLLM-CPU's in-place ``torch.ops._C.fused_add_rms_norm``, side by side in interleaved rounds
(:func:`qkvfuse.benchmarks.timing.measure`), bf16, hidden 4096 and 5120, T in {1, 16, 256, 4096}, hot buffers and
(T <= 16) buffers rotated past L2; weights in the activations' dtype, as in a bf16 model. The roofline is a copy
of the same bytes (both read x and residual and write them back). Also vLLM's ``RMSNorm(x, residual)`` layer as
vLLM-CPU runs it (its "native" IR implementation) and the same layer with the plugin's forward.

``--part latency``: ``vllm bench latency``-style engines on 2-layer models with the published Qwen3-8B and GLM-4.7
attention geometry (dummy weights, vocab 10 240, bf16, GLM with 16 of its 160 routed experts), plugin on
(``{"attention": true, "add_rmsnorm": true}``) and off, two engines alive side by side, rounds interleaved: ms per
decode step (batch 1, 16-token prompt) and per prefill of 512 tokens, eager and (``--mode compiled|both``) with
vLLM's torch.compile. Random token ids per round; prefix caching off.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch

import qkvfuse

from .timing import Budget, Candidate, machine_info, measure

HIDDEN = (4096, 5120)
TOKENS = (1, 16, 256, 4096)


def _norm_sets(T: int, H: int, n: int):
    g = torch.Generator().manual_seed(T * 7 + H)
    return [{"x": torch.randn(T, H, generator=g).to(torch.bfloat16),
             "residual": torch.randn(T, H, generator=g).to(torch.bfloat16)} for _ in range(n)]


def _vllm_layers(weight: torch.Tensor):
    """vLLM's ``RMSNorm`` layer as vLLM-CPU runs it, and the same layer with the plugin's forward."""
    import types

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    from ..integrations import vllm as plugin

    layers = []
    with set_current_vllm_config(VllmConfig()):
        for fused in (False, True):
            layer = RMSNorm(weight.shape[0], eps=1e-6, dtype=weight.dtype)
            layer.weight.data.copy_(weight)
            if fused:
                layer._qkvfuse = plugin._Norm(layer, None)
                layer.forward = types.MethodType(plugin._fused_norm_forward, layer)
            layers.append(layer)
    return layers


def norm_rows(budget: Budget, log=print) -> List[Dict[str, object]]:
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    vllm_op = torch.ops._C.fused_add_rms_norm.default
    bare = torch.ops.qkvfuse.add_rmsnorm_inplace.default
    rows = []
    l2 = 512 << 10
    for H in HIDDEN:
        weight = (1 + 0.1 * torch.randn(H)).to(torch.bfloat16)
        bound = qkvfuse.AddRMSNorm(weight, 1e-6)
        vllm_layer, fused_layer = _vllm_layers(weight)
        for T in TOKENS:
            layouts = [("hot", 1)] + ([("rotated", max(2, (4 * l2) // (4 * T * H * 2) + 1))] if T <= 16 else [])
            for layout, n in layouts:
                ours, theirs, funcs, bares, lv, lf = (_norm_sets(T, H, n) for _ in range(6))
                copy_src = [torch.randn(2, T, H).to(torch.bfloat16) for _ in range(n)]
                copy_dst = [torch.empty_like(s) for s in copy_src]
                candidates = [
                    Candidate("qkvfuse AddRMSNorm.inplace", "in place",
                              [lambda s=s: bound.inplace(s["x"], s["residual"]) for s in ours]),
                    Candidate("qkvfuse add_rmsnorm_", "in place",
                              [lambda s=s: qkvfuse.add_rmsnorm_(s["x"], s["residual"], weight, 1e-6) for s in funcs]),
                    Candidate("qkvfuse bare op", "in place",
                              [lambda s=s: bare(s["x"], s["residual"], weight, None, 1e-6) for s in bares]),
                    Candidate("vLLM RMSNorm layer", "as vLLM runs it",
                              [lambda s=s: vllm_layer(s["x"], s["residual"]) for s in lv]),
                    Candidate("vLLM RMSNorm layer + qkvfuse", "in place",
                              [lambda s=s: fused_layer(s["x"], s["residual"]) for s in lf]),
                    Candidate("vLLM _C.fused_add_rms_norm", "in place",
                              [lambda s=s: vllm_op(s["x"], s["residual"], weight, 1e-6) for s in theirs]),
                ]
                copies = [lambda d=d, s=s: d.copy_(s) for d, s in zip(copy_dst, copy_src)]
                with torch.inference_mode():
                    measured = measure(candidates, copies, budget)
                vllm_key = candidates[-1].key
                for c in candidates:
                    m = measured[c.key]
                    row = {"part": "norm", "hidden": H, "T": T, "buffers": layout, "impl": c.impl, "us": m.us,
                           "copy_us": m.copy_us, "roofline": m.roofline,
                           "vs_vllm": m.vs.get(vllm_key, 1.0), "rounds": m.rounds}
                    rows.append(row)
                    log(f"norm H={H} T={T:5d} {layout:8s} {c.impl:30s} {m.us:10.2f} us  "
                        f"{100 * m.roofline:5.1f}% of copy  x{row['vs_vllm']:.2f} vs vLLM")
    return rows


# --------------------------------------------------------------------------------------------------------
# Engine latency.
# --------------------------------------------------------------------------------------------------------
VOCAB = 10240


def _configs() -> Dict[str, dict]:
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, head_dim=128, max_position_embeddings=4096,
                  tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu", initializer_range=0.02)
    qwen3 = dict(common, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                 intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-6,
                 rope_theta=1e6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    glm = dict(common, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=5120,
               intermediate_size=12288, num_attention_heads=96, num_key_value_heads=8, rms_norm_eps=1e-5,
               partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, n_routed_experts=16,
               n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=1536, routed_scaling_factor=2.5,
               n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    return {"Qwen3-8B": qwen3, "GLM-4.7": glm}


def _engine(model_dir: str, on: bool, compiled: bool):
    from vllm import LLM

    return LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
               max_model_len=1024, enforce_eager=not compiled, enable_prefix_caching=False, seed=0,
               additional_config={"qkvfuse": {"attention": on, "add_rmsnorm": on}})


def _time_generate(llm, prompt: List[int], new_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, detokenize=False, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return (time.perf_counter() - t0) * 1e3


def latency_rows(names, compiled: bool, rounds: int, log=print) -> List[Dict[str, object]]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for name in names:
        with tempfile.TemporaryDirectory() as model_dir:
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(_configs()[name], f)
            t0 = time.perf_counter()
            engines = {"on": _engine(model_dir, True, compiled), "off": _engine(model_dir, False, compiled)}
            log(f"{name}: engines ready in {time.perf_counter() - t0:.0f} s ({'compiled' if compiled else 'eager'})")
            samples = {(k, p): [] for k in engines for p in ("prefill", "decode")}
            for r in range(rounds + 1):  # round 0 warms up
                order = list(engines) if r % 2 else list(reversed(list(engines)))
                for key in order:
                    llm = engines[key]
                    long = torch.randint(3, VOCAB, (512,), generator=g).tolist()
                    short = torch.randint(3, VOCAB, (16,), generator=g).tolist()
                    prefill = _time_generate(llm, long, 1)
                    first = _time_generate(llm, short, 1)
                    decode = (_time_generate(llm, short, 17) - first) / 16
                    if r:
                        samples[(key, "prefill")].append(prefill)
                        samples[(key, "decode")].append(decode)
            for phase in ("prefill", "decode"):
                on, off = samples[("on", phase)], samples[("off", phase)]
                ratio = statistics.median(b / a for a, b in zip(on, off))
                row = {"part": "latency", "model": name, "mode": "compiled" if compiled else "eager", "phase": phase,
                       "on_ms": statistics.median(on), "off_ms": statistics.median(off), "off_over_on": ratio,
                       "rounds": rounds}
                rows.append(row)
                log(f"{name} {row['mode']} {phase:8s} off {row['off_ms']:9.2f} ms  on {row['on_ms']:9.2f} ms  "
                    f"off/on x{ratio:.3f}")
            del engines
            gc.collect()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qkvfuse.benchmarks.vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["norm", "latency", "all"], default="all")
    parser.add_argument("--seconds", type=float, default=4.0, help="per norm cell")
    parser.add_argument("--rounds", type=int, default=5, help="latency rounds (after one warm-up round)")
    parser.add_argument("--mode", choices=["eager", "compiled", "both"], default="eager",
                        help="latency engines: eager (enforce_eager), vLLM's torch.compile, or both")
    parser.add_argument("--model", action="append", choices=list(_configs()), help="latency models (default both)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # an engine-core process per engine: two side by side
    print(json.dumps(machine_info()))
    rows = []
    if args.part in ("norm", "all"):
        rows += norm_rows(Budget(cell_s=args.seconds))
    if args.part in ("latency", "all"):
        names = args.model or list(_configs())
        for compiled in {"eager": (False,), "compiled": (True,), "both": (False, True)}[args.mode]:
            rows += latency_rows(names, compiled, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
