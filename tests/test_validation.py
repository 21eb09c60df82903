"""Bad input: every call in the catalogue raises ValueError/TypeError naming the argument, on every backend.

The catalogue (``qkvfuse._verify.failure_modes.BAD_CALLS``) covers the ops (the cache-writing split's caches, slots
and scales included) and the cache builder. It runs
in one child process per backend, so a crash of native or Triton code on bad input is reported as a test
failure (naming the call it died in) instead of killing pytest. NaN/Inf inputs are not errors: they
propagate inside their head or row (documented in ``split_qkv_rmsnorm_rope``), tested below.
"""

import pytest
from _support.child_records import assert_child_call_ok, child_records, describe_exit

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
                "num_q_heads", "num_kv_heads",  # head counts (bounded: their products must not wrap)
                "x", "residual", "weight", "bias", "y_out", "residual_out",  # add_rmsnorm
                "key_cache", "value_cache", "slot_mapping", "layout", "fp8_rounding", "k_scale", "v_scale",
                "cache_mode",  # the cache-writing split
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


# --------------------------------------------------------------------------------------------------------
# Raw ops at int64 edge values (qkvfuse._verify.int_edges): head counts whose products wrap in int64 once passed
# the native shape checks and wrote out of bounds.
# --------------------------------------------------------------------------------------------------------
def _registered_int_arguments():
    """``namespace::op.argument`` of every integer argument of every op in qkvfuse's namespaces."""
    import torch

    from qkvfuse._library import NAMESPACES
    from qkvfuse.backends import backend_unavailable

    namespaces = set(NAMESPACES.values())
    if not backend_unavailable("cpu"):  # loads the native library: its own namespace too
        namespaces.add("qkvfuse_cpu")
    found = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        ns, _, op = qualified.partition("::")
        if ns in namespaces:
            for arg in torch._C._get_schema(qualified, "").arguments:
                if "int" in str(arg.type).lower():
                    found.add(f"{ns}::{op}.{arg.name}")
    return found, namespaces


def test_int_edge_sweep_covers_every_integer_argument_of_every_op():
    from qkvfuse._verify import int_edges

    registered, namespaces = _registered_int_arguments()
    assert registered, "no integer arguments found: the schemas moved?"
    assert registered <= int_edges.SWEPT, f"not swept: {sorted(registered - int_edges.SWEPT)}"
    if "qkvfuse_cpu" in namespaces:
        assert registered == int_edges.SWEPT, f"swept but not registered: {sorted(int_edges.SWEPT - registered)}"


def test_raw_ops_at_int64_edges_refuse_like_the_reference_or_agree_with_it(backend):
    """Every integer argument of every op (and both head counts at once) at 0, -1, 2**31 - 1, 2**31, 2**31 + 1,
    2**62 + 1, 2**63 - 1, in every form, plus the calls whose wrapped sizes once wrote out of bounds: refused with
    the reference's type and message, or run and agreeing with the reference; the public functions' refusals are
    the raw op's, word for word. One child process per backend: a crash names the call it died in."""
    results, returncode, running, stderr = child_records("qkvfuse._verify.int_edges", backend)
    if running is not None or returncode != 0:
        where = f"while running {running!r}" if running else "after the last call"
        pytest.fail(f"the child process died ({describe_exit(returncode)}) {where}:\n{stderr}")
    assert len(results) >= 200
    failed = {name: detail for name, (ok, detail) in results.items() if not ok}
    assert not failed, failed
    refused = [detail for ok, detail in results.values() if "expected an int in [1, 1048576]" in detail]
    assert len(refused) >= 100, "the head-count sweep refused too few calls by the head-count rule"


@pytest.mark.parametrize("q_gate", [False, True], ids=["plain", "gated"])
def test_head_counts_at_the_limit_run_and_one_more_is_refused(backend, q_gate):
    """2**20 Q and KV heads (head_dim 2, one token) run and agree with the reference: the bound refuses nothing a
    caller can build; 2**20 + 1 is refused with the shared message."""
    import torch

    import qkvfuse
    from qkvfuse._checks import MAX_HEADS

    qkv = torch.randn(1, ((2 if q_gate else 1) * MAX_HEADS + 2 * MAX_HEADS) * 2)
    positions, cache = torch.zeros(1, dtype=torch.int64), torch.randn(4, 2)
    with torch.no_grad():
        got = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, cache, MAX_HEADS, MAX_HEADS, 2, q_gate=q_gate,
                                             backend=backend)
        want = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, cache, MAX_HEADS, MAX_HEADS, 2, q_gate=q_gate,
                                              backend="reference")
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, want))
        for arg in ("num_q_heads", "num_kv_heads"):
            heads = {"num_q_heads": MAX_HEADS, "num_kv_heads": MAX_HEADS, arg: MAX_HEADS + 1}
            with pytest.raises(ValueError, match=rf"^{arg}: expected an int in \[1, 1048576\], got 1048577$"):
                qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, cache, heads["num_q_heads"], heads["num_kv_heads"], 2,
                                               q_gate=q_gate, backend=backend)
