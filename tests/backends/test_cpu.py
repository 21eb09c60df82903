"""Native CPU backend: what only this backend has (the shared suite in tests/test_ops.py covers the spec).

* the kernel's copy of the mRoPE axis rule agrees with :func:`qkvfuse.rope.mrope_axis_map`;
* bits do not depend on the thread count, on repeated calls, or on which side of the parallel grain a
  batch falls;
* the kernel's own position range check raises ``ValueError`` naming ``positions`` before writing anything;
* the dispatcher reaches the C++ kernels for all five ops;
* the vector-body / scalar-tail split of odd head and rotary dims;
* the gated layout (``q_gate``, Gemma weights) in every form: the oracle's rule on the de-interleaved heads, the
  plain layout's bits, gate and v bit-exact, the in-place de-interleaving, non-finite heads, streaming stores;
* a machine without a compiler falls back to the reference backend with one warning.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import qkvfuse
from qkvfuse._library import encode_rope
from qkvfuse.backends import available_backends
from qkvfuse.rope import mrope_axis_map
from qkvfuse._verify import (SplitCase, check_split_outputs, make_norm_inputs, make_split_inputs, oracle_split,
                             poisoned_like, unfused_split)

REASON = available_backends()["cpu"]
if REASON and "cpu" in os.environ.get("QKVFUSE_REQUIRE_BACKENDS", "").split(","):
    pytest.fail(f"backend 'cpu' is required but unavailable: {REASON}", pytrace=False)
pytestmark = pytest.mark.skipif(bool(REASON), reason=f"cpu backend unavailable: {REASON}")

OPS = ("split_qkv_rmsnorm_rope", "split_qkv_rmsnorm_rope_out", "split_qkv_rmsnorm_rope_inplace", "add_rmsnorm",
       "add_rmsnorm_out")


def _raw_split_args(kwargs):
    """Positional arguments of ``torch.ops.qkvfuse.split_qkv_rmsnorm_rope*`` (no Python validation)."""
    rope = encode_rope(kwargs["is_neox"], kwargs["mrope_section"] or (), kwargs["mrope_interleaved"])
    return (kwargs["qkv"], kwargs["positions"], kwargs["cos_sin_cache"], kwargs.get("q_weight"),
            kwargs.get("k_weight"), kwargs.get("q_bias"), kwargs.get("k_bias"), kwargs["num_q_heads"],
            kwargs["num_kv_heads"], kwargs["eps"], rope)


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _with_threads(n, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


def test_all_ops_have_a_native_cpu_kernel():
    """Once built, the default overload's CPU kernels are the C++ ones (the lazy Python kernel is gone)."""
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"qkvfuse::{op}", "CPU"), op
        cpu_line = torch._C._dispatch_dump(f"qkvfuse::{op}").split("\nCPU:")[1].splitlines()[0]
        assert ".cpp:" in cpu_line, cpu_line


@pytest.mark.parametrize("interleaved", [False, True], ids=["contiguous", "interleaved"])
def test_kernel_mrope_axis_rule_matches_python(interleaved):
    cases = [(half, (s_t, s_h, half - s_t - s_h)) for half in range(1, 25)
             for s_t in range(half + 1) for s_h in range(half + 1 - s_t)]
    cases += [(64, (24, 20, 20)), (64, (16, 24, 24)), (32, (8, 12, 12)), (256, (86, 85, 85)), (256, (0, 0, 256))]
    for half, section in cases:
        kernel = torch.ops.qkvfuse_cpu.mrope_axis_map(half, list(section), interleaved)
        assert tuple(kernel) == mrope_axis_map(half, section, interleaved), (half, section)


# Wide enough that the parallel path runs: T * (Hq + Hkv + 1) work items well above the grain.
PARALLEL_CASES = [
    SplitCase(T=96, num_q_heads=12, num_kv_heads=2, head_dim=128, rotary_dim=64, dtype=torch.bfloat16, bias=True),
    SplitCase(T=80, num_q_heads=8, num_kv_heads=4, head_dim=80, rotary_dim=80, dtype=torch.float16, is_neox=False,
              mrope_section=(16, 12, 12), mrope_interleaved=True, pos_dtype=torch.int32, row_pad=8),
    SplitCase(T=70, num_q_heads=4, num_kv_heads=2, head_dim=256, rotary_dim=32, dtype=torch.float32, norm=False,
              mrope_section=(6, 5, 5), cache_dtype=torch.bfloat16),
]


@pytest.mark.parametrize("case", PARALLEL_CASES, ids=["bf16-partial-bias", "fp16-gptj-mropeI", "fp32-nonorm-mropeC"])
def test_split_bits_independent_of_threads_and_grain(case):
    kwargs = make_split_inputs(case, seed=3)
    per_token = case.num_q_heads + 2 * case.num_kv_heads  # Q/K heads + one V item, with margin
    assert case.T * per_token > 2 * torch.ops.qkvfuse_cpu.grain_items(case.head_dim), "case too small to fork"
    one = _with_threads(1, lambda: qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="cpu"))
    for _ in range(3):
        two = _with_threads(2, lambda: qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="cpu"))
        for a, b in zip(one, two):
            assert torch.equal(_bits(a), _bits(b))
    # Single tokens run below the grain (no fork): the same bits as inside the big parallel batch.
    for t in (0, case.T // 2, case.T - 1):
        part = dict(kwargs, qkv=kwargs["qkv"][t : t + 1], positions=kwargs["positions"][..., t : t + 1])
        single = _with_threads(2, lambda: qkvfuse.split_qkv_rmsnorm_rope(**part, backend="cpu"))
        for a, b in zip(one, single):
            assert torch.equal(_bits(a[t : t + 1]), _bits(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_rmsnorm_bits_independent_of_threads_and_grain(dtype):
    kwargs = make_norm_inputs(64, 1536, dtype, residual=True, bias=True, row_pad=8, seed=5)
    one = _with_threads(1, lambda: qkvfuse.add_rmsnorm(**kwargs, backend="cpu"))
    two = _with_threads(2, lambda: qkvfuse.add_rmsnorm(**kwargs, backend="cpu"))
    assert torch.equal(_bits(one[0]), _bits(two[0])) and torch.equal(_bits(one[1]), _bits(two[1]))
    for t in (0, 33, 63):
        part = dict(kwargs, x=kwargs["x"][t : t + 1], residual=kwargs["residual"][t : t + 1])
        y, r = qkvfuse.add_rmsnorm(**part, backend="cpu")
        assert torch.equal(_bits(one[0][t : t + 1]), _bits(y)) and torch.equal(_bits(one[1][t : t + 1]), _bits(r))


@pytest.mark.parametrize("mrope", [False, True], ids=["rope", "mrope"])
@pytest.mark.parametrize("bad", [-1, 4096, 10**12], ids=["negative", "max_position", "huge"])
def test_kernel_range_check_raises_before_writing(mrope, bad):
    """The raw op (no Python check in front) raises ValueError naming positions, outputs untouched."""
    case = SplitCase(T=40, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=64, max_position=4096,
                     mrope_section=(12, 10, 10) if mrope else None, pos_dtype=torch.int64)
    kwargs = make_split_inputs(case)
    positions = kwargs["positions"].clone()
    positions[..., -1] = bad  # the last token: a kernel that writes before checking would have written the rest
    kwargs["positions"] = positions
    outs = tuple(poisoned_like(torch.empty(40, w, dtype=case.dtype)) for w in (256, 128, 128))
    with pytest.raises(ValueError, match=r"^positions: expected values in \[0, 4096\)"):
        torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out(*_raw_split_args(kwargs), *outs)
    assert all(torch.isnan(o.float()).all() for o in outs), "an output was written before the range check"
    qkv = kwargs["qkv"].clone()
    with pytest.raises(ValueError, match="positions"):
        torch.ops.qkvfuse.split_qkv_rmsnorm_rope_inplace(qkv, *_raw_split_args(kwargs)[1:])
    assert torch.equal(qkv, kwargs["qkv"])


@pytest.mark.parametrize("T", [2, 300], ids=["decode", "gil-released"])
def test_public_range_check_raises_before_writing(T):
    """Through the public functions (the kernel releases the GIL for large calls): out-of-range positions raise
    ValueError naming positions, with every output (and qkv, in place) untouched."""
    case = SplitCase(T=T, num_q_heads=8, num_kv_heads=2, head_dim=128, rotary_dim=128, max_position=512)
    kwargs = make_split_inputs(case)
    positions = kwargs["positions"].clone()
    positions[-1] = 512
    kwargs["positions"] = positions
    outs = tuple(poisoned_like(torch.empty(T, w, dtype=case.dtype)) for w in (1024, 256, 256))
    with pytest.raises(ValueError, match=r"^positions: expected values in \[0, 512\)"):
        qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=outs, backend="cpu")
    assert all(torch.isnan(o.float()).all() for o in outs), "an output was written before the range check"
    with pytest.raises(ValueError, match="^positions"):
        qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="cpu")
    qkv = kwargs["qkv"].clone()
    with pytest.raises(ValueError, match="^positions"):
        qkvfuse.split_qkv_rmsnorm_rope_(qkv, **{k: v for k, v in kwargs.items() if k != "qkv"}, backend="cpu")
    assert torch.equal(qkv, kwargs["qkv"])


def test_range_check_message_matches_reference():
    kwargs = make_split_inputs(SplitCase(T=5, num_q_heads=2, num_kv_heads=1, head_dim=64, rotary_dim=32,
                                         max_position=100))
    kwargs["positions"] = torch.tensor([3, -7, 5, 120, 0], dtype=torch.int32)
    messages = []
    for backend in ("reference", "cpu"):
        with pytest.raises(ValueError) as info:
            qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend=backend)
        messages.append(str(info.value).splitlines()[0])
    expected = "positions: expected values in [0, 100) (cos_sin_cache rows), got values in [-7, 120]"
    assert messages[0] == messages[1] == expected


TAIL_CASES = [  # head_dim, rotary_dim, is_neox: every mix of 16-wide blocks, 8-wide steps and scalar tails
    (2, 2, True), (6, 4, False), (18, 18, True), (18, 6, False), (24, 24, True), (40, 34, True), (48, 48, False),
    (100, 62, True), (510, 510, False), (512, 512, True), (512, 2, True),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim,rotary_dim,is_neox", TAIL_CASES)
def test_vector_body_and_scalar_tails(head_dim, rotary_dim, is_neox, dtype):
    case = SplitCase(T=3, num_q_heads=2, num_kv_heads=1, head_dim=head_dim, rotary_dim=rotary_dim, dtype=dtype,
                     is_neox=is_neox, bias=True, weight_dtype=dtype, row_pad=2)
    kwargs = make_split_inputs(case, seed=head_dim)
    # Strided weight views: the kernel reads weights through their stride.
    for name in ("q_weight", "k_bias"):
        wide = torch.full((2 * head_dim,), float("nan"), dtype=kwargs[name].dtype)
        wide[::2] = kwargs[name]
        kwargs[name] = wide[::2]
    outs = (poisoned_like(torch.empty(3, 2 * head_dim, dtype=dtype), 4),
            poisoned_like(torch.empty(3, head_dim, dtype=dtype)), poisoned_like(torch.empty(3, head_dim, dtype=dtype)))
    result = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=outs, backend="cpu")
    report = check_split_outputs(result, oracle_split(**kwargs), unfused_split(**kwargs), kwargs["qkv"], 2, 1,
                                 head_dim)
    assert report.ok, report.detail


def _run_child(script: str, env_changes, timeout=300):
    env = dict(os.environ, **env_changes)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("form", ["split_inplace", "split_gated_inplace", "split_out", "split", "norm_inplace",
                                  "norm_out", "norm", "cache_inplace", "cache_out"])
def test_first_call_of_a_process_runs_the_native_kernel_of_its_own_op(form):
    """The first call of a process goes through the building-on-first-call kernel, which then runs the called op's
    own C++ kernel (not another form's): a gated in-place first call must not be refused as an overlapping out=
    call; its results (the caches too) are bitwise those of the next call, and an in-place write bumps the version
    counter once."""
    script = f"""
        import json, torch, qkvfuse
        form = {form!r}
        T, hq, hkv, D = 3, 4, 1, 256
        cache = qkvfuse.build_cos_sin_cache(64, 64, 1e7)
        gated = form == "split_gated_inplace"
        qkv = torch.randn(T, ((2 if gated else 1) * hq + 2 * hkv) * D, generator=torch.Generator().manual_seed(0))
        qkv, pos, w = qkv.to(torch.bfloat16), torch.arange(T), torch.randn(D) * 0.1
        kw = dict(q_weight=w, k_weight=w, q_gate=gated, gemma_norm=gated)
        x, r, nw = torch.randn(T, 64).to(torch.bfloat16), torch.randn(T, 64).to(torch.bfloat16), torch.randn(64)

        def call():  # the form under test on fresh copies: (outputs, version bumps of the written tensor)
            if form.startswith("cache"):  # the cache-writing split (outputs and both caches compared)
                target = qkv.clone()
                before = target._version
                caches = dict(key_cache=torch.zeros(2, 4, hkv, D, dtype=qkv.dtype),
                              value_cache=torch.zeros(2, 4, hkv, D, dtype=qkv.dtype),
                              slot_mapping=torch.tensor([5, -1, 2]))
                fn = (qkvfuse.split_qkv_rmsnorm_rope_cache_ if form == "cache_inplace"
                      else qkvfuse.split_qkv_rmsnorm_rope_cache)
                got = tuple(fn(target, pos, cache, hq, hkv, D, **caches, **kw))
                got += (caches["key_cache"], caches["value_cache"])
            elif form.startswith("split"):
                target = qkv.clone()
                before = target._version
                if form == "split":
                    got = qkvfuse.split_qkv_rmsnorm_rope(target, pos, cache, hq, hkv, D, **kw)
                elif form == "split_out":
                    got = tuple(torch.empty(T, n * D, dtype=qkv.dtype) for n in (hq, hkv, hkv))
                    qkvfuse.split_qkv_rmsnorm_rope(target, pos, cache, hq, hkv, D, out=got, **kw)
                else:
                    got = qkvfuse.split_qkv_rmsnorm_rope_(target, pos, cache, hq, hkv, D, **kw)
            else:
                target, res = x.clone(), r.clone()
                before = target._version
                if form == "norm":
                    got = qkvfuse.add_rmsnorm(target, res, nw)
                elif form == "norm_out":
                    got = (torch.empty_like(x), torch.empty_like(x))
                    qkvfuse.add_rmsnorm(target, res, nw, out=got)
                else:
                    got = qkvfuse.add_rmsnorm_(target, res, nw)
            return [t.clone() for t in got], target._version - before

        first, bumps = call()  # through the building-on-first-call kernel
        later, later_bumps = call()  # the C++ kernel the dispatcher now calls directly
        from qkvfuse.backends import cpu
        print(json.dumps({{"native": cpu.available()[0], "bumps": [bumps, later_bumps],
                          "equal": all(torch.equal(a, b) for a, b in zip(first, later))}}))
    """
    result = _run_child(script, {})
    assert result["native"] and result["equal"], result
    assert result["bumps"] == [1 if form.endswith("inplace") else 0] * 2, result


def test_no_compiler_falls_back_to_reference_with_one_warning(tmp_path):
    script = """
        import json, warnings, torch, qkvfuse
        from qkvfuse.backends import available_backends
        kw = dict(positions=torch.arange(2), cos_sin_cache=qkvfuse.build_cos_sin_cache(8, 4, 1e4), num_q_heads=1,
                  num_kv_heads=1, head_dim=8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                q, k, v = qkvfuse.split_qkv_rmsnorm_rope(torch.randn(2, 24), **kw)
                qkvfuse.add_rmsnorm(torch.randn(2, 8), None, torch.ones(8))
        try:
            qkvfuse.split_qkv_rmsnorm_rope(torch.randn(2, 24), **kw, backend="cpu")
            explicit = "no error"
        except RuntimeError as exc:
            explicit = str(exc)
        print(json.dumps({"warnings": [str(w.message) for w in caught], "reason": available_backends()["cpu"],
                          "explicit": explicit, "finite": bool(torch.isfinite(q).all())}))
    """
    env = {"CXX": str(tmp_path / "no-such-compiler"), "QKVFUSE_BUILD_DIR": str(tmp_path / "build"),
           "QKVFUSE_BACKEND": ""}
    result = _run_child(script, env)
    assert len(result["warnings"]) == 1, result["warnings"]
    warning = result["warnings"][0]
    assert "'cpu' unavailable" in warning and "using the reference backend" in warning
    assert "no C++ compiler" in warning and "\n" not in warning
    assert result["reason"].startswith("the native CPU kernel could not be built: no C++ compiler")
    assert "requested but is unavailable" in result["explicit"]
    assert result["finite"]


@pytest.mark.slow
def test_portable_default_vectors_build_and_match_oracle(tmp_path):
    """ATen's portable ``DEFAULT`` vectors (non-x86 machines) build and pass a few oracle cases (~1 min build)."""
    script = """
        import json, torch, qkvfuse
        from qkvfuse.backends import available_backends
        from qkvfuse._verify import (SplitCase, check_split_outputs, make_split_inputs, oracle_split,
                                     unfused_split)
        assert available_backends()["cpu"] == "", available_backends()["cpu"]
        failures = []
        for D, R, neox, dtype in ((128, 64, True, torch.bfloat16), (80, 80, False, torch.float16),
                                  (18, 6, True, torch.float32)):
            case = SplitCase(T=9, num_q_heads=3, num_kv_heads=1, head_dim=D, rotary_dim=R, dtype=dtype, is_neox=neox,
                             bias=True, mrope_section=(R // 2 - 2 * (R // 6), R // 6, R // 6))
            kw = make_split_inputs(case)
            report = check_split_outputs(qkvfuse.split_qkv_rmsnorm_rope(**kw, backend="cpu"), oracle_split(**kw),
                                         unfused_split(**kw), kw["qkv"], 3, 1, D)
            if not report.ok:
                failures.append(report.detail)
        import qkvfuse.backends.cpu as cpu
        print(json.dumps({"failures": failures, "capability": cpu.capability()}))
    """
    result = _run_child(script, {"QKVFUSE_CPU_CAPABILITY": "DEFAULT", "QKVFUSE_BUILD_DIR": str(tmp_path)}, 900)
    assert result == {"failures": [], "capability": "DEFAULT"}


def test_specialised_bf16_rounding_is_round_to_nearest_even():
    """The specialised paths' bf16 packing (AVX2: Bf16Block::pack_rne, 16-bit word arithmetic; AVX-512:
    avx512::round_lanes, the hardware conversion on AVX512-BF16 builds with pack_rne for blocks holding a
    denormal) against torch's ``.to(torch.bfloat16)``: every tie and near-tie pattern of the dropped half with
    both parities of the kept one, carries into the exponent, denormals, the largest finite values, infinities
    and zeros of both signs, and 2^22 random bit patterns. NaNs must stay NaN (payload unspecified) where the
    path can meet them: a NaN reaching it comes from a bf16 input (its dropped half is zero) or is the default
    NaN; a NaN with a non-zero dropped half (an fp32 table or weight) sends the token to the generic path, whose
    stores are NaN-safe."""
    if not hasattr(torch.ops.qkvfuse_cpu, "pack_rne_blocks"):
        pytest.skip("the specialised paths are built for AVX2 and AVX-512 only")
    block = torch.ops.qkvfuse_cpu.pack_rne_block_size()
    g = torch.Generator().manual_seed(5)
    high = torch.randint(0, 1 << 16, (4096,), generator=g, dtype=torch.int64)
    high = torch.cat([high, torch.tensor([0x0000, 0x0001, 0x007F, 0x0080, 0x3F7F, 0x3F80, 0x7F7F, 0x7F7E, 0x7F80,
                                          0x8000, 0x8001, 0x807F, 0xFF7F, 0xFF80])])
    low = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0xC000, 0x4000])
    patterns = (high[:, None] << 16 | low[None, :]).reshape(-1)
    normal = torch.randint(0x00800000, 0x7F800000, (1 << 16,), generator=g, dtype=torch.int64)  # blocks of no denormal
    patterns = torch.cat([patterns, normal, torch.randint(0, 1 << 32, (1 << 22,), generator=g, dtype=torch.int64)])
    patterns = patterns[: patterns.numel() // 32 * 32]
    x = patterns.to(torch.int32).view(torch.float32)  # wraps into int32's range: the same 32 bits
    got = torch.ops.qkvfuse_cpu.pack_rne_blocks(x)
    blocks = x.reshape(-1, 2, block // 2)
    expected = blocks.transpose(1, 2).reshape(-1).to(torch.bfloat16)  # out[B c + 2j + h] = x[B c + (B/2) h + j]
    nan = torch.isnan(expected)
    dropped = blocks.transpose(1, 2).reshape(-1).view(torch.int32) & 0xFFFF
    assert torch.isnan(got[nan & (dropped == 0)]).all()
    assert torch.equal(got[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", ["weight inf", "weight nan", "bias nan", "huge finite pair"])
def test_add_rmsnorm_nonfinite_weights_take_the_nan_safe_rows(dtype, bad):
    """The bf16 lane-order rows need finite weights and bias (their rounding skips the NaN fix-up); the check
    is folded into the per-call lane-order conversion. A non-finite value sends the call to the generic rows,
    whose results must match the reference element for element, NaNs included; two huge finite weights whose
    sum overflows must not count as non-finite (same results either way, but no needless slow path)."""
    H = 64
    kw = make_norm_inputs(4, H, dtype, residual=True, bias=bad.startswith("bias"), seed=3)
    weight = kw["weight"].clone()
    bias = kw.get("bias")
    if bad == "weight inf":
        weight[5] = float("inf")
    elif bad == "weight nan":
        weight[6] = float("nan")
    elif bad == "bias nan":
        bias = bias.clone()
        bias[7] = float("nan")
    else:
        weight[8:10] = 3e38
    kw = dict(kw, weight=weight, bias=bias)
    got = qkvfuse.add_rmsnorm(**kw, backend="cpu")
    expected = qkvfuse.add_rmsnorm(**kw, backend="reference")
    for g, e in zip(got, expected):
        assert torch.equal(torch.isnan(g), torch.isnan(e))
        torch.testing.assert_close(g, e, equal_nan=True, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("special", [None, "inf", "nan"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T, H", [(1, 4096), (3, 5120), (17, 64), (5, 48)])
def test_add_rmsnorm_bf16_weights_read_as_stored(T, H, bias, special):
    """bf16 activations with bf16 weights (a bf16 model's norms) read the weights as stored, without the
    conversion pass: the same bits as the same weights given in fp32 (finite weights), every form, and NaN
    where the reference has NaN (non-finite weights: every NaN then comes from a bf16 input, so the rounding of
    the lane-order rows stays exact)."""
    kw = make_norm_inputs(T, H, torch.bfloat16, residual=True, bias=bias, seed=T)
    weight = kw["weight"].to(torch.bfloat16)
    b16 = kw["bias"].to(torch.bfloat16) if bias else None
    if special:
        weight[3] = float(special)
    got = qkvfuse.add_rmsnorm(kw["x"], kw["residual"], weight, kw["eps"], b16, backend="cpu")
    x, r = kw["x"].clone(), kw["residual"].clone()
    qkvfuse.add_rmsnorm_(x, r, weight, kw["eps"], b16, backend="cpu")
    assert torch.equal(_bits(x), _bits(got[0])) and torch.equal(_bits(r), _bits(got[1]))
    if special is None:
        fp32 = qkvfuse.add_rmsnorm(kw["x"], kw["residual"], weight.float(), kw["eps"],
                                   b16.float() if bias else None, backend="cpu")
        assert torch.equal(_bits(got[0]), _bits(fp32[0])) and torch.equal(_bits(got[1]), _bits(fp32[1]))
    else:
        want = qkvfuse.add_rmsnorm(kw["x"], kw["residual"], weight, kw["eps"], b16, backend="reference")
        assert torch.equal(torch.isnan(got[0]), torch.isnan(want[0]))
        torch.testing.assert_close(got[0], want[0], equal_nan=True, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_finite_store_path_rounds_like_the_nan_safe_path(dtype):
    """A token whose cos/sin row holds a NaN takes the NaN-safe stores (ATen's converter); the same token with a
    finite row takes the finite stores. Every element the NaN does not reach must have the same bits."""
    case = SplitCase(T=4, num_q_heads=8, num_kv_heads=2, head_dim=128, rotary_dim=128, dtype=dtype, bias=True)
    kwargs = make_split_inputs(case, seed=11)
    half = case.rotary_dim // 2
    finite = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="cpu")
    cache = kwargs["cos_sin_cache"].clone()
    cache[kwargs["positions"], half - 1] = float("nan")  # cos of the last pair, every token
    poisoned = qkvfuse.split_qkv_rmsnorm_rope(**dict(kwargs, cos_sin_cache=cache), backend="cpu")
    reached = torch.zeros(case.head_dim, dtype=torch.bool)
    reached[[half - 1, 2 * half - 1]] = True
    for a, b in zip(finite[:2], poisoned[:2]):
        a, b = a.reshape(case.T, -1, case.head_dim), b.reshape(case.T, -1, case.head_dim)
        assert torch.isnan(b[..., reached]).all()
        assert torch.equal(_bits(a[..., ~reached].contiguous()), _bits(b[..., ~reached].contiguous()))


@pytest.mark.parametrize("is_neox,rotary_dim,norm", [(True, 128, True), (False, 64, True), (True, 64, False)],
                         ids=["qwen3-neox", "gptj-partial", "glm-air-no-norm"])
def test_specialised_and_streaming_store_paths_at_large_t(is_neox, rotary_dim, norm):
    """Outputs of 16 MB or more take the non-temporal-store path of the specialised bf16 D=128 kernel.

    Small test shapes never reach it, so this case is large on purpose (T=2304, Qwen3-8B heads: an 18 MB Q
    output): every element against the float64 oracle, NaN-poisoned out=, same bits with 1 and 2 threads
    and in place.
    """
    case = SplitCase(T=2304, num_q_heads=32, num_kv_heads=8, head_dim=128, rotary_dim=rotary_dim,
                     dtype=torch.bfloat16, is_neox=is_neox, norm=norm)
    kwargs = make_split_inputs(case, seed=11)
    qkv = kwargs["qkv"]
    out = tuple(poisoned_like(torch.empty(case.T, n * 128, dtype=torch.bfloat16)) for n in (32, 8, 8))
    got = _with_threads(2, lambda: qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="cpu"))
    report = check_split_outputs(got, oracle_split(**kwargs), unfused_split(**kwargs), qkv, 32, 8, 128)
    assert report.ok, report.detail
    one = _with_threads(1, lambda: qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend="cpu"))
    work = qkv.clone()
    views = qkvfuse.split_qkv_rmsnorm_rope_(work, **{k: v for k, v in kwargs.items() if k != "qkv"}, backend="cpu")
    for a, b, c in zip(got, one, views):
        assert torch.equal(_bits(a), _bits(b)) and torch.equal(_bits(a), _bits(c.contiguous()))


def test_capability_beyond_the_cpu_is_a_clear_error_not_sigill(tmp_path):
    """QKVFUSE_CPU_CAPABILITY naming an instruction set this CPU lacks: the backend is unavailable with that
    reason (auto falls back with one warning, an explicit backend="cpu" raises), never a SIGILL."""
    from qkvfuse.backends import cpu

    supported = cpu.supported_capabilities()
    if len(supported) == len(cpu._WIDTHS):
        pytest.skip(f"this CPU runs every build ({supported[-1]}): nothing beyond it to ask for")
    beyond = cpu._WIDTHS[len(supported)]
    script = """
        import json, warnings, torch, qkvfuse
        from qkvfuse.backends import available_backends
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y, _ = qkvfuse.add_rmsnorm(torch.randn(2, 8), None, torch.ones(8))
        try:
            qkvfuse.add_rmsnorm(torch.randn(2, 8), None, torch.ones(8), backend="cpu")
            explicit = "no error"
        except RuntimeError as exc:
            explicit = str(exc)
        print(json.dumps({"warnings": [str(w.message) for w in caught], "explicit": explicit,
                          "reason": available_backends()["cpu"]}))
    """
    result = _run_child(script, {"QKVFUSE_CPU_CAPABILITY": beyond, "QKVFUSE_BUILD_DIR": str(tmp_path),
                                 "QKVFUSE_BACKEND": ""})
    assert len(result["warnings"]) == 1 and "this CPU supports up to" in result["warnings"][0]
    assert f"QKVFUSE_CPU_CAPABILITY={beyond}: this CPU supports up to" in result["reason"]
    assert "requested but is unavailable" in result["explicit"]


def _gated_inputs(case: SplitCase, seed: int, gemma: bool):
    """``(gated, plain)``: keyword arguments of a gated call (``q_gate=True``, a ``[T, (2Hq + 2Hkv) * D]`` row
    ``[q_0 | g_0 | ... | k | v]``, ``case.row_pad`` extra elements per row) and of the plain call on the same
    heads de-interleaved (the oracle's input; Gemma weights there as their fp32 ``1 + w``), plus the gate."""
    plain = make_split_inputs(case, seed=seed)
    T, hq, D = case.T, case.num_q_heads, case.head_dim
    q, kv = plain["qkv"][:, : hq * D], plain["qkv"][:, hq * D :]
    g = torch.Generator().manual_seed(seed + 1)
    gate = (torch.randn(T, hq * D, generator=g) * 3).to(case.dtype)
    width = 2 * hq * D + kv.shape[1]
    buf = torch.full((T, width + case.row_pad), float("nan"), dtype=case.dtype)
    buf[:, : 2 * hq * D] = torch.stack([q.reshape(T, hq, D), gate.reshape(T, hq, D)], 2).reshape(T, 2 * hq * D)
    buf[:, 2 * hq * D : width] = kv
    gated = dict(plain, qkv=buf[:, :width], q_gate=True, gemma_norm=gemma)
    if gemma and case.norm:  # weights stored centred at 0; the plain call takes 1 + w (fp32), the same values
        for name in ("q_weight", "k_weight"):
            gated[name] = plain[name] - 1.0
            plain[name] = 1.0 + gated[name]
    return gated, plain, gate


GATED_CASES = [  # Qwen3.5 full attention per rank: head_dim 256, rotary 64 NeoX, Gemma QK-norm
    SplitCase(T=7, num_q_heads=4, num_kv_heads=1, head_dim=256, rotary_dim=64, dtype=torch.bfloat16, row_pad=16),
    SplitCase(T=1, num_q_heads=3, num_kv_heads=1, head_dim=256, rotary_dim=64, dtype=torch.bfloat16),
    SplitCase(T=0, num_q_heads=2, num_kv_heads=2, head_dim=256, rotary_dim=64, dtype=torch.bfloat16),
    SplitCase(T=9, num_q_heads=3, num_kv_heads=1, head_dim=256, rotary_dim=64, dtype=torch.bfloat16,
              mrope_section=(11, 11, 10), mrope_interleaved=True, pos_dtype=torch.int32, row_pad=2),
    SplitCase(T=5, num_q_heads=2, num_kv_heads=2, head_dim=256, rotary_dim=64, dtype=torch.float16,
              mrope_section=(11, 11, 10), mrope_interleaved=True, row_pad=8),
    SplitCase(T=6, num_q_heads=4, num_kv_heads=2, head_dim=128, rotary_dim=128, dtype=torch.float32,
              pos_dtype=torch.int32),
    SplitCase(T=4, num_q_heads=5, num_kv_heads=1, head_dim=128, rotary_dim=64, dtype=torch.bfloat16, norm=False),
    SplitCase(T=3, num_q_heads=3, num_kv_heads=1, head_dim=18, rotary_dim=6, dtype=torch.bfloat16, is_neox=False),
]


@pytest.mark.parametrize("gemma", [True, False], ids=["gemma", "plain-weights"])
@pytest.mark.parametrize("case", GATED_CASES, ids=["bf16-4x1", "bf16-T1-3x1", "bf16-T0-2x2", "bf16-mropeI-int32",
                                                   "fp16-mropeI-strided", "fp32-128", "bf16-nonorm", "bf16-gptj-18"])
def test_gated_layout_matches_reference(case, gemma):
    """The gated layout (``q_gate``) through the native kernel, every form: q and k within the accuracy rule of
    the oracle (run on the de-interleaved heads) and bit for bit the plain layout's result on those heads (the
    layout only moves the Q source), v and gate bit-exact, the same as the reference backend's v and gate; out=
    (NaN-poisoned, strided), functional and in-place agree bit for bit, the in-place views being the out=
    results; 1 and 2 threads agree."""
    if gemma and not case.norm:
        pytest.skip("gemma_norm changes nothing without QK-norm")
    gated, plain, gate = _gated_inputs(case, seed=case.T + case.head_dim, gemma=gemma)
    T, hq, hkv, D = case.T, case.num_q_heads, case.num_kv_heads, case.head_dim
    functional = _with_threads(2, lambda: qkvfuse.split_qkv_rmsnorm_rope(**gated, backend="cpu"))
    assert len(functional) == 4
    report = check_split_outputs(functional[:3], oracle_split(**plain), unfused_split(**plain), plain["qkv"], hq, hkv,
                                 D)
    assert report.ok, report.detail
    assert torch.equal(_bits(functional[3]), _bits(gate))
    reference = qkvfuse.split_qkv_rmsnorm_rope(**gated, backend="reference")
    for i in (2, 3):  # v and gate: bit-exact copies on both backends
        assert torch.equal(_bits(functional[i]), _bits(reference[i]))
    unfused_ref = check_split_outputs(reference[:3], oracle_split(**plain), unfused_split(**plain), plain["qkv"], hq,
                                      hkv, D)
    assert unfused_ref.ok, unfused_ref.detail
    # The layout only moves where the Q heads are read from: the plain layout's bits.
    for a, b in zip(functional[:3], qkvfuse.split_qkv_rmsnorm_rope(**plain, backend="cpu")):
        assert torch.equal(_bits(a), _bits(b))
    one = _with_threads(1, lambda: qkvfuse.split_qkv_rmsnorm_rope(**gated, backend="cpu"))
    widths = (hq * D, hkv * D, hkv * D, hq * D)
    outs = tuple(poisoned_like(torch.empty(T, w + 4, dtype=case.dtype), 4)[:, :w] for w in widths)
    got = qkvfuse.split_qkv_rmsnorm_rope(**gated, out=outs, backend="cpu")
    assert all(g is o for g, o in zip(got, outs))
    work = gated["qkv"].clone() if case.row_pad == 0 else gated["qkv"]._base.clone()[:, : gated["qkv"].shape[1]]
    views = _with_threads(2, lambda: qkvfuse.split_qkv_rmsnorm_rope_(
        work, **{k: v for k, v in gated.items() if k != "qkv"}, backend="cpu"))
    assert len(views) == 4 and all(view.stride(0) == work.stride(0) for view in views)
    for f, o, a, view in zip(functional, one, outs, views):
        assert torch.equal(_bits(f), _bits(o)) and torch.equal(_bits(f), _bits(a))
        assert torch.equal(_bits(f), _bits(view.contiguous()))
    if case.row_pad:  # the in-place form wrote nothing past the row
        assert torch.isnan(work._base[:, work.shape[1] :].float()).all()


def test_gated_out_may_alias_k_and_v_slices():
    """Gated out= with k_out and v_out exactly their own slices of qkv (k rewritten in place, V not copied):
    the same bits as fresh outputs, the Q/gate region left as it was."""
    case = SplitCase(T=5, num_q_heads=4, num_kv_heads=1, head_dim=256, rotary_dim=64, dtype=torch.bfloat16,
                     row_pad=32)
    gated, _, _ = _gated_inputs(case, seed=2, gemma=True)
    want = qkvfuse.split_qkv_rmsnorm_rope(**gated, backend="cpu")
    qkv = gated["qkv"].clone()
    before = qkv[:, : 8 * 256].clone()
    q_out, gate_out = torch.empty(5, 1024, dtype=torch.bfloat16), torch.empty(5, 1024, dtype=torch.bfloat16)
    k_out, v_out = qkv[:, 2048:2304], qkv[:, 2304:]
    qkvfuse.split_qkv_rmsnorm_rope(**dict(gated, qkv=qkv), out=(q_out, k_out, v_out, gate_out), backend="cpu")
    for a, b in zip((q_out, k_out, v_out, gate_out), want):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(qkv[:, :2048]), _bits(before))


@pytest.mark.parametrize("head_dim,rotary_dim", [(256, 64), (128, 128)])
def test_gated_nonfinite_heads_every_form(head_dim, rotary_dim):
    """Gated heads whose sum of squares overflows or holds a NaN leave the AVX2 batch for the generic head; in
    place that head's input must still be there (the region is read whole first): every form gives the same
    bits, NaNs at the same places, the gate copied bit-exact."""
    case = SplitCase(T=6, num_q_heads=5, num_kv_heads=1, head_dim=head_dim, rotary_dim=rotary_dim,
                     dtype=torch.bfloat16)
    gated, _, gate = _gated_inputs(case, seed=7, gemma=True)
    qkv = gated["qkv"].clone()
    D = head_dim
    qkv[0, 2 * D + 3] = float("inf")  # Q head 1 of token 0
    qkv[2, 6 * D + 1] = float("nan")  # Q head 3 of token 2
    qkv[3, 3 * D + 5] = float("nan")  # gate head 1 of token 3
    qkv[4, 10 * D] = 3e38  # K head of token 4: its square overflows
    gated = dict(gated, qkv=qkv)
    functional = qkvfuse.split_qkv_rmsnorm_rope(**gated, backend="cpu")
    work = qkv.clone()
    views = qkvfuse.split_qkv_rmsnorm_rope_(work, **{k: v for k, v in gated.items() if k != "qkv"}, backend="cpu")
    reference = qkvfuse.split_qkv_rmsnorm_rope(**gated, backend="reference")
    for f, view, r in zip(functional, views, reference):
        assert torch.equal(torch.isnan(f), torch.isnan(r))
        assert torch.equal(_bits(f), _bits(view.contiguous()))
    gate_in = qkv[:, : 10 * D].reshape(6, 5, 2, D)[:, :, 1].reshape(6, 5 * D)
    assert torch.equal(_bits(functional[3]), _bits(gate_in))
    assert torch.isnan(functional[0][0, D : 2 * D]).any() and torch.isnan(functional[0][2, 3 * D : 4 * D]).all()


def test_gated_streaming_store_path_at_large_t():
    """Gated outputs of 16 MB or more stream (non-temporal stores, the gate heads too): Qwen3.5-35B-A3B's full
    attention heads (16/2, head_dim 256, rotary 64, Gemma QK-norm) at T=1024, the same bits as the plain layout
    on the de-interleaved heads (below the streaming size), in place and with 1 thread."""
    case = SplitCase(T=1024, num_q_heads=16, num_kv_heads=2, head_dim=256, rotary_dim=64, dtype=torch.bfloat16)
    gated, plain, gate = _gated_inputs(case, seed=4, gemma=True)
    got = _with_threads(2, lambda: qkvfuse.split_qkv_rmsnorm_rope(**gated, backend="cpu"))
    want = qkvfuse.split_qkv_rmsnorm_rope(**plain, backend="cpu")
    for a, b in zip(got, (*want, gate)):
        assert torch.equal(_bits(a), _bits(b))
    one = _with_threads(1, lambda: qkvfuse.split_qkv_rmsnorm_rope(**gated, backend="cpu"))
    work = gated["qkv"].clone()
    views = qkvfuse.split_qkv_rmsnorm_rope_(work, **{k: v for k, v in gated.items() if k != "qkv"}, backend="cpu")
    for a, b, c in zip(got, one, views):
        assert torch.equal(_bits(a), _bits(b)) and torch.equal(_bits(a), _bits(c.contiguous()))
