"""Hardening on every backend (CPU tensors; Triton under the interpreter).

1. Norm weights and biases with any strides: a stride-2 view, a stride-0 ``expand`` and a storage offset give the
   bits of the same call with ``.contiguous()`` vectors (the Triton kernels read them as contiguous; the launcher
   hands them a unit-stride copy when they are not).
2. Version counters: a tensor saved for backward and overwritten by a mutating form makes ``backward()`` raise;
   an in-place write into an inference tensor outside ``inference_mode`` raises as torch does. (FakeTensorMode and
   meta tensors with the in-place and ``out=`` forms -- no false overlap -- are covered by
   ``test_modes.py::test_fake_tensor_mode_shapes_and_no_false_overlap`` and ``test_meta_tensors``.)
8. Partial tuples and lone optional arguments: a ValueError / TypeError whose message starts with the argument's
   name, the same message on every backend.
"""

import re

import pytest
import torch

import qkvfuse
from _support.bits import assert_bitwise

HQ, HKV, D, T = 2, 1, 64, 5
SIZES = (HQ * D, HKV * D, HKV * D)
WIDTH = sum(SIZES)
ACT = torch.bfloat16  # the activations' dtype of the strided-weight tests


def cache():
    return qkvfuse.build_cos_sin_cache(D, 32, 10000.0)


def split_inputs(dtype=ACT):
    return torch.randn(T, WIDTH, dtype=dtype), torch.tensor([0, 3, 7, 1, 30])


# --------------------------------------------------------------------------------------------------------
# 1. Strided, stride-0 and offset norm weights and biases
# --------------------------------------------------------------------------------------------------------
def vector(layout: str, n: int, dtype: torch.dtype, scale=1.0, shift=0.0) -> torch.Tensor:
    """A length-``n`` vector laid out as ``layout``; values ``shift + scale * randn``."""
    if layout == "strided":
        t = (shift + scale * torch.randn(n, 2)).to(dtype)[:, 0]
        assert t.stride() == (2,)
    elif layout == "stride0":
        t = (shift + scale * torch.randn(1)).to(dtype).expand(n)
        assert t.stride() == (0,)
    else:
        t = (shift + scale * torch.randn(n + 3)).to(dtype)[3:]
        assert t.storage_offset() == 3 and t.is_contiguous()
    return t


LAYOUTS = ["strided", "stride0", "offset"]
WEIGHT_DTYPES = {"fp32": torch.float32, "io": ACT}


@pytest.mark.parametrize("wdtype", list(WEIGHT_DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_strided_weights_and_biases(backend, layout, wdtype):
    dtype = WEIGHT_DTYPES[wdtype]
    weights = dict(q_weight=vector(layout, D, dtype, 0.2, 1.0), k_weight=vector(layout, D, dtype, 0.2, 1.0),
                   q_bias=vector(layout, D, dtype, 0.1), k_bias=vector(layout, D, dtype, 0.1))
    dense = {k: v.contiguous() for k, v in weights.items()}
    qkv, positions = split_inputs()
    table = cache()
    with torch.no_grad():
        want = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, table, HQ, HKV, D, **dense, backend=backend)
        got = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, table, HQ, HKV, D, **weights, backend=backend)
        assert_bitwise(got, want)
        work = qkv.clone()
        assert_bitwise(qkvfuse.split_qkv_rmsnorm_rope_(work, positions, table, HQ, HKV, D, **weights,
                                                       backend=backend)[:2], want[:2])
        bound = qkvfuse.QKNormRope(HQ, HKV, D, table, **weights, backend=backend)
        assert_bitwise(bound(qkv, positions), want)
        packed = torch.full((T, WIDTH), float("nan"), dtype=ACT)
        assert_bitwise(bound(qkv, positions, out=tuple(packed.split(SIZES, 1))), want)
        work = qkv.clone()
        assert_bitwise(bound.inplace(work, positions)[:2], want[:2])
    # The weights were read, not written (a copy, when one is made, is the launcher's own).
    for k, v in weights.items():
        assert torch.equal(v, dense[k]), k


@pytest.mark.parametrize("hidden", [64, 80])
@pytest.mark.parametrize("wdtype", list(WEIGHT_DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_add_rmsnorm_strided_weight_and_bias(backend, layout, wdtype, hidden):
    dtype = WEIGHT_DTYPES[wdtype]
    weight, bias = vector(layout, hidden, dtype, 0.2, 1.0), vector(layout, hidden, dtype, 0.1)
    w_dense, b_dense = weight.contiguous(), bias.contiguous()
    x, residual = torch.randn(T, hidden, dtype=ACT), torch.randn(T, hidden, dtype=ACT)
    with torch.no_grad():
        want = qkvfuse.add_rmsnorm(x, residual, w_dense, 1e-6, b_dense, backend=backend)
        assert_bitwise(qkvfuse.add_rmsnorm(x, residual, weight, 1e-6, bias, backend=backend), want)
        plain_want = qkvfuse.add_rmsnorm(x, None, w_dense, 1e-6, backend=backend)[0]
        assert_bitwise(qkvfuse.add_rmsnorm(x, None, weight, 1e-6, backend=backend)[:1], (plain_want,))
        norm = qkvfuse.AddRMSNorm(weight, 1e-6, bias, backend=backend)
        assert_bitwise(norm(x, residual), want)
        x2, r2 = x.clone(), residual.clone()
        assert_bitwise(norm(x2, r2, out=(x2, r2)), want)  # the in-place form
        assert_bitwise((x2, r2), want)
    assert torch.equal(weight, w_dense) and torch.equal(bias, b_dense)


# --------------------------------------------------------------------------------------------------------
# 2a. A saved tensor overwritten by a mutating form: backward raises
# --------------------------------------------------------------------------------------------------------
def _norm_weights():
    return dict(q_weight=1.0 + 0.2 * torch.randn(D), k_weight=1.0 + 0.2 * torch.randn(D))


SPLIT_FORMS = ["split_qkv_rmsnorm_rope_", "QKNormRope.inplace", "split out=", "QKNormRope out="]


@pytest.mark.parametrize("form", SPLIT_FORMS)
def test_split_overwrite_of_a_saved_tensor_makes_backward_raise(backend, form):
    qkv, positions = split_inputs(torch.float32)
    kw, table = _norm_weights(), cache()
    leaf = qkv.clone().requires_grad_()
    y = leaf * 2
    z = y.sin()  # saves y
    bound = qkvfuse.QKNormRope(HQ, HKV, D, table, **kw, backend=backend)
    with torch.no_grad():
        if form == "split_qkv_rmsnorm_rope_":
            qkvfuse.split_qkv_rmsnorm_rope_(y, positions, table, HQ, HKV, D, **kw, backend=backend)
        elif form == "QKNormRope.inplace":
            bound.inplace(y, positions)
        else:  # y's column views are the outputs (not aliasing the input qkv)
            outs = tuple(y.split(SIZES, 1))
            if form == "split out=":
                qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, table, HQ, HKV, D, **kw, out=outs, backend=backend)
            else:
                bound(qkv, positions, out=outs)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


@pytest.mark.parametrize("form", ["add_rmsnorm", "AddRMSNorm", "add_rmsnorm_", "AddRMSNorm.inplace"])
@pytest.mark.parametrize("saved", ["x", "residual"])
def test_add_rmsnorm_in_place_overwrite_of_a_saved_tensor_makes_backward_raise(backend, form, saved):
    hidden = 64
    weight = 1.0 + 0.2 * torch.randn(hidden)
    leaf = torch.randn(T, hidden, requires_grad=True)
    x, residual = torch.randn(T, hidden), torch.randn(T, hidden)
    s = leaf * 2
    z = s.sin()  # saves s, which is then the in-place x or residual
    if saved == "x":
        x = s
    else:
        residual = s
    with torch.no_grad():
        if form == "add_rmsnorm":
            qkvfuse.add_rmsnorm(x, residual, weight, 1e-6, out=(x, residual), backend=backend)
        elif form == "AddRMSNorm":
            qkvfuse.AddRMSNorm(weight, backend=backend)(x, residual, out=(x, residual))
        elif form == "add_rmsnorm_":
            qkvfuse.add_rmsnorm_(x, residual, weight, 1e-6, backend=backend)
        else:
            qkvfuse.AddRMSNorm(weight, backend=backend).inplace(x, residual)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


# --------------------------------------------------------------------------------------------------------
# 2b. In-place writes into inference tensors outside inference_mode raise, as torch's own in-place ops do
# --------------------------------------------------------------------------------------------------------
INFERENCE_ERROR = "Inplace update to inference tensor outside InferenceMode"


def _inference_case(backend, request):
    """Every backend refuses (fixed: the Python version-counter kernel now raises as torch does)."""


def _raises_like_torch(call):
    with torch.inference_mode():
        probe = torch.zeros(2)
    with pytest.raises(RuntimeError, match=INFERENCE_ERROR):
        probe.add_(1)  # torch's own rule, the message matched below
    try:
        call()
    except RuntimeError as e:
        assert INFERENCE_ERROR in str(e), str(e)
    else:
        raise AssertionError("no error: an inference tensor was written in place outside inference_mode")


@pytest.mark.parametrize("form", ["split_qkv_rmsnorm_rope_", "QKNormRope.inplace", "split out=", "QKNormRope out="])
@pytest.mark.parametrize("which", ["written", "all"])
def test_split_write_into_an_inference_tensor_raises(backend, form, which, request):
    _inference_case(backend, request)
    qkv, positions = split_inputs(torch.float32)
    kw, table = _norm_weights(), cache()
    with torch.inference_mode():
        target = qkv.clone()  # the in-place qkv, or the packed out= buffer
        if which == "all":
            qkv, positions, table = qkv.clone(), positions.clone(), table.clone()
            kw = {k: v.clone() for k, v in kw.items()}
    assert target.is_inference() and qkv.is_inference() == (which == "all")
    assert all(v.is_inference() == (which == "all") for v in (*kw.values(), table, positions))
    bound = qkvfuse.QKNormRope(HQ, HKV, D, table, **kw, backend=backend)
    outs = tuple(target.split(SIZES, 1))
    call = {
        "split_qkv_rmsnorm_rope_": lambda: qkvfuse.split_qkv_rmsnorm_rope_(target, positions, table, HQ, HKV, D,
                                                                           **kw, backend=backend),
        "QKNormRope.inplace": lambda: bound.inplace(target, positions),
        "split out=": lambda: qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, table, HQ, HKV, D, **kw, out=outs,
                                                             backend=backend),
        "QKNormRope out=": lambda: bound(qkv, positions, out=outs),
    }[form]
    _raises_like_torch(call)


@pytest.mark.parametrize("form", ["add_rmsnorm", "AddRMSNorm", "add_rmsnorm_"])
@pytest.mark.parametrize("which", ["written", "all"])
def test_add_rmsnorm_write_into_an_inference_tensor_raises(backend, form, which, request):
    _inference_case(backend, request)
    hidden = 64
    weight, bias = 1.0 + 0.2 * torch.randn(hidden), 0.1 * torch.randn(hidden)
    with torch.inference_mode():
        x, residual = torch.randn(T, hidden), torch.randn(T, hidden)
        if which == "all":
            weight, bias = weight.clone(), bias.clone()
    assert weight.is_inference() == (which == "all")
    if form == "add_rmsnorm":
        call = lambda: qkvfuse.add_rmsnorm(x, residual, weight, 1e-6, bias, out=(x, residual),  # noqa: E731
                                           backend=backend)
    elif form == "AddRMSNorm":
        norm = qkvfuse.AddRMSNorm(weight, 1e-6, bias, backend=backend)
        call = lambda: norm(x, residual, out=(x, residual))  # noqa: E731
    else:
        call = lambda: qkvfuse.add_rmsnorm_(x, residual, weight, 1e-6, bias, backend=backend)  # noqa: E731
    _raises_like_torch(call)


def test_writes_into_inference_tensors_inside_inference_mode_work(backend):
    """The rule is torch's: inside inference_mode, the mutating forms write inference tensors."""
    qkv, positions = split_inputs(torch.float32)
    kw, table = _norm_weights(), cache()
    with torch.no_grad():
        want = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, table, HQ, HKV, D, **kw, backend=backend)
    with torch.inference_mode():
        work = qkv.clone()
        got = qkvfuse.split_qkv_rmsnorm_rope_(work, positions, table, HQ, HKV, D, **kw, backend=backend)
        packed = torch.empty(T, WIDTH)
        got2 = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, table, HQ, HKV, D, **kw,
                                              out=tuple(packed.split(SIZES, 1)), backend=backend)
    assert_bitwise(got, want)
    assert_bitwise(got2, want)


# --------------------------------------------------------------------------------------------------------
# 8. Partial tuples and lone optional arguments
# --------------------------------------------------------------------------------------------------------
def _error_cases(backend):
    """``(case id, argument the message must start with (a regex), call)``."""
    qkv, positions = split_inputs(torch.float32)
    table = cache()
    w, w2, b, b2 = (torch.randn(D) for _ in range(4))
    kw = dict(q_weight=w, k_weight=w2)
    q, k, v = (torch.empty(T, n) for n in SIZES)
    split = lambda **a: qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, table, HQ, HKV, D,  # noqa: E731
                                                       backend=backend, **a)
    split_ = lambda **a: qkvfuse.split_qkv_rmsnorm_rope_(qkv.clone(), positions, table, HQ, HKV, D,  # noqa: E731
                                                         backend=backend, **a)
    ctor = lambda **a: qkvfuse.QKNormRope(HQ, HKV, D, table, backend=backend, **a)  # noqa: E731
    bound = ctor(**kw)
    hidden = 80
    x, r, nw = torch.randn(T, hidden), torch.randn(T, hidden), torch.randn(hidden)
    y_o, r_o = torch.empty(T, hidden), torch.empty(T, hidden)
    norm = lambda *a, **k: qkvfuse.add_rmsnorm(*a, backend=backend, **k)  # noqa: E731
    bnorm = qkvfuse.AddRMSNorm(nw, backend=backend)
    # The argument of a pair ("q_bias/k_bias: ...") or the missing one alone ("k_bias: ...") both count as
    # starting with the argument's name.
    pair = lambda name: rf"(\w+/)?{name}(/\w+)?"  # noqa: E731
    return [
        ("out=(q, None, v)", "k_out", lambda: split(**kw, out=(q, None, v))),
        ("out=(None, k, v)", "q_out", lambda: split(**kw, out=(None, k, v))),
        ("out=(q, k, None)", "v_out", lambda: split(**kw, out=(q, k, None))),
        ("out=(q, k)", "out", lambda: split(**kw, out=(q, k))),
        ("out=q", "out", lambda: split(**kw, out=q)),
        ("bound out=(q, None, v)", "k_out", lambda: bound(qkv, positions, out=(q, None, v))),
        ("bound out=(None, k, v)", "q_out", lambda: bound(qkv, positions, out=(None, k, v))),
        ("bound out=(q, k)", "out", lambda: bound(qkv, positions, out=(q, k))),
        # A tuple of the right length goes to the op as it is (the dispatcher refuses a non-tensor); the bound
        # object's re-diagnosis names the element.
        ("bound out=(q, 'k', v)", "k_out", lambda: bound(qkv, positions, out=(q, "k", v))),
        ("bound out=(q, k, v, v)", "out", lambda: bound(qkv, positions, out=(q, k, v, v))),
        ("bound out=q", "out", lambda: bound(qkv, positions, out=q)),
        ("lone q_bias", pair("k_bias"), lambda: split(**kw, q_bias=b)),
        ("lone k_bias", pair("q_bias"), lambda: split(**kw, k_bias=b)),
        ("inplace lone q_bias", pair("k_bias"), lambda: split_(**kw, q_bias=b)),
        ("q_bias without weights", "q_bias", lambda: split(q_bias=b, k_bias=b2)),
        ("k_bias without weights", "k_bias", lambda: split(k_bias=b2)),
        ("q_weight without k_weight", pair("k_weight"), lambda: split(q_weight=w)),
        ("k_weight without q_weight", pair("q_weight"), lambda: split(k_weight=w2)),
        ("ctor lone q_bias", pair("k_bias"), lambda: ctor(**kw, q_bias=b)),
        ("ctor lone k_bias", pair("q_bias"), lambda: ctor(**kw, k_bias=b)),
        ("ctor bias without weights", "q_bias", lambda: ctor(q_bias=b, k_bias=b2)),
        ("ctor q_weight without k_weight", pair("k_weight"), lambda: ctor(q_weight=w)),
        ("ctor k_weight without q_weight", pair("q_weight"), lambda: ctor(k_weight=w2)),
        ("add_rmsnorm out=(y, None) with a residual", "residual_out", lambda: norm(x, r, nw, out=(y_o, None))),
        ("add_rmsnorm out=(None, r) with a residual", "y_out", lambda: norm(x, r, nw, out=(None, r_o))),
        ("add_rmsnorm out=(None, r) without a residual", "y_out", lambda: norm(x, None, nw, out=(None, r_o))),
        ("add_rmsnorm out=(y,) with a residual", "out", lambda: norm(x, r, nw, out=(y_o,))),
        ("add_rmsnorm out=y with a residual", "out", lambda: norm(x, r, nw, out=y_o)),
        ("AddRMSNorm out=(y, None) with a residual", "residual_out", lambda: bnorm(x, r, out=(y_o, None))),
        ("AddRMSNorm out=(None, r) with a residual", "y_out", lambda: bnorm(x, r, out=(None, r_o))),
        ("AddRMSNorm out=(y, 1.0) with a residual", "residual_out", lambda: bnorm(x, r, out=(y_o, 1.0))),
        ("AddRMSNorm out=(y, r, r) with a residual", "out", lambda: bnorm(x, r, out=(y_o, r_o, r_o))),
        # The bound calls check only qkv's width themselves; a failing call is re-diagnosed under the bound
        # object's rules first (ops.QKNormRope._bad_call), else the op's own error stands.
        ("bound qkv of another width", "qkv", lambda: bound(torch.randn(T, qkv.shape[1] + D), positions)),
        ("bound.inplace qkv of another width", "qkv", lambda: bound.inplace(torch.randn(T, qkv.shape[1] + D), positions)),
        ("bound.inplace qkv 1-D", "qkv", lambda: bound.inplace(qkv[0].clone(), positions)),
        ("bound.inplace qkv 3-D of the width", "qkv", lambda: bound.inplace(qkv.clone().unsqueeze(2), positions)),
        ("bound.inplace qkv a list", "qkv", lambda: bound.inplace(qkv.tolist(), positions)),
        ("bound.inplace positions a list", "positions", lambda: bound.inplace(qkv.clone(), positions.tolist())),
        ("bound.inplace positions of another length", "positions", lambda: bound.inplace(qkv.clone(), positions[1:])),
        ("bound out= q_out of another dtype", "q_out", lambda: bound(qkv, positions, out=(q.double(), k, v))),
        ("AddRMSNorm x of another width", "x", lambda: bnorm(torch.randn(T, hidden + 1), None)),
        ("AddRMSNorm.inplace x of another width", "x", lambda: bnorm.inplace(torch.randn(T, hidden + 1), r.clone())),
        ("AddRMSNorm.inplace x 1-D", "x", lambda: bnorm.inplace(torch.randn(hidden), None)),
        ("AddRMSNorm.inplace x a list", "x", lambda: bnorm.inplace(x.tolist(), None)),
        ("AddRMSNorm.inplace residual a float", "residual", lambda: bnorm.inplace(x.clone(), 1.0)),
        ("AddRMSNorm.inplace residual of another dtype", "residual", lambda: bnorm.inplace(x.clone(), r.double())),
        ("AddRMSNorm out= y_out of another shape", "y_out", lambda: bnorm(x, r, out=(y_o[1:], r_o))),
        ("AddRMSNorm(None)", "weight", lambda: qkvfuse.AddRMSNorm(None, backend=backend)),
        ("AddRMSNorm bias of another length", "bias", lambda: qkvfuse.AddRMSNorm(nw, 1e-6, b, backend=backend)),
    ]


def _messages(backend):
    messages = {}
    for case, arg, call in _error_cases(backend):
        with torch.no_grad():
            with pytest.raises((ValueError, TypeError)) as info:
                call()
        msg = str(info.value)
        assert re.match(rf"^{arg}: ", msg), f"{case}: message does not start with {arg!r}: {msg!r}"
        messages[case] = (type(info.value).__name__, msg)
    return messages


def test_partial_tuples_and_lone_arguments_name_the_argument(backend):
    got = _messages(backend)
    if backend != "reference":
        assert got == _messages("reference")  # the same exception type and message on every backend


def test_bound_out_takes_a_list_and_returns_a_tuple_of_the_outputs(backend):
    """``out=`` as a list is accepted by the bound calls as by the functional ones (the bound calls' fast path
    takes a tuple of the right length as it is; anything else goes through the checks first)."""
    qkv, positions = split_inputs(torch.float32)
    table = cache()
    w = torch.randn(D)
    bound = qkvfuse.QKNormRope(HQ, HKV, D, table, q_weight=w, k_weight=w, backend=backend)
    outs = [torch.empty(T, n) for n in SIZES]
    x, r, nw = torch.randn(T, 64), torch.randn(T, 64), torch.randn(64)
    y, r_out = torch.empty(T, 64), torch.empty(T, 64)
    with torch.no_grad():
        got = bound(qkv, positions, out=list(outs))
        assert isinstance(got, tuple) and all(a is b for a, b in zip(got, outs))
        assert_bitwise(got, bound(qkv, positions))
        normed = qkvfuse.AddRMSNorm(nw, backend=backend)(x, r, out=[y, r_out])
        assert normed[0] is y and normed[1] is r_out
        assert_bitwise(normed, qkvfuse.add_rmsnorm(x, r, nw, 1e-6, backend=backend))


def test_no_residual_ignores_a_none_residual_out(backend):
    """Without a residual, ``residual_out`` is ignored (documented): ``out=(y, None)`` is accepted."""
    x, nw = torch.randn(T, 64), torch.randn(64)
    y = torch.empty(T, 64)
    with torch.no_grad():
        got = qkvfuse.add_rmsnorm(x, None, nw, 1e-6, out=(y, None), backend=backend)
        want = qkvfuse.add_rmsnorm(x, None, nw, 1e-6, backend=backend)
    assert got[0] is y and got[1] is x
    assert_bitwise(got[:1], want[:1])


# --------------------------------------------------------------------------------------------------------
# Bound objects cache nothing that can go stale: every tensor rule runs in the kernel on every call.
# --------------------------------------------------------------------------------------------------------
def test_bound_objects_follow_weights_updated_in_place_or_swapped_with_data(backend):
    """Engines sync weights into a running model (``copy_``, ``.data =``): the next call reads and checks the
    tensors as they are then -- new values are used, a swapped-in tensor of the wrong shape or dtype raises, and a
    swapped-in storage that overlaps the in-place target raises."""
    qkv, positions = split_inputs()
    q_w, k_w = torch.nn.Parameter(torch.randn(D), requires_grad=False), torch.nn.Parameter(torch.randn(D),
                                                                                          requires_grad=False)
    prep = qkvfuse.QKNormRope(HQ, HKV, D, cache(), q_weight=q_w, k_weight=k_w, backend=backend)
    norm_w = torch.nn.Parameter(torch.randn(64), requires_grad=False)
    norm = qkvfuse.AddRMSNorm(norm_w, backend=backend)
    x, r = torch.randn(T, 64, dtype=ACT), torch.randn(T, 64, dtype=ACT)
    with torch.no_grad():
        new_q, new_n = torch.randn(D), torch.randn(64)
        q_w.copy_(new_q)
        norm_w.data = new_n.clone()
        want = qkvfuse.split_qkv_rmsnorm_rope(qkv, positions, cache(), HQ, HKV, D, q_weight=new_q, k_weight=k_w,
                                              backend=backend)
        assert_bitwise(prep(qkv, positions), want)
        assert_bitwise(norm(x, r), qkvfuse.add_rmsnorm(x, r, new_n, backend=backend))
        q_w.data = torch.randn(D // 2)
        with pytest.raises(ValueError, match=rf"^q_weight: expected shape \({D},\), got shape \({D // 2},\)"):
            prep(qkv, positions)
        q_w.data = torch.randn(D, dtype=torch.float16)
        with pytest.raises(TypeError, match=r"^q_weight: expected torch.float32 or qkv's dtype"):
            prep(qkv, positions)
        work = qkv.clone()
        q_w.data = work.view(-1)[:D]  # the weight now lives inside the in-place target
        with pytest.raises(ValueError, match=r"^qkv: .*shared with q_weight"):
            prep.inplace(work, positions)
        norm_w.data = x.view(-1)[:64].float()  # a copy: no overlap, values used as they are
        assert_bitwise(norm.inplace(x.clone(), r.clone()), qkvfuse.add_rmsnorm(x, r, norm_w.data, backend=backend))
        norm_w.data = torch.randn(32)
        with pytest.raises(ValueError, match=r"^weight: expected shape \(64,\), got shape \(32,\)"):
            norm.inplace(x, r)


@pytest.mark.parametrize("form", ["functional", "out", "inplace"])
def test_raw_torch_ops_calls_are_checked_like_public_ones(backend, form):
    """A loaded torch.export program calls the ops directly: the kernel of every backend (the native one, the
    Triton launcher, the reference) checks its arguments with the public messages."""
    from qkvfuse import _library
    from qkvfuse.backends import select_ops

    ns = getattr(torch.ops, _library.NAMESPACES[select_ops(backend, "cpu")])
    qkv, positions = split_inputs()
    c, w = cache(), torch.randn(D)
    args = (c, w, w, None, None, HQ, HKV, 1e-6, 1)
    outs = tuple(torch.empty(T, n, dtype=ACT) for n in SIZES)
    call = {"functional": lambda q, p, *a: ns.split_qkv_rmsnorm_rope(q, p, *a),
            "out": lambda q, p, *a: ns.split_qkv_rmsnorm_rope_out(q, p, *a, *outs),
            "inplace": lambda q, p, *a: ns.split_qkv_rmsnorm_rope_inplace(q.clone(), p, *a)}[form]
    bad = [
        ("qkv", lambda: call(qkv[:, :-2], positions, *args)),  # not (Hq + 2 Hkv) * an even head_dim
        ("num_q_heads", lambda: call(qkv, positions, c, w, w, None, None, 0, HKV, 1e-6, 1)),
        ("positions", lambda: call(qkv, positions[:-1], *args)),
        ("cos_sin_cache", lambda: call(qkv, positions, torch.randn(32, 2 * D), *args[1:])),
        ("q_weight", lambda: call(qkv, positions, c, w[:-2], *args[2:])),
        ("mrope_section", lambda: call(qkv, torch.zeros(3, T, dtype=torch.int64), *args[:-1],
                                       _library.encode_rope(True, (8, 8, 8), True))),
    ]
    with torch.no_grad():
        for arg, make in bad:
            with pytest.raises((ValueError, TypeError), match=rf"^{arg}: expected"):
                make()
        if form == "out":
            short = (outs[0][:, :-2], outs[1], outs[2])
            with pytest.raises(ValueError, match=r"^q_out: expected shape"):
                ns.split_qkv_rmsnorm_rope_out(qkv, positions, *args, *short)
        x, r, nw = torch.randn(T, 64, dtype=ACT), torch.randn(T, 64, dtype=ACT), torch.randn(64)
        with pytest.raises(ValueError, match=r"^weight: expected shape \(64,\), got shape \(32,\)"):
            ns.add_rmsnorm(x, r, nw[:32], None, 1e-6)
        with pytest.raises(ValueError, match=r"^residual: expected shape"):
            ns.add_rmsnorm_inplace(x, r[:2], nw, None, 1e-6)
        with pytest.raises(ValueError, match=r"^y_out: expected shape"):
            ns.add_rmsnorm_out(x, r, nw, None, 1e-6, torch.empty(T, 32, dtype=ACT), torch.empty_like(r))
        with pytest.raises(ValueError, match=r"^residual: .*shared with x"):
            ns.add_rmsnorm_inplace(x, x, nw, None, 1e-6)
