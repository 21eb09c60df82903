"""``python -m qkvfuse`` (or ``python -m qkvfuse run``; what ``make run`` calls): build, verify, measure, report.

One screen on stdout (:func:`summary_lines`): what ran, the backends, verify per section, one speed table and the
path of the full report, which :mod:`.report` writes (Markdown with every table, JSON, PNG plots). Progress goes to
stderr (:mod:`.progress`). Exit status: 0 when everything verified, 1 when a check failed or a requested backend
could not run (the summary says which), 2 for bad flags or an output that cannot be written (before anything
runs).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from .progress import Progress, progress_mode

__all__ = ["run_main", "summary_lines", "DEFAULT_REPORT_DIR"]

DEFAULT_REPORT_DIR = "qkvfuse-report"


def run_main(args) -> int:
    """The main job for the parsed flags of the ``run`` sub-command; returns the exit status."""
    from ..benchmarks.report import unwritable

    problem = _report_problem(args.report)
    if not problem and args.json:
        reason = unwritable(args.json)
        problem = f"--json {args.json}: {reason}" if reason else ""
    tokens = tuple(dict.fromkeys(args.tokens or ()))
    if not problem and any(t < 1 for t in tokens):
        problem = f"--tokens: expected positive token counts, got {list(tokens)}"
    if not problem and args.seconds is not None and not args.seconds > 0:
        problem = f"--seconds: expected a positive number, got {args.seconds}"
    if problem:
        print(f"qkvfuse: {problem}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    mode = progress_mode(args.quiet)
    data: Dict[str, object] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    t_start = time.perf_counter()
    data["machine"] = _machine()
    data["build"] = _build(Progress(mode))
    data["machine"]["native_build"] = data["build"].get("capability", "")
    data["verify"] = _verify(args, mode)
    if data["verify"].get("error"):
        print(data["verify"]["error"], file=sys.stderr)
        return 2
    data["backends"] = _backends(data["verify"])
    if args.no_bench:
        data["bench"] = {"skipped": "--no-bench"}
    else:
        data["bench"] = _bench(args, mode, tokens or None)
    data["seconds"] = round(time.perf_counter() - t_start, 1)
    data["exit"] = _verdict(data, args)
    from .report import write_report

    try:
        data["report"] = write_report(args.report, data, summary_lines, json_copy=args.json)
    except Exception as exc:  # noqa: BLE001 -- the screen is printed regardless, then the reason
        data["report"] = {"error": f"{type(exc).__name__}: {exc}"}
        data["exit"]["code"] = 1
        data["exit"]["reasons"].append(f"the report could not be written ({type(exc).__name__}: {exc})")
    print("\n".join(summary_lines(data)), flush=True)
    return data["exit"]["code"]


def _report_problem(folder: str) -> str:
    """Why the report folder cannot be used ("" when it can): made now (it is the run's output)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        return f"--report {folder}: exists and is not a folder"
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        return f"--report {folder}: cannot be made ({exc.strerror or exc})"
    if not os.access(folder, os.W_OK):
        return f"--report {folder}: cannot be written"
    return ""


def _machine() -> Dict[str, object]:
    import qkvfuse

    from ..benchmarks.timing import machine_info

    info = machine_info()
    info["qkvfuse"] = getattr(qkvfuse, "__version__", "?")
    return info


def _build(progress: Progress) -> Dict[str, object]:
    """Build (or find) the native CPU library; on first use a progress bar counts the compiled objects."""
    try:
        from ..backends import cpu
        from ..backends.cpu.build import cache_root

        cap = cpu.capability()
    except Exception as exc:  # noqa: BLE001 -- a capability beyond this CPU, no torch headers: the reason
        return {"ok": False, "reason": _one_line(exc), "capability": "", "seconds": 0.0}
    result: Dict[str, object] = {"capability": cap}
    t0 = time.perf_counter()

    def work():
        try:
            result["path"] = cpu.prebuild()
            result["ok"] = True
        except Exception as exc:  # noqa: BLE001
            result["ok"], result["reason"] = False, _one_line(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(0.5)  # a library built before is found at once: no bar
    if thread.is_alive():
        try:  # the compiler writes one object per source into the build's folder: the bar counts them
            sources = len(cpu._build_inputs(cap)[1])
            folders = lambda: list(cache_root().glob(f"*.tmp-{os.getpid()}-*"))  # noqa: E731
        except Exception:  # noqa: BLE001 -- no count: the bar shows the time alone
            sources, folders = 0, lambda: []
        progress.start("build native CPU library (first use)", total=sources or None, unit="file")
        seen = 0
        while thread.is_alive():
            thread.join(0.25)
            done = max([len(list(f.glob("*.o"))) for f in folders()] + [seen])
            if done > seen:
                progress.advance(done - seen)
                seen = done
        progress.end(line=f"{cap} in {time.perf_counter() - t0:.0f} s")
    thread.join()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _verify(args, mode: str) -> Dict[str, object]:
    from .._verify.sections import Options, collect, failed_checks

    verified = collect(Options(quick=args.quick, backends=args.backend), progress=Progress(mode, prefix="verify "))
    if verified.code == 2:
        return {"error": verified.error}
    sections = []
    for name, section, seconds in verified.sections:
        passed, total = _counts(section)
        sections.append({"name": name, "title": section.title, "passed": passed, "total": total,
                         "skipped": sum(r.get("pass", False) is None for r in section.rows),
                         "seconds": round(seconds, 1), "failures": failed_checks(name, section),
                         "table": dataclasses.asdict(section)})
    return {"info": verified.info, "sections": sections, "seconds": round(verified.seconds, 1),
            "requested_backends": list(args.backend or [])}


def _counts(section) -> tuple:
    """(passed, total) checks of a verify table: rows that carry their own counts (failure modes) add those."""
    passed = total = 0
    for r in section.rows:
        if r.get("pass", False) is None:
            continue
        if isinstance(r.get("total"), int) and isinstance(r.get("passed"), int):
            passed, total = passed + r["passed"], total + r["total"]
        else:
            passed, total = passed + bool(r.get("pass")), total + 1
    return passed, total


def _backends(verify: Dict[str, object]) -> List[Dict[str, str]]:
    table = next((s["table"] for s in verify["sections"] if s["name"] == "backends"), None)
    if table is None:
        return []
    return [{"name": r["backend"], "status": "ok" if r["pass"] else ("FAILED" if r["pass"] is False else "skipped"),
             "reason": r.get("detail", "")} for r in table["rows"]]


def _bench(args, mode: str, tokens: Optional[Sequence[int]]) -> Dict[str, object]:
    from ..backends import backend_unavailable
    from ..benchmarks import overview
    from ..benchmarks.report import TABLE_NOTE
    from ..benchmarks.timing import cache_bytes, cpu_snapshot, others_share

    peers = overview.find_peers()
    cpu_reason = backend_unavailable("cpu")
    cells = overview.cells(tokens or overview.TOKENS)
    budget = overview.budget_for(args.seconds)
    compiled = overview.UnfusedCompiler(not args.no_compile)
    progress = Progress(mode)
    progress.start("bench", total=len(cells), unit="cell")
    rows, errors, l2 = [], [], cache_bytes(2, 1 << 20)
    before = cpu_snapshot()
    t0 = time.perf_counter()
    for cell in cells:
        try:
            cell_start = cpu_snapshot()
            measured = overview.measure_cell(cell, peers, compiled, budget, l2)
            cell_share = others_share(cell_start, cpu_snapshot())
            for row in measured:  # the noise of each cell, in the report's "others" column
                row.others = cell_share
            rows += measured
        except Exception as exc:  # noqa: BLE001 -- one broken cell must not hide the others
            errors.append(f"{cell[0]} {cell[1]} T={cell[3]}: {_one_line(exc)}")
        progress.advance()
    progress.end(line=f"{len(cells)} cells in {time.perf_counter() - t0:.0f} s")
    share = others_share(before, cpu_snapshot())
    return {"rows": [dataclasses.asdict(r) for r in rows], "errors": errors, "peers": peers.status,
            "cpu_backend": cpu_reason, "compile": "off (--no-compile)" if args.no_compile else compiled.reason,
            "budget": dataclasses.asdict(budget), "tokens": sorted({c[3] for c in cells}),
            "others_cpu_share": share, "table_note": TABLE_NOTE, "seconds": round(time.perf_counter() - t0, 1)}


def _verdict(data: Dict[str, object], args) -> Dict[str, object]:
    """The exit status and why: every failed check and every requested backend that could not run."""
    reasons: List[str] = []
    verify = data["verify"]
    failed = sum(s["total"] - s["passed"] for s in verify["sections"] if s["name"] != "backends")
    if failed:
        reasons.append(f"{failed} verify check{'s' * (failed != 1)} failed")
    for b in data["backends"]:
        if b["status"] == "FAILED":
            reasons.append(f"requested backend {b['name']} could not run ({b['reason']})")
    bench = data["bench"]
    wrong = [r for r in bench.get("rows", []) if r["check"] and r["check"] != "ok"]
    if wrong:
        reasons.append(f"{len(wrong)} timed call{'s' * (len(wrong) != 1)} gave wrong results")
    if bench.get("errors"):
        reasons.append(f"{len(bench['errors'])} benchmark cell{'s' * (len(bench['errors']) != 1)} could not run")
    return {"code": 1 if reasons else 0, "reasons": reasons}


# --------------------------------------------------------------------------------------------------------
# The screen.
# --------------------------------------------------------------------------------------------------------
def _mu() -> str:
    """The micro sign where stdout can print it."""
    try:
        "µ".encode(sys.stdout.encoding or "ascii")
        return "µ"
    except (UnicodeEncodeError, LookupError):
        return "u"


def _us(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:,.0f}"


def _times(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}x" if x < 100 else f"{x:.0f}x"


def speed_table(rows: Sequence[Dict[str, object]], op: str) -> List[Dict[str, object]]:
    """The screen's rows for ``op``: per model and T, each implementation's µs (qkvfuse's bound and functional
    calls, then the alternatives), qkvfuse bound's speed-up against eager and against the fastest other path
    (medians of per-round ratios), and its share of a same-bytes copy's speed."""
    from ..benchmarks.harness import COPY
    from ..benchmarks.overview import BOUND, FUNCTIONAL

    out = []
    cells = dict.fromkeys((r["shape"], r["T"]) for r in rows if r["op"] == op)
    for model, T in cells:
        mine = {r["impl"]: r for r in rows if (r["op"], r["shape"], r["T"]) == (op, model, T)}
        bound = mine.get(BOUND)
        others = {impl: r for impl, r in mine.items() if impl not in (BOUND, FUNCTIONAL, COPY)}
        line = {"model": model, "T": T, "us": {impl: r["us"] for impl, r in mine.items() if impl != COPY}}
        if bound is not None:
            line["vs_eager"] = bound["vs_eager"]
            ratios = [bound["vs"].get(impl) for impl in others if bound["vs"].get(impl) is not None]
            line["vs_best"] = min(ratios) if ratios else None
            line["best"] = min(others, key=lambda impl: others[impl]["us"]) if others else None
            line["of_copy"] = bound["roofline"]
        out.append(line)
    return out


def _table(title: str, lines: List[Dict[str, object]], impls: Sequence[str], headers: Dict[str, str]) -> List[str]:
    cols = ["model", "T"] + [headers.get(i, i) for i in impls] + ["vs eager", "vs best other", "of copy"]
    cells = []
    for line in lines:
        cells.append([str(line["model"]), str(line["T"])] + [_us(line["us"].get(i)) for i in impls]
                     + [_times(line.get("vs_eager")), _times(line.get("vs_best")),
                        "-" if line.get("of_copy") is None else f"{100 * line['of_copy']:.0f}%"])
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = lambda row: "  " + "  ".join(v.ljust(w) if i < 2 else v.rjust(w)  # noqa: E731
                                        for i, (v, w) in enumerate(zip(row, widths)))
    return [title, fmt(cols)] + [fmt(row) for row in cells]


def summary_lines(data: Dict[str, object]) -> List[str]:
    """The one screen (at most about 50 lines) for a run's ``data`` (what :func:`run_main` gathered)."""
    from ..benchmarks.harness import COMPILED, EAGER
    from ..benchmarks.overview import BOUND, FUNCTIONAL, NORM, SPLIT, VLLM, ZENTORCH

    m, build = data["machine"], data["build"]
    mu = _mu()
    lines = [f"qkvfuse {m.get('qkvfuse', '?')} on {m['cpu']} | native build "
             f"{build.get('capability') or 'none'} | torch {m['torch']} | {m['torch_threads']} threads"]
    backends = []
    for b in data["backends"]:
        text = b["name"] + (f" ({build['capability']})" if b["name"] == "cpu" and b["status"] == "ok"
                            and build.get("capability") else "")
        if b["status"] == "ok":
            backends.append(text + " ok")
        else:
            backends.append(f"{b['name']} {b['status']}: {_short(b['reason'], 70)}")
    lines.append("backends: " + "; ".join(backends))
    if not build.get("ok", True) and build.get("reason"):
        lines.append(f"native build: {_short(build['reason'], 100)}")
    bench = data["bench"]
    if bench.get("peers"):
        lines.append("peers: " + "; ".join(f"{k}: {v}" for k, v in bench["peers"].items()))

    verify = data["verify"]
    lines += ["", f"verify: every backend against the float64 oracle and the unfused path ({verify['seconds']:.0f} s)"]
    failures = []
    name_w = max([len(s["name"]) for s in verify["sections"]] + [4])
    for s in verify["sections"]:
        state = "passed" if s["passed"] == s["total"] else "FAILED"
        skipped = f", {s['skipped']} skipped" if s["skipped"] else ""
        lines.append(f"  {s['name'].ljust(name_w)}  {s['passed']:>5}/{s['total']:<5} {state}  {s['seconds']:6.1f} s"
                     f"  {_short(_SECTION_LABELS.get(s['name'], s['title']), 48)}{skipped}")
        failures += s["failures"]
    for f in failures[:6]:
        lines.append(f"  FAILED {_short(f['name'], 60)}: {_short(f['detail'], 50)}")
        lines.append(f"    rerun: {f['rerun']}")
    if len(failures) > 6:
        lines.append(f"  ... and {len(failures) - 6} more failures: see the report")

    if bench.get("rows"):
        rows = bench["rows"]
        present = {r["impl"] for r in rows}
        impls = [i for i in (BOUND, FUNCTIONAL, EAGER, COMPILED, VLLM, ZENTORCH) if i in present]
        headers = {BOUND: "bound", FUNCTIONAL: "functional", EAGER: "eager", COMPILED: "compile", VLLM: "vLLM",
                   ZENTORCH: "zentorch"}
        lines += ["", f"speed: {mu}s per call, bf16, median (lower is better)"]
        for op, title in ((SPLIT, "split QKV + QK-RMSNorm + RoPE (in place)"), (NORM, "add + RMSNorm (in place)")):
            table = speed_table(rows, op)
            if table:
                lines += _table(title, table, [i for i in impls if any(i in t["us"] for t in table)], headers)
        lines.append("  bound: QKNormRope / AddRMSNorm .inplace; functional: split_qkv_rmsnorm_rope_ / add_rmsnorm_; "
                     "eager / compile: the unfused PyTorch path")
        lines.append("  vs: that path's time / qkvfuse bound's; of copy: a same-bytes copy's time / qkvfuse bound's")
        if bench.get("cpu_backend"):
            lines.append("  note: the native cpu backend is unavailable, qkvfuse's columns ran the reference backend")
        if bench.get("compile") and bench["compile"] != "off (--no-compile)":
            lines.append(f"  torch.compile failed: {_short(bench['compile'], 90)}")
        share = bench.get("others_cpu_share")
        if share is not None and share > 0.10:
            lines.append(f"  note: other processes used {share:.0%} of the CPUs during the bench: timings are noisy")
    elif bench.get("skipped"):
        lines += ["", f"speed: not measured ({bench['skipped']})"]
    for e in bench.get("errors", [])[:3]:
        lines.append(f"  bench error: {_short(e, 100)}")

    report = data.get("report", {})
    lines.append("")
    if report.get("error"):
        lines.append(f"report: NOT written: {report['error']}")
    else:
        lines.append(f"full report: {report.get('markdown', '?')} (plots, JSON and every table)")
    code, reasons = data["exit"]["code"], data["exit"]["reasons"]
    lines.append(f"result: {'OK, everything verified' if code == 0 else 'FAILED: ' + '; '.join(reasons)}"
                 f" ({data.get('seconds', 0):.0f} s, exit {code})")
    return lines


_SECTION_LABELS = {"backends": "which backends can run here", "ops": "every preset's ops, per backend and dtype",
                   "models": "tiny transformers models, logits patched vs not",
                   "failure-modes": "failure modes, bad input, fuzz, determinism"}


def _short(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."
