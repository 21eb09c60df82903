"""The specialised bf16/fp16 kernels of the native CPU backend against its generic kernels, bit for bit.

The AVX-512 specialisations (``backends/cpu/isa/avx512_kernels.h``) run the generic kernel's operations per
element, so on an AVX-512 build (``AVX512`` or ``AVX512_BF16``) their outputs are compared with the generic path's
(``torch.ops.qkvfuse_cpu.split_generic_out`` / ``add_rmsnorm_generic_out``: the same kernels with the
specialised paths off), NaN positions included (a NaN's payload may differ): bit for bit for fp16 and wherever
no norm is taken; the bf16 heads and rows in lane order sum their squares in another fp32 order, so a normed
bf16 output is within one ulp of the generic one (and the rounded residual sum stays bit-exact with torch's add). Inputs include denormals (which the
AVX512-BF16 conversion would flush), infinities, NaNs and values that round to infinity. The gated layout
(``q_gate``: Q heads 2 * D apart, gate heads copied) is compared the same way, and with the plain layout's bits.
Other builds (AVX2's specialised heads use another, equally accurate, formula) are covered by the shared suite
against the oracle, the gated layout by tests/backends/test_cpu.py.
The suite as a whole runs once per capability this CPU supports (``make test``).
"""

import os

import pytest
import torch

import qkvfuse
from qkvfuse._library import encode_rope
from qkvfuse.backends import available_backends

REASON = available_backends()["cpu"]
if REASON and "cpu" in os.environ.get("QKVFUSE_REQUIRE_BACKENDS", "").split(","):
    pytest.fail(f"backend 'cpu' is required but unavailable: {REASON}", pytrace=False)
pytestmark = pytest.mark.skipif(bool(REASON), reason=f"cpu backend unavailable: {REASON}")

_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(scope="module", autouse=True)
def _avx512_build():
    from qkvfuse.backends import cpu

    if not cpu.capability().startswith("AVX512"):
        pytest.skip(f"build {cpu.capability()}: the bit-for-bit claim is the AVX-512 kernels'")


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats as ints in value order (consecutive values one apart, +0 and -0 both 0)."""
    bits = t.view(_INT[t.dtype]).int()
    return torch.where(bits >= 0, bits, -(bits & 0x7FFF))


def _assert_same(got, want, ulps=0):
    for a, b in zip(got, want):
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(b))
        assert int((_ordered(a[~nan]) - _ordered(b[~nan])).abs().max()) <= ulps if nan.sum() < nan.numel() else True


def _specials(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Plant denormals, +-inf, NaN and huge values at random places of ``t`` (in place)."""
    flat = t.view(-1)
    n = 3
    idx = torch.randint(0, flat.numel(), (4, n), generator=gen)
    flat[idx[0]] = 3e-39  # a denormal in bf16 (and 0 in fp16)
    flat[idx[1]] = float("inf")
    flat[idx[2]] = float("nan")
    flat[idx[3]] = -3.0e38 if t.dtype == torch.bfloat16 else -6.0e4
    return t


GEOMETRIES = [  # (num_q_heads, num_kv_heads, head_dim, rotary_dim)
    (32, 8, 128, 128), (4, 1, 256, 64), (3, 1, 64, 32), (2, 2, 512, 512), (17, 1, 128, 32),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("norm", ["none", "weight", "weight+bias", "bf16-weight"])
@pytest.mark.parametrize("rope", ["neox", "gptj", "mrope-interleaved", "mrope-sections"])
def test_split_specialised_heads_against_the_generic_heads(dtype, geometry, norm, rope):
    if norm == "bf16-weight" and dtype != torch.bfloat16:
        pytest.skip("a 16-bit weight serves its own dtype only")
    _check_split(dtype, geometry, norm, rope, gated=False)


GATED_GEOMETRIES = [  # Qwen3.5 / Qwen3-Next full attention per TP rank (head_dim 256, rotary 64), and head_dim 128
    (4, 1, 256, 64), (3, 1, 256, 64), (2, 2, 256, 64), (16, 2, 256, 64), (5, 1, 128, 128),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("geometry", GATED_GEOMETRIES, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("norm", ["none", "gemma", "weight+bias"])
@pytest.mark.parametrize("rope", ["neox", "gptj", "mrope-interleaved"])
def test_split_specialised_heads_gated_layout(dtype, geometry, norm, rope):
    """The gated layout (q_gate): the specialised heads read Q heads 2 * D apart; the same comparison as the plain
    layout, gate heads bit-exact, and bit for bit the plain layout's outputs on the de-interleaved heads."""
    _check_split(dtype, geometry, norm, rope, gated=True)


def _check_split(dtype, geometry, norm, rope, gated):
    hq, hkv, D, R = geometry
    gen = torch.Generator().manual_seed(D * 1000 + R + hq)
    T = 19
    q_heads = 2 * hq if gated else hq
    finite = (torch.randn(T, (q_heads + 2 * hkv) * D, generator=gen) * 3).to(dtype)
    special = _specials(finite.clone(), gen)
    cache = qkvfuse.build_cos_sin_cache(R, 4096, 1e6)
    sections = ()
    if rope.startswith("mrope"):
        third = R // 2 // 3
        sections = (R // 2 - 2 * third, third, third)
        positions = torch.randint(0, 4096, (3, T), generator=gen)
    else:
        positions = torch.randint(0, 4096, (T,), generator=gen)
    w = b = None
    if norm == "gemma":  # centred at 0: the kernel multiplies by 1 + w
        w = [torch.randn(D, generator=gen) * 0.2 for _ in range(2)]
    elif norm != "none":
        w = [torch.randn(D, generator=gen) * 0.2 + 1 for _ in range(2)]
        if norm == "bf16-weight":
            w = [t.to(torch.bfloat16) for t in w]
    if norm == "weight+bias":
        b = [torch.randn(D, generator=gen) * 0.1 for _ in range(2)]
    rope_code = encode_rope(rope != "gptj", sections, rope == "mrope-interleaved", gated, norm == "gemma")
    args = (positions, cache, *(w or (None, None)), *(b or (None, None)), hq, hkv, 1e-6, rope_code)
    widths = (hq, hkv, hkv, hq) if gated else (hq, hkv, hkv)

    def outputs():
        return [torch.full((T, n * D), float("nan"), dtype=dtype) for n in widths]

    for qkv in (finite, special):
        fast, generic = outputs(), outputs()
        torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out.default(qkv, *args, *fast)
        torch.ops.qkvfuse_cpu.split_generic_out.default(qkv, *args, *generic)
        ulps = 1 if dtype == torch.bfloat16 and norm != "none" else 0  # lane order: another sum of squares
        _assert_same(fast, generic, ulps)
        inplace = qkv.clone()
        torch.ops.qkvfuse.split_qkv_rmsnorm_rope_inplace.default(inplace, *args)
        if not gated:
            _assert_same(inplace.split([hq * D, hkv * D, hkv * D], 1), fast)
            continue
        q, gate, k, v = inplace.split([hq * D, hq * D, hkv * D, hkv * D], 1)
        _assert_same([q, k, v, gate], fast)
        heads = qkv[:, : 2 * hq * D].reshape(T, hq, 2, D)
        gate_in = heads[:, :, 1].reshape(T, hq * D)
        for got in (fast[3], generic[3], gate):  # bit-exact copies, NaN payloads included
            assert torch.equal(got.view(_INT[dtype]), gate_in.view(_INT[dtype]))
        # The plain layout on the same heads (Gemma weights as their fp32 1 + w): the same bits.
        plain = torch.cat([heads[:, :, 0].reshape(T, hq * D), qkv[:, 2 * hq * D :]], 1)
        plain_w = [1.0 + t for t in w] if norm == "gemma" else w
        plain_args = (positions, cache, *(plain_w or (None, None)), *(b or (None, None)), hq, hkv, 1e-6,
                      encode_rope(rope != "gptj", sections, rope == "mrope-interleaved"))
        want = outputs()[:3]
        torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out.default(plain, *plain_args, *want)
        for a, c in zip(fast[:3], want):
            assert torch.equal(a.view(_INT[dtype]), c.view(_INT[dtype]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hidden", [32, 4096, 4112, 4128])
@pytest.mark.parametrize("weights", ["fp32", "own-dtype", "fp32+bias", "own-dtype+bias", "strided"])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no-residual"])
def test_add_rmsnorm_specialised_rows_against_the_generic_rows(dtype, hidden, weights, residual):
    for specials in (False, True):
        _check_norm_rows(dtype, hidden, weights, residual, specials)


def _check_norm_rows(dtype, hidden, weights, residual, specials):
    gen = torch.Generator().manual_seed(hidden)
    T = 7
    x = (torch.randn(T, hidden, generator=gen) * 2).to(dtype)
    r = (torch.randn(T, hidden, generator=gen) * 2).to(dtype) if residual else None
    if specials:
        _specials(x, gen)
        if r is not None:
            r[0, :8] = 3e-39  # denormal sums: the residual is the rounded sum, denormals kept
            x[0, :8] = 0
    w = torch.randn(hidden * (2 if weights == "strided" else 1), generator=gen) * 0.2 + 1
    w = w[::2] if weights == "strided" else w
    b = torch.randn(hidden, generator=gen) * 0.1 if "bias" in weights else None
    if weights.startswith("own-dtype"):
        w, b = w.to(dtype), (b.to(dtype) if b is not None else None)

    def outputs():
        return torch.full_like(x, float("nan")), (torch.full_like(x, float("nan")) if residual else None)

    (y, ro), (gy, gro) = outputs(), outputs()
    torch.ops.qkvfuse.add_rmsnorm_out.default(x, r, w, b, 1e-6, y, ro)
    torch.ops.qkvfuse_cpu.add_rmsnorm_generic_out.default(x, r, w, b, 1e-6, gy, gro)
    ulps = 1 if dtype == torch.bfloat16 else 0  # bf16 rows: another summation order of the squares
    _assert_same([y], [gy], ulps)
    if residual:
        _assert_same([ro], [gro])
        _assert_same([ro], [x + r])  # the unfused add's bits
    xi, ri = x.clone(), (r.clone() if residual else None)
    torch.ops.qkvfuse.add_rmsnorm_inplace.default(xi, ri, w, b, 1e-6)
    _assert_same([xi, ri] if residual else [xi], [y, ro] if residual else [y])
