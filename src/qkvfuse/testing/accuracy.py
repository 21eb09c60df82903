"""The accuracy rule: the single definition of every tolerance qkvfuse's checks use.

A fused result is judged against the float64 oracle (which reads inputs and cos/sin *as stored*):

1. **No worse than unfused**: ``max|out - oracle| <= max|unfused - oracle| + ulp(max|out|)
   + FP32_REDUCTION_ULPS * ulp_fp32(max|oracle|)``, where *unfused* is the transformers-style path in the same
   dtype (a rounding after each op). The last term is fp32 reduction-order noise: an fp32 sum of 4096 squares
   differs between summation orders by about an fp32 ulp, which in fp32 outputs is the size of the one-ulp
   margin itself (the fuzz suite found Triton fp32 cases 1.1-1.7 ulp off for that reason alone). In bf16/fp16
   it is 1/32768 of an output ulp or less, so it does not hide an extra rounding there.
2. **Elementwise**: every element within half an ulp of the oracle (in the output dtype, at the larger of
   ``|out|`` and ``|oracle|``) plus an fp32 allowance of ``FP32_ALLOWANCE * max|oracle|`` over the head. Rule 1
   alone would accept one extra intermediate rounding (unfused has several); this rule does not.
3. **Finite where the oracle is finite**; NaN never passes. Pass-through data (V, the gate of the gated layout,
   ``residual_out``) must be bit-exact.

``INTERPRETER_BF16_ULPS`` is the one extra allowance that exists, and it is 0: Triton's CPU interpreter
truncates fp32 -> bf16 conversions instead of rounding to nearest even, but the Triton backend rounds
explicitly (integer bit arithmetic, ``backends/triton/kernels.py``), so interpreter results need no allowance.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

__all__ = ["FP32_ALLOWANCE", "FP32_REDUCTION_ULPS", "INTERPRETER_BF16_ULPS", "AccuracyReport", "ulp",
           "check_split_outputs", "check_norm_outputs", "MODEL_FP32_LOGIT_RTOL", "MODEL_BF16_RMS_FACTOR",
           "MODEL_BF16_MAX_FACTOR"]

# fp32 arithmetic error allowed on top of the final rounding, relative to the head's largest magnitude:
# covers reduction order and rsqrt differences between backends (a few fp32 ulps), far below one bf16/fp16 ulp.
FP32_ALLOWANCE = 4e-6
# fp32 ulps (of the largest oracle magnitude) of summation-order noise added to rule 1; see the module docstring.
FP32_REDUCTION_ULPS = 4.0
# Extra ulps of the output dtype tolerated for kernels run under TRITON_INTERPRET=1. 0: the Triton kernels round
# bf16 to nearest even themselves instead of relying on the interpreter's (truncating) conversion.
INTERPRETER_BF16_ULPS = 0.0

# Model level (qkvfuse.integrations.transformers): logits of a patched model against the same model unpatched.
# fp32: max|patched - unpatched| <= MODEL_FP32_LOGIT_RTOL * max|unpatched|, at prefill and at every greedy step.
MODEL_FP32_LOGIT_RTOL = 1e-4
# bf16: both judged against the unpatched model run in float64. The patched model's RMS logit error may exceed
# the unpatched bf16 model's by MODEL_BF16_RMS_FACTOR, its max error by MODEL_BF16_MAX_FACTOR: the max of two
# bf16 runs is set by single chaotic roundings (ratios 0.73-1.30 measured on 18 tiny models; RMS 0.88-1.04).
MODEL_BF16_RMS_FACTOR = 1.10
MODEL_BF16_MAX_FACTOR = 2.0


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` numbers at ``|values|``, subnormals included.

    Parameters
    ----------
    values : torch.Tensor
        Any float tensor (any dtype, any device).
    dtype : torch.dtype
        The floating-point format whose spacing is wanted (e.g. ``torch.bfloat16``).

    Returns
    -------
    torch.Tensor
        float64, shape of ``values``: the distance from ``|values|`` rounded down to a power of two to the next
        ``dtype`` number (``finfo(dtype).tiny * eps`` below the normal range).
    """
    info = torch.finfo(dtype)
    mag = values.abs().to(torch.float64).clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


@dataclasses.dataclass
class AccuracyReport:
    """Outcome of one accuracy check; true when it passed.

    Attributes
    ----------
    ok : bool
        Every rule held for every output.
    max_err : float
        Largest ``|out - oracle|`` over the checked (not bit-exact) outputs.
    unfused_err : float
        Largest ``|unfused - oracle|`` over the same outputs: what the unfused path achieves on these inputs.
    detail : str
        Empty when ``ok``; else the first offending element of each failing output and the rule it broke.
    """

    ok: bool
    max_err: float
    unfused_err: float
    detail: str = ""

    def __bool__(self) -> bool:
        return self.ok


def _check_tensor(name: str, out: torch.Tensor, oracle: torch.Tensor, unfused: torch.Tensor, group: int,
                  extra_ulps: float) -> AccuracyReport:
    out64 = out.detach().to("cpu", torch.float64)
    unf64 = unfused.detach().to("cpu", torch.float64)
    if out64.shape != oracle.shape:
        return AccuracyReport(False, float("nan"), float("nan"), f"{name}: shape {tuple(out64.shape)} != {tuple(oracle.shape)}")
    if out64.numel() == 0:
        return AccuracyReport(True, 0.0, 0.0)
    finite = torch.isfinite(oracle)
    bad = finite & ~torch.isfinite(out64)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        return AccuracyReport(False, float("inf"), float("nan"), f"{name}: non-finite output at {idx} ({out64[idx]})")
    err = torch.where(finite, (out64 - oracle).abs(), torch.zeros_like(oracle))
    unf_err = torch.where(finite, (unf64 - oracle).abs(), torch.zeros_like(oracle))
    max_err, max_unf = float(err.max()), float(unf_err.nan_to_num(float("inf")).max())
    dtype = out.dtype
    rows = oracle.shape[0]
    head_max = oracle.nan_to_num(0.0).abs().reshape(rows, -1, group).amax(-1, keepdim=True)
    head_max = head_max.expand(rows, oracle.shape[1] // group, group).reshape(oracle.shape)
    half_ulp = 0.5 * torch.maximum(ulp(out64.nan_to_num(0.0), dtype), ulp(oracle.nan_to_num(0.0), dtype))
    bound = half_ulp * (1.0 + 2.0 * extra_ulps) + FP32_ALLOWANCE * head_max
    over = err > bound
    if over.any():
        idx = tuple(int(i) for i in over.nonzero()[0])
        return AccuracyReport(False, max_err, max_unf,
                              f"{name}: element {idx} = {float(out64[idx]):.9g}, oracle {float(oracle[idx]):.9g}, "
                              f"error {float(err[idx]):.3g} > bound {float(bound[idx]):.3g} (half ulp + fp32 allowance)")
    largest = oracle.nan_to_num(0.0).abs().max().reshape(1)
    rule1 = (max_unf + float(ulp(out64.abs().max().reshape(1), dtype)[0])
             + FP32_REDUCTION_ULPS * float(ulp(largest, torch.float32)[0]))
    if max_err > rule1:
        return AccuracyReport(False, max_err, max_unf,
                              f"{name}: max error {max_err:.3g} exceeds unfused error {max_unf:.3g} + 1 ulp")
    return AccuracyReport(True, max_err, max_unf)


def _merge(reports: Dict[str, AccuracyReport]) -> AccuracyReport:
    failed = [r.detail for r in reports.values() if not r.ok]
    return AccuracyReport(not failed, max(r.max_err for r in reports.values()),
                          max(r.unfused_err for r in reports.values()), "; ".join(failed))


def _bit_exact(name: str, got: torch.Tensor, want: torch.Tensor) -> AccuracyReport:
    ok = got.shape == want.shape and got.dtype == want.dtype and torch.equal(got.cpu(), want.cpu())
    return AccuracyReport(ok, 0.0 if ok else float("inf"), 0.0, "" if ok else f"{name}: not a bit-exact copy")


def check_split_outputs(outs, oracle, unfused, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                        head_dim: int, extra_ulps: float = 0.0) -> AccuracyReport:
    """Judge a split kernel's outputs by the accuracy rule (module docstring): q and k against the oracle, v bit-exact.

    Parameters
    ----------
    outs : sequence of torch.Tensor
        The kernel's ``(q, k, v)``, shapes ``(T, num_q_heads * head_dim)``, ``(T, num_kv_heads * head_dim)`` twice,
        in the output dtype (the rule's ulps are the dtype's), any device. Gated layout: ``(q, k, v, gate)``.
    oracle : sequence of torch.Tensor
        :func:`~qkvfuse.testing.oracle_split` on the same inputs (float64; its first two entries are used).
    unfused : sequence of torch.Tensor
        :func:`~qkvfuse.testing.unfused_split` on the same inputs (the baseline of rule 1).
    qkv : torch.Tensor
        The input, ``(T, width)``: v (and gate) must equal its slices bit for bit. The gated layout is recognised
        by the width, ``(2 * num_q_heads + 2 * num_kv_heads) * head_dim``.
    num_q_heads, num_kv_heads, head_dim : int
        Head geometry; the fp32 allowance of rule 2 is relative to each ``head_dim``-wide head's largest value.
    extra_ulps : float
        Extra ulps of the output dtype added to rule 2's half ulp (default 0; qkvfuse passes
        ``INTERPRETER_BF16_ULPS``, itself 0, under the Triton interpreter).

    Returns
    -------
    AccuracyReport
        Passed or not, the largest errors, and what failed.
    """
    q_gate = qkv.shape[1] == (2 * num_q_heads + 2 * num_kv_heads) * head_dim
    if len(outs) != (4 if q_gate else 3):
        layout = "gated (q, k, v, gate)" if q_gate else "(q, k, v)"
        return AccuracyReport(False, float("nan"), float("nan"), f"{len(outs)} outputs for a {layout} layout")
    q, k, v = outs[:3]
    reports = {
        "q": _check_tensor("q", q, oracle[0], unfused[0], head_dim, extra_ulps),
        "k": _check_tensor("k", k, oracle[1], unfused[1], head_dim, extra_ulps),
    }
    q_region = (2 if q_gate else 1) * num_q_heads * head_dim
    reports["v"] = _bit_exact("v", v, qkv[:, q_region + num_kv_heads * head_dim :])
    if q_gate:
        T = qkv.shape[0]
        gate_in = qkv[:, :q_region].reshape(T, num_q_heads, 2, head_dim)[:, :, 1].reshape(T, num_q_heads * head_dim)
        reports["gate"] = _bit_exact("gate", outs[3], gate_in)
    return _merge(reports)


def check_norm_outputs(outs, oracle_y, unfused, x: torch.Tensor, residual: Optional[torch.Tensor],
                       extra_ulps: float = 0.0) -> AccuracyReport:
    """Judge an add + RMSNorm kernel's outputs by the accuracy rule: y against the oracle, residual_out bit-exact.

    Parameters
    ----------
    outs : sequence of 2 torch.Tensor
        The kernel's ``(y, residual_out)``, shape ``(T, hidden)``, in ``x``'s dtype, any device.
    oracle_y : torch.Tensor
        :func:`~qkvfuse.testing.oracle_add_rmsnorm` on the same inputs (float64).
    unfused : sequence of torch.Tensor
        :func:`~qkvfuse.testing.unfused_add_rmsnorm` on the same inputs; its ``y`` is the baseline of rule 1.
    x : torch.Tensor
        The input ``(T, hidden)``; the fp32 allowance of rule 2 is relative to each row's largest value.
    residual : torch.Tensor or None
        The residual input; ``residual_out`` must equal ``x + residual`` (or ``x``) computed in the dtype, bit
        for bit.
    extra_ulps : float
        As for :func:`check_split_outputs`.

    Returns
    -------
    AccuracyReport
    """
    y, residual_out = outs
    reports = {"y": _check_tensor("y", y, oracle_y, unfused[0], x.shape[1] if x.numel() else 1, extra_ulps)}
    expected = (x + residual) if residual is not None else x
    r_ok = residual_out.shape == expected.shape and torch.equal(residual_out.cpu(), expected.cpu())
    reports["residual_out"] = AccuracyReport(r_ok, 0.0, 0.0, "" if r_ok else "residual_out: not bit-exact with x + residual")
    return _merge(reports)
