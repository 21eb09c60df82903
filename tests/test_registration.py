"""torch.library registration: opcheck on every op, torch.compile(fullgraph=True) through the public API."""

import pytest
import torch
from torch.library import opcheck

import qkvfuse
from qkvfuse._library import decode_flags, decode_rope, encode_rope
from qkvfuse._library import NAMESPACES, split_config
from qkvfuse.backends import get_backend, select_ops
from qkvfuse._cache_mode import encode_cache
from qkvfuse._verify import SplitCase, make_split_inputs
from qkvfuse._verify.cache import CacheCase, make_cache_inputs

CASE = SplitCase(T=5, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, dtype=torch.float32, bias=True)
MROPE = SplitCase(T=5, num_q_heads=2, num_kv_heads=1, head_dim=64, rotary_dim=64, dtype=torch.bfloat16,
                  mrope_section=(12, 10, 10), mrope_interleaved=True)


def _op_args(case):
    """The split schema's arguments (qkvfuse._library): head_dim implied by qkv, the rope layout as one int."""
    kw = make_split_inputs(case)
    return (kw["qkv"], kw["positions"], *split_config(**kw).schema_args())


def _overload(op: str, backend: str):
    return getattr(getattr(torch.ops, NAMESPACES[select_ops(backend, "cpu")]), op).default


@pytest.mark.parametrize("case", [CASE, MROPE], ids=["rope", "mrope"])
def test_opcheck_split_ops(case, backend):
    """opcheck (schema, fake kernel, aliasing, autograd registration) of the overload each backend runs, on its
    own kernel: the cpu backend's native kernels, the reference, Triton under the interpreter."""
    args = _op_args(case)
    if backend == "triton":  # the interpreter copies through numpy: no tracing tests, the fake/schema tests only
        utils = ("test_schema", "test_faketensor")
    else:
        utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    opcheck(_overload("split_qkv_rmsnorm_rope", backend), args, test_utils=utils)
    qkv = args[0]
    hq, hkv, d = case.num_q_heads, case.num_kv_heads, case.head_dim
    outs = (qkv.new_empty(case.T, hq * d), qkv.new_empty(case.T, hkv * d), qkv.new_empty(case.T, hkv * d))
    opcheck(_overload("split_qkv_rmsnorm_rope_out", backend), args + outs, test_utils=utils)
    opcheck(_overload("split_qkv_rmsnorm_rope_inplace", backend), (qkv.clone(),) + args[1:], test_utils=utils)


@pytest.mark.parametrize("layout, cache_dtype", [("NHD", None), ("vec", None), ("amx", None),
                                                 ("HND", torch.float8_e4m3fn)])
def test_opcheck_cache_ops(layout, cache_dtype, backend):
    """opcheck of both cache-writing forms: the caches (and the out= outputs) declared written, qkv written only in
    place, the fake kernels' results and aliasing those of the kernels."""
    case = CacheCase(SplitCase(T=5, num_q_heads=2, num_kv_heads=2, head_dim=64, rotary_dim=32, dtype=torch.bfloat16),
                     layout=layout, cache_dtype=cache_dtype, slots="skips")
    kw = make_cache_inputs(case)
    split = _op_args(case.split)
    cache = (kw["key_cache"], kw["value_cache"], kw["slot_mapping"], encode_cache(layout), kw.get("k_scale"),
             kw.get("v_scale"))
    utils = ("test_schema", "test_faketensor") if backend == "triton" else (
        "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if cache_dtype is not None:  # opcheck's schema test compares tensors with arithmetic FP8 lacks on CPU
        utils = tuple(u for u in utils if u != "test_schema")
    opcheck(_overload("split_qkv_rmsnorm_rope_cache", backend), (split[0].clone(),) + split[1:] + cache,
            test_utils=utils)
    qkv, d = split[0], case.split.head_dim
    outs = tuple(qkv.new_empty(case.split.T, n * d) for n in (2, 2, 2))
    opcheck(_overload("split_qkv_rmsnorm_rope_cache_out", backend), split + cache + outs, test_utils=utils)


@pytest.mark.parametrize("with_residual", [True, False])
def test_opcheck_norm_ops(with_residual, backend):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    residual = torch.randn(4, 64, dtype=torch.bfloat16) if with_residual else None
    weight, bias = torch.randn(64), torch.randn(64)
    utils = ("test_schema", "test_faketensor") if backend == "triton" else (
        "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    opcheck(_overload("add_rmsnorm", backend), (x, residual, weight, bias, 1e-6), test_utils=utils)
    res_out = torch.empty_like(x) if with_residual else None
    opcheck(_overload("add_rmsnorm_out", backend), (x, residual, weight, bias, 1e-6, torch.empty_like(x), res_out),
            test_utils=utils)
    opcheck(_overload("add_rmsnorm_inplace", backend),
            (x.clone(), residual.clone() if with_residual else None, weight, bias, 1e-6), test_utils=utils)


@pytest.mark.parametrize("code", [(True, (), False), (False, (), False), (True, (24, 20, 20), True),
                                  (False, (8, 12, 12), False), (True, (0, 0, 256), True), (True, (1023, 0, 1), False)])
@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "q_gate", "gemma", "q_gate-gemma"])
def test_rope_code_round_trips_through_python_and_the_native_kernel(code, flags):
    """The one int carrying the rotation style, mRoPE layout and the layout flags decodes the same in Python and
    in C++."""
    pytest.importorskip("qkvfuse.backends.cpu")
    get_backend("cpu")
    rope = encode_rope(*code, *flags)
    assert decode_rope(rope) == code and decode_flags(rope) == flags
    native = torch.ops.qkvfuse_cpu.decode_rope(rope)
    assert (bool(native[0]), tuple(native[3:6]) if native[1] else (), bool(native[2])) == code
    assert (bool(native[6]), bool(native[7])) == flags


def test_torch_compile_fullgraph(backend):
    if backend == "triton":
        pytest.skip("Triton on CPU tensors runs under the interpreter, outside torch.compile")
    kw = make_split_inputs(CASE)
    qkv, positions = kw.pop("qkv"), kw.pop("positions")
    expected = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, **kw, backend=backend)

    @torch.compile(fullgraph=True, dynamic=True)
    def prepare(qkv, positions, x, residual, weight):
        q, k, v = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, **kw, backend=backend)
        y, r = qkvfuse.add_rmsnorm(x, residual, weight, 1e-6, backend=backend)
        return q, k, v, y, r

    x, residual, weight = torch.randn(5, 256), torch.randn(5, 256), torch.randn(256)
    q, k, v, y, r = prepare(qkv, positions, x, residual, weight)
    for a, b in zip((q, k, v), expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    y_ref, r_ref = qkvfuse.add_rmsnorm(x, residual, weight, 1e-6, backend=backend)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(r, r_ref)
    # A new token count must not need a new graph (dynamic shapes) and still match.
    kw2 = make_split_inputs(SplitCase(T=11, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32,
                                      dtype=torch.float32, bias=True), seed=3)
    q2 = prepare(kw2["qkv"], kw2["positions"], torch.randn(11, 256), torch.randn(11, 256), weight)[0]
    expected2 = qkvfuse.split_qkv_rmsnorm_rope(kw2["qkv"], kw2["positions"], **kw, backend=backend)[0]
    torch.testing.assert_close(q2, expected2, rtol=1e-6, atol=1e-6)


def test_compiled_in_place_variant(backend):
    if backend == "triton":
        pytest.skip("Triton on CPU tensors runs under the interpreter, outside torch.compile")
    kw = make_split_inputs(CASE)
    qkv = kw.pop("qkv")
    expected = qkvfuse.split_qkv_rmsnorm_rope(qkv, **kw, backend=backend)
    compiled = torch.compile(lambda t: qkvfuse.split_qkv_rmsnorm_rope_(t, **kw, backend=backend), fullgraph=True)
    work = qkv.clone()
    compiled(work)
    hq, hkv, d = CASE.num_q_heads, CASE.num_kv_heads, CASE.head_dim
    torch.testing.assert_close(work[:, : hq * d], expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(work[:, hq * d : (hq + hkv) * d], expected[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_torch_export_keeps_the_ops(backend, strict):
    """``torch.export`` (strict: through dynamo; non-strict: Python run on fake tensors under a tracing mode)
    records the cpu backend's qkvfuse ops, not the native fast path's result (the reference backend is plain
    aten ops, recorded as such), and the exported program matches eager."""
    if backend == "triton":
        pytest.skip("Triton on CPU tensors runs under the interpreter, outside torch.export")
    kw = make_split_inputs(MROPE)
    qkvfuse.split_qkv_rmsnorm_rope(**kw, backend=backend)  # an eager call first (binds the cpu entry)

    class Prepare(torch.nn.Module):
        def forward(self, qkv, positions, cache, q_weight, k_weight):
            q, k, v = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, cache, 2, 1, 64, q_weight=q_weight,
                                                     k_weight=k_weight, mrope_section=(12, 10, 10),
                                                     mrope_interleaved=True, backend=backend)
            y, _ = qkvfuse.add_rmsnorm(q, None, q_weight.repeat(2), backend=backend)
            return q, k, v, y

    args = (kw["qkv"], kw["positions"], kw["cos_sin_cache"], kw["q_weight"], kw["k_weight"])
    program = torch.export.export(Prepare(), args, strict=strict)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    if backend == "cpu":
        assert {"qkvfuse.split_qkv_rmsnorm_rope.default", "qkvfuse.add_rmsnorm.default"} <= targets
    for got, want in zip(program.module()(*args), Prepare()(*args)):
        assert torch.equal(got, want)


def test_unknown_backend_is_a_clear_error(monkeypatch):
    kw = make_split_inputs(CASE)
    with pytest.raises(ValueError, match="backend"):
        qkvfuse.split_qkv_rmsnorm_rope(**kw, backend="cuda-magic")
    monkeypatch.setenv("QKVFUSE_BACKEND", "nope")
    with pytest.raises(ValueError, match="QKVFUSE_BACKEND"):
        qkvfuse.split_qkv_rmsnorm_rope(**kw)


def test_import_registers_every_backends_kernels_without_building_or_importing_them(tmp_path):
    """``import qkvfuse`` registers the CPU, CUDA/XPU/PrivateUse1 and reference kernels of every op (a
    ``torch.export`` program loaded in a fresh process reaches them), yet imports no Triton and builds nothing."""
    import subprocess
    import sys

    script = """
import sys, torch, qkvfuse
from qkvfuse._library import OPS as ops
missing = [(op, ns, key) for op in ops for ns, keys in (("qkvfuse", ("CPU", "CUDA", "XPU", "PrivateUse1")),
           ("qkvfuse_triton", ("CPU", "CUDA")), ("qkvfuse_reference", ("CompositeExplicitAutograd",)))
           for key in keys if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{op}", key)]
import qkvfuse.backends.cpu as cpu
print(missing, "triton" in sys.modules, cpu._state)
"""
    env = dict(__import__("os").environ, QKVFUSE_BUILD_DIR=str(tmp_path))  # an empty cache: a build would show
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[]", "False", "None"], proc.stdout
    assert "building" not in proc.stderr
