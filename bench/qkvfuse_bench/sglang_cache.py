"""The cache-writing split against qkvfuse's split + SGLang's own KV-pool writer, run in the SGLang venv
(``make bench-sglang-cache``; ``PYTHONPATH=bench:tests/_support/sglang_stubs python -m qkvfuse_bench.sglang_cache``
from the repository root, in ``.venv-sglang``).

Per preset (Qwen3-8B, GLM-4.5 attention geometry) and T in {1, 16, 256, 4096}, bf16, side by side in interleaved
rounds (:func:`qkvfuse.benchmarks.timing.measure`), each call doing the same job -- qkv's Q and K normed and
rotated in place, each token's K and V stored in one layer of an SGLang ``MHATokenToKVPool`` at its slot
(``out_cache_loc``: a shuffled set of free slots):

* ``qkvfuse QKNormRope.inplace_cache`` -- the bound fused call, the pool's layer buffers ``[size + page_size,
  kv_heads, head_dim]`` as qkvfuse's ``NHD`` with block size 1 (what the SGLang plugin passes);
* ``qkvfuse inplace + SGLang set_kv_buffer`` -- qkvfuse's bound in-place split, then the pool's own
  ``set_kv_buffer(layer, KVWriteLoc(loc), k, v)`` (what the plugin ran before it wrote the pool itself; an indexed
  assignment on a CPU without AMX; on an AMX CPU SGLang's ``_set_kv_buffer_impl`` calls ``sgl_kernel``'s
  ``store_cache_cpu`` instead, which this bench has not been run with).

The roofline is a copy of the same bytes (qkv read and written, K and V written). The ratios are medians of
per-round ratios; ``vs two-step`` > 1 means the fused call is faster; the run ends with the targets of
:func:`qkvfuse_bench.cache.targets`.
"""

from __future__ import annotations

import sys
import types
from typing import Dict, List

import torch

import qkvfuse
from qkvfuse.benchmarks.timing import Budget, Candidate, fixed_point_weights, measure, restorer

from .cache import FUSED, PRESETS, TOKENS, run

TWO_STEP = "qkvfuse inplace + SGLang set_kv_buffer"


def _pool(size: int, hkv: int, D: int, dtype: torch.dtype):
    """One layer of SGLang's token-to-KV pool on CPU (page size 1, NHD)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size, 1, dtype, hkv, D, 1, "cpu", False, start_layer=0, end_layer=0,
                            enable_alt_stream=False)


def cache_rows(budget: Budget, log=print, presets=PRESETS, tokens=TOKENS) -> List[Dict[str, object]]:
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    layer = types.SimpleNamespace(layer_id=0)  # set_kv_buffer reads the layer's id only
    warm = _pool(2, 1, 64, torch.bfloat16)  # SGLang's first write initialises lazily (a first cell's estimate)
    warm.set_kv_buffer(layer, KVWriteLoc(torch.tensor([1]), None), *(torch.zeros(1, 1, 64, dtype=torch.bfloat16),) * 2)
    rows: List[Dict[str, object]] = []
    for name in presets:
        p = qkvfuse.get_preset(name)
        hq, hkv, D = p.num_q_heads, p.num_kv_heads, p.head_dim
        table = qkvfuse.build_cos_sin_cache(p.rotary_dim, 8192, p.rope_theta)
        w = fixed_point_weights(torch.empty(D, dtype=torch.bfloat16))
        prep = qkvfuse.QKNormRope(hq, hkv, D, table, q_weight=w, k_weight=w, eps=p.rms_norm_eps)
        for T in tokens:
            g = torch.Generator().manual_seed(T)
            size = 2 * T + 16

            def one():
                pool = _pool(size, hkv, D, torch.bfloat16)
                loc = torch.randperm(size, generator=g)[:T] + 1  # slot 0 is SGLang's padding slot
                return {"qkv": torch.randn(T, p.qkv_width, generator=g).to(torch.bfloat16),
                        "positions": torch.randint(0, 8192, (T,), generator=g), "pool": pool, "loc": loc,
                        "write_loc": KVWriteLoc(loc, None)}

            fused, two = one(), one()

            def fused_call(s=fused):
                pool = s["pool"]
                prep.inplace_cache(s["qkv"], s["positions"], pool.k_buffer[0].unsqueeze(1),
                                   pool.v_buffer[0].unsqueeze(1), s["loc"])

            def two_step(s=two):
                q, k, v = prep.inplace(s["qkv"], s["positions"])
                s["pool"].set_kv_buffer(layer, s["write_loc"], k.view(T, hkv, D), v.view(T, hkv, D))

            candidates = [Candidate(FUSED, "in place + cache", [fused_call], restorer([fused["qkv"]])),
                          Candidate(TWO_STEP, "in place + cache", [two_step], restorer([two["qkv"]]))]
            copy_src = [torch.randn(T, p.qkv_width).to(torch.bfloat16),
                        torch.zeros(T, 2 * hkv * D, dtype=torch.bfloat16)]
            copy_dst = [torch.empty_like(c) for c in copy_src]
            copies = [lambda d=d, c=c: d.copy_(c) for d, c in zip(copy_dst, copy_src)]
            with torch.inference_mode():
                measured = measure(candidates, copies, budget)
            two_key = candidates[1].key
            for c in candidates:
                m = measured[c.key]
                row = {"part": "sglang_cache", "preset": name, "T": T, "cache": "bf16", "impl": c.impl, "us": m.us,
                       "copy_us": m.copy_us, "roofline": m.roofline, "vs_two_step": m.vs.get(two_key, 1.0),
                       "rounds": m.rounds}
                rows.append(row)
                log(f"sglang cache {name} T={T} bf16 {c.impl:40s} {m.us:10.2f} us  {100 * m.roofline:5.1f}% of copy  "
                    f"x{row['vs_two_step']:.2f} vs two-step")
    return rows


def main(argv=None) -> int:
    return run(argv, "python -m qkvfuse_bench.sglang_cache", __doc__, cache_rows)


if __name__ == "__main__":
    sys.exit(main())
