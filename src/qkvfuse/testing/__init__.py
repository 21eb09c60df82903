"""Verification helpers shared by the test suite, ``python -m qkvfuse verify`` and the device check.

* :mod:`.oracle` -- an independent float64 oracle written plainly (loops over heads and pairs; it shares no
  code with :mod:`qkvfuse.reference`), and the *unfused* transformers-style path in the working dtype.
* :mod:`.accuracy` -- the accuracy rule and its tolerances (the one place they are defined).
* :mod:`.inputs` -- random inputs for a configuration, and NaN-poisoned output buffers.
"""

from .accuracy import AccuracyReport, check_norm_outputs, check_split_outputs
from .inputs import SplitCase, make_norm_inputs, make_split_inputs, poisoned_like
from .oracle import oracle_add_rmsnorm, oracle_split, unfused_add_rmsnorm, unfused_split

__all__ = [
    "AccuracyReport",
    "check_split_outputs",
    "check_norm_outputs",
    "SplitCase",
    "make_split_inputs",
    "make_norm_inputs",
    "poisoned_like",
    "oracle_split",
    "oracle_add_rmsnorm",
    "unfused_split",
    "unfused_add_rmsnorm",
]
