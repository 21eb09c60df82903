"""torch.library registration: opcheck on every op, torch.compile(fullgraph=True) through the public API."""

import pytest
import torch
from torch.library import opcheck

import qkvfuse
from qkvfuse.testing import SplitCase, make_split_inputs

CASE = SplitCase(T=5, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, dtype=torch.float32, bias=True)
MROPE = SplitCase(T=5, num_q_heads=2, num_kv_heads=1, head_dim=64, rotary_dim=64, dtype=torch.bfloat16,
                  mrope_section=(12, 10, 10), mrope_interleaved=True)


def _op_args(case):
    kw = make_split_inputs(case)
    return (kw["qkv"], kw["positions"], kw["cos_sin_cache"], kw["num_q_heads"], kw["num_kv_heads"], kw["head_dim"],
            kw.get("q_weight"), kw.get("k_weight"), kw.get("q_bias"), kw.get("k_bias"), kw["eps"], kw["is_neox"],
            list(kw["mrope_section"] or []), kw["mrope_interleaved"])


@pytest.mark.parametrize("case", [CASE, MROPE], ids=["rope", "mrope"])
def test_opcheck_split_ops(case):
    args = _op_args(case)
    opcheck(torch.ops.qkvfuse.split_qkv_rmsnorm_rope.default, args)
    qkv = args[0]
    hq, hkv, d = case.num_q_heads, case.num_kv_heads, case.head_dim
    outs = (qkv.new_empty(case.T, hq * d), qkv.new_empty(case.T, hkv * d), qkv.new_empty(case.T, hkv * d))
    opcheck(torch.ops.qkvfuse.split_qkv_rmsnorm_rope_out.default, args + outs)
    opcheck(torch.ops.qkvfuse.split_qkv_rmsnorm_rope_inplace.default, (qkv.clone(),) + args[1:])


@pytest.mark.parametrize("with_residual", [True, False])
def test_opcheck_norm_ops(with_residual):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    residual = torch.randn(4, 64, dtype=torch.bfloat16) if with_residual else None
    weight, bias = torch.randn(64), torch.randn(64)
    opcheck(torch.ops.qkvfuse.add_rmsnorm.default, (x, residual, weight, bias, 1e-6))
    res_out = torch.empty_like(x) if with_residual else None
    opcheck(torch.ops.qkvfuse.add_rmsnorm_out.default, (x, residual, weight, bias, 1e-6, torch.empty_like(x), res_out))


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
