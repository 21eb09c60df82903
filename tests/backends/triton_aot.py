"""Compile the Triton kernels for an NVIDIA Hopper target (sm_90) without a GPU; run by tests/backends/test_triton.py.

The interpreter does not type-check or lower kernels the way the GPU compiler does; this catches what only the
compiler sees (types, layouts, register spills) on a machine with no device. Prints one line per variant:
``name REG:<registers> LOCAL:<spill bytes>`` (LOCAL ``?`` when ``cuobjdump`` is missing). Exit status 1 on any
compile error or spill. Run with ``TRITON_INTERPRET`` unset.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qkvfuse.backends.triton import cache_kernels, kernels, launch

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, pointers, constexprs, num_warps):
    signature = {}
    for name in fn.arg_names:
        if name in pointers:
            signature[name] = pointers[name]
        elif name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if name == "eps" else "i32"
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=TARGET, options=dict(num_warps=num_warps))


def split_variant(hq, hkv, head_dim, rotary_dim, dtype="bf16", mrope=False, interleaved=False, norm=True,
                  bias=False, neox=True, pos="i64", cache="fp32", in_place=False, q_gate=False, gemma=False):
    # The gated in-place form widens the Q block to all heads (launch.split_qkv_rmsnorm_rope_out).
    cfg = launch.split_config(1, hq, hkv, head_dim, interpret=False, whole_q_region=q_gate and in_place)
    num_warps = cfg.pop("num_warps")
    pointers = dict(qkv_ptr=f"*{dtype}", pos_ptr=f"*{pos}", cache_ptr=f"*{cache}", q_w_ptr="*fp32",
                    k_w_ptr="*fp32", q_b_ptr="*fp32", k_b_ptr="*fp32", q_out_ptr=f"*{dtype}",
                    k_out_ptr=f"*{dtype}", v_out_ptr=f"*{dtype}", gate_out_ptr=f"*{dtype}")
    constexprs = dict(HEAD_DIM=head_dim, ROT_DIM=rotary_dim, NORM=norm, Q_BIAS=bias, K_BIAS=bias, GEMMA=gemma,
                      IS_NEOX=neox, MROPE=mrope, MROPE_INTERLEAVED=interleaved, Q_GATE=q_gate, IN_PLACE=in_place,
                      **cfg)
    return _compile(kernels.split_qkv_rmsnorm_rope_kernel, pointers, constexprs, num_warps)


def cache_variant(hq, hkv, head_dim, rotary_dim, cache="bf16", fp8=0, truncate=False, amx=False, q_gate=False,
                  mrope=False, slots="i64", in_place=True):
    # The cache kernel's block sizes are the split's (backends/triton/cache.py).
    cfg = launch.split_config(1, hq, hkv, head_dim, interpret=False, whole_q_region=q_gate and in_place)
    num_warps = cfg.pop("num_warps")
    del cfg["V_BLOCK"]
    pointers = dict(qkv_ptr="*bf16", pos_ptr="*i64", cos_sin_ptr="*fp32", q_w_ptr="*fp32", k_w_ptr="*fp32",
                    q_b_ptr="*fp32", k_b_ptr="*fp32", q_out_ptr="*bf16", k_out_ptr="*bf16", v_out_ptr="*bf16",
                    gate_out_ptr="*bf16", key_cache_ptr=f"*{cache}", value_cache_ptr=f"*{cache}",
                    slot_ptr=f"*{slots}", k_scale_ptr="*fp32", v_scale_ptr="*fp32")
    constexprs = dict(HEAD_DIM=head_dim, ROT_DIM=rotary_dim, NORM=True, Q_BIAS=False, K_BIAS=False, GEMMA=q_gate,
                      IS_NEOX=True, MROPE=mrope, MROPE_INTERLEAVED=mrope, Q_GATE=q_gate, AMX=amx, FP8=fp8,
                      TRUNCATE=truncate, IN_PLACE=in_place, COPY_V=not in_place, **cfg)
    return _compile(cache_kernels.split_qkv_rmsnorm_rope_cache_kernel, pointers, constexprs, num_warps)


def norm_variant(H, dtype="bf16", residual=True, bias=True, gemma=False):
    cfg = launch.norm_config(1, H, interpret=False)
    num_warps = cfg.pop("num_warps")
    pointers = dict(x_ptr=f"*{dtype}", res_ptr=f"*{dtype}", w_ptr="*fp32", b_ptr="*fp32", y_ptr=f"*{dtype}",
                    res_out_ptr=f"*{dtype}")
    return _compile(kernels.add_rmsnorm_kernel, pointers,
                    dict(HAS_RESIDUAL=residual, HAS_BIAS=bias, GEMMA=gemma, **cfg), num_warps)


VARIANTS = {
    "Qwen3 32/8x128": lambda: split_variant(32, 8, 128, 128),
    "GLM 96/8x128 rotary 64, bias": lambda: split_variant(96, 8, 128, 64, bias=True),
    "Qwen3-VL mRoPE interleaved": lambda: split_variant(32, 8, 128, 128, mrope=True, interleaved=True),
    "GLM-4.5V mRoPE contiguous, no norm": lambda: split_variant(96, 8, 128, 64, mrope=True, norm=False),
    "fp16 80 GPT-J, int32 pos, bf16 cache": lambda: split_variant(8, 2, 80, 40, "fp16", neox=False, pos="i32",
                                                                  cache="bf16"),
    "fp32 512": lambda: split_variant(2, 1, 512, 512, "fp32"),
    "GLM in place (barrier)": lambda: split_variant(96, 8, 128, 64, bias=True, in_place=True),
    "Qwen3.5 gated 4/1x256 rotary 64, gemma, mRoPE interleaved": lambda: split_variant(
        4, 1, 256, 64, mrope=True, interleaved=True, q_gate=True, gemma=True),
    "Qwen3.5 gated 16/4x256 in place (whole Q region)": lambda: split_variant(16, 4, 256, 64, q_gate=True,
                                                                              gemma=True, in_place=True),
    "Qwen3.5-397B gated 32/2x256 in place (whole Q region)": lambda: split_variant(32, 2, 256, 64, q_gate=True,
                                                                                   gemma=True, in_place=True),
    "cache Qwen3 32/8x128 bf16 NHD": lambda: cache_variant(32, 8, 128, 128),
    "cache Qwen3 32/8x128 e4m3, int32 slots": lambda: cache_variant(32, 8, 128, 128, "u8", cache_kernels.E4M3,
                                                                    slots="i32"),
    "cache GLM 96/8x128 rotary 64 e5m2 truncate": lambda: cache_variant(96, 8, 128, 64, "u8", cache_kernels.E5M2,
                                                                        truncate=True),
    "cache amx 16/2x128": lambda: cache_variant(16, 2, 128, 128, amx=True),
    "cache Qwen3.5 gated 16/4x256 mRoPE e4m3": lambda: cache_variant(16, 4, 256, 64, "u8", cache_kernels.E4M3,
                                                                     q_gate=True, mrope=True),
    "cache out= Qwen3.5 gated 16/4x256 e4m3": lambda: cache_variant(16, 4, 256, 64, "u8", cache_kernels.E4M3,
                                                                    q_gate=True, in_place=False),
    "cache out= GLM 96/8x128 rotary 64 bf16": lambda: cache_variant(96, 8, 128, 64, in_place=False),
    "add_rmsnorm 5120": lambda: norm_variant(5120),
    "add_rmsnorm 4096 gemma": lambda: norm_variant(4096, bias=False, gemma=True),
    "add_rmsnorm 20000 (two passes)": lambda: norm_variant(20000, residual=True, bias=False),
}


def main() -> int:
    assert not os.environ.get("TRITON_INTERPRET"), "run with TRITON_INTERPRET unset"
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in VARIANTS.items():
            try:
                compiled = build()
            except Exception as exc:
                print(f"{name}: COMPILE ERROR {type(exc).__name__}: {exc}")
                failed += 1
                continue
            usage = "REG:? LOCAL:?"
            if cuobjdump.exists():
                cubin = Path(tmp) / "k.cubin"
                cubin.write_bytes(compiled.asm["cubin"])
                out = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True,
                                     text=True).stdout
                fields = dict(f.split(":", 1) for f in out.split() if f.startswith(("REG:", "LOCAL:")))
                usage = f"REG:{fields.get('REG', '?')} LOCAL:{fields.get('LOCAL', '?')}"
                failed += fields.get("LOCAL", "0") not in ("0", "?")
            print(f"{name}: {usage}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
