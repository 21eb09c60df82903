"""qkvfuse's vLLM-CPU cache layouts against vLLM-CPU's own writer, op to op (no engine).

vLLM-CPU's ``_C.cpu_attn_reshape_and_cache`` stores K and V per ``layer.isa``: ``vec`` / ``vec16`` (K transposed in
each block-and-head region), ``amx`` (VNNI-packed tiles), and FP8 caches (``vec``) multiplied by ``1 / scale`` and
truncated. For each, the fused op's caches (every backend that runs here) are compared with qkvfuse's in-place split
followed by vLLM's writer on the same K and V:

* 16-bit and fp32 caches: byte-equal (both store the rounded K and V qkv holds);
* FP8 (``fp8_rounding="truncate"``): the reference's quantisation of the bf16 K vLLM is given is byte-equal to
  vLLM's (the same rule); the fused op quantises its fp32 K instead, so a stored value may differ from vLLM's by
  one FP8 step, and only where rounding K to bf16 first moved it across an FP8 value (checked element by element).
"""

import pytest
import torch

import qkvfuse
from qkvfuse import reference
from qkvfuse._cache_mode import encode_cache
from qkvfuse._library import CacheTarget
from qkvfuse.backends import backend_unavailable

vllm_ops = pytest.importorskip("vllm._custom_ops")

HQ, HKV = 4, 2
AMX = torch.cpu._is_amx_tile_supported()
FP8_OK = AMX or torch.cpu._is_avx512_supported()
BACKENDS = [b for b in ("reference", "cpu", "triton") if not backend_unavailable(b)]
KV_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _inputs(D: int, T: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (HQ + 2 * HKV) * D, generator=g) * 2).to(dtype)
    positions = torch.randint(0, 256, (T,), generator=g)
    table = qkvfuse.build_cos_sin_cache(D // 2, 256, 1e6)
    w = 1.0 + 0.2 * torch.randn(D, generator=g)
    return qkv, positions, table, w


def _caches(blocks: int, block_size: int, D: int, dtype, f8):
    storage = torch.zeros(blocks, HKV, block_size, 2 * D, dtype=torch.uint8 if f8 else dtype)
    key, value = storage.view(blocks, HKV, 2 * block_size, D).chunk(2, dim=2)
    return storage, key, value


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("isa,dtype,kv", [("vec", torch.float32, "auto"), ("vec", torch.bfloat16, "auto"),
                                          ("vec16", torch.bfloat16, "auto"), ("amx", torch.bfloat16, "auto"),
                                          ("vec", torch.bfloat16, "fp8_e4m3"), ("vec", torch.bfloat16, "fp8_e5m2"),
                                          ("vec", torch.float32, "fp8_e4m3")])
@pytest.mark.parametrize("D,block_size", [(64, 32), (128, 64)])
def test_fused_cache_against_vllms_writer(backend, isa, dtype, kv, D, block_size):
    f8 = KV_DTYPES[kv]
    if f8 is not None and not FP8_OK:
        pytest.skip("vLLM-CPU's FP8 cache needs AVX-512 or AMX")
    if isa == "amx" and not AMX:
        pytest.skip("vLLM-CPU's amx layout needs a CPU with AMX")
    T, blocks = 45, 4
    qkv, positions, table, w = _inputs(D, T, dtype)
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(1))[:T]
    slots[::7] = -1
    layout = "vec" if isa == "vec16" else isa
    scales = (torch.tensor(0.05), torch.tensor(0.07)) if f8 is not None else (None, None)
    split = dict(cos_sin_cache=table, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, q_weight=w, k_weight=w)

    fused_storage, key, value = _caches(blocks, block_size, D, dtype, f8)
    fused_qkv = qkv.clone()
    qkvfuse.split_qkv_rmsnorm_rope_cache_(
        fused_qkv, positions, **split, key_cache=key.view(f8) if f8 else key, value_cache=value.view(f8) if f8 else value,
        slot_mapping=slots, layout=layout, k_scale=scales[0], v_scale=scales[1], fp8_rounding="truncate",
        backend=backend)

    two_step_storage, key2, value2 = _caches(blocks, block_size, D, dtype, f8)
    split_qkv = qkv.clone()
    _, k, v = qkvfuse.split_qkv_rmsnorm_rope_(split_qkv, positions, **split, backend=backend)
    k, v = k.reshape(T, HKV, D), v.reshape(T, HKV, D)
    vllm_ops.cpu_attn_reshape_and_cache(k, v, key2, value2, slots, isa, 0.05, 0.07, kv)
    assert torch.equal(fused_qkv.view(torch.uint8) if dtype != torch.float32 else fused_qkv,
                       split_qkv.view(torch.uint8) if dtype != torch.float32 else split_qkv)
    if f8 is None or dtype == torch.float32:  # the same values reach both writers: the same bytes
        assert torch.equal(fused_storage, two_step_storage)
        return

    # The same rule on the same (bf16) input: the reference writer equals vLLM's byte for byte.
    ref_storage, key3, value3 = _caches(blocks, block_size, D, dtype, f8)
    reference.write_cache(k.float(), v, CacheTarget(key3.view(f8), value3.view(f8), slots,
                                                    encode_cache(layout, "truncate"), *scales))
    assert torch.equal(ref_storage, two_step_storage)
    # The fused op quantised its fp32 K: equal, or one FP8 step apart where the bf16 rounding of K crossed a value.
    got, want = fused_storage.view(f8).float(), two_step_storage.view(f8).float()
    differ = got != want
    if differ.any():
        steps = (fused_storage.view(torch.uint8).to(torch.int16) - two_step_storage.view(torch.uint8).to(torch.int16))
        assert steps[differ].abs().max() == 1, "more than one FP8 step from vLLM's value"
        assert differ.float().mean() < 0.05, f"{int(differ.sum())} of {differ.numel()} values differ"


def test_cache_benchmark_times_every_path_on_one_cache():
    """``make bench-cache`` (``qkvfuse_bench.cache``) at its smallest: every candidate -- the fused call in place and
    out of place, the bare op, the two-step paths, vLLM's composed ops, the split alone -- is timed in the same
    rounds against the same-bytes copy, and the targets are judged on the fused rows."""
    from qkvfuse.benchmarks.timing import Budget
    from qkvfuse_bench import cache as bench_cache

    rows = bench_cache.cache_rows(Budget(cell_s=0.05, block_s=0.001), log=lambda line: None, presets=("Qwen3-8B",),
                                  tokens=(1, 3), dtypes=("bf16",))
    impls = {bench_cache.FUSED, "qkvfuse bare op", bench_cache.TWO_STEP, bench_cache.VLLM, bench_cache.SPLIT_ONLY,
             bench_cache.OUT_FUSED, bench_cache.OUT_TWO_STEP}
    assert len(rows) == 2 * len(impls) and {(r["T"], r["impl"]) for r in rows} == {(T, i) for T in (1, 3)
                                                                                    for i in impls}
    assert all(r["us"] > 0 and r["copy_us"] > 0 and r["rounds"] >= 1 for r in rows)
    assert {t["cell"] for t in bench_cache.targets(rows)} == {"Qwen3-8B T=1 bf16"}
