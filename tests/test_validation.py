"""Bad input: every call in the catalogue raises ValueError/TypeError naming the argument, on every backend.

The catalogue (``qkvfuse._verify.failure_modes.BAD_CALLS``) covers both ops and the cache builder. It runs
in one child process per backend, so a crash of native or Triton code on bad input is reported as a test
failure (naming the call it died in) instead of killing pytest. NaN/Inf inputs are not errors: they
propagate inside their head or row (documented in ``split_qkv_rmsnorm_rope``), tested below.
"""

import pytest
from _support.child_records import assert_child_call_ok, child_records

import qkvfuse._verify.failure_modes as fm


def _results(backend):
    """``(results by call name, exit code, call that was running when the child died, stderr tail)``."""
    return child_records("qkvfuse._verify.failure_modes", "bad-input", backend)


def test_catalogue_covers_both_ops_and_the_cache_builder():
    names = [bad.name for bad in fm.BAD_CALLS]
    assert len(set(names)) == len(names) >= 30
    args = {bad.arg for bad in fm.BAD_CALLS}
    for arg in ("qkv", "positions", "cos_sin_cache", "mrope_section", "q_weight", "k_bias", "q_out", "eps",  # split
                "gate_out", "q_gate", "gemma_norm", "out",  # split, gated layout and Gemma norms
                "x", "residual", "weight", "bias", "y_out", "residual_out",  # add_rmsnorm
                "rotary_dim", "max_position", "base", "dtype", "rope_scaling"):  # build_cos_sin_cache
        assert arg in args, f"no bad call for {arg!r}"


@pytest.mark.parametrize("name", [bad.name for bad in fm.BAD_CALLS])
def test_bad_call_raises_naming_the_argument(backend, name):
    assert_child_call_ok(_results(backend), name)


def test_bad_call_gives_the_same_type_and_message_on_every_backend(backend):
    """One rule, however many copies: the native kernels check in C++ what the Python kernels check in
    qkvfuse._checks; every case must raise the same exception type with the same message as the reference."""
    want, got = _results("reference")[0], _results(backend)[0]
    differ = {name: (got[name][1], want[name][1]) for name in want if name in got and got[name][1] != want[name][1]}
    assert not differ, differ


# Inf * 0 inside an Inf head is the expected NaN; the Triton interpreter's numpy warns about it.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("geometry", [(64, 32, True), (128, 128, True), (128, 64, False)],
                         ids=["d64-partial", "d128-qwen3", "d128-partial-no-norm"])
def test_nonfinite_input_propagates_inside_its_head(backend, value, geometry):
    head_dim, rotary_dim, norm = geometry
    fm.check_nonfinite_propagates(backend, value, head_dim, rotary_dim, norm)
