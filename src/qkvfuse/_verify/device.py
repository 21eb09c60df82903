"""Device sections of ``python -m qkvfuse verify --device cuda``: the Triton backend on an accelerator.

* :func:`conformance_section` -- every preset at realistic sizes (T up to 16 384), Hkv = 1, head_dim 80/192/512,
  out-of-range positions clamped in the kernel, 64-bit offsets, in place == out of place, add_rmsnorm; every
  element against the float64 oracle with NaN-poisoned outputs;
* :func:`stability_section` -- bitwise determinism over repeated runs; no recompilation for a new T; CUDA-graph
  capture and replay; ``torch.compile(fullgraph=True, dynamic=True)`` == eager, bitwise.

Sizes come from :data:`TIERS` by ``opts.tier``: ``"quick"`` (``--quick``: about 3 minutes on an H200 with
the MoE check, the timings 1 more), ``"full"`` (every preset and dtype) and ``"cpu"`` (``--cpu-interpreter``: small
sizes on CPU tensors under ``TRITON_INTERPRET=1``, a dry run of the same code; the recompilation, graph and
compile rows need a device). The timings are ``python -m qkvfuse bench --device cuda``
(:mod:`qkvfuse.benchmarks.device`), which uses the helpers here.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from ..backends import backend_unavailable
from ..presets import PRESETS, get_preset
from ..testing.accuracy import check_norm_outputs, check_split_outputs
from ..testing.oracle import oracle_add_rmsnorm, oracle_split, unfused_add_rmsnorm, unfused_split
from .inputs import SplitCase, make_norm_inputs, make_split_inputs, poisoned_like
from .sections import Options, Section

__all__ = ["TIERS", "conformance_section", "stability_section", "device_unavailable", "split_case",
           "poisoned_outputs", "launch_direct", "synchronize", "row", "failed_row"]

TIERS = {
    # presets / token counts for conformance, extra T=16384 presets, dtypes, determinism T and repeats,
    # add_rmsnorm hidden sizes and token counts
    "cpu": dict(presets=("Qwen3-8B", "GLM-4.7", "Qwen3-VL-8B", "GLM-4.5V"), tokens=(1, 5), big=(), big_t=0,
                dtypes=("bfloat16",), det_t=5, det_repeats=3, hidden=(2048,), norm_t=(1, 5)),
    "quick": dict(presets=None, tokens=(1, 257, 4096), big=("Qwen3-8B", "GLM-4.7", "Qwen3-VL-8B"), big_t=16384,
                  dtypes=("bfloat16",), det_t=16384, det_repeats=20, hidden=(2048, 4096, 5120),
                  norm_t=(1, 4096, 16384)),
    "full": dict(presets=None, tokens=(1, 16, 257, 4096, 16384), big=None, big_t=16384,
                 dtypes=("bfloat16", "float16", "float32"), det_t=16384, det_repeats=20, hidden=(2048, 4096, 5120),
                 norm_t=(1, 256, 4096, 16384)),
}
MAX_POSITION = 32768  # rows of the cos/sin table in the checks (a 262 144-row table only slows input building)


def device_unavailable(device: str) -> str:
    """Why ``device`` (a torch device string) cannot run here, in one line; "" when it can."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        return f"not a torch device ({exc})"
    if dev.type == "cpu":
        return ""
    module = getattr(torch, dev.type, None)
    if module is None or not hasattr(module, "is_available") or not module.is_available():
        return f"no {dev.type.upper()} device (torch.{dev.type}.is_available() is not True)"
    if dev.index is not None and dev.index >= module.device_count():
        return f"no {dev} ({module.device_count()} {dev.type} device(s))"
    return ""


def tier_value(opts: Options, key: str):
    value = TIERS[opts.tier][key]
    if value is None and key in ("presets", "big"):
        return tuple(PRESETS)
    return value


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).synchronize()


def row(**fields):
    fields.setdefault("pass", True)
    return fields


def failed_row(what: str, exc: BaseException):
    return row(check=what, **{"pass": False, "detail": f"{type(exc).__name__}: {exc}"})


def _triton_unavailable(title: str) -> Optional[Section]:
    reason = backend_unavailable("triton")
    if not reason:
        return None
    return Section(title, ("check", "pass"), [row(check="triton backend available", **{"pass": False},
                                                  detail=reason)])


# ---------------------------------------------------------------------------------------------------------
# Conformance: every preset at realistic sizes against the float64 oracle (NaN-poisoned outputs).
# ---------------------------------------------------------------------------------------------------------
def split_case(preset_name: str, T: int, dtype: torch.dtype, **changes) -> SplitCase:
    """``preset_name``'s geometry at ``T`` tokens (cos/sin table capped at MAX_POSITION rows)."""
    preset = get_preset(preset_name)
    fields = dict(dtype=dtype, max_position=min(preset.max_position, MAX_POSITION))
    fields.update(changes)
    return SplitCase.from_preset(preset, T, **fields)


def poisoned_outputs(case: SplitCase, device):
    """NaN-filled ``(q, k, v)`` (gated: ``(q, k, v, gate)``) outputs for ``case`` on ``device``."""
    D = case.head_dim
    heads = (case.num_q_heads, case.num_kv_heads, case.num_kv_heads) + ((case.num_q_heads,) if case.q_gate else ())
    return tuple(poisoned_like(torch.empty(case.T, n * D, dtype=case.dtype, device=device)) for n in heads)


def check_split(kwargs, out, case):
    return check_split_outputs(out, oracle_split(**kwargs), unfused_split(**kwargs), kwargs["qkv"],
                               case.num_q_heads, case.num_kv_heads, case.head_dim)


def split_row(label, case, kwargs, out, t0):
    report = check_split(kwargs, out, case)
    return row(check=label, T=case.T, dtype=str(case.dtype)[6:], **{
        "max err": report.max_err, "unfused err": report.unfused_err, "pass": report.ok, "detail": report.detail,
        "s": round(time.perf_counter() - t0, 2)})


def conformance_section(opts: Options) -> Section:
    """Every preset at realistic sizes (and the geometries peers got wrong) against the float64 oracle."""
    import qkvfuse

    unavailable = _triton_unavailable("conformance (Triton vs float64 oracle)")
    if unavailable:
        return unavailable

    device = opts.torch_device
    rows = []
    tokens, big_t = tier_value(opts, "tokens"), tier_value(opts, "big_t")
    plan = [(p, T, d) for p in tier_value(opts, "presets") for T in tokens for d in tier_value(opts, "dtypes")
            if not (d != "bfloat16" and T > 4096)]
    plan += [(p, big_t, "bfloat16") for p in tier_value(opts, "big") if big_t and big_t not in tokens]
    for preset_name, T, dtype in plan:
        t0 = time.perf_counter()
        try:
            case = split_case(preset_name, T, _dtype(dtype))
            kwargs = make_split_inputs(case, seed=T, device=device)
            out = poisoned_outputs(case, device)
            qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")
            rows.append(split_row(preset_name, case, kwargs, out, t0))
        except Exception as exc:  # one broken case must not hide the others
            rows.append(failed_row(f"{preset_name} T={T} {dtype}", exc))

    small = opts.tier == "cpu"
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
                    case = split_case("GLM-4.7", 5 if small else 1024, torch.bfloat16, head_dim=D, rotary_dim=D // 2,
                                      num_q_heads=8, num_kv_heads=2, bias=True)
                    kwargs = make_split_inputs(case, seed=D, device=device)
                    out = poisoned_outputs(case, device)
                    qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")
                    rows.append(split_row(f"head_dim {D}, rotary {D // 2}, norm bias", case, kwargs, out, t0))
                continue
            spec = dict(spec)
            case = split_case(spec.pop("preset"), spec.pop("T"), torch.bfloat16, **spec)
            kwargs = make_split_inputs(case, seed=1, device=device)
            out = poisoned_outputs(case, device)
            qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")
            rows.append(split_row(label, case, kwargs, out, t0))
        except Exception as exc:
            rows.append(failed_row(label, exc))

    # Norm weights and biases that are not contiguous (a column of a stacked parameter, a stride-0 expand, an
    # offset view): the launcher must honour what the validator accepts; on a GPU a kernel
    # reading them as contiguous reads out of bounds.
    for label, make in (("strided weights (stride 2)", lambda w: torch.stack([w, torch.full_like(w, float("nan"))],
                                                                              1)[:, 0]),
                        ("stride-0 weights (expand)", lambda w: w[:1].expand(w.shape[0])),
                        ("offset weights", lambda w: torch.cat([torch.full_like(w[:3], float("nan")), w])[3:])):
        t0 = time.perf_counter()
        try:
            case = split_case("GLM-4.7", 7 if small else 2048, torch.bfloat16, bias=True)
            kwargs = make_split_inputs(case, seed=3, device=device)
            for name in ("q_weight", "k_weight", "q_bias", "k_bias"):
                kwargs[name] = make(kwargs[name])
            out = poisoned_outputs(case, device)
            qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")
            rows.append(split_row(label, case, kwargs, out, t0))
        except Exception as exc:
            rows.append(failed_row(label, exc))

    # Out-of-range positions with the host check bypassed (the launcher, as under graph capture): clamped inside
    # the kernel; the table is a view into a NaN-bordered buffer, so a read outside it would show as NaN.
    t0 = time.perf_counter()
    try:
        case = split_case("Qwen3-VL-8B", 9, torch.bfloat16)
        kwargs = make_split_inputs(case, device=device)
        table = kwargs["cos_sin_cache"]
        big = torch.full((table.shape[0] + 64, table.shape[1]), float("nan"), device=device)
        big[32:32 + table.shape[0]] = table
        kwargs["cos_sin_cache"] = big[32:32 + table.shape[0]]
        n = table.shape[0]
        bad = torch.tensor([-1, -(2**40), n, n + 31, 2**40, n - 1, 0, 7, -32], device=device)
        kwargs["positions"] = torch.stack([bad, bad.flip(0), bad.roll(2)])
        out = poisoned_outputs(case, device)
        launch_direct(kwargs, out)
        clamped = dict(kwargs, positions=kwargs["positions"].clamp(0, n - 1))
        rows.append(split_row("positions out of range, clamped in kernel", case, clamped, out, t0))
    except Exception as exc:
        rows.append(failed_row("positions out of range", exc))

    # 64-bit offsets: qkv rows 2^30 elements apart, so offsets pass 2^31 (skipped on CPU: a 4 GiB buffer).
    if not small:
        t0 = time.perf_counter()
        try:
            case = split_case("GLM-4.7", 3, torch.bfloat16)
            kwargs = make_split_inputs(case, device=device)
            stride = 2**30 + 64
            buf = torch.empty(2 * stride + case.width, dtype=torch.bfloat16, device=device)
            qkv = buf.as_strided((3, case.width), (stride, 1))
            qkv.copy_(kwargs["qkv"])
            kwargs["qkv"] = qkv
            out = poisoned_outputs(case, device)
            qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")
            rows.append(split_row("64-bit offsets (row stride 2^30)", case, kwargs, out, t0))
            del buf, qkv, kwargs
        except Exception as exc:
            rows.append(failed_row("64-bit offsets", exc))

    # In place (what engines call) = out of place, bit for bit. head_dim 512 puts NeoX partners in other warps.
    for label, changes in (("GLM-4.7", {}), ("head_dim 512", dict(head_dim=512, rotary_dim=512, num_q_heads=8,
                                                                  num_kv_heads=2))):
        t0 = time.perf_counter()
        try:
            case = split_case("GLM-4.7", 5 if small else 4096, torch.bfloat16, **changes)
            kwargs = make_split_inputs(case, device=device)
            expected = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="triton")
            qkv = kwargs.pop("qkv").clone()
            views = qkvfuse.split_qkv_rmsnorm_rope_(qkv, **kwargs, backend="triton")
            same = all(torch.equal(a, b) for a, b in zip(views, expected))
            rows.append(row(check=f"in place == out of place (bitwise), {label}", T=case.T, dtype="bfloat16",
                            **{"pass": same}, s=round(time.perf_counter() - t0, 2)))
        except Exception as exc:
            rows.append(failed_row(f"in place {label}", exc))

    for H in tier_value(opts, "hidden"):
        for T in tier_value(opts, "norm_t"):
            t0 = time.perf_counter()
            try:
                kw = make_norm_inputs(T, H, torch.bfloat16, residual=True, bias=H == 5120, seed=H, device=device)
                x = kw["x"]
                got = qkvfuse.add_rmsnorm(**kw, out=(poisoned_like(x), poisoned_like(x)), backend="triton")
                report = check_norm_outputs(got, oracle_add_rmsnorm(**kw), unfused_add_rmsnorm(**kw), x,
                                            kw["residual"])
                rows.append(row(check=f"add_rmsnorm hidden {H}", T=T, dtype="bfloat16", **{
                    "max err": report.max_err, "unfused err": report.unfused_err, "pass": report.ok,
                    "detail": report.detail, "s": round(time.perf_counter() - t0, 2)}))
            except Exception as exc:
                rows.append(failed_row(f"add_rmsnorm hidden {H} T={T}", exc))
    note = ("every element vs the float64 oracle, outputs NaN-poisoned; rule: within 1/2 ulp (+fp32 allowance) "
            "and no worse than unfused + 1 ulp")
    return Section("conformance (Triton vs float64 oracle)", ("check", "T", "dtype", "max err", "unfused err",
                                                              "pass", "s"), rows, note)


def launch_direct(kwargs, out):
    """The Triton launcher called directly: no validation, no host range check (what runs under capture)."""
    from .._library import split_config
    from ..backends.triton import launch

    launch.split_qkv_rmsnorm_rope_out(kwargs["qkv"], kwargs["positions"], split_config(**kwargs), *out)


# ---------------------------------------------------------------------------------------------------------
# Determinism, recompilation, graph capture and torch.compile.
# ---------------------------------------------------------------------------------------------------------
def _compiled_variants(kernel) -> int:
    """Number of compiled specialisations of a Triton kernel (-1 when this triton does not expose it)."""
    try:
        return sum(len(entry[0]) for entry in kernel.device_caches.values())
    except Exception:
        return -1


def stability_section(opts: Options) -> Section:
    """Bitwise determinism at large T; on a device also: no recompilation for a new T, CUDA-graph capture,
    torch.compile(fullgraph, dynamic)."""
    import qkvfuse

    unavailable = _triton_unavailable("stability")
    if unavailable:
        return unavailable
    from ..backends.triton import kernels

    device, rows = opts.torch_device, []
    T, repeats = tier_value(opts, "det_t"), tier_value(opts, "det_repeats")
    for preset_name in ("Qwen3-8B", "GLM-4.7", "Qwen3-VL-8B"):
        t0 = time.perf_counter()
        try:
            case = split_case(preset_name, T, torch.bfloat16)
            kwargs = make_split_inputs(case, seed=3, device=device)
            first = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="triton")
            same = all(all(torch.equal(a, b) for a, b in zip(first, qkvfuse.split_qkv_rmsnorm_rope(
                **kwargs, backend="triton"))) for _ in range(repeats - 1))
            rows.append(row(check=f"bitwise over {repeats} runs: {preset_name}", T=T, **{"pass": same},
                            s=round(time.perf_counter() - t0, 2)))
        except Exception as exc:
            rows.append(failed_row(f"determinism {preset_name}", exc))
    try:
        kw = make_norm_inputs(T, 5120, torch.bfloat16, residual=True, bias=True, device=device)
        first = qkvfuse.add_rmsnorm(**kw, backend="triton")
        same = all(all(torch.equal(a, b) for a, b in zip(first, qkvfuse.add_rmsnorm(**kw, backend="triton")))
                   for _ in range(repeats - 1))
        rows.append(row(check=f"bitwise over {repeats} runs: add_rmsnorm 5120", T=T, **{"pass": same}))
    except Exception as exc:
        rows.append(failed_row("determinism add_rmsnorm", exc))

    if device.type == "cpu":
        return Section("stability", ("check", "T", "pass", "s", "detail"), rows,
                       "cpu-interpreter mode: recompilation, CUDA graph and torch.compile rows need a device")

    # A new T must not compile a new kernel (T is neither a constexpr nor specialised).
    try:
        case = split_case("GLM-4.7", 4096, torch.bfloat16)
        kwargs = make_split_inputs(case, device=device)
        qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="triton")
        before = _compiled_variants(kernels.split_qkv_rmsnorm_rope_kernel)
        for T_new in (1, 3, 16, 17, 999, 1001, 4095):
            sub = dict(kwargs, qkv=kwargs["qkv"][:T_new], positions=kwargs["positions"][:T_new])
            qkvfuse.split_qkv_rmsnorm_rope(**sub, backend="triton")
        after = _compiled_variants(kernels.split_qkv_rmsnorm_rope_kernel)
        rows.append(row(check="no recompilation for new T (1..4096)", **{"pass": before == after or before < 0},
                        detail=f"compiled variants {before} -> {after}"))
    except Exception as exc:
        rows.append(failed_row("recompilation", exc))

    # CUDA-graph capture of the public op (host checks are skipped while capturing; no host sync may happen).
    if device.type == "cuda":
        try:
            case = split_case("Qwen3-VL-8B", 64, torch.bfloat16)
            kwargs = make_split_inputs(case, device=device)
            out = poisoned_outputs(case, device)
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
            rows.append(row(check="CUDA graph capture + replay with new inputs == eager", T=64, **{"pass": same}))
        except Exception as exc:
            rows.append(failed_row("CUDA graph", exc))

    # torch.compile(fullgraph=True) of the public ops: one opaque torch.ops.qkvfuse call each, dynamic T.
    try:
        case = split_case("GLM-4.7", 257, torch.bfloat16)
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
        rows.append(row(check="torch.compile(fullgraph, dynamic) == eager (bitwise)", T="257, 300", **{"pass": ok}))
    except Exception as exc:
        rows.append(failed_row("torch.compile", exc))
    return Section("stability", ("check", "T", "pass", "s", "detail"), rows)
