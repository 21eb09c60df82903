"""The benchmark matrix: which shapes, which implementations, which buffers; one row per measurement.

For ``split_qkv_rmsnorm_rope`` (per preset, dtype and token count T) and ``add_rmsnorm`` (per hidden size):

* ``eager unfused`` -- :func:`qkvfuse._verify.unfused_split` / ``unfused_add_rmsnorm``, the transformers-style
  path (it allocates its outputs: ``fresh``);
* ``torch.compile unfused`` -- the same function under ``torch.compile(dynamic=False)``, compiled once per
  shape; the first call (the compile) is reported apart;
* ``reference`` -- qkvfuse's reference backend through the public op (``out=``);
* ``qkvfuse cpu`` -- the native CPU backend through the public op (``out=`` and ``fresh``), validation and
  dispatch included, called as a caller's source calls it (geometry positional, options by keyword); skipped,
  with the reason, where it is unavailable;
* ``bare torch.ops`` -- the same kernel called as ``torch.ops.qkvfuse.<op>_out.default(...)`` with the lean
  schema's arguments: the dispatcher and the kernel, no Python validation. ``qkvfuse cpu [out=]``'s time over
  this one (the ``/bare`` column, a median of per-round ratios) is what the public function costs on top;
* ``copy_ roofline`` -- ``dst.copy_(src)`` of the same bytes into a preallocated tensor (``qkv`` for the split;
  a ``[T, 2H]`` tensor for add_rmsnorm, whose op reads two and writes two ``[T, H]`` tensors).

Data placement (the ``data`` column): ``hot`` calls reuse one buffer set, so at T <= 16 everything stays in
L1/L2 and the branch predictors and threads stay warm, which flatters small-T numbers; ``rotated xN`` cycles N
input/output sets totalling more than ``4 x L2``; larger T use ``1 set``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._verify import (SplitCase, check_norm_outputs, check_split_outputs, make_norm_inputs, make_split_inputs,
                       oracle_add_rmsnorm, oracle_split, unfused_add_rmsnorm, unfused_split)
from .._library import split_config
from ..ops import add_rmsnorm, split_qkv_rmsnorm_rope
from ..presets import ModelPreset
from .timing import Budget, Candidate, measure, paired

__all__ = ["BenchConfig", "Row", "bench_split", "bench_norm", "COPY", "EAGER", "COMPILED", "REFERENCE", "CPU",
           "BARE", "bare_split_call", "bare_norm_call", "check_split", "check_norm"]

EAGER, COMPILED, REFERENCE, CPU, COPY = ("eager unfused", "torch.compile unfused", "reference", "qkvfuse cpu",
                                         "copy_ roofline")
# The same kernel through a bare torch.ops call (no Python validation): the difference is the public function's cost.
BARE = "bare torch.ops"
ROTATE_MAX_T = 16  # token counts at which back-to-back calls keep the data in L1/L2: also time rotated buffers
ROTATE_FOOTPRINT_L2 = 4  # rotated buffer sets total at least this many L2 sizes
CHECK_ROWS = 64  # token rows judged against the float64 oracle per cell (every element is checked as written)
CACHE_ROWS = 8192  # rows of the cos/sin table: only T rows are read per call, so the table size is irrelevant


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What one run measures (built from the CLI flags by :func:`qkvfuse.benchmarks.run_bench`)."""

    presets: Tuple[ModelPreset, ...]
    hidden_sizes: Tuple[int, ...]
    dtypes: Tuple[torch.dtype, ...]
    tokens: Tuple[int, ...]
    impls: Tuple[str, ...]  # which of EAGER, COMPILED, REFERENCE, CPU run (COPY always does)
    compile_cells: Optional[Tuple[Tuple[str, torch.dtype, int], ...]]  # None: every cell; else (shape, dtype, T)
    budget: Budget
    l2_bytes: int
    cpu_reason: str  # why the cpu backend is unavailable ("" when it is available)

    def compiles(self, shape: str, dtype: torch.dtype, T: int) -> bool:
        return COMPILED in self.impls and (self.compile_cells is None or (shape, dtype, T) in self.compile_cells)


@dataclasses.dataclass
class Row:
    """One line of the table (``us`` etc. are medians over the rounds, ratios medians of per-round ratios)."""

    op: str
    shape: str
    mode: str
    dtype: str
    T: int
    data: str
    impl: str
    outputs: str
    us: float
    gbps: float
    roofline: float  # copy_time / time: 1.0 is the memory roofline
    vs_eager: Optional[float]
    vs_compile: Optional[float]
    copy_us: float
    bytes: int
    rounds: int
    calls_per_block: int
    compile_s: Optional[float] = None
    check: str = ""  # qkvfuse cpu / bare rows: "ok" or "FAIL: ..." -- the accuracy rule on these very inputs
    others: Optional[float] = None  # share of the CPUs other processes used while this cell ran (noise)
    vs_bare: Optional[float] = None  # this time / the bare torch.ops call's time (median of per-round ratios)
    # impl -> that candidate's time / this time (median of per-round ratios; > 1: this one is faster)
    vs: Dict[str, float] = dataclasses.field(default_factory=dict)


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _rotation(set_bytes: int, l2_bytes: int) -> int:
    return max(2, math.ceil(ROTATE_FOOTPRINT_L2 * l2_bytes / max(set_bytes, 1)))


def _more_sets(first: Dict[str, object], n_sets: int, shared: Sequence[str] = ()) -> List[Dict[str, object]]:
    """``first`` and ``n_sets - 1`` copies in their own memory, like successive layers of one forward: their own
    activations and weights; the tensors named in ``shared`` (positions, the cos/sin table) are the same objects."""
    def copy(key, value):
        return value.clone() if isinstance(value, torch.Tensor) and key not in shared else value

    return [first] + [{k: copy(k, v) for k, v in first.items()} for _ in range(1, n_sets)]


def _sample_rows(T: int) -> torch.Tensor:
    """Up to ``CHECK_ROWS`` token indices spread over ``[0, T)``, first and last included."""
    return torch.linspace(0, T - 1, min(T, CHECK_ROWS)).round().long().unique()


def _unwritten(names: Sequence[str], outs: Sequence[torch.Tensor]) -> str:
    # Inputs are finite, so after NaN poisoning a non-finite output is unwritten or broken.
    bad = [name for name, t in zip(names, outs) if not bool(torch.isfinite(t).all())]
    return f"FAIL: non-finite values in {', '.join(bad)} (NaN-poisoned outputs not fully written?)" if bad else ""


def check_split(kw: Dict[str, object], out: Tuple[torch.Tensor, ...],
                run: Optional[Callable[[], Sequence[torch.Tensor]]] = None) -> str:
    """What is timed must be right, at the timed shape: ``run()`` (default: ``qkvfuse cpu`` through the public
    op) writes NaN-poisoned ``out=`` at full T and returns ``(q, k, v)``; every element must be written and the
    sampled rows must meet the accuracy rule (the float64 oracle costs tens of seconds over all 4096 rows of a GLM
    shape). An in-place ``run`` restores its own ``qkv`` copy from ``kw["qkv"]`` first and returns its views."""
    for t in out:
        t.fill_(float("nan"))
    got = split_qkv_rmsnorm_rope(**kw, out=out, backend="cpu") if run is None else run()
    unwritten = _unwritten(("q", "k", "v"), got)
    if unwritten:
        return unwritten
    rows = _sample_rows(kw["qkv"].shape[0])
    sub = dict(kw, qkv=kw["qkv"][rows], positions=kw["positions"][..., rows])
    report = check_split_outputs(tuple(t[rows] for t in got), oracle_split(**sub), unfused_split(**sub), sub["qkv"],
                                 kw["num_q_heads"], kw["num_kv_heads"], kw["head_dim"])
    return "ok" if report.ok else f"FAIL: {report.detail}"


def check_norm(kw: Dict[str, object], out: Tuple[torch.Tensor, ...],
               run: Optional[Callable[[], Sequence[torch.Tensor]]] = None) -> str:
    """:func:`check_split` for ``add_rmsnorm`` (``run()`` returns ``(y, residual_out)``)."""
    for t in out:
        t.fill_(float("nan"))
    got = add_rmsnorm(**kw, out=out, backend="cpu") if run is None else run()
    unwritten = _unwritten(("y", "residual_out"), got)
    if unwritten:
        return unwritten
    rows = _sample_rows(kw["x"].shape[0])
    sub = dict(kw, x=kw["x"][rows], residual=kw["residual"][rows])
    report = check_norm_outputs(tuple(t[rows] for t in got), oracle_add_rmsnorm(**sub), unfused_add_rmsnorm(**sub),
                                sub["x"], sub["residual"])
    return "ok" if report.ok else f"FAIL: {report.detail}"


def _compile(fn: Callable, first_call: Callable[[Callable], object]) -> Tuple[Optional[Callable], float, str]:
    """``torch.compile(fn)`` and the seconds its first call takes (the compile), or ``(None, 0, reason)``."""
    torch._dynamo.reset()  # each shape's compile time measured from the same (empty) in-process state
    compiled = torch.compile(fn, dynamic=False)
    t0 = time.perf_counter()
    try:
        first_call(compiled)
    except Exception as exc:  # a compile failure is a finding to print, not a reason to lose the run
        return None, 0.0, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return compiled, time.perf_counter() - t0, ""


def _rows(cfg: BenchConfig, op: str, shape: str, mode: str, dtype: torch.dtype, T: int,
          candidates_for: Callable[[int], Tuple[List[Candidate], List[Callable]]], n_sets: int, nbytes: int,
          copy_bytes: int, compile_s: Optional[float], checks: Dict[str, str]) -> List[Row]:
    """Measure hot (and, for small T, rotated) placements and turn the results into rows."""
    placements = [("hot", 1), (f"rotated x{n_sets}", n_sets)] if T <= ROTATE_MAX_T else [("1 set", 1)]
    rows = []
    for data, n in placements:
        candidates, copy_calls = candidates_for(n)
        if not candidates:
            continue
        results = measure(candidates, copy_calls, cfg.budget)
        eager = next((c.key for c in candidates if c.impl == EAGER), None)
        compiled = next((c.key for c in candidates if c.impl == COMPILED), None)
        bare = next((results[c.key] for c in candidates if c.impl == BARE), None)
        copy_us = []
        for c in candidates:
            m = results[c.key]
            copy_us.append(m.copy_us)
            rows.append(Row(op, shape, mode, dtype_name(dtype), T, data, c.impl, c.outputs, m.us, nbytes / m.us / 1e3,
                            m.roofline, 1.0 if c.key == eager else m.vs.get(eager),
                            1.0 if c.key == compiled else m.vs.get(compiled), m.copy_us, nbytes, m.rounds,
                            m.calls_per_block, compile_s if c.impl == COMPILED else None, checks.get(c.impl, ""),
                            vs_bare=None if bare is None else paired(m, bare, lambda x, y: x / y)))
        copy_median = statistics.median(copy_us)
        rows.append(Row(op, shape, mode, dtype_name(dtype), T, data, COPY, "out=", copy_median,
                        copy_bytes / copy_median / 1e3, 1.0, None, None, copy_median, copy_bytes, rows[-1].rounds, 0))
    return rows


def _split_args(kw: Dict[str, object]) -> list:
    """The split's 14 leading arguments (public function order) from one buffer set's keyword arguments."""
    return ([kw[k] for k in ("qkv", "positions", "cos_sin_cache", "num_q_heads", "num_kv_heads", "head_dim")]
            + [kw.get(k) for k in ("q_weight", "k_weight", "q_bias", "k_bias")]
            + [kw[k] for k in ("eps", "is_neox", "mrope_section", "mrope_interleaved")])


def _public_split_call(kw: Dict[str, object], out: Optional[Tuple[torch.Tensor, ...]], backend: str) -> Callable:
    """The public op called the way an engine's source calls it: geometry positional, options by keyword.
    (``functools.partial(op, **kw)`` would copy its keyword dict on every call, ~0.2 us that no caller pays.)"""
    qkv, positions, cache, hq, hkv, D, q_weight, k_weight, q_bias, k_bias, eps, is_neox, section, interleaved = (
        _split_args(kw))

    def call():
        return split_qkv_rmsnorm_rope(qkv, positions, cache, hq, hkv, D, q_weight=q_weight, k_weight=k_weight,
                                      q_bias=q_bias, k_bias=k_bias, eps=eps, is_neox=is_neox, mrope_section=section,
                                      mrope_interleaved=interleaved, out=out, backend=backend)
    return call


def _public_norm_call(kw: Dict[str, object], out: Optional[Tuple[torch.Tensor, ...]], backend: str) -> Callable:
    """:func:`_public_split_call` for ``add_rmsnorm``."""
    x, residual, weight, eps, bias = kw["x"], kw["residual"], kw["weight"], kw["eps"], kw.get("bias")

    def call():
        return add_rmsnorm(x, residual, weight, eps, bias, out, backend=backend)
    return call


def bare_split_call(kw: Dict[str, object], out: Sequence[torch.Tensor], inplace: bool = False) -> Callable:
    """A bare ``torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out.default`` call (``_inplace`` with ``inplace``: then
    ``kw["qkv"]`` is rewritten and ``out`` ignored) with the lean schema's arguments, built once: the dispatcher
    and the native kernel, no Python validation (raw ``torch.ops`` calls assume validated input). Written as a
    closure like the public calls, so both pay the same call frame."""
    # The schema's arguments from the case's keywords, whichever it sets; one tuple, passed as it is (f(*t) with a
    # tuple copies nothing).
    static = split_config(**kw).schema_args()
    if inplace:
        op_ = torch.ops.qkvfuse.split_qkv_rmsnorm_rope_inplace.default
        args_ = (kw["qkv"], kw["positions"], *static)

        def call_inplace():
            return op_(*args_)
        return call_inplace
    op = torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out.default
    q_out, k_out, v_out = out
    args = (kw["qkv"], kw["positions"], *static, q_out, k_out, v_out)

    def call():
        return op(*args)
    return call


def bare_norm_call(kw: Dict[str, object], out: Sequence[torch.Tensor]) -> Callable:
    """:func:`bare_split_call` for ``torch.ops.qkvfuse.add_rmsnorm_out.default``."""
    op = torch.ops.qkvfuse.add_rmsnorm_out.default
    x, residual, weight, eps, bias = kw["x"], kw["residual"], kw["weight"], float(kw["eps"]), kw.get("bias")
    y_out, residual_out = out

    def call():
        return op(x, residual, weight, bias, eps, y_out, residual_out)
    return call


def _candidates(cfg: BenchConfig, unfused: Callable, compiled: Optional[Callable], public: Callable,
                kws: Sequence[dict], outputs: Sequence[tuple], bare: Callable) -> List[Candidate]:
    """The implementations of one op over buffer sets ``kws`` (keyword arguments) with their ``out=`` tuples;
    ``public(kw, out, backend)`` builds a call of the public op, ``bare(kw, out)`` a bare ``torch.ops`` call of
    the same cpu kernel (every T: the public op's overhead over it is judged at T >= 16)."""
    cands = []
    if EAGER in cfg.impls:
        cands.append(Candidate(EAGER, "fresh", [functools.partial(unfused, **kw) for kw in kws]))
    if compiled is not None:
        cands.append(Candidate(COMPILED, "fresh", [functools.partial(compiled, **kw) for kw in kws]))
    for impl, backend in ((REFERENCE, "reference"), (CPU, "cpu")):
        if impl not in cfg.impls or (impl == CPU and cfg.cpu_reason):
            continue
        cands.append(Candidate(impl, "out=", [public(kw, o, backend) for kw, o in zip(kws, outputs)]))
        if impl == CPU:  # the reference's own fp32 temporaries dwarf its outputs: its fresh row says nothing new
            cands.append(Candidate(impl, "fresh", [public(kw, None, backend) for kw in kws]))
        if impl == CPU:
            cands.append(Candidate(BARE, "out=", [bare(kw, o) for kw, o in zip(kws, outputs)]))
    return cands


def split_mode(preset: ModelPreset) -> str:
    rope = "rope" if preset.mrope_section is None else (
        "mrope interleaved" if preset.mrope_interleaved else "mrope contiguous")
    rotary = "" if preset.rotary_dim == preset.head_dim else f", rotary {preset.rotary_dim}/{preset.head_dim}"
    return f"{preset.num_q_heads}/{preset.num_kv_heads}x{preset.head_dim}, {rope}{rotary}, " + (
        "qk-norm" if preset.qk_norm else "no qk-norm")


def bench_split(cfg: BenchConfig, preset: ModelPreset, dtype: torch.dtype, T: int) -> List[Row]:
    """Rows for one preset / dtype / T of ``split_qkv_rmsnorm_rope`` (inputs from the shared generators)."""
    case = SplitCase.from_preset(preset, T, dtype=dtype, max_position=min(preset.max_position, CACHE_ROWS))
    first = make_split_inputs(case, seed=0)
    hq, hkv, D = case.num_q_heads, case.num_kv_heads, case.head_dim
    # Bytes the op must move: qkv in, q/k/v out, the T cos/sin rows it gathers, positions and norm params.
    per_token_cache = case.rotary_dim * first["cos_sin_cache"].element_size()
    nbytes = (2 * _nbytes(first["qkv"]) + T * per_token_cache
              + _nbytes(*(first.get(k) for k in ("positions", "q_weight", "k_weight", "q_bias", "k_bias"))))
    n_sets = _rotation(2 * _nbytes(first["qkv"]), cfg.l2_bytes) if T <= ROTATE_MAX_T else 1
    sets = _more_sets(first, n_sets, shared=("positions", "cos_sin_cache"))
    outs = [tuple(torch.empty(T, n * D, dtype=dtype) for n in (hq, hkv, hkv)) for _ in sets]
    copy_dst = [torch.empty_like(kw["qkv"]) for kw in sets]

    checks = {}
    if CPU in cfg.impls and not cfg.cpu_reason:
        checks[CPU] = check_split(first, outs[0])
        checks[BARE] = check_split(first, outs[0], lambda: (bare_split_call(first, outs[0])(), outs[0])[1])

    compiled, compile_s = None, None
    if cfg.compiles(preset.name, dtype, T):
        compiled, compile_s, reason = _compile(unfused_split, lambda f: f(**first))
        if compiled is None:
            print(f"  torch.compile failed for {preset.name} {dtype_name(dtype)} T={T}: {reason}")

    def candidates_for(n: int):
        copies = [functools.partial(dst.copy_, kw["qkv"]) for dst, kw in zip(copy_dst[:n], sets[:n])]
        return _candidates(cfg, unfused_split, compiled, _public_split_call, sets[:n], outs[:n],
                           bare_split_call), copies

    return _rows(cfg, "split_qkv_rmsnorm_rope", preset.name, split_mode(preset), dtype, T, candidates_for, n_sets,
                 nbytes, 2 * _nbytes(first["qkv"]), compile_s, checks)


def bench_norm(cfg: BenchConfig, hidden: int, dtype: torch.dtype, T: int) -> List[Row]:
    """Rows for one hidden size / dtype / T of ``add_rmsnorm`` with a residual (fp32 weight, no bias)."""
    first = make_norm_inputs(T, hidden, dtype, residual=True, seed=0)
    # x and residual in, y and residual_out out (plus the weight): the copy moves a [T, 2H] tensor to match.
    nbytes = 4 * _nbytes(first["x"]) + _nbytes(first["weight"])
    n_sets = _rotation(4 * _nbytes(first["x"]), cfg.l2_bytes) if T <= ROTATE_MAX_T else 1
    sets = _more_sets(first, n_sets)
    outs = [(torch.empty_like(kw["x"]), torch.empty_like(kw["x"])) for kw in sets]
    copy_src = [torch.cat([kw["x"], kw["residual"]], dim=1) for kw in sets]
    copy_dst = [torch.empty_like(src) for src in copy_src]
    shape = f"hidden {hidden}"

    checks = {}
    if CPU in cfg.impls and not cfg.cpu_reason:
        checks[CPU] = check_norm(first, outs[0])
        checks[BARE] = check_norm(first, outs[0], lambda: (bare_norm_call(first, outs[0])(), outs[0])[1])

    compiled, compile_s = None, None
    if cfg.compiles(shape, dtype, T):
        compiled, compile_s, reason = _compile(unfused_add_rmsnorm, lambda f: f(**first))
        if compiled is None:
            print(f"  torch.compile failed for add_rmsnorm {shape} {dtype_name(dtype)} T={T}: {reason}")

    def candidates_for(n: int):
        copies = [functools.partial(dst.copy_, src) for dst, src in zip(copy_dst[:n], copy_src[:n])]
        return _candidates(cfg, unfused_add_rmsnorm, compiled, _public_norm_call, sets[:n], outs[:n],
                           bare_norm_call), copies

    return _rows(cfg, "add_rmsnorm", shape, "residual, fp32 weight", dtype, T, candidates_for, n_sets, nbytes,
                 2 * _nbytes(copy_src[0]), compile_s, checks)
