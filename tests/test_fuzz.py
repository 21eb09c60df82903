"""Fuzzing: hypothesis over random valid configurations, every backend against the float64 oracle.

The configuration space is ``qkvfuse._verify.failure_modes.draw_split_case`` / ``draw_norm_case`` (shared
with the verify section's fuzz-lite rows): T (0 included), head_dim 2..512, rotary dim full/half/2/32/D-2,
head counts, QK-norm and bias on/off, NeoX/GPT-J, RoPE and both mRoPE layouts with arbitrary sections,
image/decode rows, all dtypes of qkv, cache, weights and positions, strided rows, tiny tables, out= /
functional / in-place, the gated layout (``q_gate``) and Gemma norm weights (``gemma_norm``, split and add+norm).
Each example is checked under the accuracy rule with NaN-poisoned outputs. The cache-writing split draws any such
split with a KV cache (``draw_cache_case``: every layout, same-dtype and FP8 caches, block sizes, slot patterns,
interleaved and padded caches, in-place / out-of-place / bound forms), checked by ``qkvfuse._verify.cache``.
Hypothesis shrinks a failure to the plainest configuration (the first option of every choice).

CI runs 100 derandomized examples per backend, device and op (reproducible); ``-m slow`` runs 1 000 with a fresh
random seed each time. Triton examples on CPU tensors are interpreter-sized (``small=True``).
"""

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import qkvfuse._verify.failure_modes as fm

# No "explain" phase: on this space it costs ~30 s per failure and the shrunk case already says enough.
_COMMON = dict(deadline=None, database=None, print_blob=True,
               phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                      HealthCheck.data_too_large])
CI = settings(max_examples=100, derandomize=True, **_COMMON)
SLOW = settings(max_examples=1000, **_COMMON)


def _chooser(data):
    def choose(options):
        if isinstance(options, range):  # integers shrink towards the start and are cheaper to draw
            return data.draw(st.integers(options.start, options.stop - 1))
        return data.draw(st.sampled_from(options))

    return choose


# op -> (draw, check): its configuration space and its check (qkvfuse._verify.failure_modes).
OPS = {"split": (fm.draw_split_case, fm.check_split_case),
       "add_rmsnorm": (fm.draw_norm_case, fm.check_norm_case),
       "split_cache": (fm.draw_cache_case, fm.check_cache_fuzz_case)}


def _example(op, pair, data):
    draw, check = OPS[op]
    drawn = draw(_chooser(data), small=pair.interpreted)
    note(f"{op}: {drawn}")
    check(pair.backend, drawn, device=pair.device)


@pytest.mark.parametrize("op", list(OPS))
@CI
@given(data=st.data())
def test_fuzz(op, backend_device, data):
    _example(op, backend_device, data)


@pytest.mark.slow
@pytest.mark.parametrize("op", list(OPS))
@SLOW
@given(data=st.data())
def test_fuzz_slow(op, backend_device, data):
    _example(op, backend_device, data)


def test_fuzz_shrinks_to_a_minimal_case():
    """A planted bug (wrong output when head_dim is 80 and NeoX is off) shrinks to a minimal case with it."""
    found = []

    @settings(max_examples=100, derandomize=True, **_COMMON)
    @given(data=st.data())
    def planted(data):
        case, seed, mode, pad = fm.draw_split_case(_chooser(data))
        if case.head_dim == 80 and not case.is_neox:
            found.append(case)
            raise AssertionError("planted")

    with pytest.raises(AssertionError, match="planted"):
        planted()
    minimal = found[-1]
    assert (minimal.head_dim, minimal.is_neox) == (80, False)
    assert (minimal.T, minimal.num_q_heads, minimal.num_kv_heads) == (1, 1, 1)
    assert minimal.mrope_section is None and minimal.rotary_dim == 80 and minimal.row_pad == 0
