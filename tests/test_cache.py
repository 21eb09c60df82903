"""The cache-writing split on every backend (qkvfuse._verify.cache judges every byte; see its docstring).

Every layout x cache dtype x FP8 rounding on small shapes (Triton under the interpreter), the geometries that
matter (partial rotary, GPT-J pairs, mRoPE, the gated Gemma layout, no QK-norm), slot patterns (shuffled, fewer
slots than tokens, negative slots, saturating FP8 scales), K and V interleaved in one buffer, strided caches, the
bound form, the out-of-place forms, and the error rules that need data (slots past the capacity, scales that are
not positive) leaving qkv, the outputs and the caches untouched.
"""

import pytest
import torch

import qkvfuse
from qkvfuse._verify.cache import FORMS, VERIFY_CASES, CacheCase, check_cache_case, make_cache_inputs
from qkvfuse._verify.inputs import SplitCase

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _split(**changes) -> SplitCase:
    fields = dict(T=9, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, dtype=torch.bfloat16,
                  max_position=64)
    fields.update(changes)
    return SplitCase(**fields)


@pytest.mark.parametrize("name", [name for name, _ in VERIFY_CASES])
def test_verify_cases(backend, name):
    check_cache_case(backend, dict(VERIFY_CASES)[name])


@pytest.mark.parametrize("layout", ["NHD", "HND", "vec", "amx"])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, None), (torch.float16, None),
                                               (torch.float32, None), (torch.bfloat16, torch.float8_e4m3fn),
                                               (torch.float32, torch.float8_e5m2)],
                         ids=["bf16", "fp16", "fp32", "bf16-e4m3", "fp32-e5m2"])
@pytest.mark.parametrize("rounding", ["nearest", "truncate"])
def test_layouts_and_dtypes(backend, layout, dtype, cache_dtype, rounding):
    if layout == "amx" and (dtype == torch.float32 or cache_dtype is not None):
        pytest.skip("the amx layout holds 16-bit caches")
    if rounding == "truncate" and cache_dtype is None:
        pytest.skip("the rounding option applies to FP8 caches")
    check_cache_case(backend, CacheCase(_split(dtype=dtype), layout=layout, cache_dtype=cache_dtype,
                                        rounding=rounding, slots="skips"))


@pytest.mark.parametrize("geometry", ["glm-partial", "gptj", "no-norm", "mrope", "gated"])
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["same", "e4m3"])
def test_geometries(backend, geometry, cache_dtype):
    changes = {"glm-partial": dict(num_q_heads=6, num_kv_heads=2, head_dim=128, rotary_dim=64, bias=True),
               "gptj": dict(is_neox=False), "no-norm": dict(norm=False),
               "mrope": dict(mrope_section=(6, 5, 5), mrope_interleaved=False),
               "gated": dict(q_gate=True, gemma_norm=True, head_dim=128, rotary_dim=32,
                             mrope_section=(6, 5, 5), mrope_interleaved=True)}[geometry]
    check_cache_case(backend, CacheCase(_split(**changes), layout="vec", cache_dtype=cache_dtype, slots="short",
                                        block_size=32))


@pytest.mark.parametrize("interleaved,padded", [(True, False), (False, True)], ids=["kv-interleaved", "padded"])
def test_strided_caches(backend, interleaved, padded):
    for layout in ("NHD", "HND"):
        check_cache_case(backend, CacheCase(_split(), layout=layout, interleaved=interleaved, padded=padded),
                         form="bound")


@pytest.mark.parametrize("form", [f for f in FORMS if f not in ("inplace", "bound")])
@pytest.mark.parametrize("name", ["NHD bf16", "vec e4m3 truncate", "amx bf16 interleaved", "NHD fp32 short slots",
                                  "HND e5m2 saturated", "NHD gated mRoPE"])
def test_out_of_place_forms(backend, form, name):
    """``split_qkv_rmsnorm_rope_cache`` (into poisoned ``out=`` tensors) and ``QKNormRope.with_cache`` (fresh
    outputs): ``qkv`` unchanged, the outputs those of ``split_qkv_rmsnorm_rope``, the caches as in place."""
    check_cache_case(backend, dict(VERIFY_CASES)[name], form=form)


@pytest.mark.parametrize("form", FORMS)
def test_every_form_at_decode_and_without_tokens(backend, form):
    check_cache_case(backend, CacheCase(_split(T=1), layout="vec", block_size=32), form=form)
    check_cache_case(backend, CacheCase(_split(T=0, q_gate=True, gemma_norm=True), layout="NHD"), form=form)


def test_out_of_place_refuses_a_cache_over_an_output(backend):
    """A cache may not share memory with an output of the out-of-place form (nor with an input); nothing is
    written."""
    kw = make_cache_inputs(CacheCase(_split(), layout="NHD"), seed=2)
    storage, qkv = kw.pop("storage"), kw.pop("qkv")
    T, kv_width = qkv.shape[0], 2 * 64
    outs = [qkv.new_zeros(T, 4 * 64), qkv.new_zeros(T, kv_width), qkv.new_zeros(T, kv_width)]
    outs[1] = kw["key_cache"].view(-1)[: T * kv_width].view(T, kv_width)  # k_out inside the key cache
    before, qkv_before = storage.clone(), qkv.clone()
    with pytest.raises(ValueError, match=r"^key_cache: expected a cache that shares no element with an output, "
                                         r"got memory shared with k_out"):
        qkvfuse.split_qkv_rmsnorm_rope_cache(qkv, **kw, out=tuple(outs), backend=backend)
    assert torch.equal(storage, before) and torch.equal(qkv.view(torch.int16), qkv_before.view(torch.int16))


def test_decode_and_one_block(backend):
    """T = 1 (a decode step) and a single block of size 1 (SGLang's token pool is NHD with block_size 1)."""
    check_cache_case(backend, CacheCase(_split(T=1), layout="NHD", num_blocks=5, block_size=1))
    check_cache_case(backend, CacheCase(_split(T=3), layout="NHD", num_blocks=8, block_size=1,
                                        cache_dtype=torch.float8_e4m3fn))


def test_no_tokens(backend):
    check_cache_case(backend, CacheCase(_split(T=0), layout="HND"))


def test_duplicate_slots_store_one_tokens_rows(backend):
    """Two tokens to one slot: each (slot, head) row holds one of the two tokens' rows, never a mix within a
    row."""
    kw = make_cache_inputs(CacheCase(_split(T=2, num_kv_heads=1), layout="NHD"), seed=3)
    kw.pop("storage")
    kw["slot_mapping"] = torch.tensor([5, 5])
    qkv = kw.pop("qkv")
    qkvfuse.split_qkv_rmsnorm_rope_cache_(qkv, **kw, backend=backend)
    stored = kw["key_cache"][0, 5, 0]
    k_rows = qkv[:, 256:320]
    assert torch.equal(stored, k_rows[0]) or torch.equal(stored, k_rows[1])


def _untouched(backend, kw, in_place, **changes):
    """Call the in-place or the out-of-place form (into poisoned outputs); whatever it raises, nothing changed."""
    kw = dict(kw, **changes)
    storage = kw.pop("storage")
    qkv = kw.pop("qkv")
    outs = tuple(torch.full((qkv.shape[0], w), float("nan"), dtype=qkv.dtype) for w in (4 * 64, 2 * 64, 2 * 64))
    before, qkv_before, outs_before = storage.clone(), qkv.clone(), [o.clone() for o in outs]
    try:
        if in_place:
            qkvfuse.split_qkv_rmsnorm_rope_cache_(qkv, **kw, backend=backend)
        else:
            qkvfuse.split_qkv_rmsnorm_rope_cache(qkv, **kw, out=outs, backend=backend)
    finally:
        assert torch.equal(storage, before) and torch.equal(qkv.view(torch.int16), qkv_before.view(torch.int16)), (
            "a refused call wrote to qkv or a cache")
        assert all(torch.equal(o.view(torch.int16), b.view(torch.int16)) for o, b in zip(outs, outs_before)), (
            "a refused call wrote to an output")


@pytest.mark.parametrize("in_place", [True, False], ids=["inplace", "out"])
def test_slot_past_the_capacity_is_refused_before_any_write(backend, in_place):
    kw = make_cache_inputs(CacheCase(_split(), layout="vec", block_size=32), seed=1)
    slots = kw["slot_mapping"].clone()
    slots[-1] = 3 * 32
    with pytest.raises(ValueError, match=r"^slot_mapping: expected values < 96 .* got 96"):
        _untouched(backend, kw, in_place, slot_mapping=slots)


@pytest.mark.parametrize("in_place", [True, False], ids=["inplace", "out"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_scale_is_refused_before_any_write(backend, value, in_place):
    kw = make_cache_inputs(CacheCase(_split(), layout="NHD", cache_dtype=torch.float8_e4m3fn), seed=1)
    with pytest.raises(ValueError, match=r"^v_scale: expected a positive finite scale"):
        _untouched(backend, kw, in_place, v_scale=torch.tensor(value))


def _bound(kw, backend):
    """The bound object of a make_cache_inputs case's split (the engine plugins' object)."""
    static = {k: kw[k] for k in ("q_weight", "k_weight", "q_bias", "k_bias", "eps", "is_neox", "mrope_section",
                                 "mrope_interleaved", "q_gate", "gemma_norm") if k in kw}
    return qkvfuse.QKNormRope(kw["num_q_heads"], kw["num_kv_heads"], kw["head_dim"], kw["cos_sin_cache"], **static,
                              backend=backend)


def test_plugins_write_without_views_as_inplace_cache(backend):
    """``QKNormRope._write_cache`` (the engine plugins' call: ``inplace_cache`` without the views) writes the bytes
    ``inplace_cache`` writes, and refuses a bad call with its error before writing anything."""
    kw = make_cache_inputs(CacheCase(_split(), layout="vec", block_size=32), seed=4)
    prep = _bound(kw, backend)
    cache_args = (kw["key_cache"], kw["value_cache"], kw["slot_mapping"])
    storage, qkv = kw["storage"], kw["qkv"]
    first_storage, first_qkv = storage.clone(), qkv.clone()
    prep.inplace_cache(qkv, kw["positions"], *cache_args, layout="vec")
    want_storage, want_qkv = storage.clone(), qkv.clone()
    storage.copy_(first_storage)
    qkv.copy_(first_qkv)
    assert prep._write_cache(qkv, kw["positions"], *cache_args, "vec", None, None, "nearest") is None
    assert torch.equal(storage, want_storage) and torch.equal(qkv.view(torch.int16), want_qkv.view(torch.int16))
    for bad in (qkv[:, :-2], qkv[0], "qkv"):
        with pytest.raises(Exception) as want:
            prep.inplace_cache(bad, kw["positions"], *cache_args, layout="vec")
        before = storage.clone()
        with pytest.raises(type(want.value)) as got:
            prep._write_cache(bad, kw["positions"], *cache_args, "vec", None, None, "nearest")
        assert str(got.value) == str(want.value) and torch.equal(storage, before)
    slots = kw["slot_mapping"].clone()
    slots[-1] = 3 * 32
    with pytest.raises(ValueError, match=r"^slot_mapping: expected values < 96 .* got 96"):
        prep._write_cache(qkv, kw["positions"], kw["key_cache"], kw["value_cache"], slots, "vec", None, None,
                          "nearest")


@pytest.mark.parametrize("layout", ["NHD", "HND", "vec"])
def test_cache_offsets_past_2_31_elements(backend, layout):
    """Caches whose second block starts past 2^31 elements (a block stride of 2^31 + 64 over one allocation whose
    untouched pages are never backed): an int32 block offset (block x stride) would wrap and write elsewhere.
    Every token to the far block, against the same call on compact caches."""
    case = _split(T=3, num_q_heads=2, num_kv_heads=1, head_dim=64, rotary_dim=64)
    kw = make_cache_inputs(CacheCase(case, layout=layout, num_blocks=2, block_size=4), seed=3)
    kw.pop("storage")
    block_size, D, stride = 4, 64, 2**31 + 64
    shape = (2, block_size, 1, D) if layout == "NHD" else (2, 1, block_size, D)  # vec: HND's index order
    strides = (stride, block_size * D if layout == "vec" else D, D, 1)  # vec: one region per block and head
    caches = []
    for _ in range(2):
        try:
            buf = torch.empty(stride + block_size * D, dtype=torch.bfloat16)
        except (RuntimeError, MemoryError) as exc:  # no address space for it
            pytest.skip(f"cannot reserve {stride + block_size * D} elements: {exc}")
        caches.append(buf.as_strided(shape, strides).fill_(float("nan")))
    compact = [torch.full(shape, float("nan"), dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.tensor([block_size + 2, block_size, block_size + 3])
    common = {k: v for k, v in kw.items() if k not in ("qkv", "key_cache", "value_cache", "slot_mapping")}
    qkv = kw["qkv"]
    want = qkvfuse.split_qkv_rmsnorm_rope_cache(qkv, **common, key_cache=compact[0], value_cache=compact[1],
                                                slot_mapping=slots, backend=backend)
    got = qkvfuse.split_qkv_rmsnorm_rope_cache(qkv, **common, key_cache=caches[0], value_cache=caches[1],
                                               slot_mapping=slots, backend=backend)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for far, near in zip(caches, compact):
        assert torch.equal(far.view(torch.int16), near.view(torch.int16)), "the far block's slots differ"
