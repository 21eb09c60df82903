"""Guard-page tensors: any out-of-bounds read or write by a kernel is a segmentation fault, not silent.

:func:`guarded_empty` places a tensor in its own anonymous ``mmap`` so that its last byte is directly followed
by an inaccessible (``PROT_NONE``) page (``align="end"``) or its first byte directly follows one
(``align="start"``). :func:`guarded_copy` does the same for a copy of an existing tensor, keeping its strides.
The mappings are never unmapped (a tensor may outlive any handle we could keep): use this in short-lived
processes, as ``tests/test_memory_safety.py`` does through ``python -m qkvfuse._verify.guarded BACKEND``,
which runs :data:`SPLIT_CASES`, :data:`NORM_CASES` and :data:`CACHE_CASES` (the cache-writing split, every KV-cache
layout with the first and last slot written) with every input, output and cache guarded and prints one JSON line
per case (a ``start`` line first, so a crash names the case it happened in).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import mmap
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["guarded_empty", "guarded_copy", "PAGE", "SPLIT_CASES", "NORM_CASES", "CACHE_CASES", "run_cases",
           "skip_reason"]

PAGE = mmap.PAGESIZE
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _span_elements(shape: Sequence[int], strides: Sequence[int]) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))


def guarded_empty(shape: Sequence[int], dtype: torch.dtype, strides: Optional[Sequence[int]] = None,
                  align: str = "end") -> torch.Tensor:
    """An uninitialised CPU tensor whose memory touches an inaccessible page.

    Parameters
    ----------
    shape, strides : sequence of int
        Strides in elements (non-negative; default: contiguous). The memory spanned is exactly what these
        strides reach, so a strided view ends at its last element, not at the end of a padded row.
    dtype : torch.dtype
    align : {"end", "start"}
        ``"end"``: the byte after the last element is a guard page; ``"start"``: the byte before the first
        element is. Both ends have a guard page; only one end can be flush unless the size is a page multiple.
    """
    shape = tuple(int(s) for s in shape)
    if strides is None:
        strides, acc = [], 1
        for size in reversed(shape):
            strides.insert(0, acc)
            acc *= max(size, 1)
    strides = tuple(int(s) for s in strides)
    if any(s < 0 for s in strides):
        raise ValueError(f"strides: expected non-negative strides, got {strides}")
    if align not in ("end", "start"):
        raise ValueError(f"align: expected 'end' or 'start', got {align!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = _span_elements(shape, strides) * itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    data_pages = -(-nbytes // PAGE)
    total = (data_pages + 2) * PAGE
    base = _libc.mmap(None, total, _PROT_RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap failed")
    for guard in (base, base + (data_pages + 1) * PAGE):
        if _libc.mprotect(guard, PAGE, _PROT_NONE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")
    start = base + PAGE if align == "start" else base + (data_pages + 1) * PAGE - nbytes
    buffer = (ctypes.c_char * nbytes).from_address(start)
    flat = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype)
    return flat.as_strided(shape, strides)


def guarded_copy(t: torch.Tensor, align: str = "end", row_pad: int = 0) -> torch.Tensor:
    """A guarded copy of ``t`` (same values and shape; 2-D tensors get rows ``row_pad`` elements apart
    beyond their width, so the copy is a strided view whose last row ends at the guard page)."""
    if t.dim() == 2 and t.shape[1] > 0:
        strides = (t.shape[1] + row_pad if t.stride(0) != 0 else 0, 1)
    else:
        strides = None
    out = guarded_empty(t.shape, t.dtype, strides, align)
    if strides is not None and strides[0] == 0:
        out[0].copy_(t[0])  # an expanded view: every row is the same memory
    else:
        out.copy_(t)
    return out


# --------------------------------------------------------------------------------------------------------
# Edge cases run under the guard (subprocess entry point below).
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GuardedSplit:
    name: str
    T: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    dtype: torch.dtype = torch.bfloat16
    mrope: Optional[str] = None  # None, "contiguous" or "interleaved"
    decode: bool = False  # mRoPE rows equal, as an expanded stride-0 view
    norm: bool = True
    bias: bool = False
    is_neox: bool = True
    row_pad: int = 0  # qkv and output rows further apart than their width
    pos_dtype: torch.dtype = torch.int64
    cache_dtype: torch.dtype = torch.float32
    max_position: int = 64
    inplace: bool = False
    q_gate: bool = False  # the gated layout (Qwen3-Next / Qwen3.5): four outputs, the in-place row rewritten
    gemma_norm: bool = False


SPLIT_CASES: Tuple[GuardedSplit, ...] = (
    GuardedSplit("T=1, 1 head each", 1, 1, 1, 64, 64),
    GuardedSplit("T=1, odd heads 3/1, D=80, partial R=40", 1, 3, 1, 80, 40, bias=True),
    GuardedSplit("odd heads 7/3, D=96, R=32, GPT-J, fp16", 5, 7, 3, 96, 32, torch.float16, is_neox=False),
    GuardedSplit("D=2, R=2", 3, 2, 1, 2, 2, torch.float32),
    GuardedSplit("D=192 partial, mRoPE contiguous", 4, 5, 1, 192, 96, mrope="contiguous"),
    GuardedSplit("D=512 full rotary, int32 positions", 2, 1, 1, 512, 512, torch.float32, pos_dtype=torch.int32),
    GuardedSplit("GLM-like 12/1 x 128, R=64, strided rows, bf16 cache", 17, 12, 1, 128, 64, bias=True, row_pad=24,
                 cache_dtype=torch.bfloat16),
    GuardedSplit("Qwen3-VL-like mRoPE interleaved, strided rows", 9, 4, 1, 128, 128, mrope="interleaved", row_pad=8),
    GuardedSplit("mRoPE decode (stride-0 rows), T=1", 1, 4, 2, 128, 128, mrope="interleaved", decode=True),
    GuardedSplit("no QK-norm, fp16, int32", 6, 3, 3, 64, 32, torch.float16, norm=False, pos_dtype=torch.int32),
    GuardedSplit("in place, odd heads, partial", 5, 3, 1, 80, 40, inplace=True, row_pad=16),
    GuardedSplit("in place mRoPE, T=1", 1, 2, 1, 128, 64, mrope="contiguous", inplace=True),
    GuardedSplit("T=33 many tokens, max_position 1", 33, 2, 1, 64, 64, max_position=1),
    GuardedSplit("gated Qwen3.5-like 4/1 x 256, R=64, mRoPE interleaved, Gemma, strided rows", 3, 4, 1, 256, 64,
                 mrope="interleaved", row_pad=8, q_gate=True, gemma_norm=True),
    GuardedSplit("gated T=1, 1/1 x 64, full rotary, fp32", 1, 1, 1, 64, 64, torch.float32, q_gate=True),
    GuardedSplit("gated in place 3/1 x 256, R=64, Gemma", 5, 3, 1, 256, 64, inplace=True, row_pad=16, q_gate=True,
                 gemma_norm=True),
    GuardedSplit("Gemma norms alone, 2/1 x 128, R=64", 4, 2, 1, 128, 64, gemma_norm=True),
)


@dataclasses.dataclass(frozen=True)
class GuardedNorm:
    name: str
    T: int
    H: int
    dtype: torch.dtype = torch.bfloat16
    residual: bool = True
    bias: bool = False
    row_pad: int = 0
    inplace: bool = False
    gemma_norm: bool = False


NORM_CASES: Tuple[GuardedNorm, ...] = (
    GuardedNorm("T=1, H=1", 1, 1),
    GuardedNorm("T=1, H=3, no residual", 1, 3, torch.float32, residual=False),
    GuardedNorm("H=80, bias", 7, 80, bias=True),
    GuardedNorm("H=4096 residual+bias", 3, 4096, bias=True),
    GuardedNorm("H=5120 fp16, strided rows", 5, 5120, torch.float16, row_pad=40),
    GuardedNorm("H=17 fp32, strided, no residual", 2, 17, torch.float32, residual=False, row_pad=3),
    GuardedNorm("in place, H=96", 4, 96, bias=True, inplace=True, row_pad=8),
    GuardedNorm("in place, no residual, H=33", 3, 33, torch.float16, residual=False, inplace=True),
    GuardedNorm("Gemma H=2048, strided rows", 3, 2048, row_pad=8, gemma_norm=True),
    GuardedNorm("Gemma in place, H=96", 4, 96, inplace=True, gemma_norm=True),
)


@dataclasses.dataclass(frozen=True)
class GuardedCache:
    """One call of the cache-writing split whose caches start (or end) at a guard page and whose slots include the
    cache's first and last: slot 0 writes each cache's first element, the last slot its last, in every layout."""

    name: str
    T: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    layout: str = "NHD"
    dtype: torch.dtype = torch.bfloat16
    cache_dtype: Optional[torch.dtype] = None  # None: qkv's dtype; FP8 with 0-d scales (guarded too)
    block_size: int = 16
    num_blocks: int = 3
    slots: str = "ends"  # "ends": slot 0, the last slot, the rest shuffled, one skip; "runs": the last T slots in
    #                      order (whole blocks: the tiled layouts' transposes), slot 0 for the first token
    slot_dtype: torch.dtype = torch.int64
    interleaved: bool = False  # K and V the halves of one buffer (vLLM-CPU's cache); else two mappings
    out: bool = False  # the out-of-place form: its outputs guarded too
    native_only: bool = False  # a size only the native CPU kernels run in a test's time (its streamed stores)


CACHE_CASES: Tuple[GuardedCache, ...] = (
    GuardedCache("NHD bf16, 2 KV heads x 128", 6, 2, 2, 128),
    GuardedCache("HND fp16, D=80, int32 slots", 5, 3, 1, 80, "HND", torch.float16, slot_dtype=torch.int32),
    GuardedCache("NHD fp32, D=52, block_size 1 (SGLang's pool)", 4, 2, 1, 52, dtype=torch.float32, block_size=1,
                 num_blocks=9),
    GuardedCache("vec bf16 interleaved (vLLM-CPU), runs", 40, 2, 2, 128, "vec", block_size=32, slots="runs",
                 interleaved=True),
    GuardedCache("vec fp16, D=52, runs", 21, 1, 1, 52, "vec", torch.float16, slots="runs"),
    GuardedCache("amx bf16 interleaved, runs", 40, 2, 2, 128, "amx", block_size=32, slots="runs", interleaved=True),
    GuardedCache("amx fp16, D=80", 7, 2, 1, 80, "amx", torch.float16),
    GuardedCache("vec FP8 e4m3, D=64", 9, 2, 2, 64, "vec", cache_dtype=torch.float8_e4m3fn, slots="runs"),
    GuardedCache("HND FP8 e5m2 interleaved", 5, 2, 1, 128, "HND", cache_dtype=torch.float8_e5m2, interleaved=True),
    GuardedCache("NHD bf16 out of place", 6, 3, 1, 128, out=True),
    GuardedCache("vec bf16 out of place, runs", 33, 2, 1, 128, "vec", block_size=32, slots="runs", out=True),
    GuardedCache("vec bf16 interleaved, 16 MiB written (streamed stores)", 4096, 1, 8, 128, "vec", block_size=32,
                 num_blocks=129, slots="runs", interleaved=True, native_only=True),
    GuardedCache("NHD bf16, 16 MiB written (streamed stores)", 4096, 1, 8, 128, block_size=16, num_blocks=257,
                 native_only=True),
)


def _split_inputs(case: GuardedSplit):
    """Plain inputs with positions at both ends of the table (rows 0 and max_position - 1)."""
    from .inputs import SplitCase, make_split_inputs

    sections = None
    if case.mrope:
        half = case.rotary_dim // 2
        s = half * 5 // 16
        sections = (half - 2 * s, s, s)
    sc = SplitCase(T=case.T, num_q_heads=case.num_q_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                   rotary_dim=case.rotary_dim, dtype=case.dtype, norm=case.norm, bias=case.bias, is_neox=case.is_neox,
                   mrope_section=sections, mrope_interleaved=case.mrope == "interleaved", image=not case.decode,
                   pos_dtype=case.pos_dtype, cache_dtype=case.cache_dtype, max_position=max(case.max_position, 2),
                   q_gate=case.q_gate, gemma_norm=case.gemma_norm)
    kw = make_split_inputs(sc, seed=case.T)
    last = case.max_position - 1
    kw["cos_sin_cache"] = kw["cos_sin_cache"][: case.max_position]
    ends = torch.tensor([last if i % 2 == 0 else 0 for i in range(case.T)], dtype=case.pos_dtype)
    if case.mrope is None:
        kw["positions"] = ends
    elif case.decode:
        kw["positions"] = ends.expand(3, case.T)
    else:
        kw["positions"] = torch.stack([ends, ends.flip(0), torch.full_like(ends, last)])
    return kw


def _guard_split(kw, align: str, row_pad: int):
    out = dict(kw)
    for name, t in kw.items():  # every tensor the case passes, whichever the split takes
        if isinstance(t, torch.Tensor):
            out[name] = guarded_copy(t, align, row_pad if name == "qkv" else 0)
    return out


def _run_split(case: GuardedSplit, backend: str, align: str) -> None:
    import qkvfuse

    kw = _split_inputs(case)
    hq, hkv, D = case.num_q_heads, case.num_kv_heads, case.head_dim
    expected = qkvfuse.split_qkv_rmsnorm_rope(**kw, backend=backend)
    guarded = _guard_split(kw, align, case.row_pad)
    if case.inplace:
        qkv = guarded.pop("qkv")
        got = qkvfuse.split_qkv_rmsnorm_rope_(qkv, **guarded, backend=backend)
    else:
        heads = (hq, hkv, hkv) + ((hq,) if case.q_gate else ())
        outs = tuple(guarded_empty((case.T, n * D), case.dtype, (n * D + case.row_pad, 1), align).fill_(float("nan"))
                     for n in heads)
        got = qkvfuse.split_qkv_rmsnorm_rope(**guarded, out=outs, backend=backend)
    assert len(got) == len(expected)
    for name, a, b in zip(("q", "k", "v", "gate"), got, expected):
        assert torch.equal(a, b), f"{name}: guarded result differs from the same call on ordinary memory"


def _run_norm(case: GuardedNorm, backend: str, align: str) -> None:
    import qkvfuse

    from .inputs import make_norm_inputs

    kw = make_norm_inputs(case.T, case.H, case.dtype, residual=case.residual, bias=case.bias, seed=case.H,
                          gemma_norm=case.gemma_norm)
    expected = qkvfuse.add_rmsnorm(**kw, backend=backend)
    x = guarded_copy(kw["x"], align, case.row_pad)
    residual = guarded_copy(kw["residual"], align, case.row_pad) if case.residual else None
    weight = guarded_copy(kw["weight"], align)
    bias = guarded_copy(kw["bias"], align) if case.bias else None
    if case.inplace:
        out = (x, residual)
    else:
        out = tuple(guarded_empty((case.T, case.H), case.dtype, (case.H + case.row_pad, 1), align).fill_(float("nan"))
                    for _ in range(2))
    y, r = qkvfuse.add_rmsnorm(x, residual, weight, kw["eps"], bias=bias, out=out, gemma_norm=case.gemma_norm,
                               backend=backend)
    assert torch.equal(y, expected[0]), "y: guarded result differs from the same call on ordinary memory"
    if case.residual:
        assert torch.equal(r, expected[1]), "residual_out: guarded result differs from ordinary memory"


def _cache_inputs(case: GuardedCache) -> Tuple[Dict[str, object], Dict[str, object]]:
    """``(split keyword arguments, cache keyword arguments)`` on ordinary memory; the caches poisoned."""
    from .inputs import SplitCase, make_split_inputs

    sc = SplitCase(T=case.T, num_q_heads=case.num_q_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                   rotary_dim=case.head_dim // 2, dtype=case.dtype, max_position=64)
    kw = make_split_inputs(sc, seed=case.T)
    nb, bs, H, D = case.num_blocks, case.block_size, case.num_kv_heads, case.head_dim
    dtype = case.cache_dtype or case.dtype
    cap = nb * bs
    g = torch.Generator().manual_seed(case.T)
    if case.slots == "runs":
        slots = torch.arange(cap - case.T, cap)
        slots[0] = 0
    else:
        slots = torch.randperm(cap - 2, generator=g)[: case.T] + 1
        slots[0], slots[-1] = 0, cap - 1
        slots[case.T // 2] = -1
    nhd = case.layout == "NHD"
    if case.interleaved:  # K and V the halves of one buffer along the token (NHD: head) dim
        whole = torch.empty((nb, bs, 2 * H, D) if nhd else (nb, H, 2 * bs, D), dtype=dtype)
        whole.view(torch.uint8).fill_(0xA5)
        key, value = whole.chunk(2, dim=2)
    else:
        shape = (nb, bs, H, D) if nhd else (nb, H, bs, D)  # HND, vec, amx: one contiguous region per block, head
        key, value = (torch.empty(shape, dtype=dtype) for _ in range(2))
        for c in (key, value):
            c.view(torch.uint8).fill_(0xA5)
    cache_kw: Dict[str, object] = dict(key_cache=key, value_cache=value, slot_mapping=slots.to(case.slot_dtype),
                                       layout=case.layout)
    if dtype.itemsize == 1:
        cache_kw.update(k_scale=torch.tensor(0.05), v_scale=torch.tensor(0.07))
    return kw, cache_kw


def _guard_caches(cache_kw: Dict[str, object], align: str) -> Dict[str, object]:
    """The caches in guarded memory (an interleaved pair as one guarded buffer, K and V its halves again)."""
    out = dict(cache_kw)
    key, value = cache_kw["key_cache"], cache_kw["value_cache"]
    if key.untyped_storage().data_ptr() == value.untyped_storage().data_ptr():
        base = key._base if key._base is not None else key
        whole = guarded_empty(base.shape, base.dtype, align=align)
        whole.view(torch.uint8).copy_(base.view(torch.uint8))
        out["key_cache"] = whole.as_strided(key.shape, key.stride(), key.storage_offset())
        out["value_cache"] = whole.as_strided(value.shape, value.stride(), value.storage_offset())
    else:
        for name in ("key_cache", "value_cache"):
            c = cache_kw[name]
            out[name] = guarded_empty(c.shape, c.dtype, align=align)
            out[name].view(torch.uint8).copy_(c.view(torch.uint8))
    for name in ("slot_mapping", "k_scale", "v_scale"):
        if name in cache_kw:
            out[name] = guarded_copy(cache_kw[name], align)
    return out


def _cache_bytes(cache_kw: Dict[str, object]) -> List[torch.Tensor]:
    return [cache_kw[n].view(torch.uint8) for n in ("key_cache", "value_cache")]


def _run_cache(case: GuardedCache, backend: str, align: str) -> None:
    import qkvfuse

    kw, cache_kw = _cache_inputs(case)
    guarded = _guard_split(kw, align, 0)
    guarded_caches = _guard_caches(cache_kw, align)
    if case.out:
        expected = qkvfuse.split_qkv_rmsnorm_rope_cache(**kw, **cache_kw, backend=backend)
        heads = (case.num_q_heads, case.num_kv_heads, case.num_kv_heads)
        outs = tuple(guarded_empty((case.T, n * case.head_dim), case.dtype, align=align).fill_(float("nan"))
                     for n in heads)
        got = qkvfuse.split_qkv_rmsnorm_rope_cache(**guarded, **guarded_caches, out=outs, backend=backend)
    else:
        qkv = kw.pop("qkv")
        expected = qkvfuse.split_qkv_rmsnorm_rope_cache_(qkv, **kw, **cache_kw, backend=backend)
        gqkv = guarded.pop("qkv")
        got = qkvfuse.split_qkv_rmsnorm_rope_cache_(gqkv, **guarded, **guarded_caches, backend=backend)
    for name, a, b in zip(("q", "k", "v"), got, expected):
        assert torch.equal(a, b), f"{name}: guarded result differs from the same call on ordinary memory"
    for name, a, b in zip(("key_cache", "value_cache"), _cache_bytes(guarded_caches), _cache_bytes(cache_kw)):
        assert torch.equal(a, b), f"{name}: guarded cache bytes differ from the same call on ordinary memory"


def skip_reason(case_id: str, backend: str) -> Optional[str]:
    """Why :func:`run_cases` does not run this case for ``backend`` (None: it does)."""
    op, _, name = case_id.split("/", 2)
    if op == "cache" and backend != "cpu" and any(c.native_only and c.name == name for c in CACHE_CASES):
        return "a size for the native CPU kernels' streamed stores (the Triton interpreter would take minutes)"
    return None


def case_ids() -> List[str]:
    """Names of every (op, alignment, case) run by :func:`run_cases`, in order."""
    return [f"{op}/{align}/{c.name}" for align in ("end", "start")
            for op, cases in (("split", SPLIT_CASES), ("add_rmsnorm", NORM_CASES), ("cache", CACHE_CASES))
            for c in cases]


def run_cases(backend: str) -> Dict[str, Tuple[bool, str]]:
    """Run every guarded case for ``backend``, printing a JSON ``start`` line before and a result line after each."""
    results = {}
    for align in ("end", "start"):
        for op, cases, runner in (("split", SPLIT_CASES, _run_split), ("add_rmsnorm", NORM_CASES, _run_norm),
                                  ("cache", CACHE_CASES, _run_cache)):
            for case in cases:
                name = f"{op}/{align}/{case.name}"
                if skip_reason(name, backend):
                    continue
                print(json.dumps({"start": name}), flush=True)
                try:
                    runner(case, backend, align)
                    ok, detail = True, ""
                except Exception as exc:  # noqa: BLE001 -- reported per case; a crash is what we are after
                    ok, detail = False, f"{type(exc).__name__}: {exc}"
                results[name] = (ok, detail)
                print(json.dumps({"name": name, "ok": ok, "detail": detail}), flush=True)
    return results


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m qkvfuse._verify.guarded BACKEND", file=sys.stderr)
        sys.exit(2)
    run_cases(sys.argv[1])
