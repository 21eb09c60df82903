"""Benchmarks against vLLM (and zentorch), run in the vLLM venv (``make bench-vllm``;
``PYTHONPATH=bench python -m qkvfuse_bench.vllm`` from the repository root, in ``.venv-vllm``).

``--part split``: qkvfuse's in-place attention-prepare (:meth:`qkvfuse.QKNormRope.inplace`,
:func:`qkvfuse.split_qkv_rmsnorm_rope_`, the bare op) against the fastest composition of vLLM-CPU's C ops -- QK-norm
by ``torch.ops._C.rms_norm`` on ``[T*H, D]`` into preallocated outputs (vLLM's CPU kernel ignores strides: for T > 1
the Q/K column slices are first copied into preallocated contiguous buffers; a fresh copy page-faults, 10-57 ms at
T = 4096 on a Zen 5), then ``torch.ops._C.rotary_embedding`` in place with a
bf16 table (vLLM casts its table to the model dtype), V left as a view -- for the Qwen3-8B and GLM-4.5 geometry,
bf16, T in {1, 16, 256, 4096}, side by side in interleaved rounds; the roofline is a copy of the qkv bytes.

``--part norm``: qkvfuse's in-place add+RMSNorm (:meth:`qkvfuse.AddRMSNorm.inplace`, :func:`qkvfuse.add_rmsnorm_`,
the bare op) against vLLM-CPU's in-place ``torch.ops._C.fused_add_rms_norm``, side by side in interleaved rounds
(:func:`qkvfuse.benchmarks.timing.measure`), bf16, hidden 4096 and 5120, T in {1, 16, 256, 4096}, hot buffers and
(T <= 16) buffers rotated past L2; weights in the activations' dtype, as in a bf16 model. The roofline is a copy
of the same bytes (both read x and residual and write them back). Also vLLM's ``RMSNorm(x, residual)`` layer as
vLLM-CPU runs it (its "native" IR implementation) and the same layer with the plugin's forward, and zentorch's
in-place ``torch.ops.zentorch.zentorch_add_rms_norm_`` (AMD's ZenDNN plugin for PyTorch) when it is installed.
First, per hidden size, each in-place op's accuracy on the same rows (:func:`_norm_accuracy`).

``--part gated``: the gated attention-prepare of Qwen3-Next / Qwen3.5 full-attention layers (``[q_gate | k | v]`` rows,
Gemma QK-norm, partial NeoX RoPE 64 of 256 dims; Qwen3.5 with interleaved mRoPE and ``[3, T]`` positions):
qkvfuse's bound in-place call (:meth:`qkvfuse.QKNormRope.inplace` with ``q_gate=True, gemma_norm=True``: q, k, v,
gate as column views), its ``out=`` call and the bare op against vLLM-CPU's own unfused path
(``Qwen3NextAttention._project_qkv_gate`` run on vLLM's ``GemmaRMSNorm`` and ``get_rope`` modules: what vLLM-CPU runs,
its fused Triton kernel being CUDA/XPU only) and transformers' eager path (``Qwen3_5Attention.forward``'s chunk,
``Qwen3_5RMSNorm`` and ``apply_rotary_pos_emb``, cos/sin precomputed as the model does once per forward), bf16,
T in {1, 16, 256, 4096}, the Qwen3.5-27B and Qwen3-Next-80B-A3B geometry; the roofline is a copy of the qkv bytes.

``--part latency``: ``vllm bench latency``-style engines on 2-layer models with the published Qwen3-8B and GLM-4.7
attention geometry (dummy weights, vocab 10 240, bf16, GLM with 16 of its 160 routed experts), plugin on
(eager: ``{"attention": true, "add_rmsnorm": true}``; compiled: ``{"attention": true}``, :data:`COMPILED_PARTS`) and
off, two engines alive side by side, rounds interleaved (ABBA): per round one batch-1 request of 512 random tokens
generating 33 on each engine, timed by the engine core's own request timestamps -- ms of the prefill (scheduled
to first token) and per decode step (first to last token) -- eager and (``--mode compiled|both``) with vLLM's
torch.compile; prefix caching off. Rows give the medians, the
median per-round ratio off/on and the ratio of the fastest rounds. ``--one-engine``: one engine alive at a time,
re-created every round. ``--fuse attention|add_rmsnorm``: only those parts of the plugin in the "on" engine;
``--kv-cache on|off``: its fused attention layers write vLLM's KV cache themselves (the plugin's default) or not.

``--part graph`` (not in ``all``): vLLM's compiled mode in one layer, without an engine -- the input norm, the QKV
GEMM, the prepare, an opaque attention stand-in, o_proj and the post-attention norm compiled with vLLM's native
code (which inductor fuses into its own kernels) and with each part of the plugin fused (the prepare, the norms,
both: qkvfuse's in-place ops), T in {1, 16, 512}, the compiled functions in turn; and the cost of one op call
from Python after the caches were evicted (what each extern call in inductor's wrapper pays after a GEMM);
:func:`graph_rows`.

``--part profile`` (not in ``all``): where a step's time goes, plugin on and off -- both engines re-created every
round, each in a fresh process, ABBA; :func:`profile_rows`.

At the end, the team's targets against vLLM-CPU and zentorch judged on the run's rows (:func:`targets`: the split's and the norm's bound in-place
calls against the peers in every cell, the split at T = 4096 against the copy, engines with the plugin against
without), each MET or MISSED; ``--json`` writes them too (``"part": "targets"``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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

from qkvfuse._library import encode_rope
from qkvfuse.benchmarks.report import unwritable
from qkvfuse.benchmarks.timing import Budget, Candidate, fixed_point_weights, machine_info, measure, restorer

HIDDEN = (4096, 5120)
TOKENS = (1, 16, 256, 4096)
# The candidates' names that :func:`targets` judges (the bound in-place calls) and shows beside them (the bare op)
_SPLIT_BOUND, _NORM_BOUND, _BARE = "qkvfuse QKNormRope.inplace", "qkvfuse AddRMSNorm.inplace", "qkvfuse bare op"


def _norm_sets(T: int, H: int, n: int):
    g = torch.Generator().manual_seed(T * 7 + H)
    return [{"x": torch.randn(T, H, generator=g).to(torch.bfloat16),
             "residual": torch.randn(T, H, generator=g).to(torch.bfloat16)} for _ in range(n)]


def _vllm_layers(weight: torch.Tensor):
    """vLLM's ``RMSNorm`` layer as vLLM-CPU runs it, and the same layer with the plugin's forward."""
    import types

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    from qkvfuse.integrations import vllm as plugin

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


def _zentorch_add_rms_norm():
    """zentorch's in-place add+RMSNorm op (y over x, the sum over residual), or None when zentorch is absent."""
    try:
        import zentorch  # noqa: F401  (registers torch.ops.zentorch)
    except Exception:  # not installed, or built for another torch: the row is left out
        return None
    return torch.ops.zentorch.zentorch_add_rms_norm_.default


def _load_vllm_ops(isa: str) -> str:
    """Load vLLM-CPU's C ops (``torch.ops._C``) built for ``isa`` and return the library's file name.

    ``native``: the library vLLM picks for this CPU (``_C``: AVX-512 with BF16; ``_C_AVX512``; ``_C_AVX2``).
    ``avx2``: ``_C_AVX2``, the library vLLM-CPU loads on a CPU without AVX-512 -- for timing a forced AVX2 build of
    qkvfuse (``QKVFUSE_CPU_CAPABILITY=AVX2``) against vLLM's code for the same instruction set. vLLM chooses the
    library from ``torch.cpu._is_avx512_supported()`` when its ops are first imported, so the choice is made
    before that import and holds for the process."""
    if isa == "avx2":
        torch.cpu._is_avx512_supported = lambda: False
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    with open("/proc/self/maps") as f:
        names = {os.path.basename(line.split()[-1]) for line in f if "/vllm/_C" in line}
    return ", ".join(sorted(names)) or "?"


def _measured_rows(fields: Dict[str, object], candidates: List[Candidate], copy_src: List[torch.Tensor],
                   budget: Budget, log) -> List[Dict[str, object]]:
    """Time ``candidates`` side by side (the last one is vLLM's, the ratios' base) against a copy of ``copy_src``;
    one row each, ``fields`` first, each also logged."""
    copy_dst = [torch.empty_like(c) for c in copy_src]
    copies = [lambda d=d, c=c: d.copy_(c) for d, c in zip(copy_dst, copy_src)]
    with torch.inference_mode():
        measured = measure(candidates, copies, budget)
    vllm_key, rows = candidates[-1].key, []
    zentorch_key = next((c.key for c in candidates if c.impl.startswith("zentorch")), None)
    label = " ".join(f"{k}={v}" for k, v in fields.items() if k != "part")
    for c in candidates:
        m = measured[c.key]
        rows.append({**fields, "impl": c.impl, "us": m.us, "copy_us": m.copy_us, "roofline": m.roofline,
                     "vs_vllm": m.vs.get(vllm_key, 1.0), "rounds": m.rounds})
        versus = f"x{rows[-1]['vs_vllm']:.2f} vs vLLM"
        if zentorch_key is not None:  # the median of the per-round ratios, like vs_vllm
            rows[-1]["vs_zentorch"] = m.vs.get(zentorch_key, 1.0)
            versus += f"  x{rows[-1]['vs_zentorch']:.2f} vs zentorch"
        log(f"{fields['part']} {label} {c.impl:40s} {m.us:10.2f} us  {100 * m.roofline:5.1f}% of copy  {versus}")
    return rows


def _norm_accuracy(H: int, weight: torch.Tensor, ops: Dict[str, object], log) -> Dict[str, object]:
    """Each in-place op of ``ops`` (name -> ``f(x, residual)``) once on the same 256 random bf16 rows: the mean
    absolute error of its ``y`` against the float64 oracle (from the bf16 sum, as the spec says) and the share of
    its bf16 sums that are not the fp32 sum rounded to nearest even (the unfused add's value)."""
    from qkvfuse.testing import oracle_add_rmsnorm

    (inputs,) = _norm_sets(256, H, 1)
    x, r = inputs["x"], inputs["residual"]
    want_y, want_sum = oracle_add_rmsnorm(x, r, weight), x + r
    row: Dict[str, object] = {"part": "norm accuracy", "hidden": H, "T": 256}
    for name, f in ops.items():
        y, s = x.clone(), r.clone()
        f(y, s)
        row[name] = {"y_mean_abs_err": (y.double() - want_y).abs().mean().item(),
                     "sum_not_rne": (s != want_sum).double().mean().item()}
    base = row["qkvfuse"]["y_mean_abs_err"]
    log(f"norm accuracy hidden={H} T=256 (y: mean |err| vs float64, x of qkvfuse's; sums not rounded to nearest "
        "even): " + "; ".join(f"{n} {v['y_mean_abs_err']:.3e} (x{v['y_mean_abs_err'] / base:.2f}), "
                              f"{100 * v['sum_not_rne']:.1f}%" for n, v in row.items() if isinstance(v, dict)))
    return row


def norm_rows(budget: Budget, log=print) -> List[Dict[str, object]]:
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    zentorch_op = _zentorch_add_rms_norm()
    vllm_op = torch.ops._C.fused_add_rms_norm.default
    bare = torch.ops.qkvfuse.add_rmsnorm_inplace.default
    rows = []
    l2 = 512 << 10
    for H in HIDDEN:
        weight = (1 + 0.1 * torch.randn(H)).to(torch.bfloat16)
        bound = qkvfuse.AddRMSNorm(weight, 1e-6)
        vllm_layer, fused_layer = _vllm_layers(weight)
        peers = {"qkvfuse": bound.inplace, "vLLM _C.fused_add_rms_norm": lambda x, r: vllm_op(x, r, weight, 1e-6)}
        if zentorch_op is not None:
            peers["zentorch_add_rms_norm_"] = lambda x, r: zentorch_op(x, weight, r, 1e-6)
        with torch.inference_mode():
            rows.append(_norm_accuracy(H, weight, peers, log))
        for T in TOKENS:
            layouts = [("hot", 1)] + ([("rotated", max(2, (4 * l2) // (4 * T * H * 2) + 1))] if T <= 16 else [])
            for layout, n in layouts:
                ours, theirs, funcs, bares, lv, lf, zen = (_norm_sets(T, H, n) for _ in range(7))
                copy_src = [torch.randn(2, T, H).to(torch.bfloat16) for _ in range(n)]
                candidates = [
                    Candidate(_NORM_BOUND, "in place",
                              [lambda s=s: bound.inplace(s["x"], s["residual"]) for s in ours], _norm_reset(ours)),
                    Candidate("qkvfuse add_rmsnorm_", "in place",
                              [lambda s=s: qkvfuse.add_rmsnorm_(s["x"], s["residual"], weight, 1e-6) for s in funcs],
                              _norm_reset(funcs)),
                    Candidate(_BARE, "in place",
                              [lambda s=s: bare(s["x"], s["residual"], weight, None, 1e-6) for s in bares],
                              _norm_reset(bares)),
                    Candidate("vLLM RMSNorm layer", "as vLLM runs it",
                              [lambda s=s: vllm_layer(s["x"], s["residual"]) for s in lv], _norm_reset(lv)),
                    Candidate("vLLM RMSNorm layer + qkvfuse", "in place",
                              [lambda s=s: fused_layer(s["x"], s["residual"]) for s in lf], _norm_reset(lf)),
                ]
                if zentorch_op is not None:
                    candidates.append(Candidate("zentorch_add_rms_norm_", "in place",
                                                [lambda s=s: zentorch_op(s["x"], weight, s["residual"], 1e-6)
                                                 for s in zen], _norm_reset(zen)))
                candidates.append(Candidate("vLLM _C.fused_add_rms_norm", "in place",
                                            [lambda s=s: vllm_op(s["x"], s["residual"], weight, 1e-6)
                                             for s in theirs], _norm_reset(theirs)))
                rows += _measured_rows({"part": "norm", "hidden": H, "T": T, "buffers": layout}, candidates,
                                       copy_src, budget, log)
    return rows


def _norm_reset(sets):
    """The reset of in-place norm candidates over ``sets``: their x and residual as first made."""
    return restorer([s[k] for s in sets for k in ("x", "residual")])


SPLIT_PRESETS = ("Qwen3-8B", "GLM-4.5")


def split_rows(budget: Budget, log=print) -> List[Dict[str, object]]:
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    rms_norm, rotary = torch.ops._C.rms_norm.default, torch.ops._C.rotary_embedding.default
    bare = torch.ops.qkvfuse.split_qkv_rmsnorm_rope_inplace.default
    rows = []
    l2 = 512 << 10
    for name in SPLIT_PRESETS:
        p = qkvfuse.get_preset(name)
        hq, hkv, D = p.num_q_heads, p.num_kv_heads, p.head_dim
        qw, kw = hq * D, hkv * D
        cache = qkvfuse.build_cos_sin_cache(p.rotary_dim, 8192, p.rope_theta)
        cache16 = cache.to(torch.bfloat16)  # vLLM's RotaryEmbedding casts its table to the model dtype
        # The in-place forms rewrite one buffer again and again: weights that keep it at a fixed point, and the
        # buffer restored before each block (no denormals: timing.fixed_point_weights), the same for every candidate.
        wq = wk = fixed_point_weights(torch.empty(D, dtype=torch.bfloat16))
        prep = qkvfuse.QKNormRope(hq, hkv, D, cache, q_weight=wq, k_weight=wk, eps=p.rms_norm_eps)
        static = (cache, wq, wk, None, None, hq, hkv, p.rms_norm_eps, encode_rope(True))
        for T in TOKENS:
            nbytes = T * p.qkv_width * 2
            layouts = [("hot", 1)] + ([("rotated", max(2, (4 * l2) // nbytes + 1))] if T <= 16 else [])
            for layout, n in layouts:
                g = torch.Generator().manual_seed(T)

                def sets():
                    return [{"qkv": torch.randn(T, p.qkv_width, generator=g).to(torch.bfloat16),
                             "positions": torch.randint(0, 8192, (T,), generator=g),
                             "qn": torch.empty(T * hq, D, dtype=torch.bfloat16),
                             "kn": torch.empty(T * hkv, D, dtype=torch.bfloat16),
                             "qc": torch.empty(T, qw, dtype=torch.bfloat16),
                             "kc": torch.empty(T, kw, dtype=torch.bfloat16)} for _ in range(n)]

                ours, funcs, bares, theirs = sets(), sets(), sets(), sets()

                def vllm_call(s):
                    qkv = s["qkv"]
                    q, k = qkv[:, :qw], qkv[:, qw:qw + kw]
                    if T > 1:  # strided column slices: into preallocated contiguous buffers (fresh ones page-fault)
                        q, k = s["qc"].copy_(q), s["kc"].copy_(k)
                    rms_norm(s["qn"], q.view(T * hq, D), wq, p.rms_norm_eps)
                    rms_norm(s["kn"], k.view(T * hkv, D), wk, p.rms_norm_eps)
                    rotary(s["positions"], s["qn"].view(T, qw), s["kn"].view(T, kw), D, cache16, True)
                    return s["qn"], s["kn"], qkv[:, qw + kw:]

                candidates = [
                    Candidate(_SPLIT_BOUND, "in place",
                              [lambda s=s: prep.inplace(s["qkv"], s["positions"]) for s in ours], _qkv_reset(ours)),
                    Candidate("qkvfuse split_qkv_rmsnorm_rope_", "in place",
                              [lambda s=s: qkvfuse.split_qkv_rmsnorm_rope_(
                                  s["qkv"], s["positions"], cache, hq, hkv, D, q_weight=wq, k_weight=wk,
                                  eps=p.rms_norm_eps) for s in funcs], _qkv_reset(funcs)),
                    Candidate(_BARE, "in place",
                              [lambda s=s: bare(s["qkv"], s["positions"], *static) for s in bares],
                              _qkv_reset(bares)),
                    Candidate("vLLM _C.rms_norm + _C.rotary_embedding", "q/k out, v view",
                              [lambda s=s: vllm_call(s) for s in theirs]),
                ]
                copy_src = [torch.randn(T, p.qkv_width).to(torch.bfloat16) for _ in range(n)]
                rows += _measured_rows({"part": "split", "preset": name, "T": T, "buffers": layout}, candidates,
                                       copy_src, budget, log)
    return rows


def _qkv_reset(sets):
    """The reset of in-place split candidates over ``sets``: their qkv as first made (vLLM's reads it only)."""
    return restorer([s["qkv"] for s in sets])


GATED_PRESETS = ("Qwen3.5-27B", "Qwen3-Next-80B-A3B")


def _vllm_gated_prepare(p, cache_dtype=torch.bfloat16):
    """vLLM-CPU's unfused gated prepare for preset ``p``: ``Qwen3NextAttention._project_qkv_gate`` bound to an object
    holding vLLM's own q/k ``GemmaRMSNorm`` and rotary modules (the attributes that method reads)."""
    import types

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.models.qwen3_next import Qwen3NextAttention

    rope_parameters = {"rope_type": "default", "rope_theta": p.rope_theta,
                       "partial_rotary_factor": p.rotary_dim / p.head_dim}
    if p.mrope_section:
        rope_parameters.update(mrope_section=list(p.mrope_section), mrope_interleaved=p.mrope_interleaved)
    with set_current_vllm_config(VllmConfig()):
        layer = types.SimpleNamespace(
            use_fused_qk_norm_rope_gate=False, attn_output_gate=True, num_heads=p.num_q_heads,
            num_kv_heads=p.num_kv_heads, head_dim=p.head_dim, q_size=p.num_q_heads * p.head_dim,
            kv_size=p.num_kv_heads * p.head_dim,
            q_norm=GemmaRMSNorm(p.head_dim, eps=p.rms_norm_eps), k_norm=GemmaRMSNorm(p.head_dim, eps=p.rms_norm_eps),
            rotary_emb=get_rope(head_size=p.head_dim, max_position=8192, rope_parameters=rope_parameters,
                                dtype=cache_dtype))
    return layer, types.MethodType(Qwen3NextAttention._project_qkv_gate, layer)


def _transformers_gated_prepare(p, wq, wk):
    """transformers' eager gated prepare (``Qwen3_5Attention.forward`` up to attention) on a packed qkv row."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    q_norm, k_norm = hf.Qwen3_5RMSNorm(p.head_dim, p.rms_norm_eps), hf.Qwen3_5RMSNorm(p.head_dim, p.rms_norm_eps)
    q_norm.weight.data, k_norm.weight.data = wq.clone(), wk.clone()
    q_norm.to(torch.bfloat16), k_norm.to(torch.bfloat16)
    cache = qkvfuse.build_cos_sin_cache(p.rotary_dim, 8192, p.rope_theta)
    qw, kw = p.num_q_heads * p.head_dim, p.num_kv_heads * p.head_dim

    def cos_sin(positions):  # once per forward in the model: not timed
        half = p.rotary_dim // 2
        rows = cache[positions if positions.dim() == 1 else positions[0]]
        cos = torch.cat([rows[:, :half]] * 2, -1).to(torch.bfloat16)[None]
        sin = torch.cat([rows[:, half:]] * 2, -1).to(torch.bfloat16)[None]
        return cos, sin

    def call(qkv, cos, sin):
        T = qkv.shape[0]
        q, gate = torch.chunk(qkv[None, :, : 2 * qw].view(1, T, -1, p.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(1, T, -1)
        q = q_norm(q.view(1, T, -1, p.head_dim)).transpose(1, 2)
        k = k_norm(qkv[None, :, 2 * qw : 2 * qw + kw].view(1, T, -1, p.head_dim)).transpose(1, 2)
        v = qkv[None, :, 2 * qw + kw :].view(1, T, -1, p.head_dim).transpose(1, 2)
        q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v, gate

    return cos_sin, call


def gated_rows(budget: Budget, log=print) -> List[Dict[str, object]]:
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    bare = torch.ops.qkvfuse.split_qkv_rmsnorm_rope_inplace.default
    rows = []
    for name in GATED_PRESETS:
        p = qkvfuse.get_preset(name)
        hq, hkv, D = p.num_q_heads, p.num_kv_heads, p.head_dim
        width, qw = (2 * hq + 2 * hkv) * D, hq * D
        mrope = bool(p.mrope_section)
        cache = qkvfuse.build_cos_sin_cache(p.rotary_dim, 8192, p.rope_theta)
        # Gemma weights (centred at 0) that keep the in-place forms' one buffer at a fixed point, restored before
        # each block (no denormals: timing.fixed_point_weights), the same for every candidate.
        wq = wk = fixed_point_weights(torch.empty(D), gemma=True)
        wq16, wk16 = wq.to(torch.bfloat16), wk.to(torch.bfloat16)
        kwargs = dict(q_weight=wq16, k_weight=wk16, eps=p.rms_norm_eps, mrope_section=p.mrope_section,
                      mrope_interleaved=p.mrope_interleaved, q_gate=True, gemma_norm=True)
        prep = qkvfuse.QKNormRope(hq, hkv, D, cache, **kwargs)
        static = (cache, wq16, wk16, None, None, hq, hkv, p.rms_norm_eps,
                  encode_rope(True, p.mrope_section or (), p.mrope_interleaved, q_gate=True, gemma=True))
        layer, vllm_prepare = _vllm_gated_prepare(p)
        layer.q_norm.weight.data.copy_(wq), layer.k_norm.weight.data.copy_(wk)
        layer.q_norm.to(torch.bfloat16), layer.k_norm.to(torch.bfloat16)
        hf_cos_sin, hf_call = _transformers_gated_prepare(p, wq, wk)
        for T in TOKENS:
            g = torch.Generator().manual_seed(T)

            def sets(n=1):
                out = []
                for _ in range(n):
                    positions = torch.randint(0, 8192, (T,), generator=g)
                    s = {"qkv": torch.randn(T, width, generator=g).to(torch.bfloat16),
                         "positions": positions.expand(3, T).contiguous() if mrope else positions,
                         "outs": (torch.empty(T, qw, dtype=torch.bfloat16),
                                  torch.empty(T, hkv * D, dtype=torch.bfloat16))}
                    s["cos_sin"] = hf_cos_sin(s["positions"])
                    out.append(s)
                return out

            ours, outs, bares, theirs, hfs = sets(), sets(), sets(), sets(), sets()

            def out_call(s):
                qkv = s["qkv"]
                q, k = s["outs"]
                gate = s.setdefault("gate", torch.empty(T, qw, dtype=torch.bfloat16))
                return prep(qkv, s["positions"], out=(q, k, qkv[:, 2 * qw + hkv * D:], gate))

            candidates = [
                Candidate(_SPLIT_BOUND, "in place, views",
                          [lambda s=s: prep.inplace(s["qkv"], s["positions"]) for s in ours], _qkv_reset(ours)),
                Candidate("qkvfuse QKNormRope out=", "q/k/gate out, v view", [lambda s=s: out_call(s) for s in outs]),
                Candidate(_BARE, "in place",
                          [lambda s=s: bare(s["qkv"], s["positions"], *static) for s in bares], _qkv_reset(bares)),
                Candidate("transformers eager (Qwen3_5Attention)", "as transformers runs it",
                          [lambda s=s: hf_call(s["qkv"], *s["cos_sin"]) for s in hfs]),
                Candidate("vLLM-CPU _project_qkv_gate", "as vLLM-CPU runs it",
                          [lambda s=s: vllm_prepare(s["qkv"], s["positions"]) for s in theirs]),
            ]
            rows += _measured_rows({"part": "gated", "preset": name, "T": T}, candidates,
                                   [torch.randn(T, width).to(torch.bfloat16)], budget, log)
    return rows


def _round_order(r: int, keys=("off", "on")):
    """The order of round ``r``'s pair: ``keys`` on even rounds, reversed on odd ones (ABBA): a setting's samples
    are never all first or all last of their pair."""
    return keys[::-1] if r % 2 else keys


def _abba(rounds: int):
    """``(round, "off" | "on")`` for ``rounds`` rounds in :func:`_round_order`."""
    for r in range(rounds):
        for key in _round_order(r):
            yield r, key


# --------------------------------------------------------------------------------------------------------
# One layer inside a compiled graph.
# --------------------------------------------------------------------------------------------------------
PLUGIN_PARTS = ("attention", "add_rmsnorm")  # the plugin's options (additional_config["qkvfuse"])
# The plugin's kv_cache option (on by default, with attention): in an engine's "fused" parts when the "on" engine's
# fused layers write vLLM's KV cache themselves (--kv-cache on), absent when vLLM's writer keeps it (off).
CACHE_PART = "kv_cache"
# Under vLLM's torch.compile inductor fuses vLLM's own add+RMSNorm at least as well as the opaque op (the graph
# part: add_rmsnorm alone slower at T = 1 and 16, both presets), while the fused prepare wins from T = 16 on: the
# recommended compiled setting, and the compiled "on" engine of the latency and profile parts.
COMPILED_PARTS = ("attention",)
GRAPH_PRESETS = ("Qwen3-8B", "GLM-4.5")
GRAPH_TOKENS = (1, 16, 512)
# The graph part's layers: vLLM's native code, and the plugin's parts fused (each alone, then both), in the order of
# its even rounds (odd rounds reverse it).
GRAPH_VARIANTS = {"vLLM native": (), "qkvfuse attention": ("attention",), "qkvfuse add_rmsnorm": ("add_rmsnorm",),
                  "qkvfuse both": PLUGIN_PARTS}
GRAPH_KEYS = tuple(GRAPH_VARIANTS)
PROFILED_ROUNDS = 8  # per T, the graph part's profiled calls of each layer


@functools.lru_cache(maxsize=None)  # the op is defined once per process
def _attention_stand_in():
    """An opaque op reading ``q, k, v`` and returning a copy of ``q``, in place of vLLM's attention op: as in an
    engine's graph, inductor materialises the prepare's outputs before it."""
    @torch.library.custom_op("qkvfuse_bench::attention", mutates_args=())
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q.clone(memory_format=torch.contiguous_format)

    @attention.register_fake
    def _(q, k, v):
        return q.new_empty(q.shape)

    return attention


def _graph_layer(p, parts=PLUGIN_PARTS):
    """A decoder layer's path around attention, as one function of ``(hidden, ids, positions)`` for
    ``torch.compile``: the layer input from a GEMM (a stand-in for the previous layer's down projection) and the
    residual from an embedding lookup (both graph intermediates, as in an engine's graph), the input norm (in place
    with the residual), the QKV GEMM, the prepare (QK-norm + RoPE), attention (:func:`_attention_stand_in`), the
    o_proj GEMM and the post-attention norm. ``parts`` (of the plugin's options): ``"attention"`` makes the
    prepare the plugin's call under compile (``split_qkv_rmsnorm_rope_`` on the graph's own buffers),
    ``"add_rmsnorm"`` both norms (``add_rmsnorm_``); the rest is vLLM's native code -- its RMSNorm IR ops' native
    implementations and its rotary module's ``forward_native``, what vLLM-CPU's compiled mode runs (its custom ops
    off), which inductor fuses into its own kernels (``parts=()``: all of it)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.ir import ops as ir_ops
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    g = torch.Generator().manual_seed(0)
    hq, hkv, D, H = p.num_q_heads, p.num_kv_heads, p.head_dim, p.hidden_size
    bf16 = torch.bfloat16

    def weight(*shape):
        return (torch.randn(*shape, generator=g) / shape[0] ** 0.5).to(bf16)

    w_down, w_qkv, w_o, embedding = weight(H, H), weight(H, p.qkv_width), weight(hq * D, H), weight(1024, H)
    with set_current_vllm_config(VllmConfig()):
        norms = [RMSNorm(n, eps=p.rms_norm_eps, dtype=bf16) for n in (H, H, D, D)]
        rope = get_rope(head_size=D, max_position=8192, dtype=bf16, rope_parameters={
            "rope_type": "default", "rope_theta": p.rope_theta, "partial_rotary_factor": p.rotary_dim / D})
    for n in norms:
        n.weight.data.copy_((1 + 0.1 * torch.randn(n.weight.shape[0], generator=g)).to(bf16))
    in_norm, post_norm, q_norm, k_norm = norms
    cache = rope.cos_sin_cache.to(bf16)
    sizes = [hq * D, hkv * D, hkv * D]
    attention = _attention_stand_in()
    eps = p.rms_norm_eps

    # RMSNorm.forward_native calls vLLM's IR ops, which the engine's compile passes replace by their native
    # implementations before inductor sees them (IrOpPriorityConfig "native"): those, as the graph gets them.
    rms_norm, add_rms_norm = (op.impls["native"].impl_fn for op in (ir_ops.rms_norm, ir_ops.fused_add_rms_norm))
    add_norm = qkvfuse.add_rmsnorm_ if "add_rmsnorm" in parts else add_rms_norm

    def prepare(qkv, positions):
        if "attention" in parts:
            return qkvfuse.split_qkv_rmsnorm_rope_(qkv, positions, cache, hq, hkv, D, q_weight=q_norm.weight,
                                                   k_weight=k_norm.weight, eps=eps)
        q, k, v = qkv.split(sizes, dim=-1)
        q = rms_norm(q.reshape(-1, D), q_norm.weight, eps).view(q.shape)
        k = rms_norm(k.reshape(-1, D), k_norm.weight, eps).view(k.shape)
        q, k = rope.forward_native(positions, q, k)
        return q, k, v

    def layer(hidden, ids, positions):
        x, residual = hidden @ w_down, embedding[ids]
        h, residual = add_norm(x, residual, in_norm.weight, eps)
        q, k, v = prepare(h @ w_qkv, positions)
        return add_norm(attention(q, k, v) @ w_o, residual, post_norm.weight, eps)

    return layer


def _cold_call_rows(p, log, rounds: int = 200) -> List[Dict[str, object]]:
    """One call each after a 96 MB copy has evicted the caches (a step's GEMMs do that before every op), T = 1:
    qkvfuse's in-place ops, ``aten.add_`` and ``aten.detach`` (one argument), from Python as inductor's wrapper
    calls them. Medians in µs."""
    import random

    hq, hkv, D, H = p.num_q_heads, p.num_kv_heads, p.head_dim, p.hidden_size
    big = torch.empty(96 << 20, dtype=torch.uint8)
    dst = torch.empty_like(big)
    x, residual = torch.randn(1, H).to(torch.bfloat16), torch.randn(1, H).to(torch.bfloat16)
    qkv, positions = torch.randn(1, p.qkv_width).to(torch.bfloat16), torch.zeros(1, dtype=torch.long)
    w, wd = (fixed_point_weights(torch.empty(n, dtype=torch.bfloat16)) for n in (H, D))
    cache = qkvfuse.build_cos_sin_cache(p.rotary_dim, 8192, p.rope_theta).to(torch.bfloat16)
    split = torch.ops.qkvfuse.split_qkv_rmsnorm_rope_inplace.default
    norm = torch.ops.qkvfuse.add_rmsnorm_inplace.default
    rope = encode_rope(True)
    calls = {"qkvfuse split_qkv_rmsnorm_rope_inplace": lambda: split(qkv, positions, cache, wd, wd, None, None, hq,
                                                                     hkv, p.rms_norm_eps, rope),
             "qkvfuse add_rmsnorm_inplace": lambda: norm(x, residual, w, None, p.rms_norm_eps),
             "aten add_": lambda: torch.ops.aten.add_.Tensor(x, residual),
             "aten detach (one argument)": lambda: torch.ops.aten.detach.default(x)}
    samples = {name: [] for name in calls}
    order = list(calls)
    with torch.inference_mode():
        for call in calls.values():
            call()
        for _ in range(rounds):
            random.shuffle(order)
            for name in order:
                dst.copy_(big)
                t0 = time.perf_counter()
                calls[name]()
                samples[name].append((time.perf_counter() - t0) * 1e6)
    rows = []
    for name, us in samples.items():
        rows.append({"part": "graph", "preset": p.name, "T": 1, "what": "cold call", "impl": name,
                     "us": statistics.median(us), "rounds": rounds})
        log(f"graph {p.name} cold call (after a 96 MB copy) {name:40s} {rows[-1]['us']:8.1f} us")
    return rows


# The variants are closures of one function: each preset and T adds a compiled entry per variant to that one code
# object, past dynamo's default limit of 8.
@torch._dynamo.config.patch(recompile_limit=64)
def graph_rows(seconds: float, log=print, presets=None, tokens=GRAPH_TOKENS,
               cold_rounds: int = 200) -> List[Dict[str, object]]:
    """vLLM's compiled-mode question in one layer, per part of the plugin: the layer of :func:`_graph_layer`
    compiled (``fullgraph``, the token dim dynamic) for each of :data:`GRAPH_VARIANTS` -- vLLM's native code, the
    plugin's attention alone, its add_rmsnorm alone, both; per T the compiled functions called in turn for about
    ``seconds`` (ABBA order), one row per fused variant with the medians and the median per-call difference
    (variant - vLLM's code) and ratio (vLLM / variant), then the same for the time outside the GEMMs (profiled,
    :data:`PROFILED_ROUNDS` calls each, in turn). The layer with both parts fused is first checked bit for bit
    against the same function run eagerly (qkvfuse's results never depend on the mode; where vLLM's native code
    remains, inductor's fusions change its bits). Then the cold-call costs
    (:func:`_cold_call_rows`): why the opaque ops' extern calls can lose to inductor's own code at T = 1.
    ``presets`` (default :data:`GRAPH_PRESETS`), ``tokens`` and ``cold_rounds`` make it small for a test."""
    rows = []
    native = GRAPH_KEYS[0]
    for p in presets or [qkvfuse.get_preset(name) for name in GRAPH_PRESETS]:
        name = p.name
        fns = {key: _graph_layer(p, parts) for key, parts in GRAPH_VARIANTS.items()}
        # The token dim dynamic (every argument's dim 0, marked below), the rest static: as vLLM compiles
        # (dynamic=True would make the weights' and the table's sizes symbolic too, and inductor's kernels slow).
        compiled = {key: torch.compile(fn, fullgraph=True) for key, fn in fns.items()}
        for T in tokens:
            g = torch.Generator().manual_seed(T)
            args = (torch.randn(T, p.hidden_size, generator=g).to(torch.bfloat16),
                    torch.randint(0, 1024, (T,), generator=g), torch.randint(0, 8192, (T,), generator=g))
            for a in args:
                torch._dynamo.mark_dynamic(a, 0)
            with torch.inference_mode():
                eager, got = fns[GRAPH_KEYS[-1]](*args), compiled[GRAPH_KEYS[-1]](*args)
                if not all(torch.equal(a, b) for a, b in zip(eager, got)):
                    raise AssertionError(f"graph {name} T={T}: qkvfuse compiled differs from eager")
                for key in GRAPH_KEYS[:-1]:  # warm-up (compiles each dynamic graph once)
                    compiled[key](*args)
                samples = {key: [] for key in compiled}
                t_end = time.perf_counter() + seconds
                r = 0
                while time.perf_counter() < t_end or r < 6:
                    for key in _round_order(r, GRAPH_KEYS):
                        t0 = time.perf_counter()
                        compiled[key](*args)
                        samples[key].append((time.perf_counter() - t0) * 1e6)
                    r += 1
                # The GEMMs' variance swamps the rest at T = 512: also, per call, the self CPU time of everything
                # but the GEMMs and the stand-in (step_parts' "rest": inductor's kernels, qkvfuse's ops, the
                # wrapper), one profiled call of each per round, in turn.
                rest = {key: [] for key in compiled}
                for i in range(PROFILED_ROUNDS):
                    for key in _round_order(i, GRAPH_KEYS):
                        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                            compiled[key](*args)
                        rest[key].append(
                            1e3 * step_parts((e.key, e.self_cpu_time_total) for e in prof.key_averages())["rest"])
            theirs, theirs_rest = samples[native], rest[native]
            for key in GRAPH_KEYS[1:]:
                ours = samples[key]
                row = {"part": "graph", "preset": name, "T": T, "what": "compiled layer", "impl": key,
                       "fused": list(GRAPH_VARIANTS[key]), "us": statistics.median(ours),
                       "vllm_native_us": statistics.median(theirs),
                       "minus_native_us": statistics.median(a - b for a, b in zip(ours, theirs)),
                       "native_over_this": statistics.median(b / a for a, b in zip(ours, theirs)), "rounds": r,
                       "rest_us": statistics.median(rest[key]), "vllm_native_rest_us": statistics.median(theirs_rest),
                       "rest_native_over_this": statistics.median(b / a for a, b in zip(rest[key], theirs_rest))}
                rows.append(row)
                log(f"graph {name} T={T:4d} compiled layer, {key:20s} {row['us']:10.1f} us  vLLM native "
                    f"{row['vllm_native_us']:10.1f} us  paired diff {row['minus_native_us']:+8.1f} us  "
                    f"x{row['native_over_this']:.3f} ({r} rounds); without the GEMMs (profiled): "
                    f"{row['rest_us']:8.1f} us  vLLM native {row['vllm_native_rest_us']:8.1f} us  "
                    f"x{row['rest_native_over_this']:.3f}")
        rows += _cold_call_rows(p, log, cold_rounds)
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


@contextlib.contextmanager
def _model_dir(name: str):
    """A temporary model directory holding only ``name``'s config (the engines load dummy weights)."""
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(_configs()[name], f)
        yield model_dir


def _engine(model_dir: str, fused, compiled: bool):
    """An engine of the model in ``model_dir`` with the plugin's parts in ``fused`` on (an empty tuple: off)."""
    from vllm import LLM

    # disable_log_stats=False: each request's output carries the engine core's timestamps (RequestStateStats).
    return LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
               max_model_len=1024, enforce_eager=not compiled, enable_prefix_caching=False, seed=0,
               disable_log_stats=False,
               additional_config={"qkvfuse": {part: part in fused for part in PLUGIN_PARTS + (CACHE_PART,)}})


PROMPT_TOKENS, NEW_TOKENS = 512, 33


def _random_prompt(g: torch.Generator, length: int = PROMPT_TOKENS) -> List[int]:
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def _time_request(llm, prompt: List[int]) -> Dict[str, float]:
    """One request, batch 1: ms of its prefill (scheduled to first token) and per decode step (first to last
    token over the steps between), from the engine core's own timestamps (what ``vllm bench`` reports as TTFT
    without queueing, and TPOT)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, detokenize=False, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    m = out.metrics
    if m is None or not m.first_token_ts or len(out.outputs[0].token_ids) != NEW_TOKENS:
        raise RuntimeError("vLLM returned no request timestamps (disable_log_stats=False is needed)")
    return {"prefill": (m.first_token_ts - m.scheduled_ts) * 1e3,
            "decode": (m.last_token_ts - m.first_token_ts) * 1e3 / (NEW_TOKENS - 1)}


def _paired_row(name: str, mode: str, phase: str, on: List[float], off: List[float]) -> Dict[str, object]:
    """Medians, the median of the per-round ratios off/on, and the ratio of the fastest rounds (contention on
    a shared machine only ever slows a round down)."""
    return {"part": "latency", "model": name, "mode": mode, "phase": phase, "on_ms": statistics.median(on),
            "off_ms": statistics.median(off), "off_over_on": statistics.median(b / a for a, b in zip(on, off)),
            "min_off_over_min_on": min(off) / min(on), "rounds": len(on), "on_samples": on, "off_samples": off}


def latency_rows(names, compiled: bool, rounds: int, one_engine: bool = False, fused=PLUGIN_PARTS,
                 log=print) -> List[Dict[str, object]]:
    """Engine latency, plugin on vs off: per round one request of :data:`PROMPT_TOKENS` random tokens (prefill)
    generating :data:`NEW_TOKENS` (decode) on each engine, the order alternating (ABBA), so the two samples of
    a pair are seconds apart. Two engines side by side (each in its engine-core process) after one untimed
    warm-up request each (the "on" engine created first); with ``one_engine`` (the creation order alternating too;
    less memory) a fresh engine per round and setting, each in a fresh process (:func:`_fresh_engine_rounds`;
    vLLM's compile cache makes a re-created compiled engine load its graphs), warmed up by one untimed request, a
    round's sample the median of three requests, a round's two engines given the same prompts."""
    rows = []
    g = torch.Generator().manual_seed(0)
    mode = "compiled" if compiled else "eager"
    for name in names:
        with _model_dir(name) as model_dir:
            samples = {(k, p): [] for k in ("on", "off") for p in ("prefill", "decode")}

            def record(key, measured):
                for phase, ms in measured.items():
                    samples[(key, phase)].append(ms)

            if one_engine:
                for r, key, measured in _fresh_engine_rounds(_latency_engine, name, fused, compiled, rounds):
                    log(f"{name} round {r + 1}/{rounds}: engine {key} ready in {measured.pop('ready_s'):.0f} s "
                        f"({mode})")
                    record(key, measured)
            else:
                t0 = time.perf_counter()
                engines = {"on": _engine(model_dir, fused, compiled), "off": _engine(model_dir, (), compiled)}
                log(f"{name}: engines ready in {time.perf_counter() - t0:.0f} s ({mode})")
                for key in engines:  # (a loop variable bound to an engine would keep it alive into the next model)
                    _time_request(engines[key], _random_prompt(g))  # warm-up
                for _, key in _abba(rounds):
                    record(key, _time_request(engines[key], _random_prompt(g)))
                del engines
                gc.collect()
            for phase in ("prefill", "decode"):
                row = {**_paired_row(name, mode, phase, samples[("on", phase)], samples[("off", phase)]),
                       "fused": list(fused)}
                rows.append(row)
                log(f"{name} {mode} {phase:8s} off {row['off_ms']:9.2f} ms  on {row['on_ms']:9.2f} ms  "
                    f"off/on x{row['off_over_on']:.3f} (fastest rounds x{row['min_off_over_min_on']:.3f}, "
                    f"{rounds} rounds)")
    return rows


def _latency_engine(name: str, fused, compiled: bool, seed: int) -> Dict[str, float]:
    """One engine in this process (:func:`_fresh_engine_rounds`): seconds to create it and, after one untimed
    request, the median prefill and decode ms of three requests (:func:`_time_request`)."""
    g = torch.Generator().manual_seed(seed)
    with _model_dir(name) as model_dir:
        t0 = time.perf_counter()
        llm = _engine(model_dir, fused, compiled)
        ready_s = time.perf_counter() - t0
        _time_request(llm, _random_prompt(g))  # warm-up
        runs = [_time_request(llm, _random_prompt(g)) for _ in range(3)]
    return {"ready_s": ready_s, **{phase: statistics.median(m[phase] for m in runs) for phase in runs[0]}}


def _fresh_engine_rounds(task, name: str, fused, compiled: bool, rounds: int):
    """``(round, "off" | "on", task(name, parts, compiled, seed=round))`` in :func:`_abba` order, each call in a
    fresh spawned process: nothing of one engine outlives it (vLLM's engine core ``gc.freeze()``s the heap;
    re-created in-process engines kept ~0.9 GB each), and a round's two engines get the same seed."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                max_tasks_per_child=1) as pool:
        for r, key in _abba(rounds):
            yield r, key, pool.submit(task, name, fused if key == "on" else (), compiled, r).result()


# Where an engine step's time goes, by the profiler's self CPU time: the weight GEMMs and the MoE experts (the
# same work with the plugin on and off), attention and vLLM's KV-cache writes, and the rest -- inductor's generated
# code, qkvfuse's ops, everything else the plugin changes. With the kv_cache option the cache write is part of
# qkvfuse's op (qkvfuse::split_qkv_rmsnorm_rope_cache, compiled: qkvfuse_vllm::prepare_and_cache), so it moves
# from "attention" to "rest": compare the two parts' sum between kv_cache on and off.
_GEMM_MARKS, _ATTENTION_MARKS = ("linear", "matmul", "fused_moe", "aten::mm", "aten::addmm", "aten::bmm"), (
    "attention", "kv_cache", "reshape_and_cache")


def _profiled_ms(llm, prompt: List[int], new_tokens: int) -> Dict[str, object]:
    """ms per request by part (:func:`step_parts`), and under ``"top"`` the rest's largest ops (:func:`rest_top`)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, detokenize=False, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    events = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    return {**step_parts(events), "top": rest_top(events)}


def _part(name: str) -> str:
    return ("gemm" if any(m in name for m in _GEMM_MARKS) else
            "attention" if any(m in name for m in _ATTENTION_MARKS) else "rest")


def step_parts(events) -> Dict[str, float]:
    """``{"gemm", "attention", "rest": ms}`` of profiler ``(name, self CPU µs)`` pairs."""
    parts = {"gemm": 0.0, "attention": 0.0, "rest": 0.0}
    for name, self_us in events:
        parts[_part(name)] += self_us / 1e3
    return parts


def rest_top(events, n: int = 8) -> List[List[object]]:
    """The ``n`` largest ops of :func:`step_parts`' rest, ``[[name, self CPU ms], ...]`` largest first."""
    rest = {}
    for name, self_us in events:
        if _part(name) == "rest":
            rest[name] = rest.get(name, 0.0) + self_us / 1e3
    return [[name, ms] for name, ms in sorted(rest.items(), key=lambda kv: -kv[1])[:n]]


def _heap_only_malloc() -> bool:
    """glibc's allocator in this process: no ``mmap``-ed chunks and no trimming (``mallopt(M_MMAP_MAX, 0)``,
    ``mallopt(M_TRIM_THRESHOLD, INT_MAX)``), so a freed activation's pages are reused, not given back and faulted in
    again. Without it the first-touch page faults of an eager step's fresh MLP outputs (``aten::silu``, ``aten::mul``:
    34 and 65 ms of one 512-token prefill's self time with the plugin off, 3 and 5 ms with it on, the same ops) swamp
    the "rest" of a profiled step, and which engine pays them depends on the order the engines ran in (malloc's
    dynamic mmap threshold rises as the first one frees). Whether it took effect is returned (False off glibc)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-4, 0)) and bool(libc.mallopt(-1, 2 ** 31 - 1))  # M_MMAP_MAX, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


_PROFILED = (("prefill", PROMPT_TOKENS, 1), ("decode", 16, NEW_TOKENS))  # phase, prompt tokens, new tokens


def _profile_engine(name: str, fused, compiled: bool, seed: int) -> Dict[str, object]:
    """One engine in this process, after one untimed request: a profiled prefill and decode (:data:`_PROFILED`),
    ms per step by part. Run in a fresh process per engine (:func:`profile_rows`)."""
    heap_only = _heap_only_malloc()
    g = torch.Generator().manual_seed(seed)
    with _model_dir(name) as model_dir:
        llm = _engine(model_dir, fused, compiled)
        _time_request(llm, _random_prompt(g))  # warm-up
        parts, top = {}, {}
        for phase, length, new in _PROFILED:
            measured = _profiled_ms(llm, _random_prompt(g, length), new)
            top[phase] = [[op, ms / new] for op, ms in measured.pop("top")]
            parts[phase] = {p: v / new for p, v in measured.items()}
    return {"heap_only_malloc": heap_only, "top": top, **parts}


def profile_rows(names, compiled: bool, rounds: int, fused=PLUGIN_PARTS, log=print) -> List[Dict[str, object]]:
    """Per round, one engine per setting, each in a fresh process with the engine in it (the profiler sees the
    model runner; nothing of one engine outlives it: vLLM freezes its objects out of the collector, and
    re-created in-process engines kept ~0.9 GB each), the order alternating round by round (ABBA): a profiled
    prefill (a 512-token prompt, one token) and decode (a 16-token prompt, 33 tokens; per step), each split into
    GEMM/MoE, attention and the rest (the part the plugin changes). A round's two engines run seconds apart, so
    the host's drift over a run falls on both settings alike (one engine per setting for a whole run measured the
    order the engines ran in as much as the plugin: two such runs on one Zen 5 gave compiled Qwen3-8B decode 0.60x
    and 1.59x). Rows: the medians, plugin on and off, and the median of the per-round ratios off/on of the rest.
    The allocator keeps freed pages (:func:`_heap_only_malloc`); vLLM's compile cache makes every compiled engine
    after the first load its graphs."""
    rows = []
    mode = "compiled" if compiled else "eager"
    for name in names:
        parts, heap_only, tops = {(k, p): [] for k in ("on", "off") for p, _, _ in _PROFILED}, True, {}
        for r, key, measured in _fresh_engine_rounds(_profile_engine, name, fused, compiled, rounds):
            heap_only = heap_only and measured["heap_only_malloc"]
            for phase, _, _ in _PROFILED:
                parts[(key, phase)].append(measured[phase])
                log(f"{name} {mode} round {r + 1}/{rounds} {key:3s} {phase:8s} ms per step: "
                    + "  ".join(f"{p} {v:8.2f}" for p, v in measured[phase].items()))
                log("    rest's largest ops, ms per step: "
                    + "; ".join(f"{op} {ms:.2f}" for op, ms in measured["top"][phase]))
                tops.setdefault((key, phase), []).append(measured["top"][phase])
        for phase, _, _ in _PROFILED:
            on, off = parts[("on", phase)], parts[("off", phase)]
            ratios = [b["rest"] / a["rest"] for a, b in zip(on, off)]
            row = {"part": "profile", "model": name, "mode": mode, "phase": phase, "fused": list(fused),
                   "rounds": rounds, "heap_only_malloc": heap_only,
                   **{f"{k}_{p}_ms": statistics.median(s[p] for s in v)
                      for k, v in (("on", on), ("off", off)) for p in on[0]},
                   "rest_off_over_on": statistics.median(ratios), "rest_ratios": ratios,
                   "rest_top_on": tops[("on", phase)], "rest_top_off": tops[("off", phase)]}
            rows.append(row)
            log(f"{name} {mode} {phase:8s} ms per step (self CPU, medians): rest off {row['off_rest_ms']:8.2f} "
                f"on {row['on_rest_ms']:8.2f} (paired x{row['rest_off_over_on']:.2f}; rounds "
                + " ".join(f"{x:.2f}" for x in ratios) + f"); GEMM/MoE off {row['off_gemm_ms']:8.2f} "
                f"on {row['on_gemm_ms']:8.2f}; attention off {row['off_attention_ms']:6.2f} "
                f"on {row['on_attention_ms']:6.2f}")
    return rows


# The team's targets against the peers, judged on one run's rows by :func:`targets`: the one place they are written.
SPLIT_MIN_VS_VLLM = 2.0  # QKNormRope.inplace against vLLM's composed _C.rms_norm + _C.rotary_embedding, every cell
SPLIT_MIN_COPY_SHARE = 0.90  # QKNormRope.inplace at T = max(TOKENS) (4096) against a copy of the same bytes
NORM_MIN_VS_PEERS = 1.0  # AddRMSNorm.inplace against vLLM's _C.fused_add_rms_norm and zentorch_add_rms_norm_
ENGINE_MIN_OFF_OVER_ON = 1.0  # an engine with the plugin no slower than without (median of per-round ratios)


def targets(rows, forced: str = "") -> List[Dict[str, object]]:
    """The peer targets' verdicts on ``rows`` (any parts of one run): one dict per target and cell, with ``target``,
    ``cell``, ``measured`` and ``verdict`` (``MET`` / ``MISSED``). The bound in-place calls are judged, the bare op
    shown beside them. ``forced``: the qkvfuse build when it is not this CPU's own (``QKVFUSE_CPU_CAPABILITY``);
    zentorch has no such switch, so its verdicts then say they need a CPU of that kind. A norm cell without zentorch
    (not importable) gets ``NOT MEASURED`` for that target, so a missing peer never reads as a met target."""
    out: List[Dict[str, object]] = []
    by_cell: Dict[tuple, Dict[str, Dict[str, object]]] = {}
    for r in rows:
        if r.get("part") in ("split", "norm") and "impl" in r:
            key = (r["part"], r.get("preset", r.get("hidden")), r["T"], r["buffers"])
            by_cell.setdefault(key, {})[r["impl"]] = r

    def add(target, cell, measured, ok, note=""):
        verdict = "NOT MEASURED" if ok is None else ("MET" if ok else "MISSED")
        out.append({"target": target, "cell": cell, "measured": measured,
                    "verdict": verdict + (f" ({note})" if note else "")})

    for (part, shape, T, buffers), impls in by_cell.items():
        bound, bare = impls.get(_SPLIT_BOUND if part == "split" else _NORM_BOUND), impls.get(_BARE)
        if bound is None:
            continue
        cell = f"{shape if part == 'split' else f'hidden {shape}'} T={T} {buffers}"
        bare_note = "" if bare is None else f"; bare op x{bare['vs_vllm']:.2f}"
        if part == "split":
            add(f"split: QKNormRope.inplace >= {SPLIT_MIN_VS_VLLM:g}x vLLM", cell,
                f"x{bound['vs_vllm']:.2f} ({bound['us']:.2f} us){bare_note}", bound["vs_vllm"] >= SPLIT_MIN_VS_VLLM)
            if T == max(TOKENS):
                add(f"split: T={T} >= {SPLIT_MIN_COPY_SHARE:.0%} of the copy", cell,
                    f"{bound['roofline']:.1%} of the copy", bound["roofline"] >= SPLIT_MIN_COPY_SHARE)
            continue
        add(f"add+RMSNorm: AddRMSNorm.inplace >= {NORM_MIN_VS_PEERS:g}x vLLM", cell,
            f"x{bound['vs_vllm']:.2f} ({bound['us']:.2f} us){bare_note}", bound["vs_vllm"] >= NORM_MIN_VS_PEERS)
        zentorch_target = f"add+RMSNorm: AddRMSNorm.inplace >= {NORM_MIN_VS_PEERS:g}x zentorch"
        if "vs_zentorch" not in bound:
            add(zentorch_target, cell, "zentorch not importable here", None)
            continue
        bare_note = "" if bare is None else f"; bare op x{bare['vs_zentorch']:.2f}"
        add(zentorch_target, cell, f"x{bound['vs_zentorch']:.2f}{bare_note}", bound["vs_zentorch"] >= NORM_MIN_VS_PEERS,
            f"zentorch runs this CPU's code: judge it where {forced} is the widest build" if forced else "")
    for r in rows:
        if r.get("part") == "latency":
            ratios = [b / a for a, b in zip(r["on_samples"], r["off_samples"])]
            lo, hi = min(ratios), max(ratios)
            add(f"engine: plugin on no slower (off/on >= {ENGINE_MIN_OFF_OVER_ON:g})",
                f"{r['model']} {r['mode']} {r['phase']}",
                f"x{r['off_over_on']:.3f} over {r['rounds']} rounds (rounds {lo:.2f}-{hi:.2f})",
                r["off_over_on"] >= ENGINE_MIN_OFF_OVER_ON,
                # rounds on both sides of the threshold: the median's side is not shown by this run
                "not resolved: rounds on both sides" if lo < ENGINE_MIN_OFF_OVER_ON < hi else "")
    return out


def print_targets(summary) -> None:
    """:func:`targets`' verdicts as one table (nothing when the run judged nothing)."""
    from qkvfuse._verify.sections import Section, print_section

    if summary:
        print_section(Section("targets against vLLM-CPU and zentorch on this run (x = median of per-round ratios; > 1: qkvfuse faster)",
                              ("target", "cell", "measured", "verdict"), [dict(s) for s in summary]))


_COMPILED = {"eager": (False,), "compiled": (True,), "both": (False, True)}  # --mode -> compiled settings


def _parts(requested, compiled: bool, kv_cache: bool = True):
    """The plugin's parts on in the 'on' engine: ``--fuse``, else the recommended setting of the engine's mode;
    with ``kv_cache`` (``--kv-cache on``) and attention, :data:`CACHE_PART`."""
    parts = tuple(requested) if requested else (COMPILED_PARTS if compiled else PLUGIN_PARTS)
    return parts + ((CACHE_PART,) if kv_cache and "attention" in parts else ())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qkvfuse_bench.vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["split", "norm", "gated", "graph", "latency", "profile", "all"],
                        default="all", help="graph: one layer compiled, qkvfuse vs vLLM's native code, and cold "
                                            "calls; profile: where an engine step's time goes, plugin on and off "
                                            "(neither is part of all)")
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="per split / norm / gated cell, and per T of the graph part")
    parser.add_argument("--rounds", type=int, default=5, help="latency and profile rounds (after one warm-up request)")
    parser.add_argument("--mode", choices=["eager", "compiled", "both"], default="eager",
                        help="latency engines: eager (enforce_eager), vLLM's torch.compile, or both")
    parser.add_argument("--model", action="append", choices=list(_configs()), help="latency models (default both)")
    parser.add_argument("--one-engine", action="store_true",
                        help="latency: one engine alive at a time, re-created per round, the creation order "
                             "alternating (side by side, the 'on' engine is always created first)")
    parser.add_argument("--fuse", action="append", choices=PLUGIN_PARTS,
                        help="latency and profile: the plugin's parts on in the 'on' engine (default: both for "
                             "eager engines, attention alone for compiled ones, as recommended: COMPILED_PARTS)")
    parser.add_argument("--kv-cache", choices=["on", "off"], default="on",
                        help="latency and profile: the 'on' engine's fused attention layers write vLLM's KV cache "
                             "themselves (the plugin's kv_cache option, its default) or leave it to vLLM's writer")
    parser.add_argument("--peer-isa", choices=["native", "avx2"], default="native",
                        help="vLLM-CPU's library: the one vLLM picks for this CPU, or its AVX2 build (_C_AVX2, what "
                             "vLLM runs on a CPU without AVX-512) to time a forced AVX2 qkvfuse build against; "
                             "avx2 with the in-process parts only (split, norm, gated, graph)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    reason = args.json and unwritable(args.json)
    if reason:  # before the run, not after it
        parser.error(f"--json {args.json}: {reason}")
    if args.peer_isa != "native" and args.part in ("latency", "profile", "all"):
        parser.error("--peer-isa avx2 applies to the in-process parts (split, norm, gated, graph): engines load "
                     "the library vLLM picks")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # latency side by side: an engine-core process per engine; profile and --one-engine: the engine in its own
    # fresh process (_fresh_engine_rounds)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if args.part == "profile" or args.one_engine else "1")
    print(json.dumps(machine_info()))
    from qkvfuse.backends import cpu

    print(f"qkvfuse native CPU build: {cpu.capability()} (QKVFUSE_CPU_CAPABILITY forces another)")
    if args.peer_isa == "avx2" and cpu.capability() != "AVX2":
        parser.error(f"--peer-isa avx2 times the AVX2 builds against each other: set QKVFUSE_CPU_CAPABILITY=AVX2 "
                     f"(qkvfuse's build here: {cpu.capability()})")
    print(f"vLLM-CPU ops: {_load_vllm_ops(args.peer_isa)} (--peer-isa {args.peer_isa}); zentorch's add+RMSNorm takes "
          "its AVX-512 row on any CPU with AVX-512 (no switch)")
    rows = []
    if args.part in ("split", "all"):
        rows += split_rows(Budget(cell_s=args.seconds))
    if args.part in ("norm", "all"):
        rows += norm_rows(Budget(cell_s=args.seconds))
    if args.part in ("gated", "all"):
        rows += gated_rows(Budget(cell_s=args.seconds))
    if args.part == "graph":
        rows += graph_rows(args.seconds)
    if args.part in ("latency", "all"):
        names = args.model or list(_configs())
        for compiled in _COMPILED[args.mode]:
            rows += latency_rows(names, compiled, args.rounds, args.one_engine,
                                 _parts(args.fuse, compiled, args.kv_cache == "on"))
    if args.part == "profile":
        for compiled in _COMPILED[args.mode]:
            rows += profile_rows(args.model or list(_configs()), compiled, args.rounds,
                                 _parts(args.fuse, compiled, args.kv_cache == "on"))
    for row in rows:
        row["peer_isa"] = args.peer_isa
    build = cpu.capability()
    summary = targets(rows, forced=build if build != cpu.detected_capability() else "")
    print_targets(summary)
    rows += [{"part": "targets", **s} for s in summary]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
