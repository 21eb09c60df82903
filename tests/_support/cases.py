"""One split configuration, run with NaN-poisoned ``out=`` buffers and checked under the accuracy rule."""

from qkvfuse._verify.failure_modes import run_split
from qkvfuse._verify.inputs import SplitCase, make_split_inputs


def run_split_case(backend: str, case: SplitCase, seed: int = 0, device="cpu"):
    """``(kwargs, (q, k, v))`` for ``case`` on ``device``; outputs as strided as the case's qkv rows."""
    kwargs = make_split_inputs(case, seed=seed, device=device)
    return kwargs, run_split(backend, kwargs, out_row_pad=case.row_pad)
