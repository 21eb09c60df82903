"""Verification: everything ``python -m qkvfuse verify`` runs, and what the test suite and the benchmark check with.

Private (no stability promise); the library never imports it, the CLI and the tests do. Nothing here imports
:mod:`qkvfuse.cli`.

* The float64 oracle, the unfused baseline and the accuracy rule are public: :mod:`qkvfuse.testing` (re-exported
  here for the modules below).
* :mod:`.inputs` -- random inputs for a configuration, and NaN-poisoned output buffers.
* :mod:`.guarded` -- guard-page tensors (``python -m qkvfuse._verify.guarded BACKEND``).
* :mod:`.failure_modes` -- the catalogue of public failure modes, bad calls, fuzz space, determinism checks
  (``python -m qkvfuse._verify.failure_modes bad-input BACKEND``).
* :mod:`.int_edges` -- every integer argument of every raw op at int64 edge values, refused with the reference's
  message or agreeing with it (``python -m qkvfuse._verify.int_edges BACKEND``).
* :mod:`.tiny_models`, :mod:`.models` -- tiny random-weight transformers models and the logits-to-logits checks.
* :mod:`.sections` -- the :class:`~.sections.Section` protocol, the registry of sections and the runner; the
  sections are :mod:`.conformance` (``ops``), :mod:`.models`, :mod:`.failure_modes` (host) and :mod:`.device`,
  :mod:`.moe_streams` (device: ``--device cuda``, or ``--cpu-interpreter`` as a dry run on CPU).

numpy is needed only here (the optional ``verify`` extra), never by the ops.
"""

from ..testing import (AccuracyReport, check_norm_outputs, check_split_outputs, oracle_add_rmsnorm, oracle_split,
                       unfused_add_rmsnorm, unfused_split)
from .inputs import SplitCase, make_norm_inputs, make_split_inputs, poisoned_like, poisoned_split_outputs

__all__ = [
    "AccuracyReport",
    "check_split_outputs",
    "check_norm_outputs",
    "SplitCase",
    "make_split_inputs",
    "make_norm_inputs",
    "poisoned_like",
    "poisoned_split_outputs",
    "oracle_split",
    "oracle_add_rmsnorm",
    "unfused_split",
    "unfused_add_rmsnorm",
]
