"""Device check of the Triton backend: conformance at realistic sizes, determinism, graph/compile safety, timings.

    bench/gpu_check.sh                    # quick tier: about 5 minutes on an H200, Triton compilation included
    bench/gpu_check.sh --full             # full tier: every preset, dtype and token count, every timing
    bench/gpu_check.sh --cpu-interpreter  # small sizes on CPU tensors under TRITON_INTERPRET=1 (CI runs it;
                                          # chosen automatically when there is no GPU)

Every section prints its table when done and the JSON (``--json``; default ``$OUT/gpu_check.json`` when ``$OUT``
is set, else ``bench/results/gpu_check.json``) is rewritten after each section, so a run cut short still leaves
its results.
Exit status 1 if any correctness row fails; timing rows are informational (the copy-bandwidth target, >= 80 %
for T >= 4096, is reported in the ``target`` column).

``SECTIONS`` lists ``(name, section)``. A function here is ``section(args) -> qkvfuse.cli.verify.Section``
(``args`` has ``tier`` -- "cpu", "quick" or "full" --, ``device``, a ``torch.device``, and ``cpu_interpreter``). A
``"module:function"`` string names a section of another part of qkvfuse, imported when it runs (skipped, not
failed, when the module is missing) and called as ``function(quick=tier != "full")``; it returns a JSON-able dict
with ``pass`` (True, False, or None when skipped) and a printable ``table`` (``qkvfuse.moe.gpu_check``'s protocol).

Runs from a plain checkout with any Python that has torch and triton (``src/`` is put on ``sys.path``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402  (TRITON_INTERPRET is decided in main(), before the kernels are imported)


# ---------------------------------------------------------------------------------------------------------
# Sizes per tier.
# ---------------------------------------------------------------------------------------------------------
TIERS = {
    # presets / token counts for conformance, extra T=16384 presets, dtypes, determinism, timing presets and T
    "cpu": dict(presets=("Qwen3-8B", "GLM-4.7", "Qwen3-VL-8B", "GLM-4.5V"), tokens=(1, 5), big=(), big_t=0,
                dtypes=("bfloat16",), det_t=5, det_repeats=3, timing=("Qwen3-8B",), timing_t=(5,), hidden=(2048,),
                norm_t=(1, 5)),
    "quick": dict(presets=None, tokens=(1, 257, 4096), big=("Qwen3-8B", "GLM-4.7", "Qwen3-VL-8B"), big_t=16384,
                  dtypes=("bfloat16",), det_t=16384, det_repeats=20, timing=("Qwen3-8B", "GLM-4.7"),
                  timing_t=(1, 16, 256, 4096, 16384), hidden=(2048, 4096, 5120), norm_t=(1, 4096, 16384)),
    "full": dict(presets=None, tokens=(1, 16, 257, 4096, 16384), big=None, big_t=16384,
                 dtypes=("bfloat16", "float16", "float32"), det_t=16384, det_repeats=20, timing=None,
                 timing_t=(1, 16, 256, 1024, 4096, 16384), hidden=(2048, 4096, 5120), norm_t=(1, 256, 4096, 16384)),
}
MAX_POSITION = 32768  # rows of the cos/sin table in the checks (a 262 144-row table only slows input building)
BANDWIDTH_TARGET = 0.8


def _tier(args, key):
    from qkvfuse.presets import PRESETS

    value = TIERS[args.tier][key]
    if value is None and key in ("presets", "big", "timing"):
        return tuple(PRESETS)
    return value


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).synchronize()


def _row(**fields):
    fields.setdefault("pass", True)
    return fields


def _failed_row(what: str, exc: BaseException):
    return _row(check=what, **{"pass": False, "detail": f"{type(exc).__name__}: {exc}"})


# ---------------------------------------------------------------------------------------------------------
# Conformance: every preset at realistic sizes against the float64 oracle (NaN-poisoned outputs).
# ---------------------------------------------------------------------------------------------------------
def _split_case(preset_name: str, T: int, dtype: torch.dtype, **changes):
    from qkvfuse.presets import get_preset
    from qkvfuse.testing import SplitCase

    preset = get_preset(preset_name)
    fields = dict(dtype=dtype, max_position=min(preset.max_position, MAX_POSITION))
    fields.update(changes)
    return SplitCase.from_preset(preset, T, **fields)


def _poisoned_outputs(case, device):
    from qkvfuse.testing import poisoned_like

    D = case.head_dim
    return tuple(poisoned_like(torch.empty(case.T, n * D, dtype=case.dtype, device=device))
                 for n in (case.num_q_heads, case.num_kv_heads, case.num_kv_heads))


def _check_split(kwargs, out, case):
    from qkvfuse.testing import check_split_outputs, oracle_split, unfused_split

    return check_split_outputs(out, oracle_split(**kwargs), unfused_split(**kwargs), kwargs["qkv"],
                               case.num_q_heads, case.num_kv_heads, case.head_dim)


def _split_row(label, case, kwargs, out, t0):
    report = _check_split(kwargs, out, case)
    return _row(check=label, T=case.T, dtype=str(case.dtype)[6:], **{"max err": report.max_err,
                "unfused err": report.unfused_err, "pass": report.ok, "detail": report.detail,
                "s": round(time.perf_counter() - t0, 2)})


def conformance_section(args):
    import qkvfuse
    from qkvfuse.backends.triton import launch
    from qkvfuse.cli.verify import Section
    from qkvfuse.testing import (check_norm_outputs, make_norm_inputs, make_split_inputs, oracle_add_rmsnorm,
                                 poisoned_like, unfused_add_rmsnorm)

    device = args.device
    rows = []
    plan = [(p, T, d) for p in _tier(args, "presets") for T in _tier(args, "tokens") for d in _tier(args, "dtypes")
            if not (d != "bfloat16" and T > 4096)]
    plan += [(p, _tier(args, "big_t"), "bfloat16") for p in _tier(args, "big") if _tier(args, "big_t")
             and _tier(args, "big_t") not in _tier(args, "tokens")]
    for preset_name, T, dtype in plan:
        t0 = time.perf_counter()
        try:
            case = _split_case(preset_name, T, _dtype(dtype))
            kwargs = make_split_inputs(case, seed=T, device=device)
            out = _poisoned_outputs(case, device)
            qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")
            rows.append(_split_row(preset_name, case, kwargs, out, t0))
        except Exception as exc:  # one broken case must not hide the others
            rows.append(_failed_row(f"{preset_name} T={T} {dtype}", exc))

    small = args.tier == "cpu"
    extra = [
        # Hkv = 1 and a large Hq/Hkv (K-variance failure mode), partial rotary at many token x heads.
        ("Hkv=1, 64/1 x 128", dict(preset="Qwen3-32B", T=5 if small else 4096, num_q_heads=64, num_kv_heads=1)),
        ("head_dim 80 / 192 / 512", None),
    ]
    for label, spec in extra:
        t0 = time.perf_counter()
        try:
            if spec is None:
                for D in (80, 192, 512):
                    case = _split_case("GLM-4.7", 5 if small else 1024, torch.bfloat16, head_dim=D, rotary_dim=D // 2,
                                       num_q_heads=8, num_kv_heads=2, bias=True)
                    kwargs = make_split_inputs(case, seed=D, device=device)
                    out = _poisoned_outputs(case, device)
                    qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")
                    rows.append(_split_row(f"head_dim {D}, rotary {D // 2}, norm bias", case, kwargs, out, t0))
                continue
            spec = dict(spec)
            case = _split_case(spec.pop("preset"), spec.pop("T"), torch.bfloat16, **spec)
            kwargs = make_split_inputs(case, seed=1, device=device)
            out = _poisoned_outputs(case, device)
            qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")
            rows.append(_split_row(label, case, kwargs, out, t0))
        except Exception as exc:
            rows.append(_failed_row(label, exc))

    # Out-of-range positions with the host check bypassed (the launcher, as under graph capture): clamped inside
    # the kernel; the table is a view into a NaN-bordered buffer, so a read outside it would show as NaN.
    t0 = time.perf_counter()
    try:
        case = _split_case("Qwen3-VL-8B", 9, torch.bfloat16)
        kwargs = make_split_inputs(case, device=device)
        table = kwargs["cos_sin_cache"]
        big = torch.full((table.shape[0] + 64, table.shape[1]), float("nan"), device=device)
        big[32:32 + table.shape[0]] = table
        kwargs["cos_sin_cache"] = big[32:32 + table.shape[0]]
        n = table.shape[0]
        bad = torch.tensor([-1, -(2**40), n, n + 31, 2**40, n - 1, 0, 7, -32], device=device)
        kwargs["positions"] = torch.stack([bad, bad.flip(0), bad.roll(2)])
        out = _poisoned_outputs(case, device)
        _launch_direct(launch, kwargs, out)
        clamped = dict(kwargs, positions=kwargs["positions"].clamp(0, n - 1))
        rows.append(_split_row("positions out of range, clamped in kernel", case, clamped, out, t0))
    except Exception as exc:
        rows.append(_failed_row("positions out of range", exc))

    # 64-bit offsets: qkv rows 2^30 elements apart, so offsets pass 2^31 (skipped on CPU: a 4 GiB buffer).
    if not small:
        t0 = time.perf_counter()
        try:
            case = _split_case("GLM-4.7", 3, torch.bfloat16)
            kwargs = make_split_inputs(case, device=device)
            stride = 2**30 + 64
            buf = torch.empty(2 * stride + case.width, dtype=torch.bfloat16, device=device)
            qkv = buf.as_strided((3, case.width), (stride, 1))
            qkv.copy_(kwargs["qkv"])
            kwargs["qkv"] = qkv
            out = _poisoned_outputs(case, device)
            qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")
            rows.append(_split_row("64-bit offsets (row stride 2^30)", case, kwargs, out, t0))
            del buf, qkv, kwargs
        except Exception as exc:
            rows.append(_failed_row("64-bit offsets", exc))

    # In place (what engines call) = out of place, bit for bit. head_dim 512 puts NeoX partners in other warps.
    for label, changes in (("GLM-4.7", {}), ("head_dim 512", dict(head_dim=512, rotary_dim=512, num_q_heads=8,
                                                                  num_kv_heads=2))):
        t0 = time.perf_counter()
        try:
            case = _split_case("GLM-4.7", 5 if small else 4096, torch.bfloat16, **changes)
            kwargs = make_split_inputs(case, device=device)
            expected = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="triton")
            qkv = kwargs.pop("qkv").clone()
            views = qkvfuse.split_qkv_rmsnorm_rope_(qkv, **kwargs, backend="triton")
            same = all(torch.equal(a, b) for a, b in zip(views, expected))
            rows.append(_row(check=f"in place == out of place (bitwise), {label}", T=case.T, dtype="bfloat16",
                             **{"pass": same}, s=round(time.perf_counter() - t0, 2)))
        except Exception as exc:
            rows.append(_failed_row(f"in place {label}", exc))

    for H in _tier(args, "hidden"):
        for T in _tier(args, "norm_t"):
            t0 = time.perf_counter()
            try:
                kw = make_norm_inputs(T, H, torch.bfloat16, residual=True, bias=H == 5120, seed=H, device=device)
                x = kw["x"]
                got = qkvfuse.add_rmsnorm(**kw, out=(poisoned_like(x), poisoned_like(x)), backend="triton")
                report = check_norm_outputs(got, oracle_add_rmsnorm(**kw), unfused_add_rmsnorm(**kw), x,
                                            kw["residual"])
                rows.append(_row(check=f"add_rmsnorm hidden {H}", T=T, dtype="bfloat16", **{
                    "max err": report.max_err, "unfused err": report.unfused_err, "pass": report.ok,
                    "detail": report.detail, "s": round(time.perf_counter() - t0, 2)}))
            except Exception as exc:
                rows.append(_failed_row(f"add_rmsnorm hidden {H} T={T}", exc))
    note = ("every element vs the float64 oracle, outputs NaN-poisoned; rule: within 1/2 ulp (+fp32 allowance) "
            "and no worse than unfused + 1 ulp")
    return Section("conformance (Triton vs float64 oracle)", ("check", "T", "dtype", "max err", "unfused err",
                                                              "pass", "s"), rows, note)


def _launch_direct(launch, kwargs, out):
    launch.split_qkv_rmsnorm_rope_out(
        kwargs["qkv"], kwargs["positions"], kwargs["cos_sin_cache"], kwargs["num_q_heads"], kwargs["num_kv_heads"],
        kwargs["head_dim"], kwargs.get("q_weight"), kwargs.get("k_weight"), kwargs.get("q_bias"),
        kwargs.get("k_bias"), kwargs["eps"], kwargs["is_neox"], list(kwargs["mrope_section"] or ()),
        kwargs["mrope_interleaved"], *out)


# ---------------------------------------------------------------------------------------------------------
# Determinism, recompilation, graph capture and torch.compile.
# ---------------------------------------------------------------------------------------------------------
def _compiled_variants(kernel) -> int:
    """Number of compiled specialisations of a Triton kernel (-1 when this triton does not expose it)."""
    try:
        return sum(len(entry[0]) for entry in kernel.device_caches.values())
    except Exception:
        return -1


def stability_section(args):
    import qkvfuse
    from qkvfuse.backends.triton import kernels
    from qkvfuse.cli.verify import Section
    from qkvfuse.testing import make_norm_inputs, make_split_inputs

    device, rows = args.device, []
    T, repeats = _tier(args, "det_t"), _tier(args, "det_repeats")
    for preset_name in ("Qwen3-8B", "GLM-4.7", "Qwen3-VL-8B"):
        t0 = time.perf_counter()
        try:
            case = _split_case(preset_name, T, torch.bfloat16)
            kwargs = make_split_inputs(case, seed=3, device=device)
            first = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="triton")
            same = all(all(torch.equal(a, b) for a, b in zip(first, qkvfuse.split_qkv_rmsnorm_rope(
                **kwargs, backend="triton"))) for _ in range(repeats - 1))
            rows.append(_row(check=f"bitwise over {repeats} runs: {preset_name}", T=T, **{"pass": same},
                             s=round(time.perf_counter() - t0, 2)))
        except Exception as exc:
            rows.append(_failed_row(f"determinism {preset_name}", exc))
    try:
        kw = make_norm_inputs(T, 5120, torch.bfloat16, residual=True, bias=True, device=device)
        first = qkvfuse.add_rmsnorm(**kw, backend="triton")
        same = all(all(torch.equal(a, b) for a, b in zip(first, qkvfuse.add_rmsnorm(**kw, backend="triton")))
                   for _ in range(repeats - 1))
        rows.append(_row(check=f"bitwise over {repeats} runs: add_rmsnorm 5120", T=T, **{"pass": same}))
    except Exception as exc:
        rows.append(_failed_row("determinism add_rmsnorm", exc))

    if device.type == "cpu":
        return Section("stability", ("check", "T", "pass", "s", "detail"), rows,
                       "cpu-interpreter mode: recompilation, CUDA graph and torch.compile rows need a device")

    # A new T must not compile a new kernel (T is neither a constexpr nor specialised).
    try:
        case = _split_case("GLM-4.7", 4096, torch.bfloat16)
        kwargs = make_split_inputs(case, device=device)
        qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="triton")
        before = _compiled_variants(kernels.split_qkv_rmsnorm_rope_kernel)
        for T_new in (1, 3, 16, 17, 999, 1001, 4095):
            sub = dict(kwargs, qkv=kwargs["qkv"][:T_new], positions=kwargs["positions"][:T_new])
            qkvfuse.split_qkv_rmsnorm_rope(**sub, backend="triton")
        after = _compiled_variants(kernels.split_qkv_rmsnorm_rope_kernel)
        rows.append(_row(check="no recompilation for new T (1..4096)", **{"pass": before == after or before < 0},
                         detail=f"compiled variants {before} -> {after}"))
    except Exception as exc:
        rows.append(_failed_row("recompilation", exc))

    # CUDA-graph capture of the public op (host checks are skipped while capturing; no host sync may happen).
    if device.type == "cuda":
        try:
            case = _split_case("Qwen3-VL-8B", 64, torch.bfloat16)
            kwargs = make_split_inputs(case, device=device)
            out = _poisoned_outputs(case, device)
            qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")  # warm-up: compile outside capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")
            fresh = make_split_inputs(case, seed=11, device=device)
            kwargs["qkv"].copy_(fresh["qkv"])
            kwargs["positions"].copy_(fresh["positions"])
            graph.replay()
            torch.cuda.synchronize()
            expected = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="triton")  # same buffers, new contents
            same = all(torch.equal(a, b) for a, b in zip(out, expected))
            rows.append(_row(check="CUDA graph capture + replay with new inputs == eager", T=64, **{"pass": same}))
        except Exception as exc:
            rows.append(_failed_row("CUDA graph", exc))

    # torch.compile(fullgraph=True) of the public ops: one opaque torch.ops.qkvfuse call each, dynamic T.
    try:
        case = _split_case("GLM-4.7", 257, torch.bfloat16)
        kwargs = make_split_inputs(case, device=device)
        qkv, positions = kwargs.pop("qkv"), kwargs.pop("positions")
        norm = make_norm_inputs(257, 5120, torch.bfloat16, residual=True, bias=True, device=device)

        @torch.compile(fullgraph=True, dynamic=True)
        def prepare(qkv, positions, x, residual):
            q, k, v = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, **kwargs, backend="triton")
            y, r = qkvfuse.add_rmsnorm(x, residual, norm["weight"], norm["eps"], bias=norm["bias"], backend="triton")
            return q, k, v, y, r

        ok = True
        for T_new in (257, 300):
            got = prepare(qkv[:T_new], positions[:T_new], norm["x"][:T_new], norm["residual"][:T_new])
            eager = qkvfuse.split_qkv_rmsnorm_rope(qkv[:T_new], positions[:T_new], **kwargs, backend="triton")
            eager += qkvfuse.add_rmsnorm(norm["x"][:T_new], norm["residual"][:T_new], norm["weight"], norm["eps"],
                                         bias=norm["bias"], backend="triton")
            ok = ok and all(torch.equal(a, b) for a, b in zip(got, eager))
        rows.append(_row(check="torch.compile(fullgraph, dynamic) == eager (bitwise)", T="257, 300", **{"pass": ok}))
    except Exception as exc:
        rows.append(_failed_row("torch.compile", exc))
    return Section("stability", ("check", "T", "pass", "s", "detail"), rows)


# ---------------------------------------------------------------------------------------------------------
# Timings: Triton vs the eager reference and torch.compile(reference), fraction of copy bandwidth.
# ---------------------------------------------------------------------------------------------------------
def _timer(device: torch.device):
    """Median milliseconds of ``fn()``: triton.testing.do_bench on a device, a wall clock on CPU."""
    if device.type != "cpu":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall(fn, repeats=3):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return wall


def _split_bytes(case) -> int:
    """Bytes the op must move: qkv read, q/k/v written, positions read, one cos/sin value per rotary lane."""
    e = torch.tensor([], dtype=case.dtype).element_size()
    positions = case.T * (3 if case.mrope_section else 1) * 8
    return 2 * case.T * case.width * e + positions + case.T * case.rotary_dim * 4


def timing_section(args):
    from qkvfuse import reference
    from qkvfuse.backends.triton import launch
    from qkvfuse.cli.verify import Section
    from qkvfuse.presets import get_preset
    from qkvfuse.testing import make_norm_inputs, make_split_inputs

    device, rows = args.device, []
    bench = _timer(device)
    compiled = {}

    def measure(op, label, T, triton_fn, reference_fn, call, nbytes, copy_src):
        """One row: the Triton launcher, the eager and compiled reference on the same preallocated outputs."""
        try:
            ms_triton = bench(lambda: triton_fn(*call))
            ms_eager = bench(lambda: reference_fn(*call))
            ms_compiled = float("nan")
            if device.type != "cpu":  # one dynamic-shape compile per (op, geometry), as serving engines compile
                fn = compiled.setdefault((op, label), torch.compile(reference_fn, dynamic=True))
                ms_compiled = bench(lambda: fn(*call))
            dst = torch.empty_like(copy_src)
            ms_copy = bench(lambda: dst.copy_(copy_src))
            copy_gbs = 2 * copy_src.numel() * copy_src.element_size() / ms_copy / 1e6
            fraction = nbytes / ms_triton / 1e6 / copy_gbs
            target = ("met" if fraction >= BANDWIDTH_TARGET else "below") if T >= 4096 else "-"
            rows.append(_row(op=op, shape=label, T=T, **{
                "triton us": ms_triton * 1e3, "eager us": ms_eager * 1e3, "compile us": ms_compiled * 1e3,
                "vs compile": ms_compiled / ms_triton, "GB/s": nbytes / ms_triton / 1e6, "copy GB/s": copy_gbs,
                "of copy": fraction, "target": target}))
        except Exception as exc:
            rows.append(_row(op=op, shape=label, T=T, **{"pass": False, "detail": f"{type(exc).__name__}: {exc}"}))

    for preset_name in _tier(args, "timing"):
        for T in _tier(args, "timing_t"):
            case = _split_case(preset_name, T, torch.bfloat16)
            kwargs = make_split_inputs(case, seed=T, device=device)
            call = (kwargs["qkv"], kwargs["positions"], kwargs["cos_sin_cache"], kwargs["num_q_heads"],
                    kwargs["num_kv_heads"], kwargs["head_dim"], kwargs.get("q_weight"), kwargs.get("k_weight"),
                    kwargs.get("q_bias"), kwargs.get("k_bias"), kwargs["eps"], kwargs["is_neox"],
                    list(kwargs["mrope_section"] or ()), kwargs["mrope_interleaved"],
                    *_poisoned_outputs(case, device))
            measure("split_qkv_rmsnorm_rope", preset_name, T, launch.split_qkv_rmsnorm_rope_out,
                    reference.split_qkv_rmsnorm_rope_out, call, _split_bytes(case), kwargs["qkv"])
            del kwargs, call
        hidden = get_preset(preset_name).hidden_size
        for T in _tier(args, "timing_t"):
            kw = make_norm_inputs(T, hidden, torch.bfloat16, residual=True, device=device)
            x = kw["x"]
            call = (x, kw["residual"], kw["weight"], None, kw["eps"], torch.empty_like(x), torch.empty_like(x))
            measure("add_rmsnorm", f"{preset_name} ({hidden})", T, launch.add_rmsnorm_out, reference.add_rmsnorm_out,
                    call, 4 * x.numel() * x.element_size(), x)
    note = ("median of triton.testing.do_bench (ms -> us) on preallocated outputs; bytes = qkv read + q/k/v written "
            "+ positions + cos/sin (add_rmsnorm: x, residual read, y, residual_out written); 'of copy' = op GB/s / "
            f"GB/s of a same-size tensor copy; target >= {BANDWIDTH_TARGET:.0%} for T >= 4096; compile = "
            "torch.compile(reference, dynamic=True)")
    if device.type == "cpu":
        note = "cpu-interpreter mode: wall-clock medians of the interpreter, not kernel timings; " + note
    return Section("timing (bf16)", ("op", "shape", "T", "triton us", "eager us", "compile us", "vs compile", "GB/s",
                                     "copy GB/s", "of copy", "target"), rows, note)


def block_sweep_section(args):
    """Full tier only (None otherwise): time per device tile size (launch.GPU_TILE), to tune its default."""
    from qkvfuse.backends.triton import launch
    from qkvfuse.cli.verify import Section
    from qkvfuse.testing import make_split_inputs

    rows = []
    if args.tier != "full":
        return None
    bench, default = _timer(args.device), launch.GPU_TILE
    try:
        for preset_name in ("Qwen3-8B", "GLM-4.7"):
            for T in (1, 16, 4096, 16384):
                case = _split_case(preset_name, T, torch.bfloat16)
                kwargs = make_split_inputs(case, seed=T, device=args.device)
                out = _poisoned_outputs(case, args.device)
                for tile in (512, 1024, 2048, 4096, 8192):
                    launch.GPU_TILE = tile
                    ms = bench(lambda: _launch_direct(launch, kwargs, out))
                    rows.append(_row(preset=preset_name, T=T, tile=tile, us=ms * 1e3,
                                     **{"GB/s": _split_bytes(case) / ms / 1e6}))
    finally:
        launch.GPU_TILE = default
    return Section("tile sweep (launch.GPU_TILE)", ("preset", "T", "tile", "us", "GB/s"), rows,
                   f"default GPU_TILE = {default}")


SECTIONS = [
    ("conformance", conformance_section),
    ("stability", stability_section),
    ("timing", timing_section),
    ("tile-sweep", block_sweep_section),
    ("moe-stream", "qkvfuse.moe.gpu_check:section"),
]


# ---------------------------------------------------------------------------------------------------------
def _has_device() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tier = parser.add_mutually_exclusive_group()
    tier.add_argument("--full", action="store_true", help="full tier (longer than the 5-minute quick tier)")
    tier.add_argument("--cpu-interpreter", action="store_true",
                      help="small sizes on CPU tensors under TRITON_INTERPRET=1 (automatic without a GPU)")
    parser.add_argument("--json", default=None,
                        help="output JSON path (default $OUT/gpu_check.json, else bench/results/gpu_check.json)")
    parser.add_argument("--section", action="append", help="run only these sections (repeatable)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_interpreter or not _has_device():
        args.cpu_interpreter = True
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated (first qkvfuse triton import)
    args.tier = "cpu" if args.cpu_interpreter else ("full" if args.full else "quick")
    args.device = torch.device("cpu") if args.cpu_interpreter else torch.device(
        "cuda" if torch.cuda.is_available() else "xpu")
    json_path = Path(args.json or (Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "results")
                     / "gpu_check.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)

    import triton

    from qkvfuse.backends import available_backends
    from qkvfuse.cli.verify import Section, print_section

    reason = available_backends()["triton"]
    header = dict(mode="cpu-interpreter" if args.cpu_interpreter else "device", tier=args.tier,
                  device=(torch.cuda.get_device_name() if args.device.type == "cuda" else str(args.device)),
                  torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                  triton_backend_unavailable=reason)
    print(json.dumps(header))
    result = dict(header, sections=[], skipped={}, elapsed_s=0.0)
    if reason:
        print(f"triton backend unavailable: {reason}")
        json_path.write_text(json.dumps(result, indent=1, default=str))
        return 1
    start = time.perf_counter()
    failures = 0
    for name, entry in SECTIONS:
        if args.section and name not in args.section:
            continue
        t0 = time.perf_counter()
        if isinstance(entry, str):
            module, func = entry.split(":")
            try:
                external = getattr(importlib.import_module(module), func)
            except ImportError as exc:
                print(f"\n== {name} == skipped: {exc}")
                result["skipped"][name] = str(exc)
                continue
            try:
                outcome = external(quick=args.tier != "full")
            except Exception as exc:
                traceback.print_exc()
                outcome = {"pass": False, "table": f"== {name} == FAIL: {type(exc).__name__}: {exc}"}
            print("\n" + str(outcome.get("table", f"== {name} ==")))
            failures += outcome.get("pass") is False
            result["external"] = dict(result.get("external", {}), **{name: dict(
                {k: v for k, v in outcome.items() if k != "table"}, seconds=round(time.perf_counter() - t0, 1))})
        else:
            try:
                section = entry(args)
            except Exception as exc:
                traceback.print_exc()
                section = Section(name, ("check", "pass", "detail"), [_failed_row(name, exc)])
            if section is None:  # not part of this tier
                continue
            _sync(args.device)
            print_section(section)
            for row in section.rows:
                if not row.get("pass", False) and row.get("detail"):
                    print(f"  FAIL detail: {row['detail']}")
            failures += section.failures
            result["sections"].append(dict(dataclasses.asdict(section), name=name,
                                           seconds=round(time.perf_counter() - t0, 1)))
        result["elapsed_s"] = round(time.perf_counter() - start, 1)
        json_path.write_text(json.dumps(result, indent=1, default=str))
    total = sum(len(s["rows"]) for s in result["sections"])
    print(f"\ngpu_check ({args.tier}): {total - failures} rows passed, {failures} failed, "
          f"{result['elapsed_s']} s; JSON: {json_path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
