"""The Triton backend's host path, and the GPU bug classes of fused prologue kernels.

Host path: the Triton ops run the native host kernels (``backends/cpu/triton_host.cpp``: the CPU kernels' C++
argument checks, then the launcher) once the native library is loaded, and keep their Python kernels where it
cannot be built -- the bad-call catalogue holds on both with the reference's messages. A device launch reuses the
compiled kernel: its arguments must be the ones Triton's JIT launch would pass (checked here with recording
stand-ins for the kernels, so on CPU).

Bug classes (the interpreter here, CUDA where there is a GPU): offsets past 2^31 elements; in-place writes that
another program of the same launch still has to read (the interpreter runs programs one after another, so a
program writing over another's unread input shows); ``[3, T]`` mRoPE positions as strided views, replayed under
a CUDA graph with new values (GPU only); partial rotary with many heads per program.
"""

import os
import subprocess
import sys
import types

import pytest
import torch

import qkvfuse
from qkvfuse._verify import (SplitCase, check_split_outputs, make_split_inputs, oracle_split, poisoned_like,
                             unfused_split)
from qkvfuse._verify.cache import CacheCase, check_cache_case, make_cache_inputs
from qkvfuse.backends import available_backends, backend_unavailable

if available_backends()["triton"]:
    if "triton" in os.environ.get("QKVFUSE_REQUIRE_BACKENDS", "").split(","):
        pytest.fail(f"triton backend required but unavailable: {available_backends()['triton']}", pytrace=False)
    pytest.skip(f"triton backend unavailable: {available_backends()['triton']}", allow_module_level=True)

from qkvfuse.backends import native_host, triton_host_kernels  # noqa: E402
from qkvfuse.backends.triton import launch  # noqa: E402

from _support.child_records import child_records  # noqa: E402

# The bug classes run where the kernels run: CPU tensors under the interpreter (make test), CUDA tensors with
# TRITON_INTERPRET=0 on a GPU machine (bench/device-check.sh).
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"


def _needs_native():
    reason = backend_unavailable("cpu")
    if reason:
        pytest.skip(f"no native library: {reason}")


# ---------------------------------------------------------------------------------------------------------
# The host path.
# ---------------------------------------------------------------------------------------------------------
def test_native_host_kernels_serve_the_triton_ops():
    """With the native library the Triton ops' kernels are C++ (the triton ops on every key, the cache-writing forms
    included, their version-counter kernels, the auto ops on the accelerator keys)."""
    _needs_native()
    assert triton_host_kernels() and native_host.enabled()
    for op, keys in (("qkvfuse_triton::split_qkv_rmsnorm_rope_inplace", ("CPU", "CUDA", "ADInplaceOrView")),
                     ("qkvfuse_triton::add_rmsnorm", ("CPU", "XPU")),
                     ("qkvfuse::split_qkv_rmsnorm_rope_out", ("CUDA", "PrivateUse1")),
                     ("qkvfuse_triton::split_qkv_rmsnorm_rope_cache", ("CPU", "CUDA", "ADInplaceOrView")),
                     ("qkvfuse::split_qkv_rmsnorm_rope_cache_out", ("CUDA", "XPU"))):
        lines = {line.split(":")[0]: line for line in torch._C._dispatch_dump(op).splitlines()}
        for key in keys:
            assert "triton_host.cpp" in lines.get(key, ""), (op, key, lines.get(key))
    # and they run: the same bits as the reference's in-place form within the accuracy rule
    case = SplitCase(T=3, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, bias=True)
    kwargs = make_split_inputs(case, device=DEVICE)
    qkv = kwargs.pop("qkv")
    fresh = qkvfuse.split_qkv_rmsnorm_rope(qkv, **kwargs, backend="triton")
    qkv = qkv.clone()
    views = qkvfuse.split_qkv_rmsnorm_rope_(qkv, **kwargs, backend="triton")
    for a, b in zip(views, fresh):
        assert torch.equal(a, b)


def _catalogue_in_child(env_changes, enable_first):
    """The bad-call catalogue on the triton backend in a child process (``enable_first``: after switching to the
    native host kernels): ``{name: (ok, detail)}``."""
    code = ("import sys, runpy, qkvfuse.backends as b\n"
            f"if {enable_first!r}: assert b.triton_host_kernels(), 'no native host kernels'\n"
            "sys.argv = ['failure_modes', 'bad-input', 'triton']\n"
            "runpy.run_module('qkvfuse._verify.failure_modes', run_name='__main__')\n")
    env = dict(os.environ, **env_changes)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    import json

    results = {}
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        if "name" in record:
            results[record["name"]] = (record["ok"], record["detail"])
    assert results, proc.stderr[-3000:]
    return results


@pytest.mark.parametrize("path", ["native-host", "python-fallback"])
def test_bad_calls_same_messages_on_both_host_paths(path, tmp_path):
    """The catalogue on the C++ host path (checks.h) and, without a native library (no compiler, empty cache),
    on the Python kernels: every call raises the reference backend's type and message."""
    if path == "native-host":
        _needs_native()
        got = _catalogue_in_child({}, True)
    else:
        got = _catalogue_in_child({"CXX": str(tmp_path / "no-such-compiler"), "QKVFUSE_BUILD_DIR": str(tmp_path)},
                                  False)
    want = child_records("qkvfuse._verify.failure_modes", "bad-input", "reference")[0]
    assert set(got) == set(want)
    bad = {name: got[name] for name in got if not got[name][0]}
    assert not bad, bad
    differ = {name: (got[name][1], want[name][1]) for name in want if got[name][1] != want[name][1]}
    assert not differ, differ


class _Recorder:
    """Stand-ins for a Triton kernel: the JIT launch records its arguments and returns a compiled stand-in, whose
    launcher records what a cached launch passes."""

    def __init__(self, kernel, log):
        self.fn, self.log = kernel.fn, log

    def __getitem__(self, grid):
        def jit(*args, **constexprs):
            self.log.append(("jit", tuple(grid), args, constexprs))
            return _RecordingCompiled(self.log)

        return jit


class _RecordingCompiled:
    function = "function"
    packed_metadata = "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, leave, *args):
        assert (g2, stream, function, metadata) == (1, "stream", "function", "metadata")
        self.log.append(("run", (g0, g1), args, None))

    def launch_metadata(self, grid, stream, *args):
        return None


def _as_launched(args, names, constexprs):
    """A JIT launch's arguments as a compiled launch passes them: pointers as ints, then the constexprs' values."""
    ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    return ints + tuple(constexprs[name] for name in names)


@pytest.fixture
def recorded(monkeypatch):
    log = []
    monkeypatch.setattr(launch, "split_qkv_rmsnorm_rope_kernel", _Recorder(launch.split_qkv_rmsnorm_rope_kernel, log))
    monkeypatch.setattr(launch, "add_rmsnorm_kernel", _Recorder(launch.add_rmsnorm_kernel, log))
    monkeypatch.setattr(launch, "split_qkv_rmsnorm_rope_cache_kernel",
                        _Recorder(launch.split_qkv_rmsnorm_rope_cache_kernel, log))
    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda index: "stream")
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "_split_plans", {})
    monkeypatch.setattr(launch, "_norm_plans", {})
    return log


def _assert_cached_launch_matches_jit(log, call, names, fresh=()):
    """``call()`` twice: the first is Triton's JIT launch, the second the cached compiled launch with the same
    grid and the same arguments (``fresh``: the positions of outputs each call allocates anew)."""
    del log[:]
    call()
    call()
    assert [entry[0] for entry in log] == ["jit", "run"], [entry[0] for entry in log]
    (_, grid, args, constexprs), (_, run_grid, run_args, _) = log
    want = _as_launched(args, names, constexprs)
    assert run_grid == (grid + (1,))[:2] and len(run_args) == len(want)
    for i, (got, expected) in enumerate(zip(run_args, want)):
        assert got == expected or (i in fresh and got % 16 == 0), (i, got, expected)


def _launch_inputs(case: SplitCase, kwargs: dict, form: str):
    """``(qkv, outs)`` popped from / made for a call's ``kwargs``: mRoPE positions as a strided ``[3, T]`` view, and
    out= tensors (``form`` ``"out-aliasing-k-v"``: k and v exactly ``qkv``'s own K and V columns)."""
    if case.mrope_section:
        wide = torch.zeros(3, 2 * case.T, dtype=case.pos_dtype)
        wide[:, ::2] = kwargs["positions"]
        kwargs["positions"] = wide[:, ::2]
    qkv = kwargs.pop("qkv")
    T, D, hq, hkv = case.T, case.head_dim, case.num_q_heads, case.num_kv_heads
    outs = [torch.empty(T, n * D, dtype=case.dtype) for n in (hq, hkv, hkv)] + (
        [torch.empty(T, hq * D, dtype=case.dtype)] if case.q_gate else [])
    if form == "out-aliasing-k-v":
        k_col = (2 if case.q_gate else 1) * hq * D
        outs[1], outs[2] = qkv[:, k_col:k_col + hkv * D], qkv[:, k_col + hkv * D:k_col + 2 * hkv * D]
    return qkv, outs


SPLIT_CASES = {
    "plain": SplitCase(T=5, num_q_heads=8, num_kv_heads=2, head_dim=64, rotary_dim=64, weight_dtype=torch.bfloat16),
    "partial-gptj-bias-padded": SplitCase(T=3, num_q_heads=6, num_kv_heads=2, head_dim=96, rotary_dim=32,
                                          is_neox=False, bias=True, row_pad=16),
    "mrope-strided-positions": SplitCase(T=4, num_q_heads=4, num_kv_heads=1, head_dim=128, rotary_dim=128,
                                         mrope_section=(24, 20, 20), mrope_interleaved=True, pos_dtype=torch.int32),
    "no-norm": SplitCase(T=2, num_q_heads=2, num_kv_heads=2, head_dim=64, rotary_dim=64, norm=False),
    "gated-gemma": SplitCase(T=3, num_q_heads=4, num_kv_heads=1, head_dim=64, rotary_dim=32, q_gate=True,
                             gemma_norm=True, mrope_section=(6, 5, 5), mrope_interleaved=True),
}


@pytest.mark.parametrize("form", ["inplace", "out", "out-aliasing-k-v", "functional"])
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_cached_split_launch_passes_the_jit_arguments(recorded, name, form):
    """Every form of the split, through the public call (the host kernels, or the Python ones): the second call's
    compiled launch has the first call's grid, pointers, strides, scalars and constexprs."""
    case = SPLIT_CASES[name]
    kwargs = make_split_inputs(case)
    qkv, outs = _launch_inputs(case, kwargs, form)
    calls = {"inplace": lambda: qkvfuse.split_qkv_rmsnorm_rope_(qkv, **kwargs, backend="triton"),
             "functional": lambda: qkvfuse.split_qkv_rmsnorm_rope(qkv, **kwargs, backend="triton")}
    call = calls.get(form, lambda: qkvfuse.split_qkv_rmsnorm_rope(qkv, **kwargs, out=tuple(outs), backend="triton"))
    _assert_cached_launch_matches_jit(recorded, call, launch._SPLIT_CONSTEXPRS,
                                      fresh=(7, 8, 9, 10) if form == "functional" else ())


@pytest.mark.parametrize("form", ["inplace", "out", "functional", "no-residual"])
def test_cached_norm_launch_passes_the_jit_arguments(recorded, form):
    x, residual = torch.randn(3, 80, dtype=torch.bfloat16), torch.randn(3, 80, dtype=torch.bfloat16)
    weight, bias = torch.randn(80), torch.randn(80, dtype=torch.bfloat16)
    calls = {
        "inplace": lambda: qkvfuse.add_rmsnorm_(x, residual, weight, 1e-6, backend="triton"),
        "out": lambda: qkvfuse.add_rmsnorm(x, residual, weight, 1e-6, bias=bias, out=(torch.empty_like(x),
                                           torch.empty_like(x)), backend="triton"),
        "functional": lambda: qkvfuse.add_rmsnorm(x, residual, weight, 1e-5, gemma_norm=True, backend="triton"),
        "no-residual": lambda: qkvfuse.add_rmsnorm(x, None, weight, 1e-6, backend="triton"),
    }
    _assert_cached_launch_matches_jit(recorded, calls[form], launch._NORM_CONSTEXPRS,
                                      fresh=(4, 5) if form in ("functional", "no-residual", "out") else ())


CACHE_CASES = {
    "nhd-bf16": CacheCase(SPLIT_CASES["plain"]),
    "hnd-bias-padded-interleaved": CacheCase(SPLIT_CASES["partial-gptj-bias-padded"], layout="HND", interleaved=True),
    "vec-mrope-strided-positions": CacheCase(SPLIT_CASES["mrope-strided-positions"], layout="vec", block_size=32),
    "amx-no-norm": CacheCase(SPLIT_CASES["no-norm"], layout="amx", block_size=32),
    "vec-fp8-truncate": CacheCase(SPLIT_CASES["no-norm"], layout="vec", cache_dtype=torch.float8_e4m3fn,
                                  rounding="truncate"),
    "nhd-e5m2-gated": CacheCase(SPLIT_CASES["gated-gemma"], cache_dtype=torch.float8_e5m2, slots="short"),
}


@pytest.mark.parametrize("form", ["inplace", "out", "out-aliasing-k-v"])
@pytest.mark.parametrize("name", list(CACHE_CASES))
def test_kept_cache_launch_passes_the_jit_arguments(recorded, name, form):
    """The cache-writing split: after the first call's JIT launch the host kernel keeps its compiled launch, and the
    second call's launch has the first's grid, pointers, strides, scalars and constexprs (the Python host path
    makes Triton's JIT launch every time)."""
    from qkvfuse.backends.triton import cache as cache_launch

    case = CACHE_CASES[name]
    kwargs = make_cache_inputs(case, seed=2)
    kwargs.pop("storage")
    qkv, outs = _launch_inputs(case.split, kwargs, form)
    if form == "inplace":
        def call():
            qkvfuse.split_qkv_rmsnorm_rope_cache_(qkv, **kwargs, backend="triton")
    else:
        def call():
            qkvfuse.split_qkv_rmsnorm_rope_cache(qkv, **kwargs, out=tuple(outs), backend="triton")
    triton_host_kernels()  # the C++ kernels from the first call on (else the first Triton call switches to them)
    del recorded[:]
    call()
    call()
    kinds = [entry[0] for entry in recorded]
    if not native_host.enabled():
        assert kinds == ["jit", "jit"], kinds
        return
    assert kinds == ["jit", "run"], kinds
    (_, grid, args, constexprs), (_, run_grid, run_args, _) = recorded
    want = _as_launched(args, cache_launch._CACHE_CONSTEXPRS, constexprs)
    assert run_grid == tuple(grid) and len(run_args) == len(want)
    for i, (got, expected) in enumerate(zip(run_args, want)):
        assert got == expected, (i, got, expected)


def test_kept_cache_launch_leaves_hooked_launches_to_the_launcher(recorded):
    """With a launch hook set the cache-writing split's launch is the Python launcher's (Triton's JIT launch, which
    calls the hooks); the kept launch again once the hook is gone."""
    from triton import knobs

    kwargs = make_cache_inputs(CACHE_CASES["nhd-bf16"], seed=2)
    kwargs.pop("storage")
    qkv = kwargs.pop("qkv")
    triton_host_kernels()
    del recorded[:]
    for _ in range(2):
        qkvfuse.split_qkv_rmsnorm_rope_cache_(qkv, **kwargs, backend="triton")
    chain = knobs.runtime.launch_enter_hook
    hook = lambda *args: None  # noqa: E731
    chain.add(hook)
    try:
        qkvfuse.split_qkv_rmsnorm_rope_cache_(qkv, **kwargs, backend="triton")
    finally:
        chain.remove(hook)
    qkvfuse.split_qkv_rmsnorm_rope_cache_(qkv, **kwargs, backend="triton")
    kinds = [entry[0] for entry in recorded]
    assert kinds == (["jit", "run", "jit", "run"] if native_host.enabled() else ["jit"] * 4), kinds


def _kept_calls():
    """``{name: call}``: public Triton calls of each op and form whose compiled launch the host kernel keeps."""
    case = SPLIT_CASES["plain"]
    kwargs = make_split_inputs(case)
    qkv = kwargs.pop("qkv")
    x, residual = torch.randn(3, 80, dtype=torch.bfloat16), torch.randn(3, 80, dtype=torch.bfloat16)
    weight = torch.randn(80)
    norm = qkvfuse.AddRMSNorm(weight, eps=1e-6, backend="triton")
    return {
        "split-inplace": lambda: qkvfuse.split_qkv_rmsnorm_rope_(qkv, **kwargs, backend="triton"),
        "split-functional": lambda: qkvfuse.split_qkv_rmsnorm_rope(qkv, **kwargs, backend="triton"),
        "norm-inplace": lambda: norm.inplace(x, residual),
        "norm-functional": lambda: qkvfuse.add_rmsnorm(x, None, weight, 1e-6, backend="triton"),
    }


@pytest.mark.parametrize("name", ["split-inplace", "split-functional", "norm-inplace", "norm-functional"])
def test_kept_launch_leaves_hooked_launches_to_the_launcher(recorded, monkeypatch, name):
    """After the first launch, the host kernel makes the compiled launch itself (the Python launcher's cached launch
    is not reached); with a launch hook set (Triton's rule: a hook chain with hooks) the Python launcher makes it
    (with the launch metadata the hook takes), with the same grid and arguments."""
    from triton import knobs

    call = _kept_calls()[name]
    metadata, python_launches = [], []
    monkeypatch.setattr(_RecordingCompiled, "launch_metadata", lambda self, *args: metadata.append(args))
    launch_compiled = launch._launch_compiled
    monkeypatch.setattr(launch, "_launch_compiled",
                        lambda *args: (python_launches.append(1), launch_compiled(*args)))
    for _ in range(3):
        call()
    assert [entry[0] for entry in recorded] == ["jit", "run", "run"] and metadata == []
    if native_host.enabled():
        assert python_launches == []  # the kept launches are the host kernel's
    chain = knobs.runtime.launch_enter_hook
    hook = lambda *args: None  # noqa: E731
    chain.add(hook)
    try:
        call()
    finally:
        chain.remove(hook)
    assert [entry[0] for entry in recorded] == ["jit", "run", "run", "run"] and len(metadata) == 1
    assert recorded[3][1:3] == recorded[2][1:3] or name.endswith("functional")
    call()
    assert len(metadata) == 1  # kept again once the hook is gone


def test_misaligned_pointer_takes_the_jit_launch(recorded):
    """A pointer off a 16-byte boundary changes Triton's specialisation: no cached launch for it."""
    case = SPLIT_CASES["plain"]
    kwargs = make_split_inputs(case)
    qkv = kwargs.pop("qkv")
    shifted = torch.empty(qkv.numel() + 1, dtype=qkv.dtype)[1:].view_as(qkv)
    shifted.copy_(qkv)
    for _ in range(2):
        qkvfuse.split_qkv_rmsnorm_rope_(shifted, **kwargs, backend="triton")
    assert [entry[0] for entry in recorded] == ["jit", "jit"]


# ---------------------------------------------------------------------------------------------------------
# Bug classes.
# ---------------------------------------------------------------------------------------------------------
def _huge_rows(rows: int, width: int, row_stride: int, dtype):
    """A ``[rows, width]`` view with ``row_stride`` over one allocation (untouched pages are never backed)."""
    try:
        buf = torch.empty((rows - 1) * row_stride + width, dtype=dtype, device=DEVICE)
    except (RuntimeError, MemoryError) as exc:  # no address space (or device memory) for it
        pytest.skip(f"cannot reserve {(rows - 1) * row_stride + width} elements: {exc}")
    return buf.as_strided((rows, width), (row_stride, 1))


@pytest.mark.parametrize("row_stride,T", [(2**30 + 64, 3), (2**31 + 64, 2)], ids=["int32-stride", "int64-stride"])
def test_offsets_past_2_31_elements(row_stride, T):
    """qkv and x whose last row starts past 2^31 elements (4 GiB of address space, a few pages touched): an int32
    row offset (token x stride, or the stride itself) would wrap and read or write the wrong row. In place, out=
    and add_rmsnorm in place, against the same call on compact rows."""
    case = SplitCase(T=T, num_q_heads=2, num_kv_heads=1, head_dim=64, rotary_dim=64, bias=True)
    kwargs = make_split_inputs(case, device=DEVICE)
    compact = kwargs.pop("qkv")
    assert (T - 1) * row_stride >= 2**31
    qkv = _huge_rows(T, case.width, row_stride, compact.dtype)
    qkv.copy_(compact)
    want = qkvfuse.split_qkv_rmsnorm_rope(compact, **kwargs, backend="triton")
    got = qkvfuse.split_qkv_rmsnorm_rope(qkv, **kwargs, out=tuple(poisoned_like(t) for t in want[:3]),
                                         backend="triton")
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    views = qkvfuse.split_qkv_rmsnorm_rope_(qkv, **kwargs, backend="triton")
    for a, b in zip(views, want):
        assert torch.equal(a, b)
    # The cache-writing split in place on the far rows, against the same call on the compact ones.
    qkv.copy_(compact)
    slots = torch.tensor([5, 0, 2][:T], device=DEVICE)
    caches = [[torch.full((2, 4, 1, 64), float("nan"), dtype=compact.dtype, device=DEVICE) for _ in range(2)]
              for _ in range(2)]
    got = qkvfuse.split_qkv_rmsnorm_rope_cache_(qkv, **kwargs, key_cache=caches[0][0], value_cache=caches[0][1],
                                                slot_mapping=slots, backend="triton")
    want = qkvfuse.split_qkv_rmsnorm_rope_cache_(compact.clone(), **kwargs, key_cache=caches[1][0],
                                                 value_cache=caches[1][1], slot_mapping=slots, backend="triton")
    for a, b in zip((*got, *caches[0]), (*want, *caches[1])):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    x = _huge_rows(T, 64, row_stride, torch.bfloat16)
    residual = _huge_rows(T, 64, row_stride, torch.bfloat16)
    x_c, r_c = (torch.randn(T, 64, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    x.copy_(x_c)
    residual.copy_(r_c)
    weight = torch.randn(64, device=DEVICE)
    y_want, r_want = qkvfuse.add_rmsnorm(x_c, r_c, weight, 1e-6, backend="triton")
    qkvfuse.add_rmsnorm_(x, residual, weight, 1e-6, backend="triton")
    assert torch.equal(x, y_want) and torch.equal(residual, r_want)


def test_64bit_offset_arithmetic_in_the_kernels():
    """Every row offset in the kernels is an int64 token or row index times a stride (read from the source: the
    program's first token/row index is cast before it is multiplied)."""
    import inspect

    from qkvfuse.backends.triton import kernels

    split = inspect.getsource(kernels.split_qkv_rmsnorm_rope_kernel.fn)
    norm = inspect.getsource(kernels.add_rmsnorm_kernel.fn)
    assert "tok = tl.program_id(0).to(tl.int64) * BLOCK_T" in split
    assert "row = tl.program_id(0).to(tl.int64) * BLOCK_T" in norm
    heads = inspect.getsource(kernels._norm_rope_heads.fn)
    assert "row = tok[:, None, None] * src_stride" in heads and "dst_row = tok[:, None, None] * dst_stride" in heads


def _small_tile_case(monkeypatch, q_gate: bool) -> SplitCase:
    """Device block sizes with a small tile: several Q programs per token and several token blocks."""
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "GPU_SPLIT_TILE", 128)
    case = SplitCase(T=5, num_q_heads=6, num_kv_heads=2, head_dim=32, rotary_dim=16, q_gate=q_gate,
                     gemma_norm=q_gate, bias=not q_gate)
    cfg = launch.split_config(case.T, 6, 2, 32)
    assert cfg["Q_HEADS"] < 6 and cfg["BLOCK_T"] < case.T
    return case


@pytest.mark.parametrize("q_gate", [False, True], ids=["plain", "gated"])
def test_in_place_programs_never_read_what_another_wrote(monkeypatch, q_gate):
    """In place with several Q programs per token and several token blocks (a small device tile): Q heads (and,
    gated, the interleaved gates, whose region the in-place form rearranges) read after another program's write
    would differ from the out-of-place result. The interpreter runs the programs one after another."""
    case = _small_tile_case(monkeypatch, q_gate)
    kwargs = make_split_inputs(case, device=DEVICE)
    qkv = kwargs.pop("qkv")
    want = qkvfuse.split_qkv_rmsnorm_rope(qkv, **kwargs, backend="triton")
    work = qkv.clone()
    got = qkvfuse.split_qkv_rmsnorm_rope_(work, **kwargs, backend="triton")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["NHD", "vec"])
@pytest.mark.parametrize("q_gate", [False, True], ids=["plain", "gated"])
def test_in_place_cache_programs_never_read_what_another_wrote(monkeypatch, q_gate, layout):
    """The cache-writing kernel in place under the same tiling as above: its views equal the out-of-place split's,
    and every cache byte is the token's K / V (:func:`qkvfuse._verify.cache.check_cache_case`)."""
    case = _small_tile_case(monkeypatch, q_gate)
    cache_case = CacheCase(case, layout=layout, num_blocks=2)
    kw = make_cache_inputs(cache_case, seed=4, device=DEVICE)
    kw.pop("storage")
    qkv = kw.pop("qkv")
    split_kw = {k: v for k, v in kw.items() if k not in ("key_cache", "value_cache", "slot_mapping", "layout",
                                                          "fp8_rounding")}
    want = qkvfuse.split_qkv_rmsnorm_rope(qkv, **split_kw, backend="triton")
    got = qkvfuse.split_qkv_rmsnorm_rope_cache_(qkv.clone(), **kw, backend="triton")
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    check_cache_case("triton", cache_case, seed=4, device=DEVICE, form="inplace")


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("mrope", [False, True], ids=["rope", "mrope"])
def test_partial_rotary_many_heads_per_program(monkeypatch, is_neox, mrope):
    """Partial rotary (32 of 64) with 16 Q heads in one program (the device tile): each head rotates its own first
    32 lanes and passes the rest through, against the float64 oracle."""
    monkeypatch.setattr(launch, "INTERPRET", False)
    case = SplitCase(T=3, num_q_heads=16, num_kv_heads=4, head_dim=64, rotary_dim=32, is_neox=is_neox, bias=True,
                     mrope_section=(6, 5, 5) if mrope else None, mrope_interleaved=mrope)
    assert launch.split_config(case.T, 16, 4, 64)["Q_HEADS"] == 16
    kwargs = make_split_inputs(case, device=DEVICE)
    out = tuple(poisoned_like(torch.empty(case.T, n * 64, dtype=case.dtype, device=DEVICE)) for n in (16, 4, 4))
    qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend="triton")
    report = check_split_outputs(out, oracle_split(**kwargs), unfused_split(**kwargs), kwargs["qkv"], 16, 4, 64)
    assert report.ok, report.detail


@pytest.mark.parametrize("layout,cache_dtype", [("vec", None), ("NHD", torch.float8_e4m3fn)], ids=["vec", "NHD-fp8"])
@pytest.mark.parametrize("mrope", [False, True], ids=["rope", "mrope"])
def test_partial_rotary_many_heads_per_program_into_the_cache(monkeypatch, mrope, layout, cache_dtype):
    """The cache-writing kernel with the same 16 Q heads per program: outputs bit-equal to the split's (checked
    against the oracle above), cached K / V the tokens' bits, FP8 within half a step of the oracle."""
    monkeypatch.setattr(launch, "INTERPRET", False)
    case = SplitCase(T=3, num_q_heads=16, num_kv_heads=4, head_dim=64, rotary_dim=32, bias=True,
                     mrope_section=(6, 5, 5) if mrope else None, mrope_interleaved=mrope)
    assert launch.split_config(case.T, 16, 4, 64)["Q_HEADS"] == 16
    check_cache_case("triton", CacheCase(case, layout=layout, cache_dtype=cache_dtype, num_blocks=1), seed=5,
                     device=DEVICE, form="out")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("layout", ["strided", "transposed"])
def test_strided_mrope_positions_under_cuda_graph_replay(layout):
    """``[3, T]`` positions as a strided view (every other column of a wider buffer) or a transposed ``[T, 3]``
    buffer, captured once in a CUDA graph with the bound in-place call and replayed after the positions (and qkv)
    change in place: each replay gives the eager result for the new values."""
    case = SplitCase(T=8, num_q_heads=4, num_kv_heads=1, head_dim=128, rotary_dim=128, mrope_section=(24, 20, 20),
                     mrope_interleaved=True)
    kwargs = make_split_inputs(case, device="cuda")
    T = case.T
    if layout == "strided":
        store = torch.zeros(3, 2 * T, dtype=torch.int64, device="cuda")
        positions = store[:, ::2]
    else:
        store = torch.zeros(T, 3, dtype=torch.int64, device="cuda")
        positions = store.t()
    prep = qkvfuse.QKNormRope(case.num_q_heads, case.num_kv_heads, case.head_dim, kwargs["cos_sin_cache"],
                              q_weight=kwargs["q_weight"], k_weight=kwargs["k_weight"], eps=case.eps,
                              mrope_section=case.mrope_section, mrope_interleaved=True)
    qkv = kwargs["qkv"].clone()
    positions.copy_(kwargs["positions"])
    prep.inplace(qkv.clone(), positions)  # warm up (compile) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prep.inplace(qkv, positions)
    generator = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(3):
        fresh_qkv = torch.randn(qkv.shape, dtype=qkv.dtype, device="cuda", generator=generator)
        fresh_pos = torch.randint(0, 4096, (3, T), device="cuda", generator=generator)
        qkv.copy_(fresh_qkv)
        positions.copy_(fresh_pos)
        graph.replay()
        want_qkv = fresh_qkv.clone()
        prep.inplace(want_qkv, fresh_pos.contiguous())
        torch.cuda.synchronize()
        assert torch.equal(qkv, want_qkv)
