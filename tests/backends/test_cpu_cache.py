"""The native CPU kernel of the cache-writing split (``split_qkv_rmsnorm_rope_cache``), on the build this process
loaded (``make test`` runs the CPU suite once per capability the machine supports).

* ``qkv`` gets exactly the native in-place split's bits, every split mode included (gated, mRoPE, partial rotary,
  GPT-J, no norm, biases, Gemma weights);
* a cache of qkv's dtype holds the K and V bits that land in ``qkv``: the in-place split followed by a plain
  indexed copy, written here per layout with its own index arithmetic;
* an FP8 cache holds :func:`qkvfuse.reference.quantize` of the fp32 K and of V: bit for bit where the kernel's
  fp32 K is known to be the reference's (V always; K without a norm at the rotation's identity, whose values pass
  through exactly), otherwise within one FP8 step -- the kernel quantises its own fp32 K (the generic head's, before
  the bf16/fp16 rounding), which may differ from the reference's fp32 K by an fp32 rounding, and a value next to a
  rounding boundary of FP8 then lands on its other side;
* every byte of the caches' storage the call does not write (other slots, skipped tokens, padding, the other half
  of an interleaved K/V buffer) keeps its poison;
* repeated slots store the last of their tokens, whichever threads run them; a bad slot or scale raises before
  anything is written; T = 0 writes nothing;
* the C++ argument rules raise the Python rules' exception types and messages.
"""

import os

import pytest
import torch

import qkvfuse
from qkvfuse import reference
from qkvfuse._cache_mode import encode_cache
from qkvfuse._library import split_config
from qkvfuse._verify import SplitCase, make_split_inputs
from qkvfuse.backends import available_backends

REASON = available_backends()["cpu"]
if REASON and "cpu" in os.environ.get("QKVFUSE_REQUIRE_BACKENDS", "").split(","):
    pytest.fail(f"backend 'cpu' is required but unavailable: {REASON}", pytrace=False)
pytestmark = pytest.mark.skipif(bool(REASON), reason=f"cpu backend unavailable: {REASON}")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
POISON = 0xFF  # every byte: a NaN in each float format the caches use


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _size_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def make_caches(layout, dtype, nb, bs, H, D, padded=False, interleaved=False):
    """``(storage, key_cache, value_cache)``: poisoned uint8 storage and the two cache views over it. padded: NHD/HND
    views of a wider buffer (strided blocks, heads and rows); interleaved: K and V the two halves of one buffer
    (vLLM-CPU's ``kv_cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)``; NHD: ``[nb, bs, 2 * H, D]``)."""
    es = _size_of(dtype)
    if interleaved:
        shape = (nb, bs, 2 * H, D) if layout == "NHD" else (nb, H, 2 * bs, D)
        storage = torch.full((nb * bs * 2 * H * D * es,), POISON, dtype=torch.uint8)
        key, value = storage.view(dtype).view(shape).chunk(2, dim=2)
        return storage, key, value
    pad = 2 if padded else 0
    shape = (nb, bs + pad, H + pad, D + pad) if layout == "NHD" else (nb, H + pad, bs + pad, D + pad)
    if layout in ("vec", "amx"):
        shape = (nb, H + pad, bs, D)  # a contiguous (bs, D) region per block and head; padded: spare heads
    numel = 1
    for n in shape:
        numel *= n
    storage = torch.full((2 * numel * es,), POISON, dtype=torch.uint8)
    flat = storage.view(dtype)
    views = []
    for part in (flat[:numel], flat[numel:]):
        whole = part.view(shape)
        views.append(whole[:, :bs, :H, :D] if layout == "NHD" else whole[:, :H, :bs, :D])
    return storage, views[0], views[1]


def _region_index(layout, is_key, bs, D, off, d):
    """Element index of (offset, dim) inside a (block, head) region of the vLLM-CPU layouts."""
    if layout == "vec":
        return d * bs + off if is_key else off * D + d
    if is_key:  # amx K: [bs / 16, D / 2, 16, 2]
        return (off // 16) * 16 * D + (d // 2) * 32 + (off % 16) * 2 + d % 2
    return (d // 16) * 16 * bs + (off // 2) * 32 + (d % 16) * 2 + off % 2  # amx V: [D / 16, bs / 2, 16, 2]


def store_expected(cache, layout, is_key, slots, rows):
    """rows ``[T, H, D]`` (the cache's dtype) into ``cache`` (a view sharing the expected storage), token by token in
    order (a repeated slot keeps the last token's row); slots: the first min(T, S) entries, negative skipped."""
    c = _bits(cache)
    r = _bits(rows)
    bs = cache.shape[1] if layout == "NHD" else cache.shape[2]
    H, D = r.shape[1], r.shape[2]
    d = torch.arange(D)
    for t in range(min(r.shape[0], slots.shape[0])):
        s = int(slots[t])
        if s < 0:
            continue
        blk, off = divmod(s, bs)
        if layout == "NHD":
            c[blk, off] = r[t]
        elif layout == "HND":
            c[blk, :, off] = r[t]
        else:
            for h in range(H):
                region = c[blk, h].reshape(-1)  # contiguous: a view
                assert region.data_ptr() == c[blk, h].data_ptr()
                region[_region_index(layout, is_key, bs, D, off, d)] = r[t, h]


def _slots(kind, T, capacity, dtype, seed, blocks=1):
    """A permutation of the slots (kind "permutation"), with every third token skipped ("skips"), cut to half the
    tokens ("short"), five slots shared by all tokens ("repeats"), or runs of consecutive slots ("runs": the tiled
    layouts' transposed stores)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(capacity, generator=g)[:T]
    if kind == "skips":
        slots[::3] = -1
    elif kind == "short":
        slots = slots[: T // 2]
    elif kind == "repeats":  # few distinct slots, each taken by several tokens
        slots = torch.randint(0, 5, (T,), generator=g)
        slots[::4] = -1
    elif kind == "runs":  # a prefill's: blocks of a shuffled table filled in order from a mid-block start, one skip
        bs = capacity // blocks
        t = torch.arange(T) + 3
        slots = torch.randperm(blocks, generator=g)[t // bs] * bs + t % bs
        slots[T // 2] = -1
    return slots.to(dtype)


def _split_kwargs(kw):
    return {k: v for k, v in kw.items() if k != "qkv"}


def run_case(case, layout="NHD", cache_dtype=None, rounding="nearest", slots="skips", slot_dtype=torch.int64,
             padded=False, interleaved=False, nb=5, bs=16, seed=0, kw=None, scales=(0.05, 0.07)):
    """One call of the native op against the in-place split and the indexed copy (or the reference quantisation);
    returns the K positions whose FP8 bytes differ from the reference's (each within one step)."""
    kw = kw or make_split_inputs(case, seed=seed)
    dtype = cache_dtype or case.dtype
    H, D, T = case.num_kv_heads, case.head_dim, case.T
    storage, key, value = make_caches(layout, dtype, nb, bs, H, D, padded, interleaved)
    slot_mapping = _slots(slots, T, nb * bs, slot_dtype, seed + 1, nb)
    extra = {}
    if dtype in FP8:
        extra = dict(k_scale=torch.tensor(scales[0]), v_scale=torch.tensor(scales[1]))
    qkv = kw["qkv"].clone()
    want_qkv = kw["qkv"].clone()
    qkvfuse.split_qkv_rmsnorm_rope_(want_qkv, **_split_kwargs(kw), backend="cpu")
    expected = storage.clone()
    qkvfuse.split_qkv_rmsnorm_rope_cache_(qkv, **_split_kwargs(kw), key_cache=key, value_cache=value,
                                          slot_mapping=slot_mapping, layout=layout, fp8_rounding=rounding,
                                          backend="cpu", **extra)
    assert torch.equal(_bits(qkv), _bits(want_qkv)), "qkv differs from the native in-place split"

    hq = case.num_q_heads * (2 if case.q_gate else 1)
    k_rows = want_qkv[:, hq * D : (hq + H) * D].reshape(T, H, D)
    v_rows = want_qkv[:, (hq + H) * D :].reshape(T, H, D)
    if dtype in FP8:
        truncate = rounding == "truncate"
        _, k32, _, _ = reference._split_fp32(kw["qkv"], kw["positions"], split_config(**kw))
        k_rows = reference.quantize(k32, dtype, extra["k_scale"], truncate)
        v_rows = reference.quantize(v_rows.float(), dtype, extra["v_scale"], truncate)
    flat = expected.view(dtype)
    ek = flat.as_strided(key.shape, key.stride(), key.storage_offset())
    ev = flat.as_strided(value.shape, value.stride(), value.storage_offset())
    store_expected(ek, layout, True, slot_mapping, k_rows)
    store_expected(ev, layout, False, slot_mapping, v_rows)
    differ = (storage != expected).nonzero().flatten()
    if dtype not in FP8 or differ.numel() == 0:
        assert differ.numel() == 0, f"{differ.numel()} cache bytes differ (first at byte {int(differ[0])})"
        return 0
    # FP8 K may sit one step from the reference's where the fp32 values differ; only K bytes may differ.
    marked = torch.zeros_like(storage)
    marked.view(dtype).as_strided(key.shape, key.stride(), key.storage_offset()).view(torch.uint8).fill_(1)
    assert bool(marked.bool()[differ].all()), "FP8 V or untouched bytes differ"
    got, want = storage[differ].view(dtype).float(), expected[differ].view(dtype).float()
    step = (got - want).abs()
    # One FP8 step at the larger of the two magnitudes (e4m3: 2**-3 relative, e5m2: 2**-2; denormal steps below).
    mant = 3 if dtype == torch.float8_e4m3fn else 2
    tiny = 2.0 ** (-9 if dtype == torch.float8_e4m3fn else -16)
    bound = torch.maximum(got.abs(), want.abs()).clamp_min(tiny)
    one_step = torch.maximum(2.0 ** torch.floor(torch.log2(bound)) * 2.0 ** -mant, torch.tensor(tiny))
    assert bool((step <= one_step).all()), f"FP8 K more than one step from the reference: {step.max()}"
    return differ.numel()


BF16 = SplitCase(T=41, num_q_heads=4, num_kv_heads=2, head_dim=128, rotary_dim=128, dtype=torch.bfloat16)


@pytest.mark.parametrize("layout", ["NHD", "HND", "vec", "amx"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32, *FP8],
                         ids=["bf16", "fp16", "fp32", "e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["nearest", "truncate"])
def test_every_layout_and_cache_dtype(layout, cache_dtype, rounding):
    if layout == "amx" and _size_of(cache_dtype) != 2:
        pytest.skip("amx caches are 16-bit")
    if cache_dtype not in FP8 and rounding == "truncate":
        pytest.skip("the rounding is an FP8 cache's")
    dtype = cache_dtype if cache_dtype not in FP8 else torch.bfloat16
    case = SplitCase(T=41, num_q_heads=4, num_kv_heads=2, head_dim=128, rotary_dim=128, dtype=dtype)
    run_case(case, layout, cache_dtype, rounding, padded=layout != "amx")


SPLIT_MODES = {
    "gated-gemma": SplitCase(T=19, num_q_heads=3, num_kv_heads=1, head_dim=256, rotary_dim=64, q_gate=True,
                             gemma_norm=True),
    "mrope-interleaved": SplitCase(T=23, num_q_heads=4, num_kv_heads=2, head_dim=128, rotary_dim=128,
                                   mrope_section=(24, 20, 20), mrope_interleaved=True, dtype=torch.float16),
    "partial-gptj-bias": SplitCase(T=17, num_q_heads=2, num_kv_heads=2, head_dim=64, rotary_dim=32, is_neox=False,
                                   bias=True),
    "no-norm": SplitCase(T=21, num_q_heads=4, num_kv_heads=2, head_dim=128, rotary_dim=64, norm=False),
    "odd-dims-fp32": SplitCase(T=9, num_q_heads=3, num_kv_heads=3, head_dim=48, rotary_dim=18,
                               dtype=torch.float32, row_pad=5),
}


@pytest.mark.parametrize("mode", list(SPLIT_MODES))
@pytest.mark.parametrize("cache", ["same", "e4m3"])
def test_split_modes(mode, cache):
    case = SPLIT_MODES[mode]
    run_case(case, "HND", None if cache == "same" else torch.float8_e4m3fn, slots="short")
    if cache == "same" and case.head_dim % 16 == 0 and case.dtype != torch.float32:
        run_case(case, "amx", slots="skips")


@pytest.mark.parametrize("layout, head_dim, dtype", [
    ("vec", 128, torch.bfloat16), ("vec", 80, torch.float16), ("vec", 52, torch.float32), ("vec", 52, torch.bfloat16),
    ("amx", 128, torch.bfloat16), ("amx", 80, torch.float16)])
def test_tiled_layouts_consecutive_slots(layout, head_dim, dtype):
    """Runs of consecutive slots in a block (a prefill's): the tiled layouts' K transposes of whole runs of up to 16
    tokens and of partial ones, head_dims whose columns are not a whole number of the ISA's blocks."""
    case = SplitCase(T=45, num_q_heads=2, num_kv_heads=2, head_dim=head_dim, rotary_dim=head_dim, dtype=dtype)
    run_case(case, layout, slots="runs", nb=4, bs=32)


@pytest.mark.parametrize("slots", ["skips", "short", "repeats"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_slot_mappings(slots, slot_dtype):
    run_case(BF16, "NHD", slots=slots, slot_dtype=slot_dtype)
    run_case(BF16, "vec", torch.float8_e5m2, slots=slots, slot_dtype=slot_dtype)


def _with_threads(n, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


def test_repeated_slots_keep_the_last_token_on_every_thread_split():
    """A batch large enough to run on several threads, every slot taken by many tokens: each holds the last
    token's row (store_expected writes in token order), as on one thread."""
    case = SplitCase(T=512, num_q_heads=8, num_kv_heads=2, head_dim=128, rotary_dim=128)
    for threads in (1, 2):
        _with_threads(threads, lambda: run_case(case, "HND", slots="repeats", nb=2))
        _with_threads(threads, lambda: run_case(case, "amx", slots="repeats", nb=2))


@pytest.mark.parametrize("layout", ["NHD", "vec", "amx"])
def test_interleaved_kv_buffer(layout):
    cache_dtypes = [None] if layout == "amx" else [None, torch.float8_e4m3fn]
    for cache_dtype in cache_dtypes:
        run_case(BF16, layout, cache_dtype, interleaved=True)


def test_large_batch_on_threads():
    """Qwen3-8B's per-rank geometry at T = 300: the specialised heads and the parallel split."""
    case = SplitCase(T=300, num_q_heads=32, num_kv_heads=8, head_dim=128, rotary_dim=128)
    for layout in ("NHD", "vec"):
        _with_threads(2, lambda: run_case(case, layout, nb=20))
    _with_threads(2, lambda: run_case(case, "HND", torch.float8_e4m3fn, nb=20))


@pytest.mark.parametrize("layout", ["NHD", "HND", "vec"])
def test_streamed_cache_rows(layout):
    """A call writing 16 MiB to its caches streams its contiguous rows (non-temporal stores on AVX2 / AVX-512
    builds, where a row starts on a 32-byte boundary): the same bytes; padded rows (unaligned) take plain copies."""
    case = SplitCase(T=1024, num_q_heads=1, num_kv_heads=16, head_dim=256, rotary_dim=64)
    assert 2 * case.T * case.num_kv_heads * case.head_dim * 2 >= 16 << 20
    _with_threads(2, lambda: run_case(case, layout, slots="permutation", nb=66, padded=layout != "vec"))
    if layout == "NHD":
        _with_threads(2, lambda: run_case(case, layout, slots="skips", nb=66))


# ----------------------------------------------------------------------------------------------------------------
# FP8 bit for bit: inputs whose fp32 K is known exactly (no norm, position 0 -- cos 1, sin 0 -- and the special
# values past the rotary pair), so the kernel's stored bytes are reference.quantize's for the same fp32 values.
# ----------------------------------------------------------------------------------------------------------------
def _special_values(n, gen, fmax):
    """fp32 values around every rounding case: random bit patterns over the whole range, ties and neighbours of
    FP8 values, the saturation bound, denormals of both formats, zeros, infinities and NaNs."""
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (n // 2,), generator=gen, dtype=torch.int64).to(torch.int32)
    random_bits = bits.view(torch.float32)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    fp8_values = torch.cat([grid.view(torch.float8_e4m3fn).float(), grid.view(torch.float8_e5m2).float()])
    fp8_values = fp8_values[torch.isfinite(fp8_values)]
    ties = (fp8_values[:-1] + fp8_values[1:]) / 2
    nudge = torch.cat([fp8_values * (1 + 2.0 ** -20), fp8_values * (1 - 2.0 ** -20), ties, ties * (1 + 2.0 ** -23)])
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), fmax, -fmax,
                             fmax * 1.01, 1e-45, -1e-45, 3e-39, 2.0 ** -10, 2.0 ** -17, 1e38, -1e38])
    values = torch.cat([random_bits, fp8_values, nudge, specials])
    scaled = torch.cat([values, values * 16, values / 16])
    return scaled[torch.randperm(scaled.numel(), generator=gen)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-qkv", "bf16-qkv"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["nearest", "truncate"])
def test_fp8_bits_match_quantize(dtype, cache_dtype, rounding):
    H, D, T = 2, 64, 96
    case = SplitCase(T=T, num_q_heads=1, num_kv_heads=H, head_dim=D, rotary_dim=2, dtype=dtype, norm=False)
    kw = make_split_inputs(case, seed=7)
    gen = torch.Generator().manual_seed(11)
    fmax = 448.0 if cache_dtype == torch.float8_e4m3fn else 57344.0
    values = _special_values(T * 2 * H * D, gen, fmax)
    rows = values[: T * 2 * H * D].reshape(T, 2 * H, D).to(dtype)
    rows[:, :H, :2] = 1.0  # the rotary pair of each K head: finite (the rotation at position 0 is exact there)
    qkv = kw["qkv"]
    qkv[:, D:] = rows.reshape(T, 2 * H * D)
    kw["positions"] = torch.zeros(T, dtype=torch.int64)
    for scales in ((0.05, 3.0), (1.0, 1.0), (7e-3, 2.0 ** -7)):
        assert run_case(case, "NHD", cache_dtype, rounding, slots="permutation", nb=8, bs=16, kw=kw,
                        scales=scales) == 0


# ----------------------------------------------------------------------------------------------------------------
# Refusals: before anything is written, with the Python rules' types and messages.
# ----------------------------------------------------------------------------------------------------------------
def _call_args(case=BF16, layout="NHD", cache_dtype=torch.bfloat16, seed=0):
    kw = make_split_inputs(case, seed=seed)
    storage, key, value = make_caches(layout, cache_dtype, 3, 16, case.num_kv_heads, case.head_dim)
    slots = torch.arange(case.T, dtype=torch.int64) % 48
    return kw, storage, key, value, slots


def _raw(namespace, kw, key, value, slots, code, k_scale=None, v_scale=None):
    op = getattr(torch.ops, namespace).split_qkv_rmsnorm_rope_cache
    op(kw["qkv"], kw["positions"], *split_config(**kw).schema_args(), key, value, slots, code, k_scale, v_scale)


def _outcome(namespace, build):
    kw, storage, key, value, slots, code, scales = build()
    try:
        _raw(namespace, kw, key, value, slots, code, *scales)
    except Exception as exc:  # the rule's type and message
        return type(exc), str(exc).splitlines()[0]
    return None


def _bad(**change):
    def build():
        kw, storage, key, value, slots = _call_args()
        fields = dict(kw=kw, storage=storage, key=key, value=value, slots=slots, code=encode_cache("NHD"), scales=())
        for name, fn in change.items():
            fields[name] = fn(fields)
        return (fields["kw"], fields["storage"], fields["key"], fields["value"], fields["slots"], fields["code"],
                fields["scales"])
    return build


def _fp8_caches(f):
    _, key, value = make_caches("NHD", torch.float8_e4m3fn, 3, 16, 2, 128)
    return key, value


BAD = {
    "cache_mode": _bad(code=lambda f: 37),
    "cache_mode-negative": _bad(code=lambda f: -1),
    "key-dtype": _bad(key=lambda f: f["key"].view(torch.int16)),
    "value-dtype": _bad(value=lambda f: f["value"].view(torch.float16)),
    "key-3d": _bad(key=lambda f: f["key"][0]),
    "value-shape": _bad(value=lambda f: f["value"][:2]),
    "heads": _bad(key=lambda f: f["key"][:, :, :1], value=lambda f: f["value"][:, :, :1]),
    "amx-block": _bad(code=lambda f: encode_cache("amx"), key=lambda f: f["key"][:, :8].transpose(1, 2),
                      value=lambda f: f["value"][:, :8].transpose(1, 2)),
    "vec-strides": _bad(code=lambda f: encode_cache("vec"), key=lambda f: f["key"].transpose(1, 2),
                        value=lambda f: f["value"].transpose(1, 2)),
    "zero-stride": _bad(key=lambda f: f["key"][:, :1].expand(3, 16, 2, 128)),
    "slot-dtype": _bad(slots=lambda f: f["slots"].float()),
    "slot-2d": _bad(slots=lambda f: f["slots"].reshape(1, -1)),
    "scale-not-fp8": _bad(scales=lambda f: (torch.tensor(1.0), None)),
    "scale-missing": _bad(key=lambda f: _fp8_caches(f)[0], value=lambda f: _fp8_caches(f)[1],
                          scales=lambda f: (None, torch.tensor(1.0))),
    "scale-dtype": _bad(key=lambda f: _fp8_caches(f)[0], value=lambda f: _fp8_caches(f)[1],
                        scales=lambda f: (torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0))),
    "scale-shape": _bad(key=lambda f: _fp8_caches(f)[0], value=lambda f: _fp8_caches(f)[1],
                        scales=lambda f: (torch.ones(2), torch.tensor(1.0))),
    "kv-overlap": _bad(value=lambda f: f["key"]),
    "kv-overlap-shifted": _bad(value=lambda f: f["storage"].view(torch.bfloat16)[1 : 1 + f["key"].numel()].view(
        f["key"].shape)),
    "cache-is-qkv": _bad(key=lambda f: f["kw"]["qkv"].view(-1)[: 3 * 16 * 2 * 128].view(3, 16, 2, 128)),
    "cache-is-weight": _bad(value=lambda f: f["kw"]["k_weight"].view(torch.bfloat16)[:128].view(1, 1, 1, 128).expand(
        1, 1, 1, 128).as_strided((3, 16, 2, 128), (0, 0, 0, 1))),
    "slot-too-large": _bad(slots=lambda f: torch.tensor([0] * 40 + [48])),
    "slot-too-large-int32": _bad(slots=lambda f: torch.tensor([5, 2 ** 31 - 1] + [0] * 39, dtype=torch.int32)),
    "scale-zero": _bad(key=lambda f: _fp8_caches(f)[0], value=lambda f: _fp8_caches(f)[1],
                       scales=lambda f: (torch.tensor(0.0), torch.tensor(1.0))),
    "scale-negative-small": _bad(key=lambda f: _fp8_caches(f)[0], value=lambda f: _fp8_caches(f)[1],
                                 scales=lambda f: (torch.tensor(1.0), torch.tensor(-1e-5))),
    "scale-nan": _bad(key=lambda f: _fp8_caches(f)[0], value=lambda f: _fp8_caches(f)[1],
                      scales=lambda f: (torch.tensor(float("nan")), torch.tensor(1.0))),
    "scale-inf": _bad(key=lambda f: _fp8_caches(f)[0], value=lambda f: _fp8_caches(f)[1],
                      scales=lambda f: (torch.tensor(1.0), torch.tensor(float("inf")))),
    "scale-denormal": _bad(key=lambda f: _fp8_caches(f)[0], value=lambda f: _fp8_caches(f)[1],
                           scales=lambda f: (torch.tensor(-1e-45), torch.tensor(1.0))),
    "positions-before-slots": _bad(slots=lambda f: torch.tensor([99] * 41),
                                   kw=lambda f: dict(f["kw"], positions=f["kw"]["positions"] + 10 ** 6)),
}


@pytest.mark.parametrize("name", list(BAD))
def test_refusals_match_the_python_rules(name):
    want = _outcome("qkvfuse_reference", BAD[name])
    got = _outcome("qkvfuse", BAD[name])
    assert want is not None, "the case is not refused by the reference"
    assert got == want


@pytest.mark.parametrize("bad", ["slot", "scale"])
def test_bad_values_raise_before_anything_is_written(bad):
    kw, storage, key, value, slots = _call_args(cache_dtype=torch.float8_e5m2)
    scales = [torch.tensor(1.0), torch.tensor(1.0)]
    if bad == "slot":
        slots[-1] = 48
    else:
        scales[1] = torch.tensor(-2.0)
    qkv_before, storage_before = kw["qkv"].clone(), storage.clone()
    with pytest.raises(ValueError, match="slot_mapping" if bad == "slot" else "v_scale"):
        _raw("qkvfuse", kw, key, value, slots, encode_cache("NHD"), *scales)
    assert torch.equal(_bits(kw["qkv"]), _bits(qkv_before)) and torch.equal(storage, storage_before)


def test_no_tokens_write_nothing():
    case = SplitCase(T=0, num_q_heads=4, num_kv_heads=2, head_dim=128, rotary_dim=128)
    kw, storage, key, value, _ = _call_args(case)
    before = storage.clone()
    _raw("qkvfuse", kw, key, value, torch.tensor([5, 6]), encode_cache("NHD"))
    assert torch.equal(storage, before)
