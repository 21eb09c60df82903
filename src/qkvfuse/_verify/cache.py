"""Checks of the cache-writing split (:func:`qkvfuse.split_qkv_rmsnorm_rope_cache_`, its out-of-place form
:func:`qkvfuse.split_qkv_rmsnorm_rope_cache` and their bound forms) on any backend.

:func:`check_cache_case` runs one :class:`CacheCase` -- fresh random inputs, caches (and given outputs) poisoned
before the call -- and raises ``AssertionError`` with a readable detail when the backend is wrong:

* in place, ``qkv`` holds exactly the bits :func:`qkvfuse.split_qkv_rmsnorm_rope_` gives on the same backend;
  out of place, ``qkv`` is unchanged and the outputs hold exactly the bits of
  :func:`qkvfuse.split_qkv_rmsnorm_rope`;
* a cache of ``qkv``'s dtype holds, at each written slot, exactly the K and V bits the split gave that token -- a
  plain indexed copy, computed here by per-token index arithmetic written independently of the backends' (the
  layouts of :mod:`qkvfuse._cache_mode`);
* an FP8 cache holds K and V judged against the float64 oracle divided by the scale: within half an FP8 ulp
  (``"nearest"``) or below it in magnitude by less than one ulp (``"truncate"``), plus the accuracy rule's fp32
  allowance over the head, saturation to the format's largest finite value exact, never inf or NaN from a finite
  input;
* every other byte of the caches' storage -- other slots, skipped tokens (negative slot, past the end of
  ``slot_mapping``), padding, the other half of an interleaved K/V buffer -- is unchanged.

``tests/test_cache.py`` runs the cases on every backend; ``python -m qkvfuse verify`` runs :data:`VERIFY_CASES`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

import qkvfuse

from .._cache_mode import AMX, FP8_MAX, HND, LAYOUTS, NHD, VEC, is_fp8
from ..testing.accuracy import FP32_ALLOWANCE, ulp
from ..testing.oracle import oracle_split
from .inputs import SplitCase, make_split_inputs

__all__ = ["CacheCase", "make_cache_inputs", "check_cache_case", "slot_offsets", "VERIFY_CASES"]



@dataclasses.dataclass(frozen=True)
class CacheCase:
    """One configuration of the cache-writing split: the split's :class:`SplitCase` and the cache's."""

    split: SplitCase
    layout: str = "NHD"
    cache_dtype: Optional[torch.dtype] = None  # None: the split's dtype
    rounding: str = "nearest"
    num_blocks: int = 3
    block_size: int = 16
    slots: str = "shuffled"  # shuffled | short (fewer slots than tokens) | skips (negative slots) | saturate
    interleaved: bool = False  # K and V the two halves of one buffer (vLLM-CPU's kv_cache.chunk(2, dim=2))
    padded: bool = False  # NHD/HND: caches as views of a wider buffer (strided blocks and heads)

    @property
    def dtype(self) -> torch.dtype:
        return self.cache_dtype or self.split.dtype


def _fresh_cache(case: CacheCase, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(storage, key_cache, value_cache)``: poisoned uint8 storage (0xA5 repeated, never a value the op writes
    for every byte) and the two cache views over it."""
    s = case.split
    nb, bs, H, D = case.num_blocks, case.block_size, s.num_kv_heads, s.head_dim
    es = torch.empty((), dtype=case.dtype).element_size()
    layout = LAYOUTS[case.layout]
    if layout in (VEC, AMX) or case.interleaved:
        # vLLM-CPU's kv_cache [nb, H, bs, 2*D] viewed [nb, H, 2*bs, D], chunked on dim 2 (NHD: [nb, bs, 2*H, D]).
        shape = (nb, bs, 2 * H, D) if layout == NHD else (nb, H, 2 * bs, D)
        storage = torch.full((nb * H * bs * 2 * D * es,), 0xA5, dtype=torch.uint8, device=device)
        whole = storage.view(case.dtype).view(shape)
        key, value = whole.chunk(2, dim=2)
        return storage, key, value
    pad = 3 if case.padded else 0
    shape = (nb, bs, H + pad, D + 2 * pad) if layout == NHD else (nb, H + pad, bs, D + 2 * pad)
    numel = nb * bs * (H + pad) * (D + 2 * pad)
    storage = torch.full((2 * numel * es,), 0xA5, dtype=torch.uint8, device=device)
    flat = storage.view(case.dtype)
    key = flat[:numel].view(shape)[..., :H, :D] if layout == NHD else flat[:numel].view(shape)[:, :H, :, :D]
    value = flat[numel:].view(shape)[..., :H, :D] if layout == NHD else flat[numel:].view(shape)[:, :H, :, :D]
    return storage, key, value


def _slots(case: CacheCase, g: torch.Generator) -> torch.Tensor:
    T, capacity = case.split.T, case.num_blocks * case.block_size
    slots = torch.randperm(capacity, generator=g)[:T]
    if case.slots == "short":
        slots = slots[: T // 2]
    elif case.slots == "skips":
        slots[::3] = -1
    return slots


def make_cache_inputs(case: CacheCase, seed: int = 0, device="cpu") -> Dict[str, object]:
    """Keyword arguments for :func:`qkvfuse.split_qkv_rmsnorm_rope_cache_` (without ``backend``), plus
    ``storage``: the caches' poisoned uint8 storage."""
    kw = make_split_inputs(case.split, seed, device)
    g = torch.Generator().manual_seed(seed + 1)
    storage, key, value = _fresh_cache(case, device)
    kw.update(key_cache=key, value_cache=value, slot_mapping=_slots(case, g).to(device), layout=case.layout,
              fp8_rounding=case.rounding, storage=storage)
    if is_fp8(case.dtype):
        # Scales that put the values well inside the format; "saturate" pushes most of them past its largest (K
        # values past 1/2, V past 1, whatever the format's range).
        bound = FP8_MAX[case.dtype]
        k_scale, v_scale = (0.5 / bound, 1.0 / bound) if case.slots == "saturate" else (0.05, 0.07)
        kw.update(k_scale=torch.tensor(k_scale, device=device), v_scale=torch.tensor(v_scale, device=device))
    return kw


def _region_index(layout: int, is_key: bool, bs: int, D: int, offset: int, d: torch.Tensor) -> torch.Tensor:
    if layout == VEC:
        return d * bs + offset if is_key else offset * D + d
    if is_key:  # AMX K: tiles of 16 tokens, dim pairs innermost
        return (offset // 16) * 16 * D + (d // 2) * 32 + (offset % 16) * 2 + d % 2
    return (d // 16) * 16 * bs + (offset // 2) * 32 + (d % 16) * 2 + offset % 2  # AMX V: tiles of 16 dims


def slot_offsets(layout: int, cache: torch.Tensor, is_key: bool, block: int, offset: int) -> torch.Tensor:
    """Storage element offsets ``[Hkv, D]`` of one slot's K (``is_key``) or V rows in a 4-D ``cache`` of
    ``layout``: each layout's index arithmetic written out per element (independent of the kernels')."""
    s, base = cache.stride(), cache.storage_offset()
    if layout == NHD:
        _, _, H, D = cache.shape
        h, d = torch.arange(H)[:, None], torch.arange(D)[None, :]
        return base + block * s[0] + offset * s[1] + h * s[2] + d * s[3]
    _, H, bs, D = cache.shape
    h, d = torch.arange(H)[:, None], torch.arange(D)[None, :]
    if layout == HND:
        return base + block * s[0] + h * s[1] + offset * s[2] + d * s[3]
    return base + block * s[0] + h * s[1] + _region_index(layout, is_key, bs, D, offset, d)


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (NaN payloads compare equal)."""
    return t.contiguous().view(_INTS[t.element_size()])


def _fp8_errors(name: str, stored: torch.Tensor, oracle: torch.Tensor, dtype: torch.dtype, truncate: bool) -> str:
    """'' when FP8 ``stored`` (as float64, ``[H, D]``) is ``oracle`` (float64, already divided by the scale) rounded
    by the rule; else a detail.

    On top of the rounding rule each element may be off by the split's own fp32 error, which the accuracy rule
    bounds relative to the head's largest magnitude (``FP32_ALLOWANCE``), not to the element: a rotated value that
    nearly cancels carries the absolute error of its terms, and a small scale magnifies it past an FP8 rounding
    boundary (the fuzz suite found one: an e5m2 K element of 7.4e-6 at scale 1e-3, 0.09 ulp from a boundary)."""
    bound = FP8_MAX[dtype]
    if not torch.isfinite(stored).all():
        return f"{name}: inf or NaN stored from finite input"
    target = oracle.clamp(-bound, bound)
    saturated = oracle.abs() >= bound
    if not torch.equal(stored[saturated], target[saturated]):
        return f"{name}: saturation not exact ({int(saturated.sum())} saturated values)"
    slack = FP32_ALLOWANCE * oracle.abs().amax(dim=-1, keepdim=True)
    spacing = ulp(target, dtype)
    err = stored - target
    if truncate:
        # Same sign (or zero) and |stored| <= |target| < |stored| + ulp.
        away = (err * target.sign()) > slack
        short = (target.abs() - stored.abs()) >= spacing + slack
        bad = away | short
    else:
        bad = err.abs() > 0.5 * spacing + slack
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        return (f"{name}: {int(bad.sum())} values off the {'truncating' if truncate else 'nearest'} FP8 rounding "
                f"(e.g. stored {float(stored.flatten()[i])} for {float(target.flatten()[i])})")
    return ""


# check_cache_case's forms: the public in-place function, its bound form, the out-of-place function (into poisoned
# out= tensors) and its bound form (fresh outputs).
FORMS = ("inplace", "bound", "out", "bound_out")


def check_cache_case(backend: str, case: CacheCase, seed: int = 0, device="cpu", form: str = "inplace") -> None:
    """Run ``case`` on ``backend`` in one of :data:`FORMS` and judge every byte of ``qkv``, of the outputs and of
    the caches' storage (module docstring)."""
    assert form in FORMS, form
    kw = make_cache_inputs(case, seed, device)
    storage = kw.pop("storage")
    before = storage.clone()
    qkv = kw.pop("qkv")
    split_kw = {k: v for k, v in kw.items() if k not in ("key_cache", "value_cache", "slot_mapping", "layout",
                                                          "k_scale", "v_scale", "fp8_rounding")}
    cache_kw = {k: kw[k] for k in ("key_cache", "value_cache", "slot_mapping", "k_scale", "v_scale") if k in kw}
    cache_kw.update(layout=case.layout, fp8_rounding=case.rounding)
    got = qkv.clone()
    prep = None
    if form.startswith("bound"):
        statics = {k: v for k, v in split_kw.items() if k not in ("positions", "num_q_heads", "num_kv_heads",
                                                                  "head_dim", "cos_sin_cache")}
        prep = qkvfuse.QKNormRope(split_kw["num_q_heads"], split_kw["num_kv_heads"], split_kw["head_dim"],
                                  split_kw["cos_sin_cache"], **statics, backend=backend)
    if form in ("inplace", "bound"):
        want = qkv.clone()
        qkvfuse.split_qkv_rmsnorm_rope_(want, **split_kw, backend=backend)
        if prep is not None:
            outs = prep.inplace_cache(got, kw["positions"], **cache_kw)
        else:
            outs = qkvfuse.split_qkv_rmsnorm_rope_cache_(got, **kw, backend=backend)
        assert torch.equal(_bits(got), _bits(want)), "qkv differs from split_qkv_rmsnorm_rope_ on the same backend"
        assert all(v.data_ptr() >= got.data_ptr() for v in outs)
    else:
        want = qkvfuse.split_qkv_rmsnorm_rope(qkv, **split_kw, backend=backend)
        if prep is not None:
            outs = prep.with_cache(got, kw["positions"], **cache_kw)
        else:
            poisoned = tuple(torch.full_like(t, float("nan")) for t in want)
            outs = qkvfuse.split_qkv_rmsnorm_rope_cache(got, **kw, out=poisoned, backend=backend)
            assert all(o is p for o, p in zip(outs, poisoned)), "out= returned other tensors than it was given"
        assert torch.equal(_bits(got), _bits(qkv)), "the out-of-place form wrote to qkv"
        assert len(outs) == len(want) and all(torch.equal(_bits(o), _bits(w)) for o, w in zip(outs, want)), (
            "outputs differ from split_qkv_rmsnorm_rope on the same backend")

    s = case.split
    T, H, D = s.T, s.num_kv_heads, s.head_dim
    layout, dtype, truncate = LAYOUTS[case.layout], case.dtype, case.rounding == "truncate"
    slots = kw["slot_mapping"].cpu().tolist()
    key_cache, value_cache = kw["key_cache"], kw["value_cache"]
    q_region = (2 if s.q_gate else 1) * s.num_q_heads * D
    k_rows = outs[1].reshape(T, H, D).cpu()
    v_rows = outs[2].reshape(T, H, D).cpu()
    fp8 = is_fp8(dtype)
    if fp8:
        oracle = oracle_split(qkv, **{k: v for k, v in split_kw.items()})
        k_oracle = oracle[1].reshape(T, H, D).cpu() / float(kw["k_scale"])
        v_oracle = qkv[:, q_region + H * D : q_region + 2 * H * D].reshape(T, H, D).cpu().double() / float(
            kw["v_scale"])
    after = storage.cpu()
    es = torch.empty((), dtype=dtype).element_size()
    written = torch.zeros(after.numel() // es, dtype=torch.bool)
    elems = after.view(_INTS[es])
    for t, slot in enumerate(slots[:T]):
        if slot < 0:
            continue
        block, offset = divmod(slot, case.block_size)
        for is_key, cache, rows in ((True, key_cache, k_rows), (False, value_cache, v_rows)):
            idx = slot_offsets(layout, cache.cpu(), is_key, block, offset)
            name = f"{'K' if is_key else 'V'} of token {t} (slot {slot})"
            assert not written[idx].any(), f"{name}: the case has duplicate slots"
            written[idx] = True
            stored = elems[idx]
            if not fp8:
                want_bits = _bits(rows[t])
                assert torch.equal(stored, want_bits), f"{name}: cache bits differ from the token's bits in qkv"
            else:
                values = stored.view(torch.uint8).view(dtype).double()
                detail = _fp8_errors(name, values, (k_oracle if is_key else v_oracle)[t], dtype, truncate)
                assert not detail, detail
    untouched = ~written
    assert torch.equal(elems[untouched], before.cpu().view(elems.dtype)[untouched]), (
        f"{int((elems[untouched] != before.cpu().view(elems.dtype)[untouched]).sum())} cache elements changed "
        "outside the written slots")


def _case(layout: str, dtype=torch.bfloat16, cache_dtype=None, **changes) -> CacheCase:
    fields = dict(T=13, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, dtype=dtype, bias=True,
                  max_position=64)
    fields.update(changes.pop("split", {}))
    return CacheCase(SplitCase(**fields), layout=layout, cache_dtype=cache_dtype, **changes)


# What `python -m qkvfuse verify` runs per backend: each layout, each cache dtype family, both roundings.
VERIFY_CASES = (
    ("NHD bf16", _case("NHD")),
    ("HND bf16 padded", _case("HND", padded=True)),
    ("vec bf16 interleaved", _case("vec")),
    ("amx bf16 interleaved", _case("amx")),
    ("NHD fp32 short slots", _case("NHD", torch.float32, slots="short")),
    ("NHD e4m3 nearest", _case("NHD", cache_dtype=torch.float8_e4m3fn, slots="skips")),
    ("vec e4m3 truncate", _case("vec", cache_dtype=torch.float8_e4m3fn, rounding="truncate")),
    ("HND e5m2 saturated", _case("HND", cache_dtype=torch.float8_e5m2, slots="saturate")),
    ("NHD gated mRoPE", _case("NHD", split=dict(q_gate=True, gemma_norm=True, bias=False, mrope_section=(6, 5, 5),
                                                 mrope_interleaved=True))),
)
