"""Presenting a run: the tables, the compile times, the team's speed targets (maintainers: :mod:`.targets`), JSON
and a chart."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .._verify.sections import Section, print_section
from .harness import BARE, COMPILED, COPY, CPU, EAGER, ROTATE_MAX_T, Row

__all__ = ["check_failures", "busy_warning", "print_machine", "print_tables", "print_compile_times", "summarize",
           "print_summary", "write_json", "write_plot", "matplotlib_unavailable", "TABLE_NOTE", "TARGETS"]

TABLE_NOTE = (
    "us: median per call over the rounds. GB/s: bytes the op must read + write / us. roofline: copy_ time / "
    "time (100% = as fast as\n"
    "copying the same bytes; median of per-round ratios, the copy timed right before each block). vs eager, "
    "vs compile: their time /\n"
    "this time (> 1: faster), median of per-round ratios. out=: preallocated outputs (what an engine does); "
    "fresh: allocated per call\n"
    "(glibc mmaps every allocation >= 32 MB: page faults on every call at large T). data: hot = the same "
    f"buffers every call (at T <= {ROTATE_MAX_T}\n"
    "they stay in L1/L2, which flatters the time); rotated xN = N buffer sets cycled, > 4x L2; 1 set = "
    "one buffer set (T > 16).\n"
    "/bare: this time / the bare torch.ops call's time (same kernel, no Python validation; median of per-round "
    "ratios; 1.00 = no\n"
    "overhead). check: the cpu kernel's result on these inputs vs the float64 oracle (public op and bare call "
    "each). others: CPU share\n"
    "other processes used during the cell (noise)."
)

# Published CPU anchors (bf16, median us, a 2-core AVX-512 BF16 machine, not this run): fastest published path
# and a same-shape copy there. GLM-4.7 has GLM-4.5's attention geometry (96/8 x 128, rotary 64, QK-norm).
PUBLISHED_ANCHORS: Dict[str, Dict[int, Tuple[float, float]]] = {
    "Qwen3-8B": {1: (17.1, 1.2), 16: (34.1, 2.9), 256: (227.0, 34.0), 4096: (4921.0, 2203.0)},
    "GLM-4.5": {1: (19.2, 1.4), 16: (55.8, 4.3), 256: (516.0, 91.0), 4096: (16571.0, 5280.0)},
}
_ANCHOR_OF = {"Qwen3-8B": "Qwen3-8B", "GLM-4.5": "GLM-4.5", "GLM-4.6": "GLM-4.5", "GLM-4.7": "GLM-4.5"}

# The speed targets (bf16, qkvfuse cpu with out=).
T1_MAX_US = 5.0
T16_MAX_COPIES = 3.0
T256_MIN_ROOFLINE = 0.40
T4096_MIN_ROOFLINE = 0.70
NORM_MIN_ROOFLINE = 0.70
# The public-op overhead target: at T >= 16 the public op (qkvfuse cpu, out=) is at most 5 % slower than the bare
# kernel call.
OVERHEAD_MIN_T = 16
OVERHEAD_MAX_RATIO = 1.05


def _us(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:,.0f}"


def _pct(r: Optional[float]) -> str:
    return "" if r is None else f"{100 * r:.1f}%" if r < 0.1 else f"{100 * r:.0f}%"


def _times(v: Optional[float]) -> str:
    return "" if v is None else f"{v:.2f}x"


def configure(args, config_from_args):
    """``(config, None)`` from the parsed flags (``--threads`` applied), or ``(None, 2)`` after printing why a flag
    is bad: the start of every ``bench`` mode."""
    try:
        cfg = config_from_args(args)
    except (KeyError, ValueError) as exc:
        print(f"bench: {exc.args[0] if exc.args else exc}")
        return None, 2
    threads = getattr(args, "threads", None)
    if threads is not None:
        if threads < 1:
            print(f"bench: --threads: expected a positive int, got {threads}")
            return None, 2
        torch.set_num_threads(threads)
    return cfg, None


def print_machine(info: Dict[str, object]) -> None:
    l2, l3 = info["l2_bytes"], info["l3_bytes"]
    print(f"machine: {info['cpu']} | SIMD {' '.join(info['simd']) or 'none of avx2/avx512'} | "
          f"{info['logical_cpus']} logical CPUs ({info['usable_cpus']} usable) | torch {info['torch']}, "
          f"{info['torch_threads']} threads | L2 {l2 >> 10} KiB, L3 {l3 >> 20} MiB | load average "
          f"{' '.join(f'{x:.2f}' for x in info['loadavg_start'] or [])}"
          + (f" | {info['malloc_env']}" if info["malloc_env"] else ""))


BUSY_SHARE = 0.10  # other processes using more than this share of the CPUs make a run suspect


def busy_warning(info: Dict[str, object]) -> str:
    """A warning when other work shared the CPUs: a parallel region then waits for a time slice (milliseconds)."""
    share = info.get("others_cpu_share")
    if share is None or share <= BUSY_SHARE:
        return ""
    return (f"WARNING: other processes used {share:.0%} of the CPUs during this run (the 'others' column shows it "
            f"per cell): multi-threaded calls wait for time slices and ratios in those cells are suspect. Rerun on "
            f"a quiet machine (or with --threads 1 to see single-thread numbers).")


def print_tables(rows: Sequence[Row]) -> None:
    """One table per op and shape, rows in the order measured."""
    groups: Dict[Tuple[str, str], List[Row]] = {}
    for r in rows:
        groups.setdefault((r.op, r.shape), []).append(r)
    columns = ("dtype", "T", "data", "impl", "outputs", "us", "GB/s", "roofline", "vs eager", "vs compile", "/bare",
               "rounds", "check", "others")
    for (op, shape), group in groups.items():
        cells = [{"dtype": r.dtype, "T": str(r.T), "data": r.data, "impl": r.impl, "outputs": r.outputs,
                  "us": _us(r.us), "GB/s": f"{r.gbps:.1f}", "roofline": _pct(r.roofline),
                  "vs eager": _times(r.vs_eager), "vs compile": _times(r.vs_compile),
                  "/bare": "" if r.impl not in (CPU, BARE) else _times(r.vs_bare), "rounds": str(r.rounds),
                  "check": r.check.split(":")[0], "others": _pct(r.others)}
                 for r in group]
        print_section(Section(f"{op}: {shape} ({group[0].mode})", columns, cells))


def print_compile_times(rows: Sequence[Row]) -> None:
    compiled = [r for r in rows if r.impl == COMPILED and r.compile_s is not None]
    seen, cells = set(), []
    for r in compiled:
        key = (r.op, r.shape, r.dtype, r.T)
        if key not in seen:
            seen.add(key)
            cells.append({"op": r.op, "shape": r.shape, "dtype": r.dtype, "T": str(r.T),
                          "compile s": f"{r.compile_s:.1f}"})
    if cells:
        note = ("first call in this process after torch._dynamo.reset(); inductor's on-disk cache may hold earlier "
                "compiles of the same graph\n(sub-second cells are cache hits). TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 "
                "gives cold compile times.")
        print_section(Section("torch.compile of the unfused path: first call (compile) time, apart from the tables",
                              ("op", "shape", "dtype", "T", "compile s"), cells, note))


def _pick(rows: Sequence[Row], op: str, shape: str, T: int, outputs: str = "out=", data: str = "",
          impl: str = CPU) -> Optional[Row]:
    for r in rows:
        if (r.op, r.shape, r.dtype, r.T, r.impl, r.outputs) == (op, shape, "bf16", T, impl, outputs) \
                and r.data.startswith(data):
            return r
    return None


def _judge_t1(rows: Sequence[Row], op: str, shape: str, T: int) -> Optional[Tuple[str, bool]]:
    rot, hot = _pick(rows, op, shape, T, data="rotated"), _pick(rows, op, shape, T, data="hot")
    if rot is None or hot is None:
        return None
    bare = _pick(rows, op, shape, T, data="rotated", impl=BARE)
    unwrapped = f"; bare torch.ops {_us(bare.us)}" if bare else ""
    return f"{_us(rot.us)} us rotated ({_us(hot.us)} hot{unwrapped})", rot.us <= T1_MAX_US


def _judge_t16(rows: Sequence[Row], op: str, shape: str, T: int) -> Optional[Tuple[str, bool]]:
    rot, hot = _pick(rows, op, shape, T, data="rotated"), _pick(rows, op, shape, T, data="hot")
    if rot is None or hot is None:
        return None
    copies = 1 / rot.roofline  # time / copy time, as a median of per-round ratios
    return (f"{copies:.2f}x copy, {_us(rot.us)} us rotated ({1 / hot.roofline:.2f}x hot)",
            copies <= T16_MAX_COPIES)


def _judge_roofline(floor: float):
    def judge(rows: Sequence[Row], op: str, shape: str, T: int) -> Optional[Tuple[str, bool]]:
        r, fresh = _pick(rows, op, shape, T), _pick(rows, op, shape, T, outputs="fresh")
        if r is None:
            return None
        return (f"{_pct(r.roofline)}, {_us(r.us)} us" + (f" (fresh {_pct(fresh.roofline)})" if fresh else ""),
                r.roofline >= floor)

    return judge


_SPLIT, _NORM = "split_qkv_rmsnorm_rope", "add_rmsnorm"
TARGETS = (  # (op, T, target text, judge) -- the speed targets, bf16, qkvfuse cpu with out=
    (_SPLIT, 1, f"split T=1 <= {T1_MAX_US:g} us incl. dispatch", _judge_t1),
    (_SPLIT, 16, f"split T=16 <= {T16_MAX_COPIES:g}x copy", _judge_t16),
    (_SPLIT, 256, f"split T=256 >= {T256_MIN_ROOFLINE:.0%} roofline", _judge_roofline(T256_MIN_ROOFLINE)),
    (_SPLIT, 4096, f"split T=4096 >= {T4096_MIN_ROOFLINE:.0%} roofline", _judge_roofline(T4096_MIN_ROOFLINE)),
    (_NORM, 4096, f"add_rmsnorm T=4096 >= {NORM_MIN_ROOFLINE:.0%} roofline", _judge_roofline(NORM_MIN_ROOFLINE)),
)


def summarize(rows: Sequence[Row], cpu_reason: str) -> List[Dict[str, object]]:
    """The speed targets against this run: bf16, ``qkvfuse cpu`` with ``out=``; rotated data at T <= 16."""
    measured_cells = {(r.op, r.shape, r.T) for r in rows if r.dtype == "bf16"}
    out: List[Dict[str, object]] = []
    for op, T, target, judge in TARGETS:
        for shape in dict.fromkeys(r.shape for r in rows if r.op == op and r.dtype == "bf16"):
            if (op, shape, T) not in measured_cells:
                continue
            anchor = PUBLISHED_ANCHORS.get(_ANCHOR_OF.get(shape, ""), {}).get(T) if op == _SPLIT else None
            row = {"target": target, "shape": shape, "measured": "", "verdict": "n/a: cpu backend unavailable",
                   "published": f"{_us(anchor[0])} us (copy {_us(anchor[1])}) [{_ANCHOR_OF[shape]}]" if anchor else ""}
            result = None if cpu_reason else judge(rows, op, shape, T)
            if result is not None:
                judged = _pick(rows, op, shape, T)
                row["measured"], row["verdict"] = result[0], "MET" if result[1] else "MISSED"
                if judged.check != "ok":  # a fast wrong kernel meets nothing
                    row["verdict"] = "WRONG RESULTS"
                elif judged.others is not None and judged.others > BUSY_SHARE:
                    # a stalled parallel region stalls the copy too, pushing the ratio to 1: a false MET
                    row["verdict"] += f" (noisy: others {judged.others:.0%})"
            out.append(row)
    out += _overhead_summary(rows, cpu_reason)
    return out


def _overhead_summary(rows: Sequence[Row], cpu_reason: str) -> List[Dict[str, object]]:
    """The public-op overhead target: per op and shape, the worst ``qkvfuse cpu [out=]`` / bare torch.ops ratio over
    the T >= 16 cells (every dtype measured)."""
    out: List[Dict[str, object]] = []
    judged = [r for r in rows if r.impl == CPU and r.outputs == "out=" and r.T >= OVERHEAD_MIN_T]
    for op, shape in dict.fromkeys((r.op, r.shape) for r in judged):
        cells = [r for r in judged if (r.op, r.shape) == (op, shape) and r.vs_bare is not None]
        if not cells:
            continue
        name = "split" if op == _SPLIT else op
        row = {"target": f"{name} T>={OVERHEAD_MIN_T}: public op <= {OVERHEAD_MAX_RATIO:.2f}x bare torch.ops",
               "shape": shape, "measured": "", "verdict": "n/a: cpu backend unavailable", "published": ""}
        if not cpu_reason:
            worst = max(cells, key=lambda r: r.vs_bare)
            row["measured"] = (f"worst {worst.vs_bare:.3f}x ({worst.dtype} T={worst.T}); range "
                               f"{min(r.vs_bare for r in cells):.3f}x .. {worst.vs_bare:.3f}x over {len(cells)} cells")
            row["verdict"] = "MET" if worst.vs_bare <= OVERHEAD_MAX_RATIO else "MISSED"
            if any(r.check != "ok" for r in cells):
                row["verdict"] = "WRONG RESULTS"
            elif worst.others is not None and worst.others > BUSY_SHARE:
                row["verdict"] += f" (noisy: others {worst.others:.0%})"
        out.append(row)
    return out


def check_failures(rows: Sequence[Row]) -> List[str]:
    """One line per cell where qkvfuse cpu broke the accuracy rule on the benchmark's own inputs."""
    failed = {(r.op, r.shape, r.dtype, r.T): r.check for r in rows if r.check and r.check != "ok"}
    return [f"{op} {shape} {dtype} T={T}: {check}" for (op, shape, dtype, T), check in failed.items()]


def _speedup_line(rows: Sequence[Row], versus: str, attr: str) -> str:
    mine = sorted(getattr(r, attr) for r in rows if r.impl == CPU and r.outputs == "out=" and getattr(r, attr))
    if not mine:
        return ""
    return (f"qkvfuse cpu [out=] vs {versus}: median {mine[len(mine) // 2]:.2f}x, range {mine[0]:.2f}x .. "
            f"{mine[-1]:.2f}x over {len(mine)} measurements (> 1: qkvfuse faster)")


def print_summary(rows: Sequence[Row], summary: Sequence[Dict[str, object]], cpu_reason: str,
                  targets: bool = False) -> None:
    """The speed-ups of ``qkvfuse cpu [out=]`` over the run; with ``targets`` (the maintainers' :mod:`.targets`),
    the team's targets judged in ``summary`` as a table."""
    lines = [line for line in (_speedup_line(rows, EAGER, "vs_eager"), _speedup_line(rows, COMPILED, "vs_compile"))
             if line]
    note = "\n".join(lines)
    if cpu_reason:
        note = f"qkvfuse cpu backend unavailable, its column skipped: {cpu_reason}"
    if not targets:
        print(f"\n== summary ==\n{note.strip() or '(no qkvfuse cpu [out=] row measured)'}")
        return
    if not summary:
        note += "\n(no bf16 cell at a target T measured: the targets are for bf16 at T = 1, 16, 256, 4096)"
    title = ("speed targets (bf16, qkvfuse cpu with out=; published = best published path on an AVX-512 BF16 "
             "machine, not this run) and the public-op overhead target (public op vs bare torch.ops)")
    if not summary:
        print(f"\n== {title} ==\n{note.strip()}")
        return
    columns = ("target", "shape", "measured", "verdict", "published")
    print_section(Section(title, columns, [dict(s) for s in summary], note.strip()))


def write_json(path: str, machine: Dict[str, object], config: Dict[str, object], rows: Sequence[Row],
               summary: Sequence[Dict[str, object]], extra: Optional[Dict[str, object]] = None) -> None:
    payload = {"machine": machine, "config": config, "columns_note": TABLE_NOTE,
               "rows": [dataclasses.asdict(r) for r in rows], "summary": list(summary), **(extra or {})}
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1)


def unwritable(path: str) -> str:
    """Why ``path`` cannot be written ("" when it can): opened for appending, and removed again if it was new. Every
    command with ``--json`` / ``--plot`` asks before it runs, so a long run never fails at its end for its output
    (a folder not made yet, e.g. ``bench/results/`` in a fresh clone, is such a path)."""
    if os.path.isdir(path):
        return "is a directory"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return f"cannot be written ({exc.strerror or exc})"
    if not existed:
        os.remove(path)
    return ""


def matplotlib_unavailable() -> str:
    """Why :func:`write_plot` cannot draw here ("" when it can): ``bench --plot`` checks it before the run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def write_plot(path: str, rows: Sequence[Row], title: str) -> None:
    """One panel per (op, shape, dtype): median us against T, log-log; rotated data at T <= 16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plotted = [r for r in rows if not r.data.startswith("hot") and r.impl != BARE]
    panels = list(dict.fromkeys((r.op, r.shape, r.dtype) for r in plotted))
    if not panels:
        return
    ncols = min(4, len(panels))
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.4 * nrows + 1.0), squeeze=False)
    styles = {EAGER: ("tab:red", "o"), COMPILED: ("tab:orange", "s"), "reference": ("tab:purple", "^"),
              CPU: ("tab:blue", "D"), COPY: ("black", "_")}
    handles = {}
    for ax, (op, shape, dtype) in zip(axes.flat, panels):
        mine = [r for r in plotted if (r.op, r.shape, r.dtype) == (op, shape, dtype)]
        for impl, outputs in dict.fromkeys((r.impl, r.outputs) for r in mine):
            line = sorted((r.T, r.us) for r in mine if (r.impl, r.outputs) == (impl, outputs))
            color, marker = styles.get(impl, ("tab:gray", "x"))
            label = f"{impl} [{outputs}]" if impl != COPY else "copy_ (roofline)"
            (h,) = ax.plot([t for t, _ in line], [u for _, u in line], color=color, marker=marker or None,
                           linestyle="--" if outputs == "fresh" else "-", linewidth=2.2 if impl == COPY else 1.4,
                           markersize=12 if impl == COPY else 4, label=label)
            handles.setdefault(label, h)
            if impl == CPU and outputs == "out=":  # the number the targets are about, at each point
                for r in sorted(mine, key=lambda r: r.T):
                    if (r.impl, r.outputs) == (impl, outputs):
                        ax.annotate(_pct(r.roofline), (r.T, r.us), textcoords="offset points", xytext=(4, 6),
                                    fontsize=7, color=color)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({r.T for r in mine})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_title(f"{'split+norm+rope' if op.startswith('split') else op}: {shape}, {dtype}", fontsize=10)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("median us per call")
        ax.grid(True, alpha=0.35)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    legend_cols = min(len(handles), 2 * ncols)
    legend_rows = -(-len(handles) // legend_cols)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=legend_cols, fontsize=9,
               frameon=False)
    fig.suptitle(title + "\nlabels: qkvfuse cpu [out=] as % of the copy roofline", fontsize=10)
    height = fig.get_size_inches()[1]
    fig.tight_layout(rect=(0, (0.1 + 0.22 * legend_rows) / height, 1, 1 - 0.45 / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
