"""``python -m qkvfuse verify``: every backend on this machine against the float64 oracle, as a table.

Sections (each a function ``section(args) -> Section``): ``ops`` (here), ``models`` (transformers
integration, logits-to-logits), ``failure-modes`` (the public failure modes of fused kernels). A section whose
dependencies are missing reports that instead of failing. Exit status is non-zero if any row fails.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import time
from typing import Callable, Dict, List, Sequence

import torch

from ..backends import available_backends
from ..presets import PRESETS
from ..testing import (SplitCase, check_norm_outputs, check_split_outputs, make_norm_inputs, make_split_inputs,
                       oracle_add_rmsnorm, oracle_split, poisoned_like, unfused_add_rmsnorm, unfused_split)
from ..testing.accuracy import INTERPRETER_BF16_ULPS


@dataclasses.dataclass
class Section:
    """One table: ``rows`` are dicts keyed by ``columns``; each row has a boolean ``pass`` column."""

    title: str
    columns: Sequence[str]
    rows: List[Dict[str, object]]
    note: str = ""

    @property
    def failures(self) -> int:
        return sum(1 for r in self.rows if not r.get("pass", False))


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "PASS" if value else "FAIL"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def print_section(section: Section) -> None:
    cells = [[_fmt(r.get(c, "")) for c in section.columns] for r in section.rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(section.columns)]
    print(f"\n== {section.title} ==")
    if section.note:
        print(section.note)
    print("  ".join(c.ljust(w) for c, w in zip(section.columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _triton_extra(backend: str, dtype: torch.dtype) -> float:
    return INTERPRETER_BF16_ULPS if backend == "triton" and dtype == torch.bfloat16 else 0.0


def ops_section(args) -> Section:
    """Each preset's prepare step and add_rmsnorm, per backend, against the float64 oracle."""
    import qkvfuse

    os.environ.setdefault("TRITON_INTERPRET", "1")
    usable = [b for b, reason in available_backends().items() if not reason]
    if args.backend:
        usable = [b for b in usable if b in args.backend]
    rows = []
    token_counts = (1, 33) if args.quick else (1, 33, 128)
    for backend in usable:
        # The Triton interpreter is slow on CPU: a smaller matrix keeps `make run` under a minute.
        interp = backend == "triton"
        for preset in PRESETS.values():
            for T in ((3,) if interp else token_counts):
                for dtype in (torch.bfloat16, torch.float32):
                    if interp and dtype == torch.float32 and preset.name not in ("Qwen3-8B", "GLM-4.7"):
                        continue
                    case = SplitCase.from_preset(preset, T, dtype=dtype, max_position=min(preset.max_position, 8192))
                    kwargs = make_split_inputs(case, seed=T)
                    qkv = kwargs["qkv"]
                    hq, hkv, D = case.num_q_heads, case.num_kv_heads, case.head_dim
                    out = tuple(poisoned_like(torch.empty(T, n * D, dtype=dtype)) for n in (hq, hkv, hkv))
                    t0 = time.perf_counter()
                    got = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend=backend)
                    report = check_split_outputs(got, oracle_split(**kwargs), unfused_split(**kwargs), qkv, hq, hkv,
                                                 D, _triton_extra(backend, dtype))
                    mode = "rope" if preset.mrope_section is None else "mrope-" + ("interleaved" if preset.mrope_interleaved else "contiguous")
                    mode += "" if preset.qk_norm else ", no qk-norm"
                    rows.append({"op": "split_qkv_rmsnorm_rope", "preset": preset.name, "backend": backend, "T": T,
                                 "dtype": str(dtype)[6:], "mode": mode, "max err": report.max_err,
                                 "unfused err": report.unfused_err, "pass": report.ok, "detail": report.detail,
                                 "s": round(time.perf_counter() - t0, 2)})
        for H in (4096, 5120):
            for dtype in (torch.bfloat16, torch.float32):
                T = 3 if interp else 33
                kw = make_norm_inputs(T, H, dtype, residual=True, bias=H == 5120, seed=H)
                x = kw["x"]
                got = qkvfuse.add_rmsnorm(**kw, out=(poisoned_like(x), poisoned_like(x)), backend=backend)
                report = check_norm_outputs(got, oracle_add_rmsnorm(**kw), unfused_add_rmsnorm(**kw), x, kw["residual"],
                                            _triton_extra(backend, dtype))
                rows.append({"op": "add_rmsnorm", "preset": f"hidden {H}", "backend": backend, "T": T,
                             "dtype": str(dtype)[6:], "mode": "residual" + (" + bias" if "bias" in kw else ""),
                             "max err": report.max_err, "unfused err": report.unfused_err, "pass": report.ok,
                             "detail": report.detail})
    skipped = {b: r for b, r in available_backends().items() if r}
    note = ("rule (qkvfuse.testing.accuracy): max err <= unfused err + 1 ulp (+ fp32 summation noise), every element "
            "within 1/2 ulp of the float64 oracle (+ fp32 allowance), V / residual_out bit-exact")
    if skipped:
        note += "\nunavailable backends: " + "; ".join(f"{b} ({r})" for b, r in skipped.items())
    columns = ("op", "preset", "backend", "T", "dtype", "mode", "max err", "unfused err", "pass")
    return Section("ops vs float64 oracle", columns, rows, note)


# Sections contributed by other parts of qkvfuse: name -> "module:function" (imported lazily).
SECTIONS: Dict[str, Callable | str] = {
    "ops": ops_section,
    "models": "qkvfuse.integrations.verify_models:section",
    "failure-modes": "qkvfuse.testing.failure_modes:section",
}


def _load(entry):
    if callable(entry):
        return entry
    module, func = entry.split(":")
    return getattr(importlib.import_module(module), func)


def run_verify(args) -> int:
    failures = 0
    dumped = []
    for name, entry in SECTIONS.items():
        if args.section and name not in args.section:
            continue
        try:
            section_fn = _load(entry)
        except ImportError as exc:
            print(f"\n== {name} == skipped: {exc}")
            continue
        section = section_fn(args)
        print_section(section)
        failures += section.failures
        dumped.append(dataclasses.asdict(section))
        for row in section.rows:
            if not row.get("pass", False) and row.get("detail"):
                print(f"  FAIL detail: {row['detail']}")
    total = sum(len(s["rows"]) for s in dumped)
    print(f"\nverify: {total - failures} passed, {failures} failed")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dumped, fh, indent=1, default=str)
    return 1 if failures else 0
