"""The shared conformance suite: every backend against the float64 oracle under the accuracy rule.

Outputs are NaN-poisoned before each call and every element is checked (``qkvfuse.testing.accuracy``).
Shapes stay small so the Triton interpreter runs the same matrix in CI.
"""

import itertools

import pytest
import torch

import qkvfuse
from _support.cases import run_split_case
from qkvfuse._verify import (SplitCase, check_norm_outputs, make_norm_inputs, make_split_inputs,
                             oracle_add_rmsnorm, poisoned_like, unfused_add_rmsnorm)
from qkvfuse.presets import get_preset

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def mrope_sections(rotary_dim: int):
    half = rotary_dim // 2
    s_hw = half * 5 // 16
    return (half - 2 * s_hw, s_hw, s_hw)


def _matrix():
    """A covering matrix: every value of every axis appears, crossed over the axes that interact."""
    cases = []
    geometry = [(64, 4, 4), (80, 2, 1), (96, 6, 2), (128, 4, 1), (256, 2, 2)]  # head_dim, Hq, Hkv
    cycle = itertools.count()
    for (D, hq, hkv), r_kind, mode, is_neox in itertools.product(geometry, ("full", "half", "32"),
                                                                 ("rope", "mrope", "mrope_interleaved"),
                                                                 (True, False)):
        i = next(cycle)
        R = {"full": D, "half": D // 2, "32": 32}[r_kind]
        section = None if mode == "rope" else mrope_sections(R)
        cases.append(SplitCase(
            T=(0, 1, 7, 64)[i % 4] if i % 9 else 5, num_q_heads=hq, num_kv_heads=hkv, head_dim=D, rotary_dim=R,
            dtype=DTYPES[i % 3], norm=(i % 5) != 0, bias=(i % 5) in (2, 4), is_neox=is_neox,
            mrope_section=section, mrope_interleaved=mode == "mrope_interleaved", image=(i % 7) != 0,
            pos_dtype=(torch.int64, torch.int32)[i % 2], cache_dtype=(torch.float32, torch.bfloat16)[(i // 3) % 2],
            weight_dtype=(None, "io")[(i // 2) % 2], row_pad=(0, 16)[(i // 4) % 2],
        ))
    return cases


def _resolve(case: SplitCase) -> SplitCase:
    import dataclasses
    return dataclasses.replace(case, weight_dtype=case.dtype) if case.weight_dtype == "io" else case


CASES = [_resolve(c) for c in _matrix()]

# The gated attention of Qwen3-Next / Qwen3.5 (their full-attention layers): q_gate, Gemma QK-norm, head_dim 256,
# NeoX rotary 64 (Qwen3.5: interleaved mRoPE [11, 11, 10]). Each preset at its own head counts and at TP-sized
# per-rank counts, small T.
GATED_PRESETS = ("Qwen3-Next-80B-A3B", "Qwen3.5-9B", "Qwen3.5-27B", "Qwen3.5-35B-A3B", "Qwen3.5-397B-A17B")
TP_HEADS = ((4, 1), (3, 1), (2, 1), (1, 1))


def _gated_matrix():
    cases = [SplitCase.from_preset(get_preset(name), 3, dtype=torch.bfloat16, max_position=4096)
             for name in GATED_PRESETS]
    cycle = itertools.count()
    for (hq, hkv), name, dtype in itertools.product(TP_HEADS, ("Qwen3-Next-80B-A3B", "Qwen3.5-27B"), DTYPES):
        i = next(cycle)
        cases.append(SplitCase.from_preset(
            get_preset(name), (0, 1, 5, 17)[i % 4] if i % 7 else 2, num_q_heads=hq, num_kv_heads=hkv, dtype=dtype,
            image=(i % 3) != 0, pos_dtype=(torch.int64, torch.int32)[i % 2],
            cache_dtype=(torch.float32, torch.bfloat16)[(i // 3) % 2], weight_dtype=(None, dtype)[(i // 2) % 2],
            row_pad=(0, 16)[(i // 4) % 2], max_position=4096))
    # Each flag without the other (Gemma norms alone: any model with centred weights; the gate with plain
    # weights), a norm bias, no QK-norm, GPT-J pairs and full rotary: the flags are independent of the rest.
    base = dict(T=5, num_q_heads=3, num_kv_heads=1, head_dim=128, rotary_dim=64, dtype=torch.bfloat16)
    cases += [
        SplitCase(**base, gemma_norm=True),
        SplitCase(**dict(base, dtype=torch.float32), gemma_norm=True, mrope_section=(12, 10, 10),
                  mrope_interleaved=True, row_pad=8),
        SplitCase(**base, q_gate=True),
        SplitCase(**dict(base, dtype=torch.float16), q_gate=True, gemma_norm=True, bias=True),
        SplitCase(**base, q_gate=True, norm=False),
        SplitCase(**dict(base, rotary_dim=128), q_gate=True, gemma_norm=True, is_neox=False),
        SplitCase(**dict(base, head_dim=80, rotary_dim=40), q_gate=True, gemma_norm=True,
                  mrope_section=(8, 6, 6), mrope_interleaved=False),
    ]
    return cases


GATED_CASES = _gated_matrix()


def _id(c: SplitCase) -> str:
    mode = "rope" if c.mrope_section is None else ("mropeI" if c.mrope_interleaved else "mropeC")
    return (f"T{c.T}-h{c.num_q_heads}x{c.num_kv_heads}-D{c.head_dim}-R{c.rotary_dim}-{mode}"
            f"{'-img' if c.mrope_section and c.image else ''}-{'neox' if c.is_neox else 'gptj'}"
            f"-{str(c.dtype)[6:]}{'-norm' if c.norm else ''}{'-bias' if c.bias else ''}"
            f"-{str(c.pos_dtype)[6:]}-cache{str(c.cache_dtype)[6:]}{'-strided' if c.row_pad else ''}"
            f"{'-gate' if c.q_gate else ''}{'-gemma' if c.gemma_norm else ''}")


@pytest.mark.parametrize("case", CASES + GATED_CASES, ids=_id)
def test_split_matches_oracle(backend, case):
    kwargs, result = run_split_case(backend, case)
    # The functional form allocates its own outputs and must give the same bits; so must the bound object, in
    # each of its forms.
    fresh = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend=backend)
    static = {k: v for k, v in kwargs.items() if k not in ("qkv", "positions", "num_q_heads", "num_kv_heads",
                                                            "head_dim", "cos_sin_cache")}
    bound = qkvfuse.QKNormRope(case.num_q_heads, case.num_kv_heads, case.head_dim, kwargs["cos_sin_cache"],
                               **static, backend=backend)
    qkv, positions = kwargs["qkv"], kwargs["positions"]
    work = qkv.clone()
    for got in (fresh, bound(qkv, positions), bound(qkv, positions, out=tuple(torch.empty_like(r) for r in result)),
                bound.inplace(work, positions)):
        for a, b in zip(result, got):
            assert torch.equal(a, b)
    assert all(t.is_contiguous() for t in fresh)


@pytest.mark.parametrize("case", [c for c in CASES if c.T in (7, 64)][:12] + [c for c in GATED_CASES if c.T >= 5],
                         ids=_id)
def test_split_inplace_matches_out_of_place(backend, case):
    kwargs = make_split_inputs(case)
    expected = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend=backend)
    qkv = kwargs.pop("qkv").clone()
    views = qkvfuse.split_qkv_rmsnorm_rope_(qkv, **kwargs, backend=backend)
    for view, exp in zip(views, expected):
        assert view.data_ptr() >= qkv.data_ptr()
        assert torch.equal(view, exp)


@pytest.mark.parametrize("case", [c for c in CASES if c.T == 64][:6] + [c for c in GATED_CASES if c.T == 17][:4],
                         ids=_id)
def test_split_batch_invariant(backend, case):
    """A token's output bits do not depend on T or on the other tokens in the batch."""
    kwargs = make_split_inputs(case)
    full = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend=backend)
    for lo, hi in ((0, 1), (13, 14), (5, min(38, case.T))):
        part = dict(kwargs, qkv=kwargs["qkv"][lo:hi], positions=kwargs["positions"][..., lo:hi])
        sub = qkvfuse.split_qkv_rmsnorm_rope(**part, backend=backend)
        for a, b in zip(full, sub):
            assert torch.equal(a[lo:hi], b)


@pytest.mark.parametrize("case", [c for c in GATED_CASES if c.norm and c.T >= 1][::3], ids=_id)
def test_gated_gemma_is_the_plain_op_on_the_q_heads_with_one_plus_w(backend, case):
    """The documented equivalences, bit for bit: gated, ``(q, k, v)`` are the ungated op's on the row with the gate
    slots removed, and ``gate`` the gate slots; ``gemma_norm`` equals fp32 ``1 + w`` weights without the flag."""
    kwargs = make_split_inputs(case)
    got = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend=backend)
    qkv, T, D, hq = kwargs["qkv"], case.T, case.head_dim, case.num_q_heads
    plain = {k: v for k, v in kwargs.items() if k not in ("q_gate", "gemma_norm")}
    if case.q_gate:
        pairs = qkv[:, : 2 * hq * D].reshape(T, hq, 2, D)
        plain["qkv"] = torch.cat([pairs[:, :, 0].reshape(T, hq * D), qkv[:, 2 * hq * D :]], dim=1)
        assert torch.equal(got[3], pairs[:, :, 1].reshape(T, hq * D))
    if case.gemma_norm:
        for name in ("q_weight", "k_weight"):
            plain[name] = 1.0 + kwargs[name].float()
    want = qkvfuse.split_qkv_rmsnorm_rope(**plain, backend=backend)
    for a, b in zip(got[:3], want):
        assert torch.equal(a, b)


NORM_CASES = [
    (T, H, dtype, residual, bias, pad)
    for (T, H), dtype, (residual, bias, pad) in itertools.product(
        [(0, 64), (1, 64), (7, 80), (2, 160), (33, 4096), (5, 5120), (3, 1)], DTYPES,
        [(True, False, 0), (True, True, 8), (False, False, 0), (False, True, 4)])
]


@pytest.mark.parametrize("T,H,dtype,residual,bias,pad", NORM_CASES)
def test_add_rmsnorm_matches_oracle(backend, T, H, dtype, residual, bias, pad):
    kwargs = make_norm_inputs(T, H, dtype, residual=residual, bias=bias, row_pad=pad)
    x = kwargs["x"]
    out = (poisoned_like(x, pad), poisoned_like(x, pad))
    y, res_out = qkvfuse.add_rmsnorm(**kwargs, out=out, backend=backend)
    assert y is out[0]
    if not residual:
        assert res_out is x
    oracle = oracle_add_rmsnorm(**kwargs)
    unfused = unfused_add_rmsnorm(**kwargs)
    report = check_norm_outputs((y, res_out), oracle, unfused, x, kwargs["residual"])
    assert report.ok, report.detail
    bound = qkvfuse.AddRMSNorm(kwargs["weight"], kwargs["eps"], kwargs.get("bias"), backend=backend)
    for fresh in (qkvfuse.add_rmsnorm(**kwargs, backend=backend), bound(x, kwargs["residual"])):
        assert torch.equal(fresh[0], y) and torch.equal(fresh[1], res_out)


# Gemma norms (Qwen3-Next / Qwen3.5 decoder norms): weights centred at 0, applied as 1 + w in fp32.
GEMMA_NORM_CASES = [
    (T, H, dtype, residual, bias, pad)
    for (T, H), dtype, (residual, bias, pad) in itertools.product(
        [(0, 64), (1, 64), (7, 80), (33, 2048), (5, 4096)], DTYPES,
        [(True, False, 0), (True, True, 8), (False, False, 4)])
]


@pytest.mark.parametrize("T,H,dtype,residual,bias,pad", GEMMA_NORM_CASES)
def test_add_rmsnorm_gemma_matches_oracle(backend, T, H, dtype, residual, bias, pad):
    """Every form (out=, functional, the bound object's call and out=) against the oracle's ``1 + w``; equal, bit for
    bit, to fp32 ``1 + w`` weights without the flag (the documented equivalence)."""
    kwargs = make_norm_inputs(T, H, dtype, residual=residual, bias=bias, row_pad=pad, gemma_norm=True)
    x, r = kwargs["x"], kwargs["residual"]
    out = (poisoned_like(x, pad), poisoned_like(x, pad))
    y, res_out = qkvfuse.add_rmsnorm(**kwargs, out=out, backend=backend)
    assert y is out[0]
    report = check_norm_outputs((y, res_out), oracle_add_rmsnorm(**kwargs), unfused_add_rmsnorm(**kwargs), x, r)
    assert report.ok, report.detail
    bound = qkvfuse.AddRMSNorm(kwargs["weight"], kwargs["eps"], kwargs.get("bias"), gemma_norm=True, backend=backend)
    assert "gemma_norm=True" in repr(bound)
    plain = dict(kwargs, weight=1.0 + kwargs["weight"].float(), gemma_norm=False)
    for fresh in (qkvfuse.add_rmsnorm(**kwargs, backend=backend), bound(x, r),
                  bound(x, r, out=(torch.empty_like(x), torch.empty_like(x) if residual else None)),
                  qkvfuse.add_rmsnorm(**plain, backend=backend)):
        assert torch.equal(fresh[0], y) and torch.equal(fresh[1], res_out)


@pytest.mark.parametrize("gemma_norm", [False, True], ids=["plain", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_in_place(backend, dtype, gemma_norm):
    """``y`` may alias ``x`` and ``residual_out`` may alias ``residual`` (the engine in-place form)."""
    kwargs = make_norm_inputs(9, 256, dtype, residual=True, bias=True, gemma_norm=gemma_norm)
    expected = qkvfuse.add_rmsnorm(**kwargs, backend=backend)
    x, residual = kwargs["x"].clone(), kwargs["residual"].clone()
    y, res_out = qkvfuse.add_rmsnorm(x, residual, kwargs["weight"], kwargs["eps"], bias=kwargs["bias"],
                                     out=(x, residual), gemma_norm=gemma_norm, backend=backend)
    assert y is x and res_out is residual
    assert torch.equal(x, expected[0]) and torch.equal(residual, expected[1])
    bound = qkvfuse.AddRMSNorm(kwargs["weight"], kwargs["eps"], kwargs["bias"], gemma_norm=gemma_norm,
                               backend=backend)
    for form in (lambda x, r: qkvfuse.add_rmsnorm_(x, r, kwargs["weight"], kwargs["eps"], kwargs["bias"],
                                                   gemma_norm=gemma_norm, backend=backend), bound.inplace):
        x, residual = kwargs["x"].clone(), kwargs["residual"].clone()
        got = form(x, residual)
        assert got[0] is x and got[1] is residual
        assert torch.equal(x, expected[0]) and torch.equal(residual, expected[1])
    x = kwargs["x"].clone()  # without a residual: a plain in-place RMSNorm
    assert qkvfuse.add_rmsnorm_(x, None, kwargs["weight"], kwargs["eps"], gemma_norm=gemma_norm,
                                backend=backend)[0] is x
    assert torch.equal(x, qkvfuse.add_rmsnorm(kwargs["x"], None, kwargs["weight"], kwargs["eps"],
                                              gemma_norm=gemma_norm, backend=backend)[0])


@pytest.mark.parametrize("target", ["same", "overlapping rows", "weight"])
def test_add_rmsnorm_in_place_refuses_shared_targets(backend, target):
    buf = torch.randn(5, 96)
    weight = torch.randn(64)
    x, residual = {"same": (buf[:, :64], buf[:, :64]), "overlapping rows": (buf[:, :64], buf[:, 32:]),
                   "weight": (buf[:1, :64], torch.randn(1, 64))}[target]
    weight = buf[0, :64] if target == "weight" else weight
    before = buf.clone()
    with pytest.raises(ValueError, match="x|residual"):
        qkvfuse.add_rmsnorm_(x, residual, weight, backend=backend)
    assert torch.equal(buf, before)
    left, right = buf[:, :48], buf[:, 48:]  # column halves of one buffer share no element: accepted
    qkvfuse.add_rmsnorm_(left, right, torch.randn(48), backend=backend)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_in_place_on_neighbouring_columns(backend, dtype):
    """x and the residual as the column halves of one buffer, each residual row ending where its x row starts: the
    values of separate tensors (the CPU rows load a group of blocks ahead of their stores; that must not show)."""
    kwargs = make_norm_inputs(6, 160, dtype, residual=True, bias=True)
    want = qkvfuse.add_rmsnorm(**kwargs, backend=backend)
    buf = torch.cat([kwargs["residual"], kwargs["x"]], 1)
    x, residual = buf[:, 160:], buf[:, :160]
    got = qkvfuse.add_rmsnorm_(x, residual, kwargs["weight"], kwargs["eps"], kwargs["bias"], backend=backend)
    assert got[0] is x and got[1] is residual
    assert torch.equal(x, want[0]) and torch.equal(residual, want[1])


# ------------------------------------------------------------------------------------------------------------
# The exact output-overlap rule (qkvfuse._checks.share_elements), against brute force on element addresses.
# ------------------------------------------------------------------------------------------------------------
def _addresses(t):
    base, size = t.data_ptr(), t.element_size()
    idx = torch.zeros((), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        idx = idx.unsqueeze(-1) + torch.arange(n) * s
    return {base + int(i) * size + b for i in idx.flatten() for b in range(size)}


@pytest.mark.parametrize("seed", range(300))
def test_share_elements_is_exact_for_row_views(seed):
    from qkvfuse import _checks

    g = torch.Generator().manual_seed(seed)
    buf = torch.zeros(64 * 40, dtype=torch.bfloat16)

    def rand(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    def view():
        rows, width = rand(1, 5), rand(1, 20)
        row_stride = rand(width, 48) if rand(0, 4) else rand(1, 48)  # sometimes rows overlap themselves
        return buf.as_strided((rows, width), (row_stride, 1), rand(0, 600))

    a, b = view(), view()
    entries = _checks._entries((("a", a), ("b", b)))
    assert _checks._meet(*entries) == bool(_addresses(a) & _addresses(b)) or (
        a.stride(0) != b.stride(0) and a.shape[0] > 1 and b.shape[0] > 1)  # different row strides: conservative


def test_packed_output_buffer_is_accepted_and_true_overlap_rejected(fast_backend):
    case = SplitCase(T=3, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, dtype=torch.float32)
    kw = make_split_inputs(case)
    packed = torch.full((3, 8 * 64), float("nan"))
    out = packed.split_with_sizes([256, 128, 128], dim=1)
    got = qkvfuse.split_qkv_rmsnorm_rope(**kw, out=out, backend=fast_backend)
    want = qkvfuse.split_qkv_rmsnorm_rope(**kw, backend=fast_backend)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    shifted = (packed[:, :256], packed[:, 255:383], packed[:, 384:])  # k_out overlaps q_out by one column
    with pytest.raises(ValueError, match="^q_out: expected outputs that share no element with each other, got "
                                         "memory shared with k_out"):
        qkvfuse.split_qkv_rmsnorm_rope(**kw, out=shifted, backend=fast_backend)


def test_no_host_sync_for_positions_on_accelerators_by_default():
    """Off CPU the range check would read positions back to the host: it runs only with
    QKVFUSE_CHECK_POSITIONS=1 (meta tensors stand in for a device here: reading one back raises)."""
    from qkvfuse import _library

    assert not _library.CHECK_POSITIONS_ON_ACCELERATORS
    _library.check_positions(torch.empty(7, dtype=torch.int64, device="meta"), 10)
    with pytest.raises(ValueError, match="^positions"):
        _library.check_positions(torch.tensor([0, 10]), 10)
