"""Triton's cache-writing split kernel (``backends/triton/cache_kernels.py``) against the reference.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (``tests/conftest.py``), small shapes. Every cache lives in a
uint8 storage poisoned byte by byte and the whole storage is compared, so a byte written where it should not be
(another slot, a skipped token, padding, the other half of an interleaved K/V buffer) fails like a wrong value.
What is expected:

* ``qkv``: the bits of Triton's own in-place split (:func:`qkvfuse.split_qkv_rmsnorm_rope_`);
* a cache of ``qkv``'s dtype: :func:`qkvfuse.reference.write_cache` of that ``qkv``'s K and V, byte for byte;
* an FP8 cache: ``reference.quantize`` of the kernel's fp32 K -- byte for byte with an fp32 ``qkv`` (which holds
  that fp32 K exactly) -- and of V always byte for byte; with a 16-bit ``qkv`` the kernel's fp32 K may differ
  from the reference backend's in its last bits (sums of squares in another order), so K bytes may be one FP8
  code apart from the reference backend's (adjacent codes: one ulp), V bytes not.
"""

import itertools
import os

import pytest
import torch

import qkvfuse
from qkvfuse import reference
from qkvfuse._cache_mode import LAYOUTS, NHD, encode_cache, is_fp8
from qkvfuse._library import CacheTarget, inplace_views, split_config
from qkvfuse._verify import SplitCase, make_split_inputs
from qkvfuse.backends import available_backends

if available_backends()["triton"]:  # a reason: unavailable (a failure where CI requires the backend)
    if "triton" in os.environ.get("QKVFUSE_REQUIRE_BACKENDS", "").split(","):
        pytest.fail(f"triton backend required but unavailable: {available_backends()['triton']}", pytrace=False)
    pytest.skip(f"triton backend unavailable: {available_backends()['triton']}", allow_module_level=True)

from qkvfuse.backends.triton import cache as cache_launch  # noqa: E402
from qkvfuse.backends.triton import cache_kernels, launch  # noqa: E402

POISON = 0xA5
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _device_blocks(monkeypatch, max_gated_q=256):
    """The device's block sizes with a small tile (several programs per token block: heads straddle blocks)."""
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "GPU_SPLIT_TILE", 128)
    monkeypatch.setattr(launch, "GPU_MAX_GATED_Q", max_gated_q)


def _caches(layout: str, dtype, heads: int, dim: int, num_blocks: int = 3, block_size: int = 16,
            storage: str = "separate"):
    """``(storage, key_cache, value_cache)``: uint8 storage filled with :data:`POISON` and the two cache views.

    ``storage``: ``"separate"`` (two dense halves), ``"interleaved"`` (one buffer chunked on dim 2, as vLLM-CPU's
    ``kv_cache`` and FlashInfer's interleaved KV: K and V alternate), ``"padded"`` (NHD/HND: heads and dims
    strided inside wider blocks).
    """
    es = torch.empty((), dtype=dtype).element_size()
    nhd = LAYOUTS[layout] == NHD
    if storage == "interleaved":
        shape = (num_blocks, block_size, 2 * heads, dim) if nhd else (num_blocks, heads, 2 * block_size, dim)
        buf = torch.full((num_blocks * block_size * heads * dim * 2 * es,), POISON, dtype=torch.uint8)
        key, value = buf.view(dtype).view(shape).chunk(2, dim=2)
        return buf, key, value
    pad = 3 if storage == "padded" else 0
    shape = (num_blocks, block_size, heads + pad, dim + 2 * pad) if nhd else (num_blocks, heads + pad, block_size,
                                                                              dim + 2 * pad)
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    buf = torch.full((2 * numel * es,), POISON, dtype=torch.uint8)
    halves = buf.view(dtype).chunk(2)
    views = [h.view(shape)[:, :, :heads, :dim] if nhd else h.view(shape)[:, :heads, :, :dim] for h in halves]
    return buf, views[0], views[1]


def _scales(dtype):
    return (torch.tensor(0.043), torch.tensor(0.31)) if is_fp8(dtype) else (None, None)


def _byte_mask(buf: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """Which bytes of ``buf`` the tensor ``view`` (a view of it) covers."""
    u8 = view.view(torch.uint8)
    idx = torch.arange(buf.numel()).as_strided(u8.shape, u8.stride(), u8.storage_offset())
    mask = torch.zeros(buf.numel(), dtype=torch.bool)
    mask[idx.flatten()] = True
    return mask


def _run_triton(kwargs, key, value, slots, layout, rounding, scales):
    qkv = kwargs["qkv"].clone()
    qkvfuse.split_qkv_rmsnorm_rope_cache_(**dict(kwargs, qkv=qkv), key_cache=key, value_cache=value,
                                          slot_mapping=slots, layout=layout, fp8_rounding=rounding,
                                          k_scale=scales[0], v_scale=scales[1], backend="triton")
    return qkv


def _written_from(qkv, kwargs, target):
    """``target`` after ``reference.write_cache`` of the K and V in ``qkv`` (a post-split, in-place row)."""
    T, hq, hkv, D = qkv.shape[0], kwargs["num_q_heads"], kwargs["num_kv_heads"], kwargs["head_dim"]
    _, k, v = inplace_views(qkv, hq, hkv, kwargs.get("q_gate", False))[:3]
    reference.write_cache(k.float().reshape(T, hkv, D), v.reshape(T, hkv, D), target)


def _check(kwargs, layout, cache_dtype, rounding="nearest", storage="separate", slots=None, num_blocks=3,
           block_size=16):
    """One call on the Triton backend judged as the module docstring says."""
    hkv, D = kwargs["num_kv_heads"], kwargs["head_dim"]
    T = kwargs["qkv"].shape[0]
    if slots is None:  # distinct slots in every block, one token skipped
        slots = torch.randperm(num_blocks * block_size)[:T]
        slots[T // 2] = -1
    scales = _scales(cache_dtype)
    buf, key, value = _caches(layout, cache_dtype, hkv, D, num_blocks, block_size, storage)
    qkv = _run_triton(kwargs, key, value, slots, layout, rounding, scales)

    split = kwargs["qkv"].clone()
    qkvfuse.split_qkv_rmsnorm_rope_(**dict(kwargs, qkv=split), backend="triton")
    assert torch.equal(qkv.view(torch.uint8), split.view(torch.uint8)), "qkv differs from the in-place split"

    want_buf, want_key, want_value = _caches(layout, cache_dtype, hkv, D, num_blocks, block_size, storage)
    code = encode_cache(layout, rounding)
    exact = not is_fp8(cache_dtype) or qkv.dtype == torch.float32
    if exact:
        _written_from(qkv, kwargs, CacheTarget(want_key, want_value, slots, code, *scales))
        bad = (buf != want_buf).nonzero().flatten()
        assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at {bad[:8].tolist()}"
        return buf
    # 16-bit qkv, FP8 cache: the reference backend's fp32 K may differ in its last bits from the kernel's.
    reference_kwargs = dict(kwargs, qkv=kwargs["qkv"].clone(), backend="reference")
    qkvfuse.split_qkv_rmsnorm_rope_cache_(**reference_kwargs, key_cache=want_key, value_cache=want_value,
                                          slot_mapping=slots, layout=layout, fp8_rounding=rounding,
                                          k_scale=scales[0], v_scale=scales[1])
    diff = (buf.int() - want_buf.int()).abs()
    in_key = _byte_mask(buf, key)
    assert int(diff[~in_key].max()) == 0, "V or untouched bytes differ"
    assert int(diff[in_key].max()) <= 1, "K more than one FP8 code from the reference"
    assert int((diff != 0).sum()) <= max(2, diff.numel() // 100), int((diff != 0).sum())
    return buf


def _case(**changes):
    fields = dict(T=7, num_q_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=32, bias=True)
    fields.update(changes)
    return make_split_inputs(SplitCase(**fields))


CACHE_DTYPES = {"bf16": (torch.bfloat16, None), "fp32": (torch.float32, None), "e4m3": (torch.bfloat16, FP8[0]),
                "e5m2": (torch.bfloat16, FP8[1]), "e4m3-fp32qkv": (torch.float32, FP8[0])}


def _layout_cases():
    turn = itertools.count()
    for layout in LAYOUTS:
        for name, (dtype, fp8) in CACHE_DTYPES.items():
            if layout == "amx" and (fp8 is not None or dtype == torch.float32):
                continue  # amx: 16-bit caches only
            for rounding in ("nearest", "truncate"):
                if fp8 is None and rounding == "truncate":
                    continue  # the rounding is FP8's
                storages = ("separate", "interleaved") + (("padded",) if layout in ("NHD", "HND") else ())
                yield pytest.param(layout, name, rounding, storages[next(turn) % len(storages)],
                                   id=f"{layout}-{name}-{rounding}")


@pytest.mark.parametrize("layout,cache_name,rounding,storage", list(_layout_cases()))
def test_layout_dtype_rounding(layout, cache_name, rounding, storage):
    """Every layout x cache dtype x FP8 rounding; storages rotate over separate / interleaved / padded."""
    dtype, fp8 = CACHE_DTYPES[cache_name]
    _check(_case(dtype=dtype), layout, fp8 or dtype, rounding, storage)


@pytest.mark.parametrize("layout,storage", [("NHD", "padded"), ("HND", "interleaved"), ("vec", "interleaved"),
                                            ("amx", "separate")])
def test_device_blocks_every_layout(monkeypatch, layout, storage):
    """Several KV programs per token block (device blocks, small tile): each writes only its heads' rows."""
    _device_blocks(monkeypatch)
    kwargs = _case(T=3, num_q_heads=6, num_kv_heads=3, head_dim=64, rotary_dim=32, is_neox=False)
    _check(kwargs, layout, torch.bfloat16, storage=storage)
    if layout != "amx":
        _check(kwargs, layout, torch.float8_e4m3fn, "truncate", storage)


@pytest.mark.parametrize("scheme", ["whole-q-region", "scratch"])
@pytest.mark.parametrize("cache", ["bf16", "e4m3"])
def test_gated_mrope_partial_rotary(monkeypatch, scheme, cache):
    """Gated Q/gate (Gemma weights), interleaved mRoPE over a partial rotary dim: the in-place de-interleave is
    the split's (one program per token block owns the whole Q/gate region, or the scratch buffer for wider
    regions) and the K/V caches are right."""
    _device_blocks(monkeypatch, 1 << 12 if scheme == "whole-q-region" else 1)
    kwargs = _case(T=3, num_q_heads=3, num_kv_heads=1, head_dim=64, rotary_dim=32, mrope_section=(6, 5, 5),
                   mrope_interleaved=True, q_gate=True, gemma_norm=True, dtype=torch.bfloat16)
    cfg = launch.split_config(3, 3, 1, 64, whole_q_region=True)
    assert (cfg["Q_HEADS"] >= 3) == (scheme == "whole-q-region")
    _check(kwargs, "NHD", torch.bfloat16 if cache == "bf16" else torch.float8_e4m3fn)
    _check(kwargs, "HND", torch.bfloat16 if cache == "bf16" else torch.float8_e4m3fn, storage="interleaved")


def test_mrope_contiguous_without_norm_strided_slots():
    """Contiguous mRoPE without norm weights; slot_mapping a strided view (int32, a column of a wider table)."""
    kwargs = _case(T=6, num_q_heads=2, num_kv_heads=2, head_dim=32, rotary_dim=16, mrope_section=(4, 2, 2),
                   norm=False, dtype=torch.float32)
    table = torch.full((6, 3), -7, dtype=torch.int32)
    table[:, 1] = torch.tensor([40, 3, -1, 17, 0, 33])
    _check(kwargs, "NHD", torch.float32, slots=table[:, 1])
    _check(kwargs, "vec", torch.float8_e5m2, slots=table[:, 1])


def _launch(kwargs, key, value, slots, layout, rounding="nearest"):
    """The launcher called directly (no validation, no host value check): what runs on a device and under graph
    capture. Returns the new qkv."""
    qkv = kwargs["qkv"].clone()
    config = split_config(**kwargs)._replace(inplace=True)
    views = inplace_views(qkv, kwargs["num_q_heads"], kwargs["num_kv_heads"], kwargs.get("q_gate", False))
    target = CacheTarget(key, value, slots, encode_cache(layout, rounding), *_scales(key.dtype))
    cache_launch.split_qkv_rmsnorm_rope_cache(qkv, kwargs["positions"], config, *views[:3],
                                              views[3] if len(views) == 4 else None, target)
    return qkv


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("layout", ["NHD", "amx"])
def test_bad_and_short_slots_are_skipped_in_kernel(slot_dtype, layout):
    """Negative slots, slots at or past the capacity (the host check is skipped on devices) and tokens past the
    end of a short slot_mapping write nothing; the others are written. Through the public op on CPU tensors an
    out-of-range slot is an error naming slot_mapping, raised before anything is written."""
    kwargs = _case(T=9, head_dim=32)
    capacity = 3 * 16
    info = torch.iinfo(slot_dtype)
    slots = torch.tensor([5, -1, capacity, 47, info.max, info.min, 0, 20], dtype=slot_dtype)  # 8 < T = 9
    buf, key, value = _caches(layout, torch.bfloat16, 2, 32)
    qkv = _launch(kwargs, key, value, slots, layout)
    split = kwargs["qkv"].clone()
    qkvfuse.split_qkv_rmsnorm_rope_(**dict(kwargs, qkv=split), backend="triton")
    assert torch.equal(qkv, split)
    want_buf, want_key, want_value = _caches(layout, torch.bfloat16, 2, 32)
    kept = torch.where((slots >= 0) & (slots < capacity), slots, -1)
    _written_from(qkv, kwargs, CacheTarget(want_key, want_value, kept, encode_cache(layout)))
    assert torch.equal(buf, want_buf)
    assert int((buf != POISON).sum()) == 4 * 2 * 2 * 32 * 2  # four tokens kept, K and V, two heads, bf16 bytes

    untouched = buf.clone()
    _launch(kwargs, key, value, slots[:0], layout)  # no slots: nothing written
    assert torch.equal(buf, untouched)
    with pytest.raises(ValueError, match="slot_mapping"):
        _run_triton(kwargs, key, value, slots, layout, "nearest", (None, None))
    assert torch.equal(buf, untouched)


def test_fp8_saturates_and_keeps_nan():
    """Values beyond the format's range saturate to its largest finite code (never inf); a NaN input stays NaN
    in the cache (an fp32 qkv keeps the kernel's fp32 K, so every byte is compared with reference.quantize)."""
    kwargs = _case(T=4, dtype=torch.float32, norm=False, bias=False)
    qkv = kwargs["qkv"]
    qkv[:, 4 * 32:] *= 1e4  # K and V far above 448 * scale
    qkv[1, 4 * 32 + 3] = float("nan")
    qkv[2, 6 * 32 + 5] = float("nan")  # V
    for dtype in FP8:
        for rounding in ("nearest", "truncate"):
            buf = _check(kwargs, "HND", dtype, rounding, slots=torch.tensor([0, 1, 2, 3]))
            values = buf.view(dtype).float()
            assert bool(values.isnan().any()) and not bool(values.isinf().any())


def _fp8_probe_values() -> torch.Tensor:
    """Random magnitudes over many octaves, every finite FP8 value of both formats, the midpoints between
    neighbours and the fp32 values on either side of each midpoint, and the special values."""
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(4000, generator=g) * torch.exp(torch.randn(4000, generator=g) * 6)]
    for dtype in FP8:
        values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        values = values[values.isfinite()].sort().values
        mids = ((values[1:].double() + values[:-1].double()) / 2).float()
        parts += [values, mids, torch.nextafter(mids, torch.tensor(float("inf"))),
                  torch.nextafter(mids, torch.tensor(-float("inf")))]
    parts.append(torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -1e-45,
                               1e-40, 3e38, 448.1, 464.0, 57344.0, 61440.0, 1e6]))
    return torch.cat(parts)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # numpy, on the inf / 3e38 probes
@pytest.mark.parametrize("truncate", [False, True], ids=["nearest", "truncate"])
def test_fp8_encoding_matches_reference_quantize(truncate):
    """The in-kernel FP8 encoding (integer operations on the fp32 bits) gives reference.quantize's bytes: ties
    to even, subnormals, saturation, NaN with its sign, -0, truncation toward zero."""
    x = _fp8_probe_values()
    block = 1 << (x.numel() - 1).bit_length()
    for dtype, code in zip(FP8, (cache_kernels.E4M3, cache_kernels.E5M2)):
        for scale in (1.0, 0.37, 3.0):
            s = torch.tensor(scale)
            out = torch.empty(x.shape, dtype=torch.uint8)
            cache_kernels.fp8_kernel[(1,)](x, s, out, x.numel(), FP8=code, TRUNCATE=truncate, BLOCK=block)
            want = reference.quantize(x, dtype, s, truncate).view(torch.uint8)
            bad = (out != want).nonzero().flatten()
            assert bad.numel() == 0, (dtype, scale, x[bad[:5]].tolist(), out[bad[:5]].tolist(),
                                      want[bad[:5]].tolist())


def test_one_launch_no_reference_write(monkeypatch):
    """The launcher is one kernel launch (no second pass through the reference writer)."""
    launches = []
    kernel = cache_kernels.split_qkv_rmsnorm_rope_cache_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(launch, "split_qkv_rmsnorm_rope_cache_kernel", Counting())
    monkeypatch.setattr(reference, "write_cache", None)
    _, key, value = _caches("NHD", torch.bfloat16, 2, 32)
    _launch(_case(T=3), key, value, torch.tensor([0, 1, 2]), "NHD")
    assert len(launches) == 1


def test_cache_offsets_past_2_31_elements():
    """A cache of more than 2^31 elements (FP8, 2.1 GB each, never touched but at the written slots: the
    allocation is virtual): slots near its end land at their int64 offsets (int32 arithmetic would wrap, as the
    interpreter's does), nothing else changes."""
    heads, dim, block_size = 1, 64, 16
    num_blocks = (1 << 31) // (block_size * heads * dim) + 2
    try:
        key = torch.empty((num_blocks, block_size, heads, dim), dtype=torch.uint8)
        value = torch.empty_like(key)
    except RuntimeError as exc:  # pragma: no cover - depends on the machine's overcommit policy
        pytest.skip(f"cannot reserve two 2.1 GB caches: {exc}")
    capacity = num_blocks * block_size
    slots = torch.tensor([capacity - 1, 0, capacity - block_size - 3], dtype=torch.int64)
    tail = slice((num_blocks - 3) * block_size * dim, None)
    for c in (key, value):
        c.view(-1)[tail] = POISON
        c.view(-1)[: block_size * dim] = POISON
    kwargs = _case(T=3, num_q_heads=2, num_kv_heads=1, head_dim=dim, rotary_dim=dim, dtype=torch.float32)
    e4m3 = torch.float8_e4m3fn
    qkv = _launch(kwargs, key.view(e4m3), value.view(e4m3), slots, "NHD")
    _, k, v = inplace_views(qkv, 2, 1)
    k_scale, v_scale = _scales(e4m3)
    for c, rows, scale in ((key, k, k_scale), (value, v, v_scale)):
        want = reference.quantize(rows.float(), e4m3, scale, False).view(torch.uint8)
        flat = c.view(-1)
        for t, slot in enumerate(slots.tolist()):
            assert torch.equal(flat[slot * dim:(slot + 1) * dim], want[t]), (t, slot)
            flat[slot * dim:(slot + 1) * dim] = POISON
        for part in (tail, slice(0, block_size * dim)):
            assert bool((flat[part] == POISON).all())  # nothing else written


def test_device_script_dry_run(capsys):
    """``qkvfuse_bench.cache_device`` (bench/device-check.sh's cache step) at small sizes on CPU tensors: the
    correctness rows pass and every section runs (the GPU run's code cannot rot)."""
    from qkvfuse_bench import cache_device

    assert cache_device.main(["--device", "cpu", "--tokens", "8", "--large-T", "8"]) == 0
    text = capsys.readouterr().out
    assert "FAIL" not in text and "replay" in text and "copy_ same bytes" in text
