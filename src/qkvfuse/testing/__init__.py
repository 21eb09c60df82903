"""Check a kernel the way qkvfuse checks its own: a float64 oracle and one accuracy rule.

For anyone who writes or ports a split-QKV + QK-RMSNorm + RoPE or add + RMSNorm kernel (qkvfuse's backends, an
engine's own op, a new device) and wants the verdict qkvfuse's tests, ``python -m qkvfuse verify`` and the engine
plugins' ``verify`` option give. A guide with examples: ``docs/testing.md``.

* :mod:`.oracle` -- :func:`oracle_split` and :func:`oracle_add_rmsnorm`, the ops evaluated in float64 from the
  inputs as stored, written plainly and independently of :mod:`qkvfuse.reference`; and :func:`unfused_split` and
  :func:`unfused_add_rmsnorm`, the transformers-style unfused path in the working dtype (a rounding after every
  op), the baseline the rule compares against.
* :mod:`.accuracy` -- :func:`check_split_outputs` and :func:`check_norm_outputs` apply the rule and return an
  :class:`AccuracyReport`; :func:`ulp` and the tolerances (``FP32_ALLOWANCE``, ``FP32_REDUCTION_ULPS``,
  ``INTERPRETER_BF16_ULPS``, the ``MODEL_*`` logit tolerances) are the one place qkvfuse defines them.

Needs torch only. The oracle loops over heads and rotary pairs in Python: use test-sized inputs (a few hundred
tokens), or check a sample of rows.
"""

from .accuracy import (FP32_ALLOWANCE, FP32_REDUCTION_ULPS, INTERPRETER_BF16_ULPS, MODEL_BF16_MAX_FACTOR,
                       MODEL_BF16_RMS_FACTOR, MODEL_FP32_LOGIT_RTOL, AccuracyReport, check_norm_outputs,
                       check_split_outputs, ulp)
from .oracle import oracle_add_rmsnorm, oracle_split, unfused_add_rmsnorm, unfused_split

__all__ = [
    "oracle_split",
    "oracle_add_rmsnorm",
    "unfused_split",
    "unfused_add_rmsnorm",
    "check_split_outputs",
    "check_norm_outputs",
    "AccuracyReport",
    "ulp",
    "FP32_ALLOWANCE",
    "FP32_REDUCTION_ULPS",
    "INTERPRETER_BF16_ULPS",
    "MODEL_FP32_LOGIT_RTOL",
    "MODEL_BF16_RMS_FACTOR",
    "MODEL_BF16_MAX_FACTOR",
]
