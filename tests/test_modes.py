"""Contract: a result never depends on which PyTorch mode is active.

Every entry point -- :class:`qkvfuse.QKNormRope` (call, ``out=`` into a packed buffer, ``out=`` exactly aliasing
its own slices of ``qkv``, ``.inplace``), the public :func:`~qkvfuse.split_qkv_rmsnorm_rope` (functional, ``out=``)
and :func:`~qkvfuse.split_qkv_rmsnorm_rope_`, the cache-writing :func:`~qkvfuse.split_qkv_rmsnorm_rope_cache_` and
``QKNormRope.inplace_cache`` (a bf16/fp32 NHD cache; an FP8 vLLM-CPU ``vec`` cache), their out-of-place forms
:func:`~qkvfuse.split_qkv_rmsnorm_rope_cache` (fresh outputs, an HND cache) and ``QKNormRope.with_cache`` (``out=``
into a packed buffer, an FP8 NHD cache), :class:`qkvfuse.AddRMSNorm` (call, in-place ``out=(x, residual)``,
``.inplace``), :func:`~qkvfuse.add_rmsnorm` (with and without a residual) and :func:`~qkvfuse.add_rmsnorm_` -- runs
in one module, :class:`Prepare`, which each test runs eagerly and then under one mode: ``torch.jit.trace``,
``torch.export`` (strict / non-strict, saved and loaded in a fresh process), ``torch.compile`` (static, dynamic over
T), ``FakeTensorMode`` and meta tensors, a ``TorchDispatchMode`` / ``TorchFunctionMode``, the profiler,
``inference_mode`` / ``no_grad``. Outputs must be
**bitwise** equal to eager (compared as integers, so NaN and -0.0 count too), and where the mode records a graph
or a trace, it must contain the qkvfuse ops.

Also here: the inference-only rule (inputs requiring grad under grad mode), version counters of in-place writes
(autograd must see them), and the packed-output / overlap rule.

Shapes are small (T <= 8 except the dynamic-shape sweep, head_dim 64, partial rotary; one RoPE bf16 case, one
mRoPE fp32 case and one gated + Gemma bf16 case -- Qwen3.5's layout: ``q_gate``, ``gemma_norm``, interleaved mRoPE
-- whose entry points return ``(q, k, v, gate)`` and take four ``out=`` tensors). Triton runs CPU tensors under
``TRITON_INTERPRET=1`` (set by conftest) in every mode here, also inside compiled and exported graphs: the graphs
call the op, whose kernel runs eagerly at run time.
"""

import contextlib
import dataclasses
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import qkvfuse
from _support.bits import assert_bitwise
from qkvfuse._library import NAMESPACES, OPS
from qkvfuse.backends import select_ops
from qkvfuse._verify import SplitCase, make_norm_inputs, make_split_inputs

# torch.jit.trace / script_method are deprecated (a DeprecationWarning per use); still a mode users run.
pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")

ROPE = SplitCase(T=7, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, dtype=torch.bfloat16, bias=True)
MROPE = SplitCase(T=5, num_q_heads=2, num_kv_heads=1, head_dim=64, rotary_dim=48, dtype=torch.float32,
                  mrope_section=(8, 8, 8), mrope_interleaved=True)
GATED = SplitCase(T=5, num_q_heads=2, num_kv_heads=1, head_dim=64, rotary_dim=32, dtype=torch.bfloat16,
                  mrope_section=(6, 5, 5), mrope_interleaved=True, q_gate=True, gemma_norm=True)
CASES = {"rope-bf16": ROPE, "mrope-fp32": MROPE, "gated-gemma-bf16": GATED}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=list(CASES), ids=list(CASES))
def case(request) -> SplitCase:
    return CASES[request.param]


# --------------------------------------------------------------------------------------------------------
# The module under test and its inputs.
# --------------------------------------------------------------------------------------------------------
def static_args(case: SplitCase):
    """``(split kwargs without qkv/positions, norm weight, norm bias)`` -- the layer's static configuration."""
    kw = make_split_inputs(case, seed=0)
    del kw["qkv"], kw["positions"]
    hidden = case.num_q_heads * case.head_dim
    g = torch.Generator().manual_seed(100)
    weight = (0.0 if case.gemma_norm else 1.0) + 0.2 * torch.randn(hidden, generator=g)  # Gemma: centred at 0
    bias = 0.1 * torch.randn(hidden, generator=g) if case.bias else None
    return kw, weight, bias


def call_inputs(case: SplitCase, seed: int, T=None):
    """``(qkv, positions, residual)`` for one call; a new ``seed`` gives new values of the same shapes."""
    if T is not None:
        case = dataclasses.replace(case, T=T)
    kw = make_split_inputs(case, seed=seed)
    residual = make_norm_inputs(case.T, case.num_q_heads * case.head_dim, case.dtype, seed=seed + 50)["residual"]
    return kw["qkv"], kw["positions"], residual


class Prepare(torch.nn.Module):
    """Every public entry point once, on one layer's configuration; returns all their outputs (gated: each split
    entry point's four, ``(q, k, v, gate)``)."""

    def __init__(self, case: SplitCase, backend, static=None):
        super().__init__()
        kw, weight, bias = static if static is not None else static_args(case)
        self.kw, self.backend, self.weight, self.bias = kw, backend, weight, bias
        hq, hkv, d = case.num_q_heads, case.num_kv_heads, case.head_dim
        self.gated, self.gemma = case.q_gate, case.gemma_norm
        self.sizes = [hq * d, hkv * d, hkv * d] + ([hq * d] if case.q_gate else [])  # out= order: q, k, v(, gate)
        self.k_start = (2 if case.q_gate else 1) * hq * d  # K's first column in qkv
        self.prep = qkvfuse.QKNormRope(**kw, backend=backend)  # the case's keywords, whichever it sets
        self.norm = qkvfuse.AddRMSNorm(weight, 1e-6, bias, gemma_norm=case.gemma_norm, backend=backend)

    def own_slices(self, qkv):
        """``out=`` tensors exactly aliasing their own slices of ``qkv`` (gated, only K and V have one: q and gate
        are fresh)."""
        if not self.gated:
            return tuple(qkv.split(self.sizes, dim=1))
        q_width, kv_width = self.sizes[0], self.sizes[1]
        k, v = qkv[:, self.k_start : self.k_start + kv_width], qkv[:, self.k_start + kv_width :]
        return qkv.new_empty(qkv.shape[0], q_width), k, v, qkv.new_empty(qkv.shape[0], q_width)

    def forward(self, qkv, positions, residual):
        kw, b = self.kw, self.backend
        outs = []
        fresh = self.prep(qkv, positions)  # bound object, fresh outputs
        q = fresh[0]
        outs += fresh
        packed = qkv.new_empty(qkv.shape[0], sum(self.sizes))  # bound object, out= column views of one buffer
        self.prep(qkv, positions, out=tuple(packed.split(self.sizes, dim=1)))
        work = qkv.clone()  # bound object, in place
        self.prep.inplace(work, positions)
        aliased = qkv.clone()  # bound object, out= exactly its own slices of qkv
        own = self.own_slices(aliased)
        self.prep(aliased, positions, out=own)
        outs += [packed, work, aliased] + ([own[0], own[3]] if self.gated else [])
        functional = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, **kw, backend=b)  # public, functional
        fq = functional[0]
        outs += functional
        fpacked = qkv.new_empty(qkv.shape[0], sum(self.sizes))  # public, out=
        qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, **kw, out=tuple(fpacked.split(self.sizes, dim=1)), backend=b)
        fwork = qkv.clone()  # public, in place
        views = qkvfuse.split_qkv_rmsnorm_rope_(fwork, positions, **kw, backend=b)
        outs += [fpacked, fwork] + ([views[3]] if self.gated else [])  # the gate view of the in-place row
        # The cache-writing split, public and bound: a bf16/fp32 NHD cache and an FP8 vLLM-CPU "vec" cache (K and
        # V the halves of one buffer), slots derived from T (every third token skipped).
        T, d = qkv.shape[0], self.kw["head_dim"]
        heads = self.sizes[1] // d
        token = torch.arange(T, device=qkv.device)
        slots = torch.where(token % 3 == 2, -1, (token + token + token) % 64)  # (a traced `* 3` replays wrongly)
        k_cache, v_cache = qkv.new_zeros(4, 16, heads, d), qkv.new_zeros(4, 16, heads, d)
        cwork = qkv.clone()
        cviews = qkvfuse.split_qkv_rmsnorm_rope_cache_(cwork, positions, **kw, key_cache=k_cache, value_cache=v_cache,
                                                       slot_mapping=slots, backend=b)
        kv8 = torch.zeros(4, heads, 32, d, dtype=torch.float8_e4m3fn, device=qkv.device)
        k8, v8 = kv8.chunk(2, dim=2)
        bwork = qkv.clone()
        k_scale = qkv.new_full((), 0.05, dtype=torch.float32)
        v_scale = qkv.new_full((), 0.07, dtype=torch.float32)
        self.prep.inplace_cache(bwork, positions, k8, v8, slots, layout="vec", k_scale=k_scale, v_scale=v_scale,
                                fp8_rounding="truncate")
        outs += [cwork, cviews[1], k_cache, v_cache, bwork, kv8]
        # Out of place: public with fresh outputs into an HND cache, bound into out= column views of one buffer
        # and an FP8 e5m2 NHD cache.
        hk_cache, hv_cache = qkv.new_zeros(4, heads, 16, d), qkv.new_zeros(4, heads, 16, d)
        couts = qkvfuse.split_qkv_rmsnorm_rope_cache(qkv, positions, **kw, key_cache=hk_cache, value_cache=hv_cache,
                                                     slot_mapping=slots, layout="HND", backend=b)
        bpacked = qkv.new_empty(qkv.shape[0], sum(self.sizes))
        k85 = torch.zeros(4, 16, heads, d, dtype=torch.float8_e5m2, device=qkv.device)
        v85 = torch.zeros_like(k85)
        self.prep.with_cache(qkv, positions, k85, v85, slots, k_scale=k_scale, v_scale=v_scale,
                             out=tuple(bpacked.split(self.sizes, dim=1)))
        outs += [*couts, hk_cache, hv_cache, bpacked, k85, v85]
        g = self.gemma
        y, r = self.norm(q, residual)  # bound add + norm
        x2, r2 = q.clone(), residual.clone()  # bound, in-place out=(x, residual)
        self.norm(x2, r2, out=(x2, r2))
        x5, r5 = q.clone(), residual.clone()  # bound, .inplace
        self.norm.inplace(x5, r5)
        x6, r6 = fq.clone(), residual.clone()  # public, in place
        qkvfuse.add_rmsnorm_(x6, r6, self.weight, 1e-6, self.bias, gemma_norm=g, backend=b)
        y3, r3 = qkvfuse.add_rmsnorm(fq, residual, self.weight, 1e-6, self.bias, gemma_norm=g, backend=b)  # public
        y4, _ = qkvfuse.add_rmsnorm(fq, None, self.weight, 1e-6, gemma_norm=g, backend=b)  # public, no residual
        return (*outs, y, r, x2, r2, x5, r5, x6, r6, y3, r3, y4)


def namespace(backend) -> str:
    """The op namespace a backend's calls go to (qkvfuse, qkvfuse_reference, qkvfuse_triton)."""
    return NAMESPACES[select_ops(backend, "cpu")]


def expected_overloads(backend) -> set:
    return {f"{namespace(backend)}.{op}.default" for op in OPS}


def eager(model, inputs):
    with torch.no_grad():
        return model(*inputs)


class RecordDispatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


class RecordFunction(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def qkvfuse_calls(calls) -> set:
    return {c for c in calls if c.startswith("qkvfuse")}


def jit_trace(model, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the validators read shapes as Python ints
        return torch.jit.trace(model, inputs, check_trace=False)


# --------------------------------------------------------------------------------------------------------
# 1. torch.jit.trace
# --------------------------------------------------------------------------------------------------------
def test_jit_trace_records_the_ops_and_matches_eager_on_new_inputs(backend, case, request):
    """Eager call first, then trace (the regression: tracing after an eager call once recorded only
    ``aten::empty`` and replayed uninitialised memory); the trace replays new values bitwise like eager."""
    model = Prepare(case, backend)
    inputs = call_inputs(case, seed=1)
    eager(model, inputs)
    traced = jit_trace(model, inputs)
    graph = str(traced.inlined_graph)
    for op in OPS:
        assert f"{namespace(backend)}::{op}(" in graph, op
    new = call_inputs(case, seed=2)
    assert not torch.equal(new[0], inputs[0])
    with torch.no_grad():
        got = traced(*new)
    assert_bitwise(got, eager(model, new))


def test_jit_trace_of_a_plain_function_after_an_eager_call(backend):
    kw, _, _ = static_args(ROPE)

    def prepare(qkv, positions):
        return qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, **kw, backend=backend)

    qkv, positions, _ = call_inputs(ROPE, seed=1)
    prepare(qkv, positions)
    traced = jit_trace(prepare, (qkv, positions))
    assert f"{namespace(backend)}::split_qkv_rmsnorm_rope(" in str(traced.graph)
    qkv2, positions2, _ = call_inputs(ROPE, seed=3)
    assert_bitwise(traced(qkv2, positions2), prepare(qkv2, positions2))


def test_jit_trace_replays_the_requested_backend(backend, request):
    """The traced graph runs the ops eager ran (the backend choice survives tracing: one name per backend)."""
    model = Prepare(ROPE, backend)
    inputs = call_inputs(ROPE, seed=1)
    with RecordDispatch() as seen_eager, torch.no_grad():
        model(*inputs)
    traced = jit_trace(model, inputs)
    with RecordDispatch() as seen_traced, torch.no_grad():
        traced(*inputs)
    assert qkvfuse_calls(seen_eager.calls) == expected_overloads(backend)
    assert qkvfuse_calls(seen_traced.calls) == expected_overloads(backend)


# --------------------------------------------------------------------------------------------------------
# 2. torch.export
# --------------------------------------------------------------------------------------------------------
def _targets(program) -> set:
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_records_the_ops_and_matches_eager(backend, case, strict):
    model = Prepare(case, backend)
    inputs = call_inputs(case, seed=1)
    want = eager(model, inputs)
    program = torch.export.export(model, inputs, strict=strict)
    assert expected_overloads(backend) <= _targets(program)
    assert_bitwise(program.module()(*inputs), want)


_LOAD_AND_RUN = textwrap.dedent("""
    import sys
    import torch
    import qkvfuse  # the only qkvfuse import: it must register every kernel the programs call

    int_view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
                torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
    runs = 0
    for data_path, *programs in (arg.split(",") for arg in sys.argv[1:]):
        data = torch.load(data_path)
        for path in programs:
            got = torch.export.load(path).module()(*data["inputs"])
            assert len(got) == len(data["expected"]), path
            for i, (a, b) in enumerate(zip(got, data["expected"])):
                assert (a.shape, a.dtype) == (b.shape, b.dtype), (path, i)
                assert torch.equal(a.view(int_view[a.dtype]), b.view(int_view[b.dtype])), (path, i)
            runs += 1
    print("ok", runs)
""")


@pytest.mark.parametrize("name", ["mrope-fp32", "gated-gemma-bf16"])
def test_export_save_load_in_a_fresh_process(backend, tmp_path, name):
    """Strict and non-strict programs saved here, loaded and run in a fresh process that only imports qkvfuse:
    outputs bitwise equal to the eager result saved alongside. The fp32 mRoPE case: in fp32 the backends differ
    by an ulp, so a loaded program that ran another backend's kernel would show; the gated Gemma case: the four
    outputs and the optional ``gate_out`` of the out op survive serialisation."""
    case = CASES[name]
    model = Prepare(case, backend)
    inputs = call_inputs(case, seed=1)
    torch.save({"inputs": inputs, "expected": eager(model, inputs)}, tmp_path / f"{name}.pt")
    group = [str(tmp_path / f"{name}.pt")]
    for strict in (False, True):
        path = tmp_path / f"{name}-{'strict' if strict else 'non-strict'}.pt2"
        torch.export.save(torch.export.export(model, inputs, strict=strict), path)
        group.append(str(path))
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _LOAD_AND_RUN, ",".join(group)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok 2"


# --------------------------------------------------------------------------------------------------------
# 3. torch.compile
# --------------------------------------------------------------------------------------------------------
class GraphRecorder:
    """A torch.compile backend that keeps each graph dynamo hands over, then compiles it with ``inner``."""

    def __init__(self, inner: str = "aot_eager"):
        self.inner, self.graphs = inner, []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend(self.inner)(gm, example_inputs)

    @property
    def op_graphs(self):
        """The graphs that call a qkvfuse op (dynamo may also hand over an empty graph)."""
        return [gm for gm in self.graphs if "qkvfuse" in gm.code]

    def targets(self) -> set:
        return {str(n.target) for gm in self.op_graphs for n in gm.graph.nodes if n.op == "call_function"}


def test_compile_fullgraph_static(backend, case):
    """fullgraph, static shapes; inductor for the cpu backend's RoPE case (the ops run as extern kernels),
    aot_eager (functionalised: the mutable ops through auto_functionalized) otherwise."""
    model = Prepare(case, backend)
    inputs = call_inputs(case, seed=1)
    want = eager(model, inputs)
    recorder = GraphRecorder("inductor" if backend == "cpu" and case is ROPE else "aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=recorder)
    with torch.no_grad():
        got = compiled(*inputs)
    assert_bitwise(got, want)
    assert expected_overloads(backend) <= recorder.targets()
    assert len(recorder.op_graphs) == 1


class PrepareLite(torch.nn.Module):
    """The bound objects' three call forms (fresh outputs, in place, in-place add + norm): the dynamic-shape
    sweep runs T=300, slow for Triton under the interpreter with every form of :class:`Prepare`."""

    def __init__(self, case: SplitCase, backend):
        super().__init__()
        full = Prepare(case, backend)
        self.prep, self.norm = full.prep, full.norm

    def forward(self, qkv, positions, residual):
        q, k, v = self.prep(qkv, positions)
        work = qkv.clone()
        self.prep.inplace(work, positions)
        x, r = q.clone(), residual.clone()
        self.norm(x, r, out=(x, r))
        return q, k, v, work, x, r


def test_compile_dynamic_over_tokens_one_graph(backend):
    """dynamic=True over T in {1, 7, 300}: bitwise equal to eager and one graph for all of them. T=1 would get
    its own graph from dynamo's 0/1 specialisation (a framework rule, not the op's: see the next test), so
    sizes are size-oblivious here."""
    model = PrepareLite(ROPE, backend)
    recorder = GraphRecorder("inductor" if backend == "cpu" else "aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=recorder)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        for T in (7, 300, 1):
            inputs = call_inputs(ROPE, seed=T, T=T)
            with torch.no_grad():
                got = compiled(*inputs)
            assert_bitwise(got, eager(model, inputs))
            assert len(recorder.op_graphs) == 1, f"recompiled at T={T}"


def test_compile_dynamic_default_recompiles_only_for_one_token(backend):
    """Plain dynamic=True: one graph for every T >= 2; T=1 adds exactly one (0/1 specialisation), reused after."""
    prep = Prepare(ROPE, backend).prep
    recorder = GraphRecorder("aot_eager")
    compiled = torch.compile(lambda qkv, positions: prep(qkv, positions), fullgraph=True, dynamic=True,
                             backend=recorder)
    counts = []
    for T in (7, 300, 5, 1, 1, 8):
        qkv, positions, _ = call_inputs(ROPE, seed=T, T=T)
        assert_bitwise(compiled(qkv, positions), prep(qkv, positions))
        counts.append(len(recorder.op_graphs))
    assert counts == [1, 1, 1, 2, 2, 2]


def test_compile_cache_ops_take_new_slots_and_scales_without_recompiling(backend):
    """Slots, FP8 scales and the caches are graph inputs: calls with new values (and new cache tensors) of the
    same shapes run the first graph, bitwise equal to eager -- no recompile per value, no value baked in."""
    d, heads = ROPE.head_dim, ROPE.num_kv_heads
    prep = Prepare(ROPE, backend).prep

    def f(qkv, positions, k8, v8, k16, v16, slots, k_scale, v_scale):
        views = prep.inplace_cache(qkv, positions, k8, v8, slots, layout="vec", k_scale=k_scale, v_scale=v_scale)
        outs = prep.with_cache(qkv, positions, k16, v16, slots, layout="HND")
        return (*views, *outs)

    def new_args(seed):
        qkv, positions, _ = call_inputs(ROPE, seed=seed)
        g = torch.Generator().manual_seed(seed)
        slots = torch.randperm(64, generator=g)[: ROPE.T]
        slots[seed % ROPE.T] = -1
        k8, v8 = (torch.zeros(4, heads, 16, d, dtype=torch.float8_e4m3fn) for _ in range(2))
        k16, v16 = (torch.zeros(4, heads, 16, d, dtype=qkv.dtype) for _ in range(2))
        scales = 0.02 + 0.1 * torch.rand(2, generator=g)
        return [qkv, positions, k8, v8, k16, v16, slots, scales[0].clone(), scales[1].clone()]

    recorder = GraphRecorder("aot_eager")
    compiled = torch.compile(f, fullgraph=True, dynamic=False, backend=recorder)
    with torch.no_grad():
        for seed in (1, 2, 3):
            args, want_args = new_args(seed), new_args(seed)
            got, want = compiled(*args), f(*want_args)
            assert_bitwise(got, want)
            assert_bitwise([args[i] for i in (0, 2, 3, 4, 5)], [want_args[i] for i in (0, 2, 3, 4, 5)])  # in place
            assert len(recorder.op_graphs) == 1, f"recompiled for seed {seed}"


_FIRST_CALL_COMPILED = textwrap.dedent("""
    import sys, torch, qkvfuse
    backend = None if sys.argv[1] == "auto" else sys.argv[1]
    hq, hkv, D = 4, 2, 64
    cache = qkvfuse.build_cos_sin_cache(64, 32, 1e4)

    def f(qkv, pos, w, x, r):
        q, k, v = qkvfuse.split_qkv_rmsnorm_rope(qkv, pos, cache, hq, hkv, D, q_weight=w, k_weight=w,
                                                 backend=backend)
        y, s = qkvfuse.add_rmsnorm(x, r, w, 1e-6, backend=backend)
        return q, k, v, y, s

    def new_args():
        return (torch.randn(3, (hq + 2 * hkv) * D), torch.arange(3), torch.ones(D), torch.randn(3, D),
                torch.randn(3, D))

    compiles = []

    def counting(gm, inputs):
        compiles.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

    compiled = torch.compile(f, fullgraph=True, backend=counting)
    with torch.no_grad():
        for args in (new_args(), new_args()):  # the second call runs the first call's graph: no recompile
            got = compiled(*args)
            want = f(*args)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(compiles) == 1, f"{len(compiles)} compiles"
    print("ok")
""")


def _first_call_compiled(which: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _FIRST_CALL_COMPILED, which], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_first_call_of_a_process_inside_compile_fullgraph(backend):
    """A fresh process whose first qkvfuse call is traced by ``torch.compile(fullgraph=True)``: resolving the
    backend (an import, a build, a lock) happens outside the traced code, and the next call reuses the graph
    (the backend cache the first call filled is not part of the graph's guards)."""
    _first_call_compiled(backend)


def test_first_call_of_a_process_inside_compile_fullgraph_auto():
    _first_call_compiled("auto")


def test_backend_loading_is_marked_as_torch_compiler_marks_a_constant():
    """qkvfuse.backends marks its loader by hand (torch.compiler.assume_constant_result imports torch._dynamo,
    and Triton with it, at ``import qkvfuse``): the mark must be the one torch's API sets."""
    from qkvfuse import backends

    marked = torch.compiler.assume_constant_result(lambda: None)
    assert vars(marked) and all(getattr(backends._unavailable_reason, k, None) == v for k, v in vars(marked).items())


def test_compile_with_an_unbacked_token_dim():
    """An unbacked token dim (torch._dynamo.mark_unbacked, separately on qkv and positions): the validators never
    guard on it (token counts are asserted equal at run time)."""
    prep = Prepare(ROPE, "reference").prep
    compiled = torch.compile(lambda qkv, positions: prep(qkv, positions), fullgraph=True, backend="aot_eager")
    for T in (7, 1):
        qkv, positions, _ = call_inputs(ROPE, seed=T, T=T)
        torch._dynamo.decorators.mark_unbacked(qkv, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        assert_bitwise(compiled(qkv, positions), prep(qkv, positions))


# --------------------------------------------------------------------------------------------------------
# 4. FakeTensorMode and meta tensors
# --------------------------------------------------------------------------------------------------------
def test_fake_tensor_mode_shapes_and_no_false_overlap(backend, case):
    """Under FakeTensorMode every form runs (the packed / own-slice out= and the in-place forms raise no
    overlap error: fake tensors have no memory to compare) with eager's shapes and dtypes."""
    inputs = call_inputs(case, seed=1)
    want = eager(Prepare(case, backend), inputs)
    kw, weight, bias = static_args(case)
    with FakeTensorMode() as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        model = Prepare(case, backend, ({k: fake(v) for k, v in kw.items()}, fake(weight), fake(bias)))
        got = model(*map(fake, inputs))
    assert all(isinstance(t, FakeTensor) for t in got)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]


def _to_meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("meta_case", ["mrope-fp32", "gated-gemma-bf16"])
@pytest.mark.parametrize("which", ["reference", "auto"])
def test_meta_tensors(which, meta_case):
    """Meta tensors run through the reference and auto (the dispatcher's Meta kernel) with eager's shapes."""
    backend = None if which == "auto" else which
    case = CASES[meta_case]
    inputs = call_inputs(case, seed=1)
    want = eager(Prepare(case, "reference"), inputs)  # shapes only: the reference runs every case on CPU today
    kw, weight, bias = static_args(case)
    model = Prepare(case, backend, ({k: _to_meta(v) for k, v in kw.items()}, _to_meta(weight), _to_meta(bias)))
    got = model(*map(_to_meta, inputs))
    assert all(t.is_meta for t in got)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]


def test_meta_tensors_with_a_cpu_only_backend_is_a_clear_error(fast_backend):
    kw, _, _ = static_args(ROPE)
    with pytest.raises(ValueError, match=f"backend {fast_backend!r} does not run meta tensors"):
        qkvfuse.QKNormRope(4, 2, 64, kw["cos_sin_cache"].to("meta"), backend=fast_backend)


# --------------------------------------------------------------------------------------------------------
# 5-7. Dispatch and function modes, the profiler, inference_mode / no_grad
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recorder", [RecordDispatch, RecordFunction], ids=["dispatch-mode", "function-mode"])
def test_recording_modes_see_the_ops(backend, case, recorder):
    model = Prepare(case, backend)
    inputs = call_inputs(case, seed=1)
    want = eager(model, inputs)
    with recorder() as mode, torch.no_grad():
        got = model(*inputs)
    assert_bitwise(got, want)
    assert qkvfuse_calls(mode.calls) == expected_overloads(backend)


def test_profiler_records_the_ops(backend, case):
    model = Prepare(case, backend)
    inputs = call_inputs(case, seed=1)
    want = eager(model, inputs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        got = model(*inputs)
    assert_bitwise(got, want)
    names = {e.name for e in prof.events()}
    assert {f"{namespace(backend)}::{op}" for op in OPS} <= names


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
def test_grad_modes(backend, case, mode):
    """inference_mode, no_grad and plain grad mode (inputs not requiring grad) give the same bits."""
    model = Prepare(case, backend)
    inputs = call_inputs(case, seed=1)
    want = eager(model, inputs)
    ctx = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": contextlib.nullcontext}[mode]
    with ctx():
        got = model(*inputs)
    assert_bitwise(got, want)
    assert not any(t.requires_grad for t in got)


# --------------------------------------------------------------------------------------------------------
# 8. Inputs that require grad
# --------------------------------------------------------------------------------------------------------
def _grad_calls(backend):
    """``(argument named in the error, call)`` for each entry point, one input requiring grad in each."""
    kw, weight, bias = static_args(ROPE)
    qkv, positions, residual = call_inputs(ROPE, seed=1)
    hq, hkv, d = ROPE.num_q_heads, ROPE.num_kv_heads, ROPE.head_dim
    static = {k: kw[k] for k in ("q_weight", "k_weight", "q_bias", "k_bias", "eps")}
    q_param = torch.nn.Parameter(kw["q_weight"].clone())
    cache_grad = kw["cos_sin_cache"].clone().requires_grad_()
    norm_param = torch.nn.Parameter(weight.clone())
    x = qkv[:, : hq * d].contiguous()
    grad = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    outs = lambda: tuple(torch.empty(ROPE.T, n, dtype=qkv.dtype) for n in (hq * d, hkv * d, hkv * d))  # noqa: E731
    return [
        ("qkv", lambda: qkvfuse.split_qkv_rmsnorm_rope(grad(qkv), positions, kw["cos_sin_cache"], hq, hkv, d,
                                                        **static, backend=backend)),
        ("qkv", lambda: qkvfuse.split_qkv_rmsnorm_rope(grad(qkv), positions, kw["cos_sin_cache"], hq, hkv, d,
                                                        **static, out=outs(), backend=backend)),
        ("q_weight", lambda: qkvfuse.QKNormRope(hq, hkv, d, kw["cos_sin_cache"], q_weight=q_param,
                                                k_weight=kw["k_weight"], backend=backend)(qkv, positions)),
        ("cos_sin_cache", lambda: qkvfuse.QKNormRope(hq, hkv, d, cache_grad, backend=backend).inplace(
            qkv.clone(), positions)),
        ("weight", lambda: qkvfuse.AddRMSNorm(norm_param, backend=backend)(x, residual)),
        ("residual", lambda: qkvfuse.add_rmsnorm(x, grad(residual), weight, 1e-6, bias, backend=backend)),
    ]


def test_inputs_requiring_grad_raise_under_grad_mode_and_work_under_no_grad(backend):
    for arg, call in _grad_calls(backend):
        with pytest.raises(RuntimeError, match=rf"^{arg}: .*inference only"):
            call()
    plain = [call for _, call in _grad_calls(backend)]
    with torch.no_grad():
        under_no_grad = [call() for call in plain]
    with torch.inference_mode():
        under_inference = [call() for call in plain]
    for a, b in zip(under_no_grad, under_inference):
        assert_bitwise([t for t in a if t.numel()], [t for t in b if t.numel()])
        assert not any(t.requires_grad for t in a)


# --------------------------------------------------------------------------------------------------------
# 9. Version counters of in-place writes
# --------------------------------------------------------------------------------------------------------
def test_in_place_write_of_a_saved_tensor_is_seen_by_autograd(backend, request):
    """``y`` is saved for backward by ``y.sin()``; overwriting it with the in-place op (under no_grad, as an
    engine would) must make backward raise, never return a gradient computed from the new values."""
    kw, _, _ = static_args(ROPE)
    qkv, positions, _ = call_inputs(ROPE, seed=1)
    leaf = qkv.detach().clone().requires_grad_()
    y = leaf * 2
    z = y.sin()  # saves y
    with torch.no_grad():
        qkvfuse.split_qkv_rmsnorm_rope_(y, positions, **kw, backend=backend)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_in_place_and_out_writes_bump_version_counters(backend, request):
    kw, _, _ = static_args(ROPE)
    model = Prepare(ROPE, backend)
    qkv, positions, residual = call_inputs(ROPE, seed=1)
    bumped = {}

    def check(name, tensors, call):
        before = [t._version for t in tensors]
        call()
        bumped[name] = all(t._version > v for t, v in zip(tensors, before))

    with torch.no_grad():
        work = qkv.clone()
        check("split_qkv_rmsnorm_rope_", [work], lambda: qkvfuse.split_qkv_rmsnorm_rope_(work, positions, **kw,
                                                                                          backend=backend))
        work2 = qkv.clone()
        check("QKNormRope.inplace", [work2], lambda: model.prep.inplace(work2, positions))
        outs = tuple(torch.empty(ROPE.T, n, dtype=qkv.dtype) for n in model.sizes)
        check("split out=", outs, lambda: qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, **kw, out=outs,
                                                                        backend=backend))
        outs2 = tuple(torch.empty(ROPE.T, n, dtype=qkv.dtype) for n in model.sizes)
        check("QKNormRope out=", outs2, lambda: model.prep(qkv, positions, out=outs2))
        x, r = qkv[:, : model.sizes[0]].clone(), residual.clone()
        check("AddRMSNorm out=", [x, r], lambda: model.norm(x, r, out=(x, r)))
        # The cache-writing split: qkv (in place) or the outputs (out=), and both caches -- also K and V as the
        # halves of one buffer, whose own counter the views share.
        d, heads = ROPE.head_dim, ROPE.num_kv_heads
        slots = torch.arange(ROPE.T)
        k_cache, v_cache = torch.zeros(2, 8, heads, d, dtype=qkv.dtype), torch.zeros(2, 8, heads, d, dtype=qkv.dtype)
        work3 = qkv.clone()
        check("split_qkv_rmsnorm_rope_cache_", [work3, k_cache, v_cache],
              lambda: qkvfuse.split_qkv_rmsnorm_rope_cache_(work3, positions, **kw, key_cache=k_cache,
                                                            value_cache=v_cache, slot_mapping=slots, backend=backend))
        kv = torch.zeros(2, 8, 2 * heads, d, dtype=qkv.dtype)
        k_half, v_half = kv.chunk(2, dim=2)
        work4 = qkv.clone()
        check("QKNormRope.inplace_cache", [work4, kv, k_half, v_half],
              lambda: model.prep.inplace_cache(work4, positions, k_half, v_half, slots))
        outs3 = tuple(torch.empty(ROPE.T, n, dtype=qkv.dtype) for n in model.sizes)
        check("QKNormRope.with_cache out=", [*outs3, k_cache, v_cache],
              lambda: model.prep.with_cache(qkv, positions, k_cache, v_cache, slots, out=outs3))
    assert all(bumped.values()), bumped


def test_gated_in_place_and_out_writes_bump_version_counters(backend):
    """The gated layout: the in-place row rewrite, all four out= tensors, the Gemma add + norm in place."""
    gated = Prepare(GATED, backend)
    qkv, positions, residual = call_inputs(GATED, seed=1)
    with torch.no_grad():
        work = qkv.clone()
        before = work._version
        gated.prep.inplace(work, positions)
        assert work._version > before, "gated QKNormRope.inplace"
        outs = tuple(torch.empty(GATED.T, n, dtype=qkv.dtype) for n in gated.sizes)
        before = [t._version for t in outs]
        qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, **gated.kw, out=outs, backend=backend)
        assert all(t._version > v for t, v in zip(outs, before)), "gated split out="
        x, r = qkv[:, : gated.sizes[0]].clone(), residual.clone()
        before = (x._version, r._version)
        gated.norm.inplace(x, r)
        assert x._version > before[0] and r._version > before[1], "Gemma AddRMSNorm.inplace"


# --------------------------------------------------------------------------------------------------------
# 10. Packed output buffers and the overlap rule
# --------------------------------------------------------------------------------------------------------
def test_packed_output_buffer_and_overlap_errors(backend, case):
    kw, _, _ = static_args(case)
    qkv, positions, _ = call_inputs(case, seed=1)
    model = Prepare(case, backend)
    sizes, width = model.sizes, sum(model.sizes)
    plain = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, **kw, backend=backend)
    gate = (torch.empty(case.T, sizes[0], dtype=qkv.dtype),) if case.q_gate else ()  # a fresh gate_out, gated

    packed = torch.full((case.T, width), float("nan"), dtype=qkv.dtype)
    got = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, **kw, out=tuple(packed.split(sizes, 1)), backend=backend)
    assert_bitwise(got, plain)
    assert all(t.data_ptr() == packed.data_ptr() + off * packed.element_size()
               for t, off in zip(got, (0, sizes[0], sizes[0] + sizes[1], sum(sizes[:3]))))
    packed2 = torch.full((case.T, width + 3), float("nan"), dtype=qkv.dtype)[:, :width]  # padded rows too
    assert_bitwise(model.prep(qkv, positions, out=tuple(packed2.split(sizes, 1))), plain)

    # q_out and k_out share one column: both named.
    buf = torch.empty(case.T, width, dtype=qkv.dtype)
    q_o, k_o = buf[:, : sizes[0]], buf[:, sizes[0] - 1 : sizes[0] - 1 + sizes[1]]
    v_o = buf[:, sizes[0] + sizes[1] : sizes[0] + sizes[1] + sizes[2]]
    for call in (lambda: qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, **kw, out=(q_o, k_o, v_o, *gate),
                                                        backend=backend),
                 lambda: model.prep(qkv, positions, out=(q_o, k_o, v_o, *gate))):
        with pytest.raises(ValueError, match=r"^q_out: .*shared with k_out"):
            call()

    # An out= view into qkv other than its own slice: k_out over qkv's V columns.
    work = qkv.clone()
    _, k_w, v_w = model.own_slices(work)[:3]
    with pytest.raises(ValueError, match=r"^k_out: .*shared with qkv"):
        model.prep(work, positions, out=(torch.empty(case.T, sizes[0], dtype=qkv.dtype), v_w, torch.empty_like(v_w),
                                         *gate))
    with pytest.raises(ValueError, match=r"^q_out: .*shared with qkv"):
        qkvfuse.split_qkv_rmsnorm_rope(work, positions, **kw, backend=backend,
                                       out=(work[:, 1 : 1 + sizes[0]], torch.empty_like(k_w), torch.empty_like(v_w),
                                            *gate))
    assert_bitwise((work,), (qkv,))  # nothing written
