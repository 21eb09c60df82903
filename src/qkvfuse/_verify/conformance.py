"""The ``ops`` section: each preset's prepare step and add_rmsnorm, per backend, against the float64 oracle.

CPU tensors; every backend that is usable here (Triton under ``TRITON_INTERPRET=1``). The device counterpart,
Triton at realistic sizes on an accelerator, is :func:`qkvfuse._verify.device.conformance_section`.
"""

from __future__ import annotations

import itertools
import time

import torch

from ..backends import available_backends
from ..presets import PRESETS
from ..testing.accuracy import INTERPRETER_BF16_ULPS, check_norm_outputs, check_split_outputs
from ..testing.oracle import oracle_add_rmsnorm, oracle_split, unfused_add_rmsnorm, unfused_split
from .cache import VERIFY_CASES as CACHE_CASES
from .cache import check_cache_case

# The cache-writing forms verified, by their public names: the in-place form and the out-of-place one.
_CACHE_FORMS = {"split_qkv_rmsnorm_rope_cache_": "inplace", "split_qkv_rmsnorm_rope_cache": "out"}
from .inputs import SplitCase, make_norm_inputs, make_split_inputs, poisoned_like, poisoned_split_outputs
from .sections import Options, Section, advance, planned, triton_interpreter

__all__ = ["ops_section"]


def _triton_extra(backend: str, dtype: torch.dtype) -> float:
    return INTERPRETER_BF16_ULPS if backend == "triton" and dtype == torch.bfloat16 else 0.0


def _mode(preset) -> str:
    mode = "rope" if preset.mrope_section is None else "mrope-" + ("interleaved" if preset.mrope_interleaved
                                                                   else "contiguous")
    mode += "" if preset.qk_norm else ", no qk-norm"
    return mode + (", gated" if preset.q_gate else "") + (", gemma" if preset.gemma_norm else "")


def ops_section(opts: Options) -> Section:
    """Each preset's prepare step and add_rmsnorm, per backend, against the float64 oracle."""
    import qkvfuse

    no_interpreter = triton_interpreter()
    skipped = {b: r for b, r in available_backends().items() if r}
    if no_interpreter:
        skipped["triton"] = no_interpreter
    usable = [b for b in available_backends() if b not in skipped and (not opts.backends or b in opts.backends)]
    rows = []
    token_counts = (1, 33) if opts.quick else (1, 33, 128)
    norm_cases = ((4096, False), (5120, False), (2048, True))  # 2048 Gemma: Qwen3-Next's decoder norms
    plan = {}
    for backend in usable:
        # The Triton interpreter is slow on CPU: a smaller matrix keeps `make run` under a minute.
        interp = backend == "triton"
        plan[backend] = [(preset, T, dtype) for preset in PRESETS.values() for T in ((3,) if interp else token_counts)
                         for dtype in (torch.bfloat16, torch.float32)
                         if not (interp and dtype == torch.float32
                                 and preset.name not in ("Qwen3-8B", "GLM-4.7", "Qwen3.5-27B"))]
    planned(sum(len(cases) + 2 * len(norm_cases) + len(_CACHE_FORMS) * len(CACHE_CASES) for cases in plan.values()))
    for backend in usable:
        interp = backend == "triton"
        for preset, T, dtype in plan[backend]:
            case = SplitCase.from_preset(preset, T, dtype=dtype, max_position=min(preset.max_position, 8192))
            kwargs = make_split_inputs(case, seed=T)
            qkv = kwargs["qkv"]
            hq, hkv, D = case.num_q_heads, case.num_kv_heads, case.head_dim
            out = poisoned_split_outputs(kwargs)
            t0 = time.perf_counter()
            got = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend=backend)
            report = check_split_outputs(got, oracle_split(**kwargs), unfused_split(**kwargs), qkv, hq, hkv,
                                         D, _triton_extra(backend, dtype))
            rows.append({"op": "split_qkv_rmsnorm_rope", "preset": preset.name, "backend": backend, "T": T,
                         "dtype": str(dtype)[6:], "mode": _mode(preset), "max err": report.max_err,
                         "unfused err": report.unfused_err, "pass": report.ok, "detail": report.detail,
                         "s": round(time.perf_counter() - t0, 2)})
            advance()
        for H, gemma in norm_cases:
            for dtype in (torch.bfloat16, torch.float32):
                T = 3 if interp else 33
                kw = make_norm_inputs(T, H, dtype, residual=True, bias=H == 5120, seed=H, gemma_norm=gemma)
                x = kw["x"]
                got = qkvfuse.add_rmsnorm(**kw, out=(poisoned_like(x), poisoned_like(x)), backend=backend)
                report = check_norm_outputs(got, oracle_add_rmsnorm(**kw), unfused_add_rmsnorm(**kw), x, kw["residual"],
                                            _triton_extra(backend, dtype))
                advance()
                rows.append({"op": "add_rmsnorm", "preset": f"hidden {H}", "backend": backend, "T": T,
                             "dtype": str(dtype)[6:],
                             "mode": "residual" + (" + bias" if "bias" in kw else "") + (", gemma" if gemma else ""),
                             "max err": report.max_err, "unfused err": report.unfused_err, "pass": report.ok,
                             "detail": report.detail})
        for (name, cache_case), (op, form) in itertools.product(CACHE_CASES, _CACHE_FORMS.items()):
            t0 = time.perf_counter()
            try:
                check_cache_case(backend, cache_case, form=form)
                ok, detail = True, ""
            except AssertionError as exc:
                ok, detail = False, str(exc)
            advance()
            rows.append({"op": op, "preset": name, "backend": backend,
                         "T": cache_case.split.T, "dtype": str(cache_case.dtype)[6:], "mode": "cache",
                         "max err": "", "unfused err": "", "pass": ok, "detail": detail,
                         "s": round(time.perf_counter() - t0, 2)})
    note = ("rule (qkvfuse.testing.accuracy): max err <= unfused err + 1 ulp (+ fp32 summation noise), every "
            "element within 1/2 ulp of the float64 oracle (+ fp32 allowance), V / residual_out bit-exact; "
            "split_qkv_rmsnorm_rope_cache_ (qkvfuse._verify.cache): qkv as split_qkv_rmsnorm_rope_ (the out-of-place "
            "split_qkv_rmsnorm_rope_cache: qkv unchanged, outputs as split_qkv_rmsnorm_rope), same-dtype caches "
            "bit-exact, FP8 within 1/2 FP8 ulp of the oracle / scale (truncate: below it by < 1 ulp), "
            "every other cache byte unchanged")
    if skipped:
        note += "\nunavailable backends: " + "; ".join(f"{b} ({r})" for b, r in skipped.items())
    columns = ("op", "preset", "backend", "T", "dtype", "mode", "max err", "unfused err", "pass")
    return Section("ops vs float64 oracle", columns, rows, note)
