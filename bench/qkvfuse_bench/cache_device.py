"""The Triton cache-writing split on a GPU: correctness rows, bandwidth against a same-size copy, CUDA-graph replay.

``PYTHONPATH=bench python -m qkvfuse_bench.cache_device [--device cuda] [--tokens 4096,16384] [--json PATH]`` from
the repository root (``bench/device-check.sh`` runs it). ``--device cpu`` with ``TRITON_INTERPRET=1`` is a dry
run at small sizes (the code a GPU run executes, timings meaningless; ``tests/backends/test_triton_cache.py``).

* correctness: :data:`qkvfuse._verify.cache.VERIFY_CASES` (in place, and out of place into poisoned outputs) and
  Qwen3-8B-sized cases through :func:`qkvfuse._verify.cache.check_cache_case` on backend ``triton`` (every byte of
  ``qkv``, of the outputs and of the caches' storage judged);
* bandwidth: Qwen3-8B (32/8 x 128, bf16) at each ``--tokens`` T, NHD caches of bf16 and e4m3: the fused op, the
  in-place split alone, the split followed by a torch indexed cache write (the unfused pair), and ``copy_`` of as
  many bytes as the fused op moves (its reads plus writes); each timed as CUDA-graph replays of
  :data:`GRAPH_CALLS` calls (the GPU's time, no launch gaps), median of :data:`TRIALS`;
* graph replay: a call captured once, then replayed on new qkv, positions, slots (negative and out-of-range ones
  included: skipped in the kernel) and FP8 scale values must give an eager call's bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

import qkvfuse
from qkvfuse._verify import SplitCase, make_split_inputs
from qkvfuse._verify.cache import VERIFY_CASES, CacheCase, check_cache_case

__all__ = ["correctness_rows", "bandwidth_rows", "graph_rows", "main"]

GRAPH_CALLS = 20
TRIALS = 7
QWEN3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, rotary_dim=128)


def correctness_rows(device: str, large_T: int) -> List[Dict[str, object]]:
    """One row per case: ``{"case", "ok", "detail"}``."""
    large = [(f"Qwen3-8B T={large_T} {layout} {name}", CacheCase(SplitCase(T=large_T, **QWEN3_8B), layout=layout,
                                                                 cache_dtype=dtype, num_blocks=large_T // 16 + 2))
             for layout in ("NHD", "HND") for name, dtype in (("bf16", None), ("e4m3", torch.float8_e4m3fn))]
    rows = []
    runs = [(name, case, "inplace") for name, case in list(VERIFY_CASES) + large]
    runs += [(f"{name} out=", case, "out") for name, case in VERIFY_CASES]
    for name, case, form in runs:
        try:
            check_cache_case("triton", case, device=device, form=form)
            rows.append(dict(case=name, ok=True, detail=""))
        except AssertionError as exc:
            rows.append(dict(case=name, ok=False, detail=str(exc)[:200]))
    return rows


def _timer(device: str) -> Callable[[Callable[[], object]], float]:
    """Microseconds per call of ``fn``: CUDA-graph replays of GRAPH_CALLS calls on a GPU (median of TRIALS),
    wall time of plain calls elsewhere (a dry run)."""
    if device == "cpu":
        def cpu_us(fn):
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        return cpu_us

    def gpu_us(fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # compile and warm up off the capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
        graph.replay()
        times = []
        for _ in range(TRIALS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
        return statistics.median(times)
    return gpu_us


def _cache_call(kw, key, value, slots, scales, backend="triton"):
    split = {k: v for k, v in kw.items() if k != "qkv"}
    return lambda: qkvfuse.split_qkv_rmsnorm_rope_cache_(kw["qkv"], **split, key_cache=key, value_cache=value,
                                                         slot_mapping=slots, k_scale=scales[0], v_scale=scales[1],
                                                         backend=backend)


def bandwidth_rows(device: str, tokens: List[int]) -> List[Dict[str, object]]:
    """Per T and cache dtype: microseconds and GB/s of the fused op, the split alone, the unfused pair and a copy
    of the fused op's bytes."""
    timer = _timer(device)
    hq, hkv, D = QWEN3_8B["num_q_heads"], QWEN3_8B["num_kv_heads"], QWEN3_8B["head_dim"]
    rows = []
    for T in tokens:
        kw = make_split_inputs(SplitCase(T=T, **QWEN3_8B), device=device)
        qkv = kw["qkv"]
        split_kw = {k: v for k, v in kw.items() if k != "qkv"}
        num_blocks = T // 16 + 2
        slots = torch.randperm(num_blocks * 16, device=device)[:T]
        for name, dtype in (("bf16", torch.bfloat16), ("e4m3", torch.float8_e4m3fn)):
            key = torch.zeros((num_blocks, 16, hkv, D), dtype=torch.uint8, device=device).view(dtype) if (
                dtype.itemsize == 1) else torch.zeros((num_blocks, 16, hkv, D), dtype=dtype, device=device)
            value = torch.zeros_like(key)
            fp8 = dtype.itemsize == 1
            scales = (torch.tensor(0.05, device=device), torch.tensor(0.07, device=device)) if fp8 else (None, None)
            k_cols = qkv[:, hq * D:(hq + hkv) * D]
            v_cols = qkv[:, (hq + hkv) * D:]

            def split():
                qkvfuse.split_qkv_rmsnorm_rope_(qkv, **split_kw, backend="triton")

            def unfused():
                split()
                for cols, cache, scale in ((k_cols, key, scales[0]), (v_cols, value, scales[1])):
                    rows_ = cols.reshape(T, hkv, D)
                    if fp8:
                        rows_ = (rows_.float() / scale).clamp(-448.0, 448.0).to(dtype)
                    cache.view(-1, hkv, D)[slots] = rows_

            moved = (qkv.numel() * qkv.element_size() + T * (hq + hkv) * D * qkv.element_size()
                     + 2 * T * hkv * D * key.element_size() + T * slots.element_size())
            copy_src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
            copy_dst = torch.empty_like(copy_src)
            times = {"fused": timer(_cache_call(kw, key, value, slots, scales)), "split only": timer(split),
                     "split + indexed write": timer(unfused),
                     "copy_ same bytes": timer(lambda: copy_dst.copy_(copy_src))}
            for impl, us in times.items():
                rows.append(dict(T=T, cache=name, impl=impl, us=us, gb_s=moved / us / 1e3))
    return rows


def graph_rows(device: str) -> List[Dict[str, object]]:
    """A captured call replayed on new data equals an eager call on the same data (qkv and caches, bytewise).
    Off CUDA (the dry run) the "replay" calls the same closure again: everything but the capture runs."""
    rows = []
    T, hkv, D = 64, 2, 128
    for layout, dtype in (("NHD", torch.float8_e4m3fn), ("HND", torch.bfloat16)):
        case = SplitCase(T=T, num_q_heads=8, num_kv_heads=hkv, head_dim=D, rotary_dim=64, bias=True)
        kw = make_split_inputs(case, device=device)
        static_qkv = kw["qkv"].clone()
        shape = (8, 16, hkv, D) if layout == "NHD" else (8, hkv, 16, D)
        storage = torch.full((2 * 8 * 16 * hkv * D * dtype.itemsize,), 0xA5, dtype=torch.uint8, device=device)
        key, value = (half.view(dtype).view(shape) for half in storage.chunk(2))
        slots = torch.zeros(T, dtype=torch.int64, device=device)
        fp8 = dtype.itemsize == 1
        scales = (torch.tensor(0.05, device=device), torch.tensor(0.07, device=device)) if fp8 else (None, None)
        graph_kw = dict(kw, qkv=static_qkv, layout=layout)
        call = _cache_call(graph_kw, key, value, slots, scales)
        call()  # compile outside the capture
        replay = call
        if device == "cuda":
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            replay = graph.replay
        ok, detail = True, ""
        for trial in range(3):
            g = torch.Generator().manual_seed(trial)
            fresh = make_split_inputs(case, seed=trial + 1, device=device)
            new_slots = torch.randperm(8 * 16, generator=g)[:T]
            new_slots[::7] = -1
            if device == "cuda":  # past the capacity: skipped in the kernel (CPU tensors: a host error)
                new_slots[3::11] = 8 * 16 + trial
            new_scales = [0.03 * (trial + 1), 0.05 * (trial + 1)]
            eager_storage = torch.full_like(storage, 0xA5)
            e_key, e_value = (half.view(dtype).view(shape) for half in eager_storage.chunk(2))
            eager_qkv = fresh["qkv"].clone()
            e_scales = tuple(torch.tensor(s, device=device) for s in new_scales) if fp8 else (None, None)
            eager_kw = dict(kw, qkv=eager_qkv, positions=fresh["positions"], layout=layout)  # same weights
            _cache_call(eager_kw, e_key, e_value, new_slots.to(device), e_scales)()
            static_qkv.copy_(fresh["qkv"])
            kw["positions"].copy_(fresh["positions"])
            slots.copy_(new_slots)
            if fp8:
                scales[0].fill_(new_scales[0])
                scales[1].fill_(new_scales[1])
            storage.fill_(0xA5)
            replay()
            if device == "cuda":
                torch.cuda.synchronize()
            if not (torch.equal(static_qkv.view(torch.int16), eager_qkv.view(torch.int16))
                    and torch.equal(storage, eager_storage)):
                ok, detail = False, f"replay {trial} differs from the eager call"
                break
        what = "graph replay" if device == "cuda" else "replay (no capture off CUDA)"
        rows.append(dict(case=f"{what} {layout} {dtype}", ok=ok, detail=detail))
    return rows


def _print(correct, bandwidth, graphs) -> None:
    print("== cache op: correctness (triton vs qkvfuse._verify.cache) ==")
    for row in correct + graphs:
        status = "skip" if row["ok"] is None else ("PASS" if row["ok"] else "FAIL")
        print(f"{status:5} {row['case']}{'  ' + row['detail'] if row['detail'] else ''}")
    print("== cache op: Qwen3-8B, NHD caches (us per call, GB/s of the fused op's bytes) ==")
    print(f"{'T':>6} {'cache':6} {'impl':24} {'us':>9} {'GB/s':>8}")
    for row in bandwidth:
        print(f"{row['T']:>6} {row['cache']:6} {row['impl']:24} {row['us']:9.1f} {row['gb_s']:8.0f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qkvfuse_bench.cache_device", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", default="4096,16384", help="comma-separated T of the bandwidth rows")
    parser.add_argument("--large-T", type=int, default=1024, help="T of the Qwen3-8B correctness rows")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    correct = correctness_rows(args.device, args.large_T)
    graphs = graph_rows(args.device)
    bandwidth = bandwidth_rows(args.device, tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(correctness=correct, graph=graphs, bandwidth=bandwidth), f, indent=1)
    _print(correct, bandwidth, graphs)
    return 0 if all(r["ok"] is not False for r in correct + graphs) else 1


if __name__ == "__main__":
    sys.exit(main())
