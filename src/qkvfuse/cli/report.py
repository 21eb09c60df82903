"""The main job's report folder (``./qkvfuse-report/`` unless ``--report DIR``).

* ``report.md`` -- the summary screen, then every detailed table as ``verify`` and ``bench`` print them (speed
  per implementation and placement with GB/s, copy share, ratios, rounds and the accuracy check; the compile
  times; each verify section with its rows), with the plots inline;
* ``report.json`` -- everything the run gathered (machine, build, backends, peers, verify sections and rows,
  benchmark rows, exit status);
* ``speed.png`` -- µs per call against T, log-log, one panel per op and model: qkvfuse's calls, every
  alternative, and the same-bytes copy;
* ``accuracy.png`` -- the largest error against the float64 oracle per preset: qkvfuse (each backend) beside the
  unfused PyTorch path in the same dtype (the verify ``ops`` section's rows).

The files are rewritten by every run; nothing else in the folder is touched.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from typing import Callable, Dict, List, Optional, Sequence

__all__ = ["write_report", "plot_speed", "plot_accuracy", "FILES"]

FILES = {"markdown": "report.md", "json": "report.json", "speed": "speed.png", "accuracy": "accuracy.png"}


def write_report(folder: str, data: Dict[str, object], summary: Callable[[Dict[str, object]], List[str]],
                 json_copy: Optional[str] = None) -> Dict[str, object]:
    """Write the report files of ``data`` into ``folder`` (made if needed) and return their paths. ``summary``
    gives the screen's lines for ``data`` (the report opens with them); ``json_copy``: also write the JSON there.
    A plot that cannot be drawn (no matplotlib) is left out, with the reason."""
    os.makedirs(folder, exist_ok=True)
    paths = {key: os.path.join(folder, name) for key, name in FILES.items()}
    report: Dict[str, object] = {"folder": folder, "markdown": paths["markdown"], "json": paths["json"]}
    plots: Dict[str, str] = {}
    rows = data.get("bench", {}).get("rows", [])
    for key, draw, have in (("speed", plot_speed, rows), ("accuracy", plot_accuracy, _ops_rows(data))):
        if not have:
            continue
        try:
            draw(paths[key], data)
            plots[key] = paths[key]
        except ImportError as exc:
            report[f"{key}_error"] = f"matplotlib is needed for the plots ({exc})"
        except Exception as exc:  # noqa: BLE001 -- the tables matter more than a plot
            report[f"{key}_error"] = f"{type(exc).__name__}: {exc}"
    report["plots"] = plots
    data["report"] = report
    with open(paths["json"], "w") as fh:
        json.dump(data, fh, indent=1, default=str)
    if json_copy:
        shutil.copyfile(paths["json"], json_copy)
    with open(paths["markdown"], "w", encoding="utf-8") as fh:
        fh.write(markdown(data, {k: os.path.basename(v) for k, v in plots.items()}, summary(data)))
    return report


def _ops_rows(data: Dict[str, object]) -> List[Dict[str, object]]:
    for s in data.get("verify", {}).get("sections", []):
        if s["name"] == "ops":
            return s["table"]["rows"]
    return []


def _printed(fn, *args) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args)
    return buf.getvalue().strip("\n")


def markdown(data: Dict[str, object], plots: Dict[str, str], screen: List[str]) -> str:
    """The report's Markdown: the screen (its ``screen`` lines), the plots, then every table as the sub-commands
    print them."""
    from .._verify.sections import Section, print_section
    from ..benchmarks.harness import Row
    from ..benchmarks.report import print_compile_times, print_tables

    out = ["# qkvfuse report", "", f"Run started {data.get('started', '')}; `python -m qkvfuse` writes this folder "
           "again on every run.", "", "## Summary", "", "```", *screen, "```", ""]
    m = data["machine"]
    out += ["## Machine", "", "```", json.dumps({k: m[k] for k in m if k != "malloc_env"}, indent=1, default=str),
            "```", ""]
    bench = data.get("bench", {})
    if bench.get("rows"):
        rows = [Row(**r) for r in bench["rows"]]
        out += ["## Speed", ""]
        if "speed" in plots:
            out += [f"![µs per call against T]({plots['speed']})", ""]
        out += ["Implementations: `qkvfuse bound in place` (QKNormRope / AddRMSNorm `.inplace`), `qkvfuse functional "
                "in place` (`split_qkv_rmsnorm_rope_` / `add_rmsnorm_`), `eager unfused` and `torch.compile unfused` "
                "(the transformers-style PyTorch path), the peers importable here "
                f"({'; '.join(f'{k}: {v}' for k, v in bench.get('peers', {}).items()) or 'none'}), and a copy of "
                "the same bytes. The in-place split forms use unit norm weights (every candidate does).", "",
                "```", bench.get("table_note", ""), _printed(print_tables, rows), "```", ""]
        compile_text = _printed(print_compile_times, rows)
        if compile_text:
            out += ["```", compile_text, "```", ""]
        if bench.get("errors"):
            out += ["Cells that could not run:", ""] + [f"- {e}" for e in bench["errors"]] + [""]
    out += ["## Accuracy", ""]
    if "accuracy" in plots:
        out += [f"![error against the float64 oracle]({plots['accuracy']})", ""]
    verify = data.get("verify", {})
    failures = [f for s in verify.get("sections", []) for f in s["failures"]]
    if failures:
        out += ["### Failures", ""] + [f"- **{f['name']}**: {f['detail']}  \n  rerun: `{f['rerun']}`"
                                       for f in failures] + [""]
    out += ["### Verify tables", "", "```"]
    for s in verify.get("sections", []):
        t = s["table"]
        out.append(_printed(print_section, Section(t["title"], t["columns"], t["rows"], t["note"])))
        out += [f"({s['name']}: {s['passed']}/{s['total']} passed in {s['seconds']} s)", ""]
    out += ["```", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------------
# Plots.
# --------------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speed(path: str, data: Dict[str, object]) -> None:
    """µs per call against T, log-log: one panel per (op, model); every implementation and the copy."""
    from ..benchmarks.harness import COMPILED, COPY, EAGER
    from ..benchmarks.overview import BOUND, FUNCTIONAL, NORM, VLLM, ZENTORCH

    plt = _pyplot()
    rows = data["bench"]["rows"]
    panels = list(dict.fromkeys((r["op"], r["shape"]) for r in rows))
    ncols = len(dict.fromkeys(shape for _, shape in panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.9 * nrows + 0.9), squeeze=False)
    styles = {BOUND: ("tab:blue", "o", "-"), FUNCTIONAL: ("tab:cyan", "s", "--"), EAGER: ("tab:red", "v", "-"),
              COMPILED: ("tab:orange", "^", "-"), VLLM: ("tab:green", "D", "-"), ZENTORCH: ("tab:purple", "P", "-"),
              COPY: ("black", None, ":")}
    handles = {}
    for ax, (op, shape) in zip(axes.flat, panels):
        mine = [r for r in rows if (r["op"], r["shape"]) == (op, shape)]
        for impl in dict.fromkeys(r["impl"] for r in mine):
            points = sorted((r["T"], r["us"]) for r in mine if r["impl"] == impl)
            color, marker, style = styles.get(impl, ("tab:gray", "x", "-"))
            label = "copy of the same bytes" if impl == COPY else impl
            (h,) = ax.plot([t for t, _ in points], [u for _, u in points], color=color, marker=marker,
                           linestyle=style, linewidth=2.0 if impl in (BOUND, COPY) else 1.3, markersize=4, label=label)
            handles.setdefault(label, h)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({r["T"] for r in mine})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        what = "add + RMSNorm" if op == NORM else "split QKV + QK-RMSNorm + RoPE"
        ax.set_title(f"{what}: {shape}\n{mine[0]['mode']}", fontsize=9)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("µs per call (median)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    m = data["machine"]
    fig.suptitle(f"qkvfuse {m.get('qkvfuse', '')}: {m['cpu']}, {m['torch_threads']} threads, bf16 "
                 f"(lower is better; T <= 16: rotated buffers)", fontsize=10)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)), fontsize=8,
               frameon=False)
    rows_of_legend = -(-len(handles) // 4)
    height = fig.get_size_inches()[1]
    fig.tight_layout(rect=(0, (0.15 + 0.2 * rows_of_legend) / height, 1, 1 - 0.35 / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy(path: str, data: Dict[str, object]) -> None:
    """Largest error against the float64 oracle per preset (every T), qkvfuse per backend beside the unfused path:
    one panel per dtype, log scale."""
    plt = _pyplot()
    rows = [r for r in _ops_rows(data) if isinstance(r.get("max err"), (int, float))]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(12, 3.6 * len(dtypes) + 0.8), squeeze=False)
    colors = {"cpu": "tab:blue", "reference": "tab:purple", "triton": "tab:olive"}
    for ax, dtype in zip(axes.flat, dtypes):
        mine = [r for r in rows if r["dtype"] == dtype]
        presets = list(dict.fromkeys(r["preset"] for r in mine))
        backends = list(dict.fromkeys(r["backend"] for r in mine))
        series = {f"qkvfuse {b}": {p: _worst(mine, p, "max err", b) for p in presets} for b in backends}
        series["unfused PyTorch"] = {p: _worst(mine, p, "unfused err") for p in presets}
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series.items()):
            color = "tab:red" if label == "unfused PyTorch" else colors.get(label.split()[-1], "tab:gray")
            # a backend not run for a preset (the Triton interpreter's smaller matrix) has no bar; an exact
            # result (error 0) sits at the axis floor
            drawn = [(j, values[p]) for j, p in enumerate(presets) if values[p] is not None]
            ax.bar([j + (i - (len(series) - 1) / 2) * width for j, _ in drawn],
                   [max(v, 1e-12) for _, v in drawn], width, label=label, color=color)
        ax.set_yscale("log")
        names = [p.replace("hidden ", "add_rmsnorm h") for p in presets]
        ax.set_xticks(range(len(presets)), names, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("max |error| vs float64")
        ax.set_title(f"{dtype}: largest error of any element against the float64 oracle (lower is better)",
                     fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=len(series), loc="upper left")
    fig.suptitle("qkvfuse accuracy: fused kernels vs the unfused PyTorch path in the same dtype (verify ops rows; "
                 "split presets, then add_rmsnorm by hidden size)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _worst(rows: Sequence[Dict[str, object]], preset: str, key: str,
           backend: Optional[str] = None) -> Optional[float]:
    values = [r[key] for r in rows if r["preset"] == preset and (backend is None or r["backend"] == backend)
              and isinstance(r.get(key), (int, float))]
    return max(values) if values else None
