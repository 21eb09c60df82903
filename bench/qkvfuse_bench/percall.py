"""Per-call cost at T = 1: the bound objects, the functional ops and bare ``torch.ops`` calls of one kernel.

``PYTHONPATH=bench python -m qkvfuse_bench.percall [bench flags]`` from the repository root, in ``.venv``: the
per-call tables only (``--op split`` / ``norm`` add the op tables of ``python -m qkvfuse bench``, whose runner times
this module's cells as a section). ``--preset`` and ``--hidden`` pick the shapes (default Qwen3-8B and GLM-4.7,
hidden 4096 and 5120), ``--dtype`` the dtypes (default bf16); the team's per-call targets are judged by
``qkvfuse_bench.targets``.

At one token the kernel moves a few KB and the cost of a call is mostly what surrounds the kernel: the Python
validation, the dispatcher, the argument parsing. This section times, side by side in interleaved rounds (see
:mod:`qkvfuse.benchmarks.timing`), for ``split_qkv_rmsnorm_rope`` (per preset) and ``add_rmsnorm`` (per hidden size), bf16 with
**bf16 norm weights** (what :func:`qkvfuse.integrations.transformers.apply_qkvfuse` passes: transformers keeps
RMSNorm weights in the model dtype):

* ``QKNormRope(...)(qkv, positions, out=)`` and ``.inplace(qkv, positions)`` -- the bound object, built once per
  buffer set (one per layer, as an engine holds them), validating only what changes per call;
* ``split_qkv_rmsnorm_rope(..., out=)`` and ``split_qkv_rmsnorm_rope_(...)`` -- the functional ops (what
  ``apply_qkvfuse`` calls: the in-place form), which validate the whole configuration on every call;
* ``torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out.default(...)`` and ``..._inplace.default(...)`` -- the same
  kernel through a bare ``torch.ops`` call with the lean schema's arguments: the dispatcher and the kernel, no
  Python validation;
* ``AddRMSNorm(weight, eps)(x, residual, out=)``, ``add_rmsnorm(x, residual, weight, eps, out=)`` and a bare
  ``torch.ops.qkvfuse.add_rmsnorm_out.default(...)``, and the in-place forms ``AddRMSNorm.inplace(x, residual)``,
  ``add_rmsnorm_(...)`` and a bare ``torch.ops.qkvfuse.add_rmsnorm_inplace.default(...)``;
* the bare in-place call followed by ``qkv.split_with_sizes`` (the three views the in-place forms return): the
  floor of any call that returns views, so its ``- bare`` is what the views alone cost;
* ``copy_`` of the same bytes (``qkv``; a ``[1, 2H]`` tensor for add_rmsnorm), timed before every block.

Every call is a closure over prebuilt arguments, so each pays the same Python call frame; backend ``"cpu"``
throughout. Each candidate's own result is checked once against the float64 oracle (accuracy rule) before any
timing. ``- bare`` is the median over rounds of (this time - the bare call's time in the same round), the bare
call of the same form (``out=`` or in place); the team's per-call targets (:mod:`.targets`) hold the bound
objects and the functional ops within a few us of it.
Placements: ``hot`` (one buffer set, L1-resident) and ``rotated xN`` (N sets, > 4x L2, like successive layers).
Modes: every row twice, ``default`` (tensors made and called in torch's default mode, as a script or
``torch.no_grad()`` code such as transformers' ``generate`` pays; views track their base) and ``inference_mode``
(tensors made and called under ``torch.inference_mode()``, as vLLM's model runner calls the plugin: inference
tensors, whose views and version counters cost less).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from qkvfuse._verify import SplitCase, make_norm_inputs, make_split_inputs
from qkvfuse._verify.sections import Section, print_section
from qkvfuse.benchmarks import DTYPES, HIDDEN_SIZES
from qkvfuse.benchmarks.harness import (CACHE_ROWS, BenchConfig, _more_sets, _nbytes, _rotation, _split_args,
                                        bare_norm_call, bare_split_call, check_norm, check_split, dtype_name)
from qkvfuse.benchmarks.timing import Candidate, fixed_point_weights, measure, paired, restorer
from qkvfuse.ops import (AddRMSNorm, QKNormRope, add_rmsnorm, add_rmsnorm_, split_qkv_rmsnorm_rope,
                         split_qkv_rmsnorm_rope_)
from qkvfuse.presets import ModelPreset, get_preset

__all__ = ["CallRow", "percall_split", "percall_norm", "BOUND_MAX_OVER_BARE_US", "PERCALL_T", "MODES", "main"]

NAME = "percall"  # the bench's --op value that selects this section
PRESETS = ("Qwen3-8B", "GLM-4.7")  # without --preset

PERCALL_T = 1
BOUND_MAX_OVER_BARE_US = 2.0  # per-call target: the bound object within 2 us of the bare torch.ops call
FUNCTIONAL_MAX_OVER_BARE_US = 5.0  # per-call target: the functional ops within 5 us of it
COPY_IMPL = "copy_ (same bytes)"
# impl names; the form (out= / in place) is a separate column
BOUND_SPLIT, FUNCTIONAL_SPLIT, BARE_SPLIT = ("QKNormRope (bound)", "split_qkv_rmsnorm_rope (functional)",
                                             "torch.ops ..._out/_inplace.default (bare)")
BOUND_NORM, FUNCTIONAL_NORM, BARE_NORM = ("AddRMSNorm (bound)", "add_rmsnorm (functional)",
                                          "torch.ops ..._out/_inplace.default (bare)")
# The bare in-place call followed by the views the in-place forms return (qkv.split_with_sizes): the least any
# in-place call that returns (q, k, v) can cost; "- bare" of this row is the views' own cost.
BARE_VIEWS_SPLIT = "torch.ops ..._inplace.default + split_with_sizes"
MODES = ("default", "inference_mode")  # the grad modes every per-call row is measured in (the module's docstring)
BOUND = (BOUND_SPLIT, BOUND_NORM)
FUNCTIONAL = (FUNCTIONAL_SPLIT, FUNCTIONAL_NORM)


@dataclasses.dataclass
class CallRow:
    """One line of a per-call table (times are medians over the rounds; differences and ratios are medians of
    per-round differences and ratios against the bare call of the same form, measured in the same rounds)."""

    op: str
    shape: str
    dtype: str
    T: int
    data: str
    impl: str
    form: str  # "out=" or "in-place"
    us: float
    minus_bare_us: Optional[float]
    vs_bare: Optional[float]
    copies: Optional[float]  # this time / the copy's time (median of per-round ratios)
    rounds: int
    calls_per_block: int
    check: str = ""
    others: Optional[float] = None
    mode: str = MODES[0]


@dataclasses.dataclass
class _Spec:
    impl: str
    form: str
    make: Callable[[int], Callable[[], object]]  # buffer set index -> zero-argument call
    check: Callable[[], str]  # runs set 0's call once on poisoned outputs and judges it


def _rows(op: str, shape: str, dtype: torch.dtype, specs: Sequence[_Spec], copies_for: Callable[[int], list],
          n_sets: int, cfg: BenchConfig, reset_for: Callable[[int], Callable[[], None]]) -> List[CallRow]:
    """``reset_for(n)``: restores the first ``n`` sets' in-place buffers (the in-place candidates' reset)."""
    checks = {(s.impl, s.form): s.check() for s in specs}  # before any timing
    rows: List[CallRow] = []
    for data, n in (("hot", 1), (f"rotated x{n_sets}", n_sets)):
        cands = [Candidate(s.impl, s.form, [s.make(i) for i in range(n)],
                           reset=reset_for(n) if s.form == "in-place" else None) for s in specs]
        results = measure(cands, copies_for(n), cfg.budget)
        bare = {s.form: results[c.key] for s, c in zip(specs, cands) if "(bare)" in s.impl}
        copy_us = []
        for s, c in zip(specs, cands):
            m, b = results[c.key], bare.get(s.form)
            copy_us.append(m.copy_us)
            rows.append(CallRow(op, shape, dtype_name(dtype), PERCALL_T, data, s.impl, s.form, m.us,
                                None if b is None else paired(m, b, lambda x, y: x - y),
                                None if b is None else paired(m, b, lambda x, y: x / y),
                                1 / m.roofline, m.rounds, m.calls_per_block, checks[(s.impl, s.form)]))
        rows.append(CallRow(op, shape, dtype_name(dtype), PERCALL_T, data, COPY_IMPL, "out=",
                            statistics.median(copy_us), None, None, 1.0, rows[-1].rounds, 0))
    return rows


def _in_mode(rows_of: Callable[[], List[CallRow]], mode: str) -> List[CallRow]:
    """The rows ``rows_of()`` measures, its tensors made and its calls made in ``mode`` (one of :data:`MODES`)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    with torch.inference_mode(mode == MODES[1]):
        rows = rows_of()
    for r in rows:
        r.mode = mode
    return rows


def percall_split(cfg: BenchConfig, preset: ModelPreset, dtype: torch.dtype = torch.bfloat16,
                  mode: str = MODES[0]) -> List[CallRow]:
    """Per-call rows of ``split_qkv_rmsnorm_rope`` at T = 1 for ``preset`` (norm weights in ``dtype``), in ``mode``."""
    return _in_mode(lambda: _percall_split(cfg, preset, dtype), mode)


def _percall_split(cfg: BenchConfig, preset: ModelPreset, dtype: torch.dtype) -> List[CallRow]:
    T = PERCALL_T
    case = SplitCase.from_preset(preset, T, dtype=dtype, weight_dtype=dtype,
                                 max_position=min(preset.max_position, CACHE_ROWS))
    first = make_split_inputs(case, seed=0)
    hq, hkv, D = case.num_q_heads, case.num_kv_heads, case.head_dim
    n_sets = _rotation(2 * _nbytes(first["qkv"]), cfg.l2_bytes)
    sets = _more_sets(first, n_sets, shared=("positions", "cos_sin_cache"))
    outs = [tuple(torch.empty(T, n * D, dtype=dtype) for n in (hq, hkv, hkv)) for _ in sets]
    # The in-place forms rewrite their qkv: their own copies (the out= candidates keep reading the originals),
    # restored before each block, and unit norm weights (timing.fixed_point_weights: no denormals).
    inplace_sets = [dict(kw, qkv=kw["qkv"].clone(), q_weight=fixed_point_weights(kw.get("q_weight")),
                         k_weight=fixed_point_weights(kw.get("k_weight"))) for kw in sets]
    copy_dst = [torch.empty_like(kw["qkv"]) for kw in sets]
    def bound_for(kw):  # the case's keywords, whichever it sets (a call's qkv and positions are not the object's)
        return QKNormRope(**{k: v for k, v in kw.items() if k not in ("qkv", "positions")}, backend="cpu")

    bound, bound_in_place = [bound_for(kw) for kw in sets], [bound_for(kw) for kw in inplace_sets]

    def bound_out(i):
        prep, qkv, positions, out = bound[i], sets[i]["qkv"], sets[i]["positions"], outs[i]

        def call():
            return prep(qkv, positions, out=out)
        return call

    def bound_inplace(i):
        prep, qkv, positions = bound_in_place[i], inplace_sets[i]["qkv"], sets[i]["positions"]

        def call():
            return prep.inplace(qkv, positions)
        return call

    def functional(i, inplace):
        kw = inplace_sets[i] if inplace else sets[i]
        qkv, positions, cache, hq_, hkv_, D_, q_w, k_w, q_b, k_b, eps, neox, section, inter = _split_args(kw)
        out = outs[i]
        if inplace:
            def call_inplace():
                return split_qkv_rmsnorm_rope_(qkv, positions, cache, hq_, hkv_, D_, q_weight=q_w, k_weight=k_w,
                                               q_bias=q_b, k_bias=k_b, eps=eps, is_neox=neox, mrope_section=section,
                                               mrope_interleaved=inter, backend="cpu")
            return call_inplace

        def call():
            return split_qkv_rmsnorm_rope(qkv, positions, cache, hq_, hkv_, D_, q_weight=q_w, k_weight=k_w,
                                          q_bias=q_b, k_bias=k_b, eps=eps, is_neox=neox, mrope_section=section,
                                          mrope_interleaved=inter, out=out, backend="cpu")
        return call

    def bare(i, inplace):
        return bare_split_call(inplace_sets[i] if inplace else sets[i], outs[i], inplace=inplace)

    widths = [hq * D, hkv * D, hkv * D]  # the in-place form's (q, k, v) columns

    def bare_views(i):
        call_inplace, qkv = bare(i, True), inplace_sets[i]["qkv"]

        def call():
            call_inplace()
            return qkv.split_with_sizes(widths, 1)
        return call

    def checker(make: Callable[[int], Callable[[], object]], inplace: bool) -> Callable[[], str]:
        def run():
            if not inplace:
                make(0)()
                return outs[0]
            qkv = inplace_sets[0]["qkv"]
            qkv.copy_(first["qkv"])
            make(0)()
            return qkv.split(widths, dim=1)
        # the in-place candidates' own weights (fixed_point_weights) are the ones to check against
        return lambda: check_split(dict(first, q_weight=inplace_sets[0].get("q_weight"),
                                        k_weight=inplace_sets[0].get("k_weight")) if inplace else first, outs[0], run)

    specs = []
    for impl, form, make in ((BOUND_SPLIT, "out=", bound_out), (BOUND_SPLIT, "in-place", bound_inplace),
                             (FUNCTIONAL_SPLIT, "out=", lambda i: functional(i, False)),
                             (FUNCTIONAL_SPLIT, "in-place", lambda i: functional(i, True)),
                             (BARE_SPLIT, "out=", lambda i: bare(i, False)),
                             (BARE_SPLIT, "in-place", lambda i: bare(i, True)),
                             (BARE_VIEWS_SPLIT, "in-place", bare_views)):
        specs.append(_Spec(impl, form, make, checker(make, form == "in-place")))

    def copies_for(n):
        return [_copy(dst, kw["qkv"]) for dst, kw in zip(copy_dst[:n], sets[:n])]

    return _rows("split_qkv_rmsnorm_rope", preset.name, dtype, specs, copies_for, n_sets, cfg,
                 _restore_from(inplace_sets, ("qkv",)))


def _restore_from(copies: Sequence[dict], keys: Sequence[str]):
    """``_rows``' ``reset_for``: the in-place candidates' reset over the first ``n`` of ``copies`` (their ``keys``)."""
    return lambda n: restorer([kw[k] for kw in copies[:n] for k in keys])


def _copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], object]:
    def call():
        return dst.copy_(src)
    return call


def percall_norm(cfg: BenchConfig, hidden: int, dtype: torch.dtype = torch.bfloat16,
                 mode: str = MODES[0]) -> List[CallRow]:
    """Per-call rows of ``add_rmsnorm`` (with a residual) at T = 1 for ``hidden`` (weight in ``dtype``), in ``mode``."""
    return _in_mode(lambda: _percall_norm(cfg, hidden, dtype), mode)


def _percall_norm(cfg: BenchConfig, hidden: int, dtype: torch.dtype) -> List[CallRow]:
    T = PERCALL_T
    first = make_norm_inputs(T, hidden, dtype, residual=True, seed=0)
    first["weight"] = first["weight"].to(dtype)
    n_sets = _rotation(4 * _nbytes(first["x"]), cfg.l2_bytes)
    sets = _more_sets(first, n_sets)
    outs = [(torch.empty_like(kw["x"]), torch.empty_like(kw["x"])) for kw in sets]
    copy_src = [torch.cat([kw["x"], kw["residual"]], dim=1) for kw in sets]
    copy_dst = [torch.empty_like(src) for src in copy_src]
    bound = [AddRMSNorm(kw["weight"], kw["eps"], backend="cpu") for kw in sets]

    def bound_out(i):
        norm, x, residual, out = bound[i], sets[i]["x"], sets[i]["residual"], outs[i]

        def call():
            return norm(x, residual, out=out)
        return call

    def functional(i):
        x, residual, weight, eps, out = (sets[i]["x"], sets[i]["residual"], sets[i]["weight"], sets[i]["eps"],
                                         outs[i])

        def call():
            return add_rmsnorm(x, residual, weight, eps, out=out, backend="cpu")
        return call

    def bare(i):
        return bare_norm_call(sets[i], outs[i])

    # The in-place forms rewrite x and residual: their own copies, restored before each block.
    inplace_sets = [dict(kw, x=kw["x"].clone(), residual=kw["residual"].clone()) for kw in sets]
    op_inplace = torch.ops.qkvfuse.add_rmsnorm_inplace.default

    def inplace(i, impl):
        kw = inplace_sets[i]
        x, residual, weight, eps, norm = kw["x"], kw["residual"], kw["weight"], float(kw["eps"]), bound[i]
        if impl == BOUND_NORM:
            return lambda: norm.inplace(x, residual)
        if impl == FUNCTIONAL_NORM:
            return lambda: add_rmsnorm_(x, residual, weight, eps, backend="cpu")
        return lambda: op_inplace(x, residual, weight, None, eps)

    def checker(make, in_place=False):
        def run():
            if not in_place:
                make(0)()
                return outs[0]
            kw = inplace_sets[0]
            kw["x"].copy_(first["x"])
            kw["residual"].copy_(first["residual"])
            make(0)()
            return kw["x"], kw["residual"]
        return lambda: check_norm(first, outs[0], run)

    specs = [_Spec(impl, "out=", make, checker(make))
             for impl, make in ((BOUND_NORM, bound_out), (FUNCTIONAL_NORM, functional), (BARE_NORM, bare))]
    for impl in (BOUND_NORM, FUNCTIONAL_NORM, BARE_NORM):
        make = (lambda impl_: lambda i: inplace(i, impl_))(impl)
        specs.append(_Spec(impl, "in-place", make, checker(make, in_place=True)))

    def copies_for(n):
        return [_copy(dst, src) for dst, src in zip(copy_dst[:n], copy_src[:n])]

    return _rows("add_rmsnorm", f"hidden {hidden}", dtype, specs, copies_for, n_sets, cfg,
                 _restore_from(inplace_sets, ("x", "residual")))


# --------------------------------------------------------------------------------------------------------
# Presenting.
# --------------------------------------------------------------------------------------------------------
PERCALL_NOTE = (
    "T = 1, bf16 activations and bf16 norm weights (as apply_qkvfuse passes them), backend 'cpu', outputs "
    "preallocated (out=) or in place.\n"
    "us: median per call over interleaved rounds. - bare: median over rounds of (this - the bare torch.ops call "
    "of the same form), in us;\n"
    "/bare: the same as a ratio. x copy: this time / a same-bytes copy_ timed just before (median of per-round "
    "ratios). data: hot = one\n"
    "buffer set (stays in L1/L2); rotated xN = N sets (own activations, outputs, norm weights, bound objects) "
    "cycled, > 4x L2.\n"
    "check: this candidate's own result vs the float64 oracle (accuracy rule), once, before timing.\n"
    "Each table twice: default mode (a script, torch.no_grad() code) and inference_mode (inference tensors, called "
    "under torch.inference_mode(), as vLLM's runner calls the plugin)."
)


def _us(x: Optional[float], signed: bool = False) -> str:
    if x is None:
        return ""
    return f"{x:+.2f}" if signed else (f"{x:.2f}" if x < 100 else f"{x:.1f}")


def print_percall(rows: Sequence[CallRow]) -> None:
    groups: Dict[Tuple[str, str, str, str], List[CallRow]] = {}
    for r in rows:
        groups.setdefault((r.op, r.shape, r.dtype, r.mode), []).append(r)
    columns = ("data", "impl", "form", "us", "- bare us", "/bare", "x copy", "rounds", "check", "others")
    for (op, shape, dtype, mode), group in groups.items():
        cells = [{"data": r.data, "impl": r.impl, "form": r.form, "us": _us(r.us),
                  "- bare us": _us(r.minus_bare_us, signed=True),
                  "/bare": "" if r.vs_bare is None else f"{r.vs_bare:.2f}x",
                  "x copy": "" if r.copies is None else f"{r.copies:.1f}x", "rounds": str(r.rounds),
                  "check": r.check.split(":")[0], "others": "" if r.others is None else f"{100 * r.others:.0f}%"}
                 for r in group]
        print_section(Section(f"per-call cost: {op}: {shape}, {dtype}, T={PERCALL_T}, {mode}", columns, cells))


def percall_summary(rows: Sequence[CallRow], busy_share: float) -> List[Dict[str, object]]:
    """The per-call targets: each bound object's time minus the bare torch.ops call's (same form,
    same placement, same rounds) at most :data:`BOUND_MAX_OVER_BARE_US`, each functional op's at most
    :data:`FUNCTIONAL_MAX_OVER_BARE_US`."""
    out = []
    bare = {(r.op, r.shape, r.dtype, r.mode, r.data, r.form): r for r in rows if "(bare)" in r.impl}
    views = {(r.op, r.shape, r.dtype, r.mode, r.data): r for r in rows if r.impl == BARE_VIEWS_SPLIT}
    for r in rows:
        if r.impl not in BOUND + FUNCTIONAL or r.minus_bare_us is None:
            continue
        b = bare[(r.op, r.shape, r.dtype, r.mode, r.data, r.form)]
        limit = BOUND_MAX_OVER_BARE_US if r.impl in BOUND else FUNCTIONAL_MAX_OVER_BARE_US
        verdict = "MET" if r.minus_bare_us <= limit else "MISSED"
        if r.check != "ok":
            verdict = "WRONG RESULTS"
        elif r.others is not None and r.others > busy_share:
            verdict += f" (noisy: others {r.others:.0%})"
        measured = f"{r.minus_bare_us:+.2f} us ({_us(r.us)} us vs bare {_us(b.us)} us)"
        v = views.get((r.op, r.shape, r.dtype, r.mode, r.data)) if r.form == "in-place" else None
        if v is not None and v.minus_bare_us is not None:
            measured += f"; the views alone {v.minus_bare_us:+.2f} us"
        out.append({"target": f"{r.impl.split()[0]} {r.form} - bare <= {limit:g} us",
                    "shape": f"{r.shape} {r.dtype} T={r.T}", "mode": r.mode, "data": r.data, "measured": measured,
                    "verdict": verdict})
    return out


def print_percall_summary(summary: Sequence[Dict[str, object]]) -> None:
    if summary:
        print_section(Section("per-call targets (bound and functional vs bare "
                              "torch.ops, T=1)", ("target", "shape", "mode", "data", "measured", "verdict"),
                              [dict(s) for s in summary]))


# --------------------------------------------------------------------------------------------------------
# The section of ``qkvfuse.benchmarks.run_bench`` (its docstring names these functions) and the command.
# --------------------------------------------------------------------------------------------------------
def cells(cfg: BenchConfig, args) -> list:
    """The per-call cells of a run: each preset and hidden size, dtype and mode; none without the cpu backend (the
    section times bound and functional calls against bare calls of its kernel)."""
    if cfg.cpu_reason:
        return []
    presets = tuple(get_preset(name) for name in (args.preset or PRESETS))
    hidden = tuple(dict.fromkeys(args.hidden or HIDDEN_SIZES))
    dtypes = tuple(DTYPES[d] for d in dict.fromkeys(args.dtype or ["bf16"]))
    split = [(lambda c, p, d, T, m=mode: percall_split(c, p, d, m), preset,
              f"per-call split {preset.name} ({mode})", dtype, PERCALL_T)
             for preset in presets for dtype in dtypes for mode in MODES]
    return split + [(lambda c, h, d, T, m=mode: percall_norm(c, h, d, m), size,
                     f"per-call add_rmsnorm hidden {size} ({mode})", dtype, PERCALL_T)
                    for size in hidden for dtype in dtypes for mode in MODES]


def print_rows(rows: Sequence[CallRow]) -> None:
    print("\nper-call cost: " + PERCALL_NOTE)
    print_percall(rows)


judge = percall_summary
print_verdicts = print_percall_summary


def failures(rows: Sequence[CallRow]) -> List[str]:
    return [f"per-call {r.op} {r.shape} {r.dtype} {r.impl} {r.form}: {r.check}"
            for r in rows if r.check and r.check != "ok" and r.data == "hot"]


def to_json(rows: Sequence[CallRow], verdicts: Sequence[Dict[str, object]]) -> Dict[str, object]:
    return {"rows": [dataclasses.asdict(r) for r in rows], "summary": list(verdicts)}


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m qkvfuse bench`` with this section and, unless ``--op`` says otherwise, only it."""
    from qkvfuse.cli import main as cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--op" not in argv:
        argv += ["--op", NAME]
    return cli_main(["bench", *argv], bench_sections=(sys.modules[__name__],))


if __name__ == "__main__":
    sys.exit(main())
