"""``python -m qkvfuse bench``: the fused ops against eager, ``torch.compile`` and a copy roofline, in one run.

Modules: :mod:`.timing` (interleaved rounds, the machine line), :mod:`.harness` (the matrix of shapes,
implementations and buffer placements), :mod:`.report` (tables, compile times, the team's targets, JSON,
chart), :mod:`.overview` (the main job's speed matrix: the user-facing calls against the alternatives),
:mod:`.device` (``--device cuda``). The engine, end-to-end, per-call and target harnesses live outside the
package, in the repository's ``bench/qkvfuse_bench/``; they build on these modules, and the per-call one runs as a
section of :func:`run_bench`. How to run and read it: ``bench/README.md``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from typing import List, Sequence

import torch

from ..backends import resolve_backend
from ..presets import get_preset
from .harness import COMPILED, CPU, EAGER, REFERENCE, BenchConfig, Row, bench_norm, bench_split, dtype_name
from .report import (BUSY_SHARE, configure, TABLE_NOTE, busy_warning, check_failures, print_compile_times, print_machine,
                     print_summary, print_tables, summarize, write_json, write_plot)
from .timing import Budget, cache_bytes, cpu_snapshot, machine_info, others_share

__all__ = ["run_bench", "config_from_args", "cpu_unavailable_reason"]

PRESETS = ("Qwen3-8B", "Qwen3-VL-8B", "GLM-4.7", "GLM-4.5-Air")
QUICK_PRESETS = ("Qwen3-8B", "GLM-4.7")
TOKENS = (1, 16, 256, 4096)
QUICK_TOKENS = (1, 256, 4096)
HIDDEN_SIZES = (4096, 5120)
E2E_MOVED = ("the end-to-end bench lives in a qkvfuse checkout's bench/ folder: PYTHONPATH=bench python -m "
             "qkvfuse_bench.e2e [--preset NAME] [--quick] [--compile] (bench/README.md)")
PERCALL_MOVED = ("the per-call bench lives in a qkvfuse checkout's bench/ folder: PYTHONPATH=bench python -m "
                 "qkvfuse_bench.percall [bench flags] (bench/README.md)")
OPS = ("split", "norm")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
FULL_BUDGET = Budget()
# --quick budget: ~1 s per measurement and the reference backend left out (it is as slow as eager at
# T = 4096, seconds per call for GLM shapes); torch.compile once, for one cell.
QUICK_BUDGET = Budget(block_s=1e-3, cell_s=1.0, warm_s=0.02, min_rounds=3, max_rounds=9)


def cpu_unavailable_reason() -> str:
    """Why the native CPU backend cannot run here ("" when it can); loads (builds) it, and only it."""
    try:
        resolve_backend("cpu", "cpu")
    except RuntimeError as exc:
        return str(exc)
    return ""


def config_from_args(args) -> BenchConfig:
    """The run's matrix from the CLI flags (``--quick`` changes the defaults, explicit flags win)."""
    quick = args.quick
    presets = tuple(get_preset(name) for name in (args.preset or (QUICK_PRESETS if quick else PRESETS)))
    dtypes = tuple(DTYPES[d] for d in dict.fromkeys(args.dtype or (["bf16"] if quick else ["bf16", "fp32"])))
    tokens = tuple(dict.fromkeys(args.tokens or (QUICK_TOKENS if quick else TOKENS)))
    if any(t < 1 for t in tokens):
        raise ValueError(f"--tokens: expected positive token counts, got {list(tokens)}")
    hidden = tuple(dict.fromkeys(getattr(args, "hidden", None) or HIDDEN_SIZES))
    if any(h < 1 for h in hidden):
        raise ValueError(f"--hidden: expected positive hidden sizes, got {list(hidden)}")
    ops = tuple(getattr(args, "op", None) or OPS)
    impls = [EAGER] + ([] if args.no_compile else [COMPILED]) + ([] if quick else [REFERENCE]) + [CPU]
    compile_cells = None
    if quick and presets and "split" in ops:
        T = 256 if 256 in tokens else tokens[len(tokens) // 2]
        compile_cells = ((presets[0].name, dtypes[0], T),)
    elif quick:
        compile_cells = ((f"hidden {hidden[0]}", dtypes[0], tokens[len(tokens) // 2]),)
    budget = QUICK_BUDGET if quick else FULL_BUDGET
    seconds = getattr(args, "seconds", None)
    if seconds is not None:
        if not seconds > 0:
            raise ValueError(f"--seconds: expected a positive number, got {seconds}")
        budget = dataclasses.replace(budget, cell_s=seconds, block_s=min(budget.block_s, seconds / 10),
                                     warm_s=min(budget.warm_s, seconds / 10))
    return BenchConfig(presets=presets if "split" in ops else (), hidden_sizes=hidden if "norm" in ops else (),
                       dtypes=dtypes, tokens=tokens, impls=tuple(impls), compile_cells=compile_cells, budget=budget,
                       l2_bytes=cache_bytes(2, 1 << 20), cpu_reason=cpu_unavailable_reason())


def _config_json(cfg: BenchConfig) -> dict:
    return {"presets": [p.name for p in cfg.presets], "hidden_sizes": list(cfg.hidden_sizes),
            "dtypes": [dtype_name(d) for d in cfg.dtypes], "tokens": list(cfg.tokens), "impls": list(cfg.impls),
            "compile_cells": None if cfg.compile_cells is None else
            [[s, dtype_name(d), t] for s, d, t in cfg.compile_cells],
            "budget": dataclasses.asdict(cfg.budget),
            "l2_bytes": cfg.l2_bytes, "cpu_backend_unavailable": cfg.cpu_reason}


def run_bench(args, sections: Sequence = ()) -> int:
    """Run the benchmark described by the CLI flags; print the tables and the summary last (with ``args.targets``,
    the maintainers' ``qkvfuse_bench.targets``: also the team's targets, judged on this run's rows, printed and in
    the JSON).

    ``sections``: more tables from harnesses outside the package (the per-call one, ``qkvfuse_bench.percall``),
    each an object with ``NAME`` (the ``--op`` value that selects it; without ``--op`` every section runs),
    ``cells(cfg, args)`` (``(bench, what, label, dtype, T)`` tuples, timed like the op cells),
    ``print_rows(rows)``, ``judge(rows, busy_share)`` (target verdicts), ``print_verdicts(verdicts)``,
    ``failures(rows)`` (lines) and ``to_json(rows, verdicts)`` (its entry in ``--json``, under ``NAME``).

    Returns 0, or 1 when the cpu backend broke the accuracy rule on the benchmark's inputs (checked once per
    cell, NaN-poisoned outputs, before timing) or ``--json`` / ``--plot`` could not be written after the run (the
    tables and summary are printed first, then the error), or 2 for bad flags and for ``--e2e``, which says where
    that harness lives now.
    """
    if getattr(args, "e2e", False):
        print(f"bench: --e2e: {E2E_MOVED}", file=sys.stderr)
        return 2
    if "percall" in (getattr(args, "op", None) or ()) and "percall" not in {s.NAME for s in sections}:
        print(f"bench: --op percall: {PERCALL_MOVED}", file=sys.stderr)
        return 2
    chosen = {s.NAME for s in sections if not getattr(args, "op", None) or s.NAME in args.op}
    t_start = time.perf_counter()
    cfg, code = configure(args, config_from_args)
    if code is not None:
        return code
    machine = machine_info()
    print_machine(machine)
    print("qkvfuse cpu backend: " + (f"unavailable, column skipped ({cfg.cpu_reason})" if cfg.cpu_reason
                                      else "available"))
    if cfg.compile_cells is not None and COMPILED in cfg.impls:
        print("torch.compile baseline only for: " + ", ".join(f"{s} {dtype_name(d)} T={t}"
                                                             for s, d, t in cfg.compile_cells))
    rows: List[Row] = []
    with warnings.catch_warnings():
        # dynamo traces through the lru_cache'd mRoPE axis map on purpose (its result is a constant)
        warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")
        cells = [(bench_split, preset, "split " + preset.name, dtype, T, rows)
                 for preset in cfg.presets for dtype in cfg.dtypes for T in cfg.tokens]
        cells += [(bench_norm, hidden, f"add_rmsnorm hidden {hidden}", dtype, T, rows)
                  for hidden in cfg.hidden_sizes for dtype in cfg.dtypes for T in cfg.tokens]
        section_rows: List[list] = [[] for _ in sections]  # a section not chosen still has its (empty) JSON entry
        cells += [cell + (sink,) for section, sink in zip(sections, section_rows) if section.NAME in chosen
                  for cell in section.cells(cfg, args)]
        run_start = cpu_snapshot()
        for bench, what, label, dtype, T, sink in cells:
            t0, before = time.perf_counter(), cpu_snapshot()
            cell = bench(cfg, what, dtype, T)
            share = others_share(before, cpu_snapshot())
            for row in cell:
                row.others = share
            sink.extend(cell)
            print(f"  measured {label} {dtype_name(dtype)} T={T} in {time.perf_counter() - t0:.1f} s"
                  + (f" (other processes: {share:.0%} of the CPUs)" if share is not None else ""), flush=True)
        machine["others_cpu_share"] = others_share(run_start, cpu_snapshot())
    machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if rows:
        print("\n" + TABLE_NOTE)
        print_tables(rows)
        print_compile_times(rows)
    for section, its_rows in zip(sections, section_rows):
        if its_rows:
            section.print_rows(its_rows)
    judge = getattr(args, "targets", False)
    summary = summarize(rows, cfg.cpu_reason) if judge else []
    verdicts = [section.judge(its_rows, BUSY_SHARE) if judge else []
                for section, its_rows in zip(sections, section_rows)]
    written, output_errors = [], []  # an output that fails after the run is reported after the summary
    if args.json:
        try:
            write_json(args.json, machine, _config_json(cfg), rows, summary,
                       {s.NAME: s.to_json(r, v) for s, r, v in zip(sections, section_rows, verdicts)})
            written.append(args.json)
        except Exception as exc:  # noqa: BLE001 -- the measurements are printed regardless
            output_errors.append(f"--json {args.json}: {type(exc).__name__}: {exc}")
    if args.plot:
        try:
            write_plot(args.plot, rows, f"qkvfuse bench: {machine['cpu']}, {machine['torch_threads']} threads "
                                        f"(out= solid, fresh dashed; T <= 16 rotated buffers)")
            written.append(args.plot)
        except Exception as exc:  # noqa: BLE001 -- the summary is printed regardless
            output_errors.append(f"--plot {args.plot}: {type(exc).__name__}: {exc}")
    if rows:
        print_summary(rows, summary, cfg.cpu_reason, judge)
    if judge:
        for section, its_verdicts in zip(sections, verdicts):
            section.print_verdicts(its_verdicts)
    busy = busy_warning(machine)
    if busy:
        print("\n" + busy)
    failures = check_failures(rows) + [line for s, r in zip(sections, section_rows) for line in s.failures(r)]
    for line in failures:
        print(f"ACCURACY FAILURE (qkvfuse cpu vs the float64 oracle, accuracy rule): {line}")
    for line in output_errors:
        print(f"bench: could not write {line}", file=sys.stderr)
    n_rows = len(rows) + sum(map(len, section_rows))
    print(f"\nbench: {n_rows} rows in {time.perf_counter() - t_start:.0f} s; load average "
          f"{' '.join(f'{x:.2f}' for x in machine['loadavg_end'] or [])} at the end"
          + (f"; wrote {', '.join(written)}" if written else "")
          + (f"; FAILED to write {', '.join(e.split(':')[0] for e in output_errors)}" if output_errors else ""),
          flush=True)
    return 1 if failures or output_errors else 0
