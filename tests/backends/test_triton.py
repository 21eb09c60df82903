"""Triton-specific tests: the failure modes of peer kernels, under both block configurations.

The shared suite (``tests/test_ops.py``) runs the Triton backend with the interpreter's block sizes (few, large
programs). The failure modes below depend on how heads and tokens share a program, so most run twice: with
those block sizes and with the *device* block sizes (``launch.INTERPRET = False``: several heads per program,
token blocks independent of T, a small tile so that head counts straddle blocks). Everything runs on CPU
tensors under ``TRITON_INTERPRET=1`` (set in ``tests/conftest.py``); outputs are NaN-poisoned and judged by the
accuracy rule with no interpreter allowance.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkvfuse
from qkvfuse._verify import (SplitCase, check_norm_outputs, check_split_outputs, make_norm_inputs,
                             make_split_inputs, oracle_add_rmsnorm, oracle_split, poisoned_like,
                             unfused_add_rmsnorm, unfused_split)
from qkvfuse._library import split_config
from qkvfuse.testing.accuracy import ulp
from qkvfuse.backends import available_backends
from qkvfuse.rope import mrope_axis_map

if available_backends()["triton"]:  # a reason: unavailable (a failure where CI requires the backend)
    if "triton" in os.environ.get("QKVFUSE_REQUIRE_BACKENDS", "").split(","):
        pytest.fail(f"triton backend required but unavailable: {available_backends()['triton']}", pytrace=False)
    pytest.skip(f"triton backend unavailable: {available_backends()['triton']}", allow_module_level=True)

from qkvfuse.backends.triton import kernels, launch  # noqa: E402

from _support.cases import run_split_case  # noqa: E402


@pytest.fixture(params=["interpreter-blocks", "device-blocks"])
def blocks(request, monkeypatch):
    """Run with the interpreter's block sizes or with the device's (small tiles: heads straddle blocks).

    Interpreted programs cost ~30 ms each, so tests using this fixture keep T small; large-T cases run with the
    interpreter's blocks (many tokens per program) and, for the device blocks, in the slow tier.
    """
    if request.param == "device-blocks":
        monkeypatch.setattr(launch, "INTERPRET", False)
        monkeypatch.setattr(launch, "GPU_SPLIT_TILE", 256)
        monkeypatch.setattr(launch, "GPU_NORM_TILE", 256)
        monkeypatch.setattr(launch, "GPU_MAX_ROW", 256)
        monkeypatch.setattr(launch, "GPU_MAX_GATED_Q", 256)
    return request.param


def _outputs(case: SplitCase):
    T, D = case.T, case.head_dim
    return tuple(poisoned_like(torch.empty(T, n * D, dtype=case.dtype)) for n in
                 (case.num_q_heads, case.num_kv_heads, case.num_kv_heads))


def _launch(kwargs, out):
    """The launcher called directly (no validation, no range check): what runs under graph capture."""
    launch.split_qkv_rmsnorm_rope_out(kwargs["qkv"], kwargs["positions"], split_config(**kwargs), *out)


# ---------------------------------------------------------------------------------------------------------
# Failure modes of peer kernels.
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_partial_rotary_many_token_heads(is_neox):
    """Partial rotary stays right far above 10 240 token x heads (vLLM #51049 broke there): 4096 x 5 = 20 480."""
    case = SplitCase(T=4096, num_q_heads=4, num_kv_heads=1, head_dim=64, rotary_dim=32, is_neox=is_neox,
                     bias=True)
    run_split_case("triton", case)


@pytest.mark.slow
def test_partial_rotary_glm_geometry_device_blocks(monkeypatch):
    """GLM-4.x geometry (96/8 x 128, rotary 64) with the device's block sizes: 128 x 104 = 13 312 token x heads."""
    monkeypatch.setattr(launch, "INTERPRET", False)
    case = SplitCase(T=128, num_q_heads=96, num_kv_heads=8, head_dim=128, rotary_dim=64, bias=True, eps=1e-5)
    run_split_case("triton", case)


HEAD_RATIOS = [(1, 1), (2, 1), (3, 1), (8, 1), (32, 1), (64, 1), (4, 2), (6, 2), (12, 3), (16, 4), (40, 8),
               (96, 8), (5, 5)]


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEAD_RATIOS, ids=lambda v: str(v))
def test_k_norm_every_head_ratio(blocks, num_q_heads, num_kv_heads):
    """K heads are normalised for every Hq/Hkv (vllm-ascend #12642 computed a K variance of 0 for some)."""
    case = SplitCase(T=2, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=64, rotary_dim=64,
                     dtype=torch.float32)
    kwargs = make_split_inputs(case)
    kwargs["q_weight"] = torch.ones(64)
    kwargs["k_weight"] = torch.ones(64)
    out = _outputs(case)
    qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")
    # With unit weights a rotated head has mean square ms / (ms + eps), ms the input's (rotation keeps each
    # pair's length); a variance computed as 0 would give ms / eps instead.
    heads_in = kwargs["qkv"].double().reshape(case.T, -1, 64)
    ms_in = heads_in.pow(2).mean(-1)
    expected = ms_in / (ms_in + case.eps)
    for t, first, heads in ((out[0], 0, num_q_heads), (out[1], num_q_heads, num_kv_heads)):
        mean_sq = t.double().reshape(case.T, heads, 64).pow(2).mean(-1)
        torch.testing.assert_close(mean_sq, expected[:, first:first + heads], rtol=1e-5, atol=0)
    report = check_split_outputs(out, oracle_split(**kwargs), unfused_split(**kwargs), kwargs["qkv"],
                                 num_q_heads, num_kv_heads, 64)
    assert report.ok, report.detail


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "contiguous"])
def test_mrope_height_width_rows_are_read(blocks, interleaved):
    """Image tokens (three differing rows) match the oracle and differ from reading the temporal row only."""
    sections = (24, 20, 20) if interleaved else (16, 24, 24)
    case = SplitCase(T=9, num_q_heads=4, num_kv_heads=2, head_dim=128, rotary_dim=128, mrope_section=sections,
                     mrope_interleaved=interleaved, image=True)
    kwargs, result = run_split_case("triton", case)
    positions = kwargs["positions"]
    assert not torch.equal(positions[0], positions[1]) and not torch.equal(positions[0], positions[2])
    temporal_only = qkvfuse.split_qkv_rmsnorm_rope(**dict(kwargs, positions=positions[0].expand(3, -1).clone()),
                                                   backend="triton")
    for got, temporal in zip(result[:2], temporal_only[:2]):  # Q and K
        assert not torch.equal(got, temporal)
    # Equal rows (text, decode) are plain RoPE, bit for bit.
    text = dict(kwargs, positions=positions[1].expand(3, -1))
    rope = dict(kwargs, positions=positions[1], mrope_section=None, mrope_interleaved=False)
    for a, b in zip(qkvfuse.split_qkv_rmsnorm_rope(**text, backend="triton"),
                    qkvfuse.split_qkv_rmsnorm_rope(**rope, backend="triton")):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("mode", ["rope", "mrope"])
def test_out_of_range_positions_clamped_in_kernel(blocks, pos_dtype, mode):
    """With the host check bypassed (graph capture), bad positions clamp into the table: nothing outside is read.

    The table is a view into a larger buffer whose other rows are NaN, so any read outside it shows up as NaN.
    """
    sections = (8, 4, 4) if mode == "mrope" else None
    case = SplitCase(T=9, num_q_heads=3, num_kv_heads=1, head_dim=64, rotary_dim=32, mrope_section=sections,
                     pos_dtype=pos_dtype, max_position=64)
    kwargs = make_split_inputs(case)
    table = kwargs["cos_sin_cache"]
    big = torch.full((table.shape[0] + 32, table.shape[1]), float("nan"))
    big[16:16 + table.shape[0]] = table
    kwargs["cos_sin_cache"] = big[16:16 + table.shape[0]]
    info = torch.iinfo(pos_dtype)
    bad = torch.tensor([-1, -16, 64, 64 + 15, info.min, info.max, 63, 0, 5], dtype=pos_dtype)
    kwargs["positions"] = bad if mode == "rope" else torch.stack([bad, bad.flip(0), bad.roll(3)])
    out = _outputs(case)
    _launch(kwargs, out)
    clamped = dict(kwargs, positions=kwargs["positions"].clamp(0, 63))
    report = check_split_outputs(out, oracle_split(**clamped), unfused_split(**clamped), kwargs["qkv"], 3, 1, 64)
    assert report.ok, report.detail
    # Through the public function (eager, CPU) the same positions are an error naming the argument.
    with pytest.raises(ValueError, match="positions"):
        qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="triton")


def test_no_intermediate_bf16_rounding():
    """Norm and rotation stay in fp32 with one rounding at the store (peers rounding between them lost accuracy).

    The check has teeth: the same computation with a bf16 rounding between norm and rotation fails the rule.
    """
    case = SplitCase(T=64, num_q_heads=8, num_kv_heads=2, head_dim=128, rotary_dim=128, dtype=torch.bfloat16)
    kwargs, result = run_split_case("triton", case)
    oracle, unfused = oracle_split(**kwargs), unfused_split(**kwargs)
    qkv = kwargs["qkv"]
    heads = qkv.float().reshape(case.T, 12, 128)
    qk = heads[:, :10]
    weight = torch.cat([kwargs["q_weight"].expand(8, 128), kwargs["k_weight"].expand(2, 128)])
    qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + case.eps) * weight
    normed = torch.cat([qk, heads[:, 10:]], 1).to(torch.bfloat16).reshape(case.T, -1)  # the extra rounding
    twice = qkvfuse.split_qkv_rmsnorm_rope(**dict(kwargs, qkv=normed, q_weight=None, k_weight=None),
                                           backend="reference")
    assert not check_split_outputs(twice, oracle, unfused, qkv, 8, 2, 128).ok
    assert check_split_outputs(result, oracle, unfused, qkv, 8, 2, 128).ok


@pytest.mark.parametrize("head_dim", [2, 6, 80, 96, 192, 510, 512])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_any_even_head_dim(blocks, head_dim, partial):
    """Non-power-of-two head_dim is masked, never skipped or asserted away (vLLM #53115, NPU pow2 asserts)."""
    R = max(2, (head_dim // 4) * 2) if partial else head_dim
    case = SplitCase(T=3, num_q_heads=3, num_kv_heads=1, head_dim=head_dim, rotary_dim=R, is_neox=head_dim % 4 == 0,
                     bias=True, dtype=torch.bfloat16)
    kwargs, result = run_split_case("triton", case)
    assert not torch.equal(result[0], kwargs["qkv"][:, : 3 * head_dim])


# ---------------------------------------------------------------------------------------------------------
# Gated attention (Qwen3-Next / Qwen3.5): the gated Q layout and Gemma norm weights.
# ---------------------------------------------------------------------------------------------------------
QWEN35_SECTIONS = (11, 11, 10)  # interleaved mRoPE over rotary 64 (Qwen3.5 VL)


def _gated_inputs(num_q_heads, num_kv_heads, head_dim, mode, T=5, dtype=torch.bfloat16, row_pad=8, seed=0):
    """``(gated, plain)`` keyword arguments of one Qwen3.5-style call (rotary 64, theta 1e7).

    ``gated``: qkv rows ``[q_0 | g_0 | ... | K | V]`` (strided by ``row_pad``), Gemma weights centred at 0,
    ``q_gate=True, gemma_norm=True``; ``plain``: the same values in the ungated layout ``[Q | K | V]`` with the
    fp32 weights ``1 + w`` -- what the oracle takes, and (the public contract) the same Q/K/V bits.
    """
    sections = QWEN35_SECTIONS if mode == "mrope" else None
    case = SplitCase(T=T, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=64,
                     dtype=dtype, mrope_section=sections, mrope_interleaved=mode == "mrope", image=True,
                     max_position=256)
    plain = make_split_inputs(case, seed=seed)
    plain["cos_sin_cache"] = qkvfuse.rope.build_cos_sin_cache(64, 256, 1e7)
    g = torch.Generator().manual_seed(seed + 1)
    centred = {name: 0.2 * torch.randn(head_dim, generator=g) for name in ("q_weight", "k_weight")}
    plain.update({name: 1.0 + w for name, w in centred.items()})
    q_width = num_q_heads * head_dim
    q = plain["qkv"][:, :q_width].reshape(T, num_q_heads, head_dim)
    gate = (torch.randn(T, num_q_heads, head_dim, generator=g) * 4).to(dtype)
    width = plain["qkv"].shape[1] + q_width
    buf = torch.full((T, width + row_pad), float("nan"), dtype=dtype)
    buf[:, :2 * q_width] = torch.stack([q, gate], 2).reshape(T, 2 * q_width)
    buf[:, 2 * q_width:width] = plain["qkv"][:, q_width:]
    gated = dict(plain, qkv=buf[:, :width], q_gate=True, gemma_norm=True, **centred)
    del gated["head_dim"]
    if sections:
        rows = plain["positions"]
        assert not torch.equal(rows[0], rows[1]) and not torch.equal(rows[1], rows[2])
    return gated, plain, gate.reshape(T, q_width)


def _split_args(kwargs):
    """``(positional, keyword)`` arguments of the public split functions for ``_gated_inputs`` kwargs."""
    kw = dict(kwargs)
    args = [kw.pop(name) for name in ("qkv", "positions", "cos_sin_cache", "num_q_heads", "num_kv_heads")]
    D = args[0].shape[1] // (2 * args[3] + 2 * args[4])
    return args + [D], kw


def _within_one_ulp(got, want):
    """Triton vs the reference backend: both compute in fp32 and round once, to nearest even (the kernel rounds
    explicitly, see ``kernels._round_for_store``), but their fp32 sums of squares may add in another order, so
    one ulp of the output dtype is allowed."""
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = (got.double() - want.double()).abs()
    assert bool((diff <= ulp(want.double(), want.dtype)).all()), float(diff.max())


GATED_GEOMETRIES = [(4, 1, 256), (3, 1, 64)]  # Qwen3.5 full-attention layers per TP rank; head_dim 256 and 64


@pytest.mark.parametrize("mode", ["mrope", "rope"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", GATED_GEOMETRIES, ids=lambda v: str(v))
def test_gated_gemma_split_out_functional_and_in_place(blocks, num_q_heads, num_kv_heads, head_dim, mode):
    """q_gate + gemma_norm through out= (poisoned, strided), the functional form and the in-place form: Q/K within
    the accuracy rule of the float64 oracle and within 1 ulp of the reference backend, V and the gate bit-exact,
    and the same Q/K/V bits as the ungated call with fp32 ``1 + w`` weights. The in-place row becomes
    ``[Q | gate | K | V]`` (device blocks: straddling Q blocks, in place through the scratch buffer for D 256)."""
    gated, plain, gate_in = _gated_inputs(num_q_heads, num_kv_heads, head_dim, mode)
    args, kw = _split_args(gated)
    qkv, T = args[0], args[0].shape[0]
    q_width, kv_width = num_q_heads * head_dim, num_kv_heads * head_dim
    reference = qkvfuse.split_qkv_rmsnorm_rope(*args, **kw, backend="reference")
    out = tuple(poisoned_like(torch.empty(T, w, dtype=qkv.dtype), 8) for w in (q_width, kv_width, kv_width, q_width))
    snapshot = qkv.clone()
    got = qkvfuse.split_qkv_rmsnorm_rope(*args, **kw, out=out, backend="triton")
    assert torch.equal(qkv.view(torch.int16), snapshot.view(torch.int16))  # the input is left alone
    q, k, v, gate = got
    report = check_split_outputs((q, k, v), oracle_split(**plain), unfused_split(**plain), plain["qkv"],
                                 num_q_heads, num_kv_heads, head_dim)
    assert report.ok, report.detail
    _within_one_ulp(q, reference[0])
    _within_one_ulp(k, reference[1])
    assert torch.equal(v, reference[2]) and torch.equal(v, qkv[:, -kv_width:])
    assert torch.equal(gate.view(torch.int16), gate_in.view(torch.int16))
    ungated = qkvfuse.split_qkv_rmsnorm_rope(**plain, backend="triton")
    for a, b in zip(got[:3], ungated):
        assert torch.equal(a, b)

    fresh = qkvfuse.split_qkv_rmsnorm_rope(*args, **kw, backend="triton")
    for a, b in zip(fresh, got):
        assert torch.equal(a, b)

    work = qkv.clone()
    views = qkvfuse.split_qkv_rmsnorm_rope_(work, *args[1:], **kw, backend="triton")
    for a, b in zip(views, got):
        assert torch.equal(a, b)
    assert torch.equal(work, torch.cat([q, gate, k, v], 1))

    # k_out / v_out may be qkv's own K / V slices (q_out and gate_out may not overlap qkv).
    aliased = qkv.clone()
    k_own, v_own = aliased[:, 2 * q_width:2 * q_width + kv_width], aliased[:, 2 * q_width + kv_width:]
    out = (poisoned_like(q), k_own, v_own, poisoned_like(gate))
    for a, b in zip(qkvfuse.split_qkv_rmsnorm_rope(*args, **kw, out=out, backend="triton"), got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scheme", ["whole-q-region", "scratch"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", GATED_GEOMETRIES + [(6, 2, 64)], ids=lambda v: str(v))
def test_gated_in_place_schemes(monkeypatch, scheme, num_q_heads, num_kv_heads, head_dim):
    """The gated in-place form writes over other Q programs' input; both safe schemes give the out= bits: one
    program per token block holding the whole Q/gate region, or (region wider than GPU_MAX_GATED_Q) a scratch
    buffer copied back. The interpreter runs programs one after another, so a program overwriting another's
    unread input shows here. Device blocks with a small tile: several Q blocks per token."""
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "GPU_SPLIT_TILE", 128)
    monkeypatch.setattr(launch, "GPU_MAX_GATED_Q", 1 << 12 if scheme == "whole-q-region" else 1)
    gated, _, _ = _gated_inputs(num_q_heads, num_kv_heads, head_dim, "mrope", T=3, row_pad=0)
    args, kw = _split_args(gated)
    cfg = launch.split_config(3, num_q_heads, num_kv_heads, head_dim, whole_q_region=True)
    assert (cfg["Q_HEADS"] >= num_q_heads) == (scheme == "whole-q-region")
    assert launch.split_config(3, num_q_heads, num_kv_heads, head_dim)["Q_HEADS"] < num_q_heads
    expected = qkvfuse.split_qkv_rmsnorm_rope(*args, **kw, backend="triton")
    work = args[0].clone()
    views = qkvfuse.split_qkv_rmsnorm_rope_(work, *args[1:], **kw, backend="triton")
    for a, b in zip(views, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("H", [80, 300])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "plain"])
def test_add_rmsnorm_gemma(blocks, H, residual):
    """Gemma decoder norms (``1 + w`` in fp32): the bits of the plain call with fp32 ``1 + w`` weights, within
    1 ulp of the reference backend, residual_out bit-exact; out= and in place (device blocks: two passes at 300)."""
    kwargs = make_norm_inputs(6, H, torch.bfloat16, residual=residual, row_pad=4, seed=H)
    centred = kwargs["weight"] - 1.0
    x = kwargs["x"]
    gemma = dict(kwargs, weight=centred, gemma_norm=True)
    plain = dict(kwargs, weight=1.0 + centred)
    y, res_out = qkvfuse.add_rmsnorm(**gemma, out=(poisoned_like(x, 4), poisoned_like(x, 4)), backend="triton")
    want = qkvfuse.add_rmsnorm(**plain, backend="triton")
    assert torch.equal(y, want[0]) and (not residual or torch.equal(res_out, want[1]))
    report = check_norm_outputs((y, res_out), oracle_add_rmsnorm(**plain), unfused_add_rmsnorm(**plain), x,
                                kwargs["residual"])
    assert report.ok, report.detail
    reference = qkvfuse.add_rmsnorm(**gemma, backend="reference")
    _within_one_ulp(y, reference[0])
    if residual:
        assert torch.equal(res_out, reference[1])
        x2, r2 = x.clone(), kwargs["residual"].clone()
        qkvfuse.add_rmsnorm_(x2, r2, centred, kwargs["eps"], gemma_norm=True, backend="triton")
        assert torch.equal(x2, y) and torch.equal(r2, res_out)


# ---------------------------------------------------------------------------------------------------------
# Kernel building blocks and launcher properties.
# ---------------------------------------------------------------------------------------------------------
def _kernel_axis_map(half, sections, interleaved):
    out = torch.full((half,), -1, dtype=torch.int32)
    kernels.mrope_axis_kernel[(1,)](out, half, *sections, INTERLEAVED=interleaved,
                                    BLOCK=launch._pow2(half))
    return tuple(out.tolist())


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "contiguous"])
def test_in_kernel_mrope_axis_rule_matches_rope_module(interleaved):
    """The kernel derives the mRoPE axis per lane; it must agree with rope.mrope_axis_map everywhere."""
    splits = [(s_t, s_h, half - s_t - s_h) for half in (1, 3, 8, 17) for s_t in range(half + 1)
              for s_h in range(half + 1 - s_t)]
    splits += [(24, 20, 20), (8, 12, 12), (16, 8, 8), (22, 21, 21), (64, 0, 0), (0, 32, 32), (10, 30, 24)]
    for sections in splits:
        half = sum(sections)
        assert _kernel_axis_map(half, sections, interleaved) == mrope_axis_map(half, sections, interleaved), sections


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # numpy, on the fp16 overflow case
def test_round_to_nearest_even_matches_torch():
    """The in-kernel bf16 rounding gives torch's bits: ties to even, NaN, inf, overflow, subnormals, -0."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n)
        tl.store(out_ptr + i, kernels._round_for_store(x, out_ptr.dtype.element_ty), mask=i < n)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=g) * torch.exp(torch.randn(4000, generator=g) * 20)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, -(2**-133), 1e-40])
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 3.3961e38, -0.0, 0.0])
    x = torch.cat([x, ties, special])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = torch.empty(x.shape, dtype=dtype)
        cast_kernel[(1,)](x, out, x.numel(), BLOCK=8192)
        expected = x.to(dtype)
        same = (out.view(torch.uint8) == expected.view(torch.uint8)).view(x.numel(), -1).all(1)
        assert bool((same | (out.isnan() & expected.isnan())).all()), dtype


def test_device_block_sizes_do_not_depend_on_t():
    """On a device the constexprs depend on the head geometry only: a new batch size never recompiles."""
    for geometry in ((32, 8, 128), (96, 8, 128), (3, 1, 80), (1, 1, 512)):
        configs = {str(launch.split_config(T, *geometry, interpret=False)) for T in (1, 2, 7, 64, 4097, 16384)}
        assert len(configs) == 1, configs
    for H in (1, 80, 4096, 5120, 20000):
        assert len({str(launch.norm_config(T, H, interpret=False)) for T in (1, 3, 1000, 16384)}) == 1


def test_host_arithmetic_and_cached_configs(monkeypatch):
    """The launcher's plain-Python power of two and ceil division equal Triton's; a cached block configuration
    follows a changed module setting and is not shared between callers (each gets its own dict)."""
    import triton

    assert all(launch._pow2(n) == triton.next_power_of_2(max(n, 1)) for n in range(-2, 5000))
    assert all(launch._cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 300) for b in range(1, 40))
    first = launch.split_config(1, 32, 8, 128, interpret=False)
    first.pop("num_warps")
    assert "num_warps" in launch.split_config(1, 32, 8, 128, interpret=False)
    monkeypatch.setattr(launch, "GPU_SPLIT_TILE", 4 * launch.GPU_SPLIT_TILE)
    assert launch.split_config(1, 32, 8, 128, interpret=False)["Q_HEADS"] == 4 * first["Q_HEADS"]
    monkeypatch.setattr(launch, "GPU_NORM_PER_THREAD", 2 * launch.GPU_NORM_PER_THREAD)
    assert launch.norm_config(1, 4096, interpret=False)["num_warps"] == 8


def test_in_place_skips_v_and_matches_out_of_place(blocks):
    case = SplitCase(T=7, num_q_heads=6, num_kv_heads=2, head_dim=96, rotary_dim=48, bias=True, row_pad=8)
    kwargs = make_split_inputs(case)
    expected = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="triton")
    qkv = kwargs.pop("qkv").clone()
    v_before = qkv[:, -2 * 96:].clone()
    views = qkvfuse.split_qkv_rmsnorm_rope_(qkv, **kwargs, backend="triton")
    for view, exp in zip(views, expected):
        assert torch.equal(view, exp)
    assert torch.equal(qkv[:, -2 * 96:], v_before)


@pytest.mark.parametrize("H", [1, 80, 300, 5120])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "plain"])
def test_add_rmsnorm_blocks(blocks, H, residual):
    """add_rmsnorm in one tile and (device blocks, H > 256) in two passes over chunks, in place too."""
    kwargs = make_norm_inputs(6, H, torch.bfloat16, residual=residual, bias=True, row_pad=4)
    x = kwargs["x"]
    y, res_out = qkvfuse.add_rmsnorm(**kwargs, out=(poisoned_like(x, 4), poisoned_like(x, 4)), backend="triton")
    report = check_norm_outputs((y, res_out), oracle_add_rmsnorm(**kwargs), unfused_add_rmsnorm(**kwargs), x,
                                kwargs["residual"])
    assert report.ok, report.detail
    if residual:  # the engine's in-place form: y over x, residual_out over residual
        x2, r2 = x.clone(), kwargs["residual"].clone()
        qkvfuse.add_rmsnorm(x2, r2, kwargs["weight"], kwargs["eps"], bias=kwargs["bias"], out=(x2, r2),
                            backend="triton")
        assert torch.equal(x2, y) and torch.equal(r2, res_out)


def test_device_types_and_registration():
    """The launchers serve cuda/xpu/npu (the auto ops' device keys) and CPU tensors under the interpreter."""
    from qkvfuse.backends import triton as backend

    assert backend.DEVICE_TYPES == ("cuda", "xpu", "npu")
    assert backend.available() == (True, "")
    for key in ("CUDA", "XPU", "PrivateUse1"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("qkvfuse::split_qkv_rmsnorm_rope", key), key
    assert qkvfuse.backends.resolve_backend(None, "cpu") != "triton"  # CPU tensors keep the CPU backend


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only, no-interpreter case")
def test_unavailable_without_device_or_interpreter():
    code = "import qkvfuse.backends.triton as t; ok, why = t.available(); print(ok); assert not ok and why"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_kernels_compile_for_hopper_without_spills():
    """The GPU compiler (not the interpreter) accepts every kernel variant for sm_90, with no register spills."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_aot.py"))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_64bit_offsets():
    """Token x row stride above 2^31 with an int32 stride (a sparse 4 GiB buffer: memory-hungry, not in CI).

    The interpreter wraps int32 products like a GPU does, so a missing int64 cast of the token index fails here.
    """
    case = SplitCase(T=2050, num_q_heads=1, num_kv_heads=1, head_dim=64, rotary_dim=64)
    kwargs = make_split_inputs(case)
    stride = 2**20 + 64  # (T - 1) * stride > 2^31
    buf = torch.empty((case.T - 1) * stride + case.width, dtype=torch.bfloat16)
    qkv = buf.as_strided((case.T, case.width), (stride, 1))
    qkv.copy_(kwargs["qkv"])
    out = _outputs(case)
    qkvfuse.split_qkv_rmsnorm_rope(**dict(kwargs, qkv=qkv), out=out, backend="triton")
    report = check_split_outputs(out, oracle_split(**kwargs), unfused_split(**kwargs), kwargs["qkv"], 1, 1, 64)
    assert report.ok, report.detail


def test_device_sections_cpu_interpreter_dry_run(tmp_path, capsys):
    """``verify`` / ``bench --cpu-interpreter``: the device sections and timings at small sizes on CPU tensors, so
    the code a GPU run executes cannot rot (conformance, stability, moe-streams; timing)."""
    import json

    from qkvfuse.cli import main

    verify_json, bench_json = tmp_path / "verify.json", tmp_path / "bench.json"
    assert main(["verify", "--cpu-interpreter", "--json", str(verify_json)]) == 0, capsys.readouterr().out[-3000:]
    result = json.loads(verify_json.read_text())
    assert result["mode"] == "cpu-interpreter" and result["tier"] == "cpu"
    sections = {s["name"]: s for s in result["sections"]}
    assert set(sections) == {"conformance", "stability", "moe-streams"}
    assert sections["conformance"]["rows"] and sections["stability"]["rows"]
    assert "skipped" in sections["moe-streams"]["note"] and not sections["moe-streams"]["rows"]
    assert all(row["pass"] for s in result["sections"] for row in s["rows"])

    assert main(["bench", "--cpu-interpreter", "--tile-sweep", "--json", str(bench_json)]) == 0, \
        capsys.readouterr().out[-3000:]
    timing = json.loads(bench_json.read_text())
    assert [s["name"] for s in timing["sections"]] == ["timing", "tile-sweep"]
    rows = timing["sections"][0]["rows"]
    assert {r["op"] for r in rows} == {"split_qkv_rmsnorm_rope", "add_rmsnorm"}
    assert all(r["pass"] and r["triton us"] > 0 for r in rows)
    sweep = timing["sections"][1]["rows"]
    assert [(r["tile"], r["warps"]) for r in sweep] == [(1024, 1), (2048, 2)] and all(r["us"] > 0 for r in sweep)
