"""Hardening checks: the public failure modes of fused QK-norm/RoPE kernels, bad input, fuzzing, determinism.

Each check takes a backend name, runs it on CPU tensors (Triton under ``TRITON_INTERPRET=1``; the fuzz cases,
:func:`check_split_case` / :func:`check_norm_case`, also on another device) and raises ``AssertionError`` with a
readable detail when the backend is wrong. ``tests/test_failure_modes.py``,
``tests/test_validation.py``, ``tests/test_fuzz.py`` and ``tests/test_concurrency.py`` run them per backend;
:func:`section` runs them for ``python -m qkvfuse verify`` and counts passes per category.

* :data:`FAILURE_MODES` -- one check per failure mode listed in the project notes (vLLM, SGLang,
  vllm-ascend, sgl-kernel-npu bug reports), each with the reason it exists in its docstring.
* :data:`BAD_CALLS` -- calls that must raise ``ValueError``/``TypeError`` whose message starts with the name of
  the offending argument; run them with :func:`run_bad_call`. ``python -m qkvfuse._verify.failure_modes
  bad-input BACKEND`` runs them in a separate process (a crash of native code is then reported, not fatal).
* :func:`draw_split_case` / :func:`draw_norm_case` -- the space of valid configurations, drawn through a
  ``choose(options)`` callable (hypothesis in the tests, :class:`random.Random` in the verify section).
* :data:`DETERMINISM` -- repeated calls, 4 concurrent threads and 1 vs 2 intra-op threads give identical bits.

NaN/Inf inputs are not errors: they propagate and stay inside the head (split) or row (add_rmsnorm) they
are in; checking for them would cost a pass over the data. :func:`check_nonfinite_propagates` pins this down.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import random
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import qkvfuse

from ..backends import available_backends
from ..presets import get_preset
from ..rope import build_cos_sin_cache
from ..testing.accuracy import INTERPRETER_BF16_ULPS, check_norm_outputs, check_split_outputs
from ..testing.oracle import oracle_add_rmsnorm, oracle_split, unfused_add_rmsnorm, unfused_split
from .cache import FORMS, CacheCase, check_cache_case
from .inputs import SplitCase, make_norm_inputs, make_split_inputs, poisoned_like, poisoned_split_outputs
from .sections import Options, Section, advance, planned, triton_interpreter

__all__ = [
    "FAILURE_MODES", "BAD_CALLS", "DETERMINISM", "concurrency_unsupported", "BadCall", "NormCase", "run_split",
    "run_norm", "run_bad_call", "bits_equal", "draw_split_case", "draw_norm_case", "check_split_case",
    "check_norm_case", "check_nonfinite_propagates",
    "section",
]

# The partial-rotary corruption of vLLM #51049 only appeared above this many token x head pairs.
PARTIAL_ROTARY_THRESHOLD = 10240


def _extra_ulps(backend: str, dtype: torch.dtype) -> float:
    """The accuracy rule's one extra allowance, for Triton under the CPU interpreter (see
    :mod:`qkvfuse.testing.accuracy`)."""
    interpreted = backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    return INTERPRETER_BF16_ULPS if interpreted and dtype == torch.bfloat16 else 0.0


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (NaN payloads compare equal, unlike ``torch.equal``)."""
    return t.contiguous().view(torch.uint8) if t.numel() else t.new_empty((0,), dtype=torch.uint8)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


_ORACLE_CACHE: Dict[bytes, object] = {}


def _fingerprint(kwargs: Dict[str, object]) -> bytes:
    """Content hash of split arguments (tensor values, shapes and dtypes, scalars; strides do not change the
    oracle)."""
    h = hashlib.blake2b(digest_size=20)
    for name in sorted(kwargs):
        value = kwargs[name]
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            # .numpy() needs numpy: verification's only use of it (the ``verify`` extra), never the ops'.
            h.update(_bits(value).cpu().numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.digest()


def _oracle_split_cached(kwargs: Dict[str, object]):
    """``(oracle, unfused)`` for split kwargs, memoised by content: every backend is checked on the same
    inputs, and the float64 oracle (Python loops over heads and pairs) dominates the cost of a check."""
    key = b"split" + _fingerprint(kwargs)
    if key not in _ORACLE_CACHE:
        if len(_ORACLE_CACHE) > 256:
            _ORACLE_CACHE.clear()
        _ORACLE_CACHE[key] = (oracle_split(**kwargs), unfused_split(**kwargs))
    return _ORACLE_CACHE[key]


_split_out = poisoned_split_outputs  # NaN-poisoned (q, k, v) -- gated (q, k, v, gate) -- outputs for split kwargs


def run_split(backend: str, kwargs: Dict[str, object], out_row_pad: int = 0, mode: str = "out"):
    """Run ``split_qkv_rmsnorm_rope`` on ``kwargs``, check it under the accuracy rule, return ``(q, k, v)``
    (``(q, k, v, gate)`` with ``q_gate``).

    ``mode``: ``"out"`` (NaN-poisoned preallocated outputs, row stride ``+out_row_pad``), ``"functional"``
    or ``"inplace"`` (on a copy of qkv). Raises ``AssertionError`` naming the first bad element.
    """
    qkv = kwargs["qkv"]
    snapshot = qkv.clone()
    hq, hkv, D = kwargs["num_q_heads"], kwargs["num_kv_heads"], kwargs["head_dim"]
    if mode == "out":
        out = _split_out(kwargs, out_row_pad)
        got = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, out=out, backend=backend)
        assert all(g is o for g, o in zip(got, out)), "out= tensors were not returned"
    elif mode == "functional":
        got = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend=backend)
    elif mode == "inplace":
        buf = torch.full((qkv.shape[0], qkv.shape[1] + out_row_pad), float("nan"), dtype=qkv.dtype,
                         device=qkv.device)
        target = buf[:, : qkv.shape[1]]
        target.copy_(qkv)
        got = qkvfuse.split_qkv_rmsnorm_rope_(target, **{k: v for k, v in kwargs.items() if k != "qkv"},
                                             backend=backend)
    else:
        raise ValueError(f"mode: expected 'out', 'functional' or 'inplace', got {mode!r}")
    assert bits_equal(qkv, snapshot), "the op modified its input qkv"
    oracle, unfused = _oracle_split_cached(kwargs)
    report = check_split_outputs(got, oracle, unfused, qkv, hq, hkv, D, _extra_ulps(backend, qkv.dtype))
    assert report.ok, f"{backend}: {report.detail}"
    return got


@dataclasses.dataclass(frozen=True)
class NormCase:
    """One configuration of ``add_rmsnorm``."""

    T: int
    H: int
    dtype: torch.dtype = torch.bfloat16
    residual: bool = True
    bias: bool = False
    row_pad: int = 0
    mode: str = "out"  # "out", "functional" or "inplace" (y aliases x, residual_out aliases residual)
    gemma_norm: bool = False  # weight centred at 0, applied as 1 + w (Qwen3-Next / Qwen3.5 decoder norms)


def run_norm(backend: str, case: NormCase, seed: int = 0, device="cpu"):
    """Run ``add_rmsnorm`` for ``case`` on ``device``, check it under the accuracy rule, return
    ``(y, residual_out)``."""
    kw = make_norm_inputs(case.T, case.H, case.dtype, residual=case.residual, bias=case.bias, seed=seed,
                          row_pad=case.row_pad, device=device, gemma_norm=case.gemma_norm)
    x, residual = kw["x"], kw["residual"]
    snapshot = (x.clone(), None if residual is None else residual.clone())
    oracle, unfused = oracle_add_rmsnorm(**kw), unfused_add_rmsnorm(**kw)
    if case.mode == "out":
        out = (poisoned_like(x, case.row_pad), poisoned_like(x, case.row_pad))
        got = qkvfuse.add_rmsnorm(**kw, out=out, backend=backend)
        assert got[0] is out[0], "out= tensor y was not returned"
    elif case.mode == "functional":
        got = qkvfuse.add_rmsnorm(**kw, backend=backend)
    else:
        x2 = poisoned_like(x, case.row_pad).copy_(x)
        r2 = None if residual is None else poisoned_like(x, case.row_pad).copy_(residual)
        got = qkvfuse.add_rmsnorm(x2, r2, kw["weight"], kw["eps"], bias=kw.get("bias"), out=(x2, r2),
                                  gemma_norm=case.gemma_norm, backend=backend)
        assert got[0] is x2
    assert bits_equal(x, snapshot[0]) and (residual is None or bits_equal(residual, snapshot[1])), \
        "the op modified an input"
    if case.mode == "inplace" and residual is None:
        got = (got[0], snapshot[0])  # residual_out "is x", and x now holds y
    report = check_norm_outputs(got, oracle, unfused, snapshot[0], snapshot[1], _extra_ulps(backend, case.dtype))
    assert report.ok, f"{backend}: {report.detail}"
    return got


# --------------------------------------------------------------------------------------------------------
# Failure modes. One function per public failure mode; each is written so a kernel with that bug fails it.
# --------------------------------------------------------------------------------------------------------
def check_partial_rotary_large(backend: str) -> None:
    """GLM-4.x partial rotary (R = D/2) above 10 240 token x heads, where vLLM #51049 produced garbage/NaN.

    Every element is checked; the last token alone must also give the same bits as inside the big batch.
    """
    glm = get_preset("GLM-4.7")
    T = PARTIAL_ROTARY_THRESHOLD // glm.num_q_heads + 8  # 112 tokens: 10 752 Q token x heads, 11 648 with K
    assert T * glm.num_q_heads > PARTIAL_ROTARY_THRESHOLD
    case = SplitCase.from_preset(glm, T, dtype=torch.bfloat16, bias=True, max_position=2048)
    kwargs = make_split_inputs(case, seed=51049)
    q, k, v = run_split(backend, kwargs)
    tail = dict(kwargs, qkv=kwargs["qkv"][-1:], positions=kwargs["positions"][-1:])
    q1, k1, _ = qkvfuse.split_qkv_rmsnorm_rope(**tail, backend=backend)
    assert torch.equal(q1, q[-1:]) and torch.equal(k1, k[-1:]), "last token differs alone vs in a large batch"


def check_rotary_dim_from_cache(backend: str, head_dim: int = 128, rotary_dim: int = 64) -> None:
    """The rotary dim is the cache's width, never a default (vLLM #43676: GLM-4.7-FP8 at 0 % GSM8K).

    The op has no ``rotary_dim`` argument a call site could forget; dims past the cache width must come out
    normalised but unrotated, rotated dims with the cache's own frequencies.
    """
    params = inspect.signature(qkvfuse.split_qkv_rmsnorm_rope).parameters
    assert "rotary_dim" not in params, "split_qkv_rmsnorm_rope must not take rotary_dim (it is the cache width)"
    case = SplitCase(T=9, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, rotary_dim=rotary_dim,
                     dtype=torch.float32, bias=True, max_position=2048)
    run_split(backend, make_split_inputs(case, seed=43676))


def check_mrope_image_rows(backend: str, interleaved: bool = True) -> None:
    """3-D mRoPE positions with differing T/H/W rows (image tokens, extend): every row must be read.

    SGLang #35345/#34446 dropped the height/width rows in a fused path (grounding 26 % -> 81.7 % after the
    fix); text-only inputs have equal rows and cannot catch it. Also checks that these inputs do depend on
    the H/W rows, so the check cannot pass by accident.
    """
    preset = get_preset("Qwen3-VL-8B" if interleaved else "GLM-4.5V")
    # The preset's rotary layout (D, R, sections); fewer heads keep the float64 oracle cheap.
    case = SplitCase.from_preset(preset, 24, num_q_heads=4, num_kv_heads=2, dtype=torch.float32, norm=True,
                                 image=True, max_position=4096)
    kwargs = make_split_inputs(case, seed=35345)
    q, k, _ = run_split(backend, kwargs)
    pos = kwargs["positions"]
    assert not torch.equal(pos[0], pos[1]) and not torch.equal(pos[0], pos[2]), "test inputs lost image rows"
    text_like = dict(kwargs, positions=pos[:1].expand(3, -1))
    q_t, _, _ = qkvfuse.split_qkv_rmsnorm_rope(**text_like, backend=backend)
    assert not torch.equal(q_t, q), "H/W rows had no effect: the check would not see them dropped"


def check_mrope_decode_rows(backend: str, interleaved: bool = True) -> None:
    """mRoPE in decode (equal T/H/W rows, an expanded stride-0 view) reduces to RoPE, bit for bit.

    Decode positions come as ``p.expand(3, T)`` (row stride 0): a kernel that assumes a packed ``[3, T]``
    or ``[T, 3]`` layout reads the wrong tokens' positions.
    """
    preset = get_preset("Qwen3-VL-8B" if interleaved else "GLM-4.5V")
    case = SplitCase.from_preset(preset, 16, num_q_heads=4, num_kv_heads=2, dtype=torch.bfloat16, norm=True,
                                 image=False, max_position=4096)
    kwargs = make_split_inputs(case, seed=34446)
    assert kwargs["positions"].stride(0) == 0
    q, k, v = run_split(backend, kwargs)
    rope = dict(kwargs, positions=kwargs["positions"][0].contiguous(), mrope_section=None, mrope_interleaved=False)
    q_r, k_r, _ = qkvfuse.split_qkv_rmsnorm_rope(**rope, backend=backend)
    assert torch.equal(q, q_r) and torch.equal(k, k_r), "decode mRoPE (equal rows) differs from RoPE"


# (num_q_heads, num_kv_heads) ratios whose K-norm must be right: MQA, MHA, GLM-4.x 96/8, Qwen3-235B 64/4.
KNORM_RATIOS = ((4, 1), (4, 4), (96, 8), (64, 4))


def check_k_norm_ratio(backend: str, num_q_heads: int = 96, num_kv_heads: int = 8) -> None:
    """K RMSNorm variance right for every head-count ratio (vllm-ascend #12642 computed it as 0 for some)."""
    case = SplitCase(T=5, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=128, rotary_dim=128,
                     dtype=torch.bfloat16, bias=False, max_position=1024)
    run_split(backend, make_split_inputs(case, seed=12642 + num_q_heads * 10 + num_kv_heads))


NON_POW2_HEAD_DIMS = (80, 96, 192, 512)


def check_head_dim_not_skipped(backend: str, head_dim: int = 80) -> None:
    """A head_dim outside a kernel's list is computed, never silently passed through (vLLM #53115).

    Odd head counts (3 Q, 1 KV) too: NPU Triton kernels asserted power-of-two sizes.
    """
    case = SplitCase(T=3, num_q_heads=3, num_kv_heads=1, head_dim=head_dim, rotary_dim=head_dim,
                     dtype=torch.bfloat16, max_position=512)
    kwargs = make_split_inputs(case, seed=53115 + head_dim)
    q, k, _ = run_split(backend, kwargs)
    q_in = kwargs["qkv"][:, : 3 * head_dim]
    assert not torch.equal(q, q_in), f"head_dim {head_dim}: Q came out unchanged (fusion skipped)"


def check_positions_deterministic_large_t(backend: str, T: int = 4096) -> None:
    """Position reads are deterministic at large T (vllm-ascend #16674: racy reads above a token threshold).

    Three runs give identical bits, the result is right under the accuracy rule, and the last tokens alone
    give the same bits as inside the large batch.
    """
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        T = min(T, 1024)  # the interpreter runs each program in Python; 1 024 tokens still cover many blocks
    case = SplitCase(T=T, num_q_heads=2, num_kv_heads=1, head_dim=64, rotary_dim=64, dtype=torch.bfloat16,
                     pos_dtype=torch.int32, max_position=T)
    kwargs = make_split_inputs(case, seed=16674)
    first = run_split(backend, kwargs)
    for _ in range(2):
        again = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), "repeated large-T runs differ"
    tail = dict(kwargs, qkv=kwargs["qkv"][-7:], positions=kwargs["positions"][-7:])
    part = qkvfuse.split_qkv_rmsnorm_rope(**tail, backend=backend)
    assert all(torch.equal(a[-7:], b) for a, b in zip(first, part)), "last tokens differ alone vs at large T"


def check_no_bf16_rounding_between_norm_and_rope(backend: str) -> None:
    """bf16 in/out with an fp32 cache: one rounding at the end, none between norm and rotation, cos/sin as stored.

    sgl-kernel-npu #535: peers rounded the normalised value (or cos/sin) to bf16 before rotating. An extra
    rounding passes "no worse than unfused" (which rounds after every op) but not the half-ulp elementwise rule.
    """
    case = SplitCase(T=64, num_q_heads=4, num_kv_heads=2, head_dim=128, rotary_dim=128, dtype=torch.bfloat16,
                     bias=True, cache_dtype=torch.float32, max_position=4096)
    run_split(backend, make_split_inputs(case, seed=535))


def _expect_rejected(call: Callable[[], object], arg: str) -> None:
    try:
        call()
    except (ValueError, TypeError) as exc:
        assert str(exc).startswith(arg), f"error does not name {arg!r}: {exc}"
        return
    raise AssertionError(f"a bad layout of {arg!r} was accepted (silently misread?)")


def check_strided_and_3d_views(backend: str) -> None:
    """Strided views are handled (same bits as packed copies); 3-D and non-unit last-dim strides are rejected.

    vLLM's CPU ``rms_norm`` silently ignored strides and its ``rotary_embedding`` was silently wrong on 3-D
    input. Covers strided qkv rows, strided outputs, strided/transposed positions, and add_rmsnorm's rows.
    """
    case = SplitCase(T=6, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, dtype=torch.bfloat16,
                     mrope_section=(6, 5, 5), mrope_interleaved=True, image=True, row_pad=24, max_position=512)
    kwargs = make_split_inputs(case, seed=3)
    assert kwargs["qkv"].stride(0) > kwargs["qkv"].shape[1]
    pos = kwargs["positions"]
    kwargs["positions"] = pos.t().contiguous().t()  # [3, T] view of a [T, 3] buffer: strides (1, 3)
    strided = run_split(backend, kwargs, out_row_pad=40)
    packed = dict(kwargs, qkv=kwargs["qkv"].contiguous(), positions=pos.contiguous())
    reference_bits = qkvfuse.split_qkv_rmsnorm_rope(**packed, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(strided, reference_bits)), "strided views gave different bits"

    qkv = kwargs["qkv"].contiguous()
    T, W, D = qkv.shape[0], qkv.shape[1], kwargs["head_dim"]
    rest = {k: v for k, v in kwargs.items() if k != "qkv"}
    split = qkvfuse.split_qkv_rmsnorm_rope
    _expect_rejected(lambda: split(qkv.view(T, W // D, D), **rest, backend=backend), "qkv")  # [T, heads, D]
    _expect_rejected(lambda: split(qkv.view(1, T, W), **rest, backend=backend), "qkv")  # [B, T, W]
    heads_major = qkv.view(T, W // D, D).transpose(0, 1)  # [heads, T, D], same numel, permuted
    _expect_rejected(lambda: split(heads_major, **rest, backend=backend), "qkv")
    every_other = torch.empty(T, 2 * W, dtype=qkv.dtype)[:, ::2]  # last-dim stride 2
    _expect_rejected(lambda: split(every_other.copy_(qkv), **rest, backend=backend), "qkv")
    _expect_rejected(lambda: split(qkv, **dict(rest, positions=pos.view(3, 1, T)), backend=backend), "positions")
    _expect_rejected(lambda: split(qkv, **dict(rest, positions=torch.cat([pos[:1], pos])), backend=backend),
                     "positions")  # generate()'s [4, T] (text row first)

    for residual in (True, False):
        norm = NormCase(T=5, H=96, dtype=torch.bfloat16, residual=residual, bias=True, row_pad=32)
        strided_y, strided_r = run_norm(backend, norm, seed=7)
        kw = make_norm_inputs(5, 96, torch.bfloat16, residual=residual, bias=True, seed=7)
        y, r = qkvfuse.add_rmsnorm(**kw, backend=backend)
        assert torch.equal(y, strided_y) and torch.equal(r, strided_r), "add_rmsnorm: strided rows changed bits"
    x = make_norm_inputs(4, 64, torch.float32)["x"]
    weight = torch.ones(64)
    _expect_rejected(lambda: qkvfuse.add_rmsnorm(x.view(2, 2, 64), None, weight, backend=backend), "x")
    _expect_rejected(lambda: qkvfuse.add_rmsnorm(x.t().contiguous().t(), None, weight, backend=backend), "x")


# --------------------------------------------------------------------------------------------------------
# The gated attention of Qwen3-Next / Qwen3.5 (q_gate, Gemma norms, head_dim 256 with rotary 64).
# --------------------------------------------------------------------------------------------------------
def _gated_case(T: int, num_q_heads: int, num_kv_heads: int, preset: str = "Qwen3.5-27B", **changes) -> SplitCase:
    """``preset``'s full-attention geometry (gated, Gemma, D 256, R 64) with a per-rank head count."""
    fields = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, dtype=torch.bfloat16, max_position=4096)
    fields.update(changes)
    return SplitCase.from_preset(get_preset(preset), T, **fields)


def _gate_slots(qkv: torch.Tensor, num_q_heads: int, head_dim: int) -> torch.Tensor:
    """The gate heads of a gated row, ``[T, Hq * D]`` (slot ``2h + 1`` of the Q region)."""
    T = qkv.shape[0]
    return qkv[:, : 2 * num_q_heads * head_dim].reshape(T, num_q_heads, 2, head_dim)[:, :, 1].reshape(T, num_q_heads * head_dim)


def check_gated_mrope_image_rows(backend: str) -> None:
    """Qwen3.5's interleaved mRoPE in the gated layout: image tokens' height/width rows are read.

    The dropped-row bug of SGLang #35345/#34446, in the layout a gated fused path adds (Q slots interleaved with
    gate slots, K after ``2 * Hq`` slots): every form is checked against the oracle, and the H/W rows must change
    Q and K (so the check cannot pass by accident), never the gate.
    """
    case = _gated_case(16, 4, 1, dtype=torch.float32, image=True)
    kwargs = make_split_inputs(case, seed=35346)
    results = [run_split(backend, kwargs, mode=mode) for mode in ("out", "functional", "inplace")]
    pos = kwargs["positions"]
    assert not torch.equal(pos[0], pos[1]) and not torch.equal(pos[0], pos[2]), "test inputs lost image rows"
    text_like = qkvfuse.split_qkv_rmsnorm_rope(**dict(kwargs, positions=pos[:1].expand(3, -1)), backend=backend)
    q, k, _, gate = results[0]
    assert not torch.equal(text_like[0], q) and not torch.equal(text_like[1], k), \
        "H/W rows had no effect: the check would not see them dropped"
    assert torch.equal(text_like[3], gate), "the gate depends on positions"


def check_gate_not_mixed_with_q(backend: str) -> None:
    """The gate is the odd slots, Q the even ones: neither is read from the other's slot (nor from a
    ``[Q heads | gate heads]`` block layout, which is not how ``q_proj`` lays them out).

    Gate slots are scaled far from the Q slots (x 64), so a gate read from Q's slot (or Q from the gate's) cannot
    match by accident; every form (``out=``, functional, in place, the bound object) returns the gate bit-exact
    and Q under the accuracy rule.
    """
    case = _gated_case(6, 3, 1, preset="Qwen3-Next-80B-A3B", dtype=torch.bfloat16)
    kwargs = make_split_inputs(case, seed=22)
    qkv = kwargs["qkv"].clone()
    hq, D = case.num_q_heads, case.head_dim
    qkv[:, : 2 * hq * D].view(case.T, hq, 2, D)[:, :, 1] *= 64
    kwargs["qkv"] = qkv
    gate_in = _gate_slots(qkv, hq, D)
    expected = None
    for mode in ("out", "functional", "inplace"):
        got = run_split(backend, kwargs, mode=mode)
        assert bits_equal(got[3], gate_in), f"{mode}: the gate is not its slots' bits"
        expected = expected or got
    static = {k: v for k, v in kwargs.items() if k not in ("qkv", "positions", "num_q_heads", "num_kv_heads",
                                                            "head_dim", "cos_sin_cache")}
    bound = qkvfuse.QKNormRope(hq, case.num_kv_heads, D, kwargs["cos_sin_cache"], **static, backend=backend)
    work = qkv.clone()
    for form, got in (("call", bound(qkv, kwargs["positions"])), ("inplace", bound.inplace(work, kwargs["positions"]))):
        assert len(got) == 4 and all(bits_equal(a, b) for a, b in zip(got, expected)), \
            f"bound object ({form}): (q, k, v, gate) differ from the public op's"


def check_pass_through_dims(backend: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Dims ``64..255`` of a rotary-64 head (Qwen3-Next / Qwen3.5) come out normalised (``* (1 + w)``) and
    unrotated: neither copied from the input nor rotated (a kernel looping over the head in rotary-wide chunks).

    Besides the oracle check: moving every token to another position changes only dims ``< 64``, bit for bit.
    """
    case = _gated_case(7, 2, 1, preset="Qwen3-Next-80B-A3B", dtype=dtype)
    kwargs = make_split_inputs(case, seed=64)
    q, k, _, _ = run_split(backend, kwargs)
    R, D = case.rotary_dim, case.head_dim
    moved = dict(kwargs, positions=(kwargs["positions"] + 1) % case.max_position)
    q2, k2, _, _ = qkvfuse.split_qkv_rmsnorm_rope(**moved, backend=backend)
    for name, a, b in (("q", q, q2), ("k", k, k2)):
        heads_a, heads_b = a.view(case.T, -1, D), b.view(case.T, -1, D)
        assert torch.equal(heads_a[..., R:], heads_b[..., R:]), f"{name}: pass-through dims depend on the position"
        assert not torch.equal(heads_a[..., :R], heads_b[..., :R]), f"{name}: rotated dims ignore the position"


# Per-rank head counts of the gated models under tensor parallelism (KV heads replicated when TP > Hkv):
# Qwen3.5-397B 32/2 at TP8 -> 4/1, Qwen3.5-27B 24/4 at TP8 -> 3/1, Qwen3-Next 16/2 at TP8 -> 2/1 and at TP16
# -> 1/1; 24/4 at TP4 -> 6/1, 16/4 at TP2 -> 8/2, 24/4 at TP2 -> 12/2, Qwen3.5-9B unsplit 16/4.
GATED_TP_HEADS = ((4, 1), (3, 1), (2, 1), (1, 1), (6, 1), (8, 2), (12, 2), (16, 4))


def check_gated_tp_heads(backend: str, num_q_heads: int = 4, num_kv_heads: int = 1) -> None:
    """The gated layout at a TP-sized head count (1-4 KV heads): K and V found after ``2 * Hq`` slots, Gemma
    weights applied as ``1 + w``; out=, functional and in place under the accuracy rule (bf16, image mRoPE)."""
    case = _gated_case(5, num_q_heads, num_kv_heads, image=True)
    kwargs = make_split_inputs(case, seed=1000 + 10 * num_q_heads + num_kv_heads)
    for mode in ("out", "functional", "inplace"):
        run_split(backend, kwargs, mode=mode)


# Checks that take several seconds under the Triton CPU interpreter; ``verify --quick`` leaves them to the
# full run and the tests.
HEAVY_ON_INTERPRETER = {"partial rotary above 10240 token x heads"}

FAILURE_MODES: Dict[str, Callable[[str], None]] = {
    "partial rotary above 10240 token x heads": check_partial_rotary_large,
    **{f"rotary_dim from the cache (D={d}, R={r})": (lambda b, d=d, r=r: check_rotary_dim_from_cache(b, d, r))
       for d, r in ((128, 64), (128, 32), (80, 40))},
    **{f"mRoPE {name} image rows (extend)": (lambda b, i=i: check_mrope_image_rows(b, i))
       for name, i in (("interleaved", True), ("contiguous", False))},
    **{f"mRoPE {name} equal rows (decode)": (lambda b, i=i: check_mrope_decode_rows(b, i))
       for name, i in (("interleaved", True), ("contiguous", False))},
    **{f"K-norm Hq/Hkv = {hq}/{hkv}": (lambda b, hq=hq, hkv=hkv: check_k_norm_ratio(b, hq, hkv))
       for hq, hkv in KNORM_RATIOS},
    **{f"head_dim {d} not skipped": (lambda b, d=d: check_head_dim_not_skipped(b, d)) for d in NON_POW2_HEAD_DIMS},
    "position reads deterministic at large T": check_positions_deterministic_large_t,
    "no bf16 rounding between norm and rotation": check_no_bf16_rounding_between_norm_and_rope,
    "strided views handled, 3-D views rejected": check_strided_and_3d_views,
    "gated: mRoPE image rows read": check_gated_mrope_image_rows,
    "gated: gate and Q not mixed up": check_gate_not_mixed_with_q,
    **{f"gated: pass-through dims 64..255 normalised, unrotated ({str(dt)[6:]})":
       (lambda b, dt=dt: check_pass_through_dims(b, dt)) for dt in (torch.bfloat16, torch.float32)},
    **{f"gated: TP heads Hq/Hkv = {hq}/{hkv}": (lambda b, hq=hq, hkv=hkv: check_gated_tp_heads(b, hq, hkv))
       for hq, hkv in GATED_TP_HEADS},
}


def check_nonfinite_propagates(backend: str, value: float = float("nan"), head_dim: int = 64, rotary_dim: int = 32,
                               norm: bool = True) -> None:
    """NaN/Inf inputs propagate and stay in their head / row (documented behaviour; not an error).

    A non-finite value in one Q head, one K head, one V element and one add_rmsnorm row: the affected head
    (row) becomes non-finite exactly where the float64 oracle does, everything else keeps its clean bits.
    The geometry is a parameter so that specialised kernels (bf16, head_dim 128) are reached too.
    """
    case = SplitCase(T=4, num_q_heads=3, num_kv_heads=2, head_dim=head_dim, rotary_dim=rotary_dim,
                     dtype=torch.bfloat16, norm=norm, max_position=256)
    kwargs = make_split_inputs(case, seed=1)
    clean = qkvfuse.split_qkv_rmsnorm_rope(**kwargs, backend=backend)
    D = case.head_dim
    dirty = kwargs["qkv"].clone()
    dirty[1, 1 * D + 5] = value  # Q head 1 of token 1
    dirty[2, 3 * D + min(rotary_dim + 8, D - 1)] = value  # K head 0 of token 2, a pass-through dim if any
    dirty[3, 5 * D + 7] = value  # V head 0 of token 3
    dkw = dict(kwargs, qkv=dirty)
    got = qkvfuse.split_qkv_rmsnorm_rope(**dkw, backend=backend)
    oracle = oracle_split(**dkw)
    T, hq, hkv = case.T, case.num_q_heads, case.num_kv_heads
    inputs = (dirty[:, : hq * D], dirty[:, hq * D : (hq + hkv) * D])
    for name, g, o, c, x in zip("qk", got, oracle, clean, inputs):
        nonfinite = ~torch.isfinite(o)
        assert nonfinite.any(), f"{name}: test inputs produced no non-finite oracle value"
        assert torch.equal(~torch.isfinite(g.double()), nonfinite), f"{name}: non-finite pattern differs from oracle"
        heads = x.shape[1] // D
        poisoned = ~torch.isfinite(x.reshape(T, heads, D)).all(-1, keepdim=True).expand(T, heads, D).reshape(T, -1)
        assert bits_equal(g[~poisoned], c[~poisoned]), f"{name}: heads without a non-finite input changed"
    assert bits_equal(got[2], dirty[:, (hq + hkv) * D :]), "v: not a bit-exact copy of the non-finite input"
    kw = make_norm_inputs(4, 64, torch.bfloat16, residual=True, seed=2)
    clean_y, clean_r = qkvfuse.add_rmsnorm(**kw, backend=backend)
    x = kw["x"].clone()
    x[2, 9] = value
    y, r = qkvfuse.add_rmsnorm(**dict(kw, x=x), backend=backend)
    rows = torch.tensor([True, True, False, True])
    assert torch.equal(y[rows], clean_y[rows]) and torch.equal(r[rows], clean_r[rows]), "non-finite leaked rows"
    assert not torch.isfinite(y[2]).all() and not torch.isfinite(r[2, 9]), "a non-finite input was swallowed"


# --------------------------------------------------------------------------------------------------------
# Bad input: each call must raise ValueError/TypeError whose message starts with the argument's name.
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BadCall:
    name: str
    arg: str  # the message must start with this
    call: Callable[[str], object]  # backend -> makes the bad call


def _split_kwargs(**changes) -> Dict[str, object]:
    case = SplitCase(T=3, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, dtype=torch.bfloat16,
                     bias=True, max_position=64)
    return dict(make_split_inputs(case, seed=0), **changes)


def _mrope_kwargs(**changes) -> Dict[str, object]:
    case = SplitCase(T=3, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, dtype=torch.bfloat16,
                     mrope_section=(6, 5, 5), mrope_interleaved=True, max_position=64)
    return dict(make_split_inputs(case, seed=0), **changes)


def _split(backend: str, **changes):
    return qkvfuse.split_qkv_rmsnorm_rope(**_split_kwargs(**changes), backend=backend)


def _norm(backend: str, **changes):
    kw = dict(make_norm_inputs(3, 64, torch.bfloat16, residual=True, bias=True), **changes)
    return qkvfuse.add_rmsnorm(**kw, backend=backend)


def _untouched_after(call: Callable[[], object], *tensors: torch.Tensor) -> None:
    """Make ``call``; whatever it raises, ``tensors`` (outputs or the in-place qkv) must be unchanged."""
    before = [t.clone() for t in tensors]
    try:
        call()
    finally:
        for t, b in zip(tensors, before):
            assert bits_equal(t, b), "a rejected call wrote to its output / in-place buffer"


def _bad_positions_out_untouched(backend: str, value: int):
    kw = _split_kwargs()
    kw["positions"] = kw["positions"].clone()
    kw["positions"][-1] = value
    out = _split_out(kw)
    _untouched_after(lambda: qkvfuse.split_qkv_rmsnorm_rope(**kw, out=out, backend=backend), *out)


def _bad_positions_inplace_untouched(backend: str):
    kw = _mrope_kwargs()
    kw["positions"] = kw["positions"].clone()
    kw["positions"][2, 1] = 64
    qkv = kw.pop("qkv").clone()
    _untouched_after(lambda: qkvfuse.split_qkv_rmsnorm_rope_(qkv, **kw, backend=backend), qkv)


def _shared_storage_inplace(backend: str):
    kw = _split_kwargs()
    qkv = kw.pop("qkv")
    buf = torch.zeros(qkv.numel() + kw["cos_sin_cache"].numel(), dtype=torch.float32)
    cache = buf[: kw["cos_sin_cache"].numel()].view_as(kw["cos_sin_cache"]).copy_(kw["cos_sin_cache"])
    big = buf.view(torch.bfloat16)  # qkv placed over the cache's bytes
    target = big[: qkv.numel()].view_as(qkv).copy_(qkv)
    return qkvfuse.split_qkv_rmsnorm_rope_(target, **dict(kw, cos_sin_cache=cache), backend=backend)


def _out(kind: str):
    """Bad ``out`` tuples for the split op built around the standard bad-call inputs."""
    kw = _split_kwargs()
    q, k, v = _split_out(kw)
    if kind == "shape":
        q = poisoned_like(torch.empty(3, 128, dtype=torch.bfloat16))
    elif kind == "dtype":
        k = poisoned_like(torch.empty(k.shape, dtype=torch.float32))
    elif kind == "overlap_outputs":
        k = q[:, : k.shape[1]]
    elif kind == "overlap_qkv":
        q = kw["qkv"][:, 64 : 64 + q.shape[1]]  # shifted by one head: not q's own slice
    elif kind == "last_dim_stride":
        v = torch.full((v.shape[0], 2 * v.shape[1]), float("nan"), dtype=v.dtype)[:, ::2]
    elif kind == "pair":
        return kw, (q, k)
    return kw, (q, k, v)


def _split_with_out(backend: str, kind: str):
    kw, out = _out(kind)
    return qkvfuse.split_qkv_rmsnorm_rope(**kw, out=out, backend=backend)


def _norm_overlap(backend: str, which: str):
    kw = make_norm_inputs(3, 64, torch.bfloat16, residual=True)
    x, residual = kw["x"], kw["residual"]
    out = (residual, torch.empty_like(x)) if which == "y_out" else (torch.empty_like(x), x)
    return qkvfuse.add_rmsnorm(**kw, out=out, backend=backend)


def _gated_kwargs(**changes) -> Dict[str, object]:
    """The standard bad-call inputs in the gated Gemma layout: width (2*4 + 2*2) * 64 = 768."""
    case = SplitCase(T=3, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, dtype=torch.bfloat16,
                     q_gate=True, gemma_norm=True, max_position=64)
    return dict(make_split_inputs(case, seed=0), **changes)


def _gated(backend: str, **changes):
    return qkvfuse.split_qkv_rmsnorm_rope(**_gated_kwargs(**changes), backend=backend)


def _gated_out(kind: str):
    """Bad ``out`` tuples for the gated split op."""
    kw = _gated_kwargs()
    q, k, v, gate = _split_out(kw)
    qkv = kw["qkv"]
    if kind == "three":
        return kw, (q, k, v)
    if kind == "gate_shape":
        gate = poisoned_like(torch.empty(3, 128, dtype=torch.bfloat16))
    elif kind == "gate_dtype":
        gate = poisoned_like(torch.empty(gate.shape, dtype=torch.float32))
    elif kind == "gate_none":
        gate = None
    elif kind == "gate_overlaps_qkv":
        gate = qkv[:, 64 : 64 + gate.shape[1]]  # from gate slot 0 on: not a slice of its own (there is none)
    elif kind == "q_over_q_slots":
        q = qkv[:, : q.shape[1]]  # the ungated layout's own Q slice: gated, it holds Q and gate slots
    elif kind == "gate_overlaps_q":
        gate = q[:, : gate.shape[1]]
    return kw, (q, k, v, gate)


def _gated_with_out(backend: str, kind: str):
    kw, out = _gated_out(kind)
    return qkvfuse.split_qkv_rmsnorm_rope(**kw, out=out, backend=backend)


def _raw_split(backend: str, qkv: torch.Tensor, inplace: bool = False):
    """The raw functional (or in-place) split op, gated layout, on ``qkv``: the kernel's own width rule (the
    public layer checks the width first, so only a raw call -- a loaded program -- reaches it)."""
    kw = _gated_kwargs()
    ops, static = _raw_ops(backend, dict(kw, q_gate=True, gemma_norm=True))
    return (ops.split_inplace if inplace else ops.split)(qkv, kw["positions"], *static)


def _raw_ops(backend: str, kw):
    """The ops of ``backend`` and the split schema's arguments after ``qkv`` and ``positions`` for a case's
    keywords (a loaded program's call)."""
    from .._library import split_config
    from ..ops import _ops_for

    return _ops_for(backend, kw["qkv"].device), split_config(**kw).schema_args()


def _raw_split_out(backend: str, gated: bool):
    """The raw out op (as a loaded ``torch.export`` program calls it) with ``gate_out`` given exactly when the
    layout is not gated: the kernel's own rule (its C++ copy on the native CPU backend)."""
    kw = _gated_kwargs() if gated else _split_kwargs()
    ops, static = _raw_ops(backend, dict(kw, q_gate=gated, gemma_norm=gated))
    outs = _split_out(kw)
    gate_out = None if gated else poisoned_like(outs[0])
    return ops.split_out(kw["qkv"], kw["positions"], *static, *outs[:3], gate_out)


def _raw_wrapping_heads(backend: str, inplace: bool):
    """The raw op with head counts whose int64 products wrap, on tensors shaped for the wrapped sizes (unbounded,
    the native kernel's shape checks passed and it wrote out of bounds)."""
    from .._library import NAMESPACES, encode_rope
    from ..backends import select_ops

    ns = getattr(torch.ops, NAMESPACES[select_ops(backend, "cpu")])
    qkv, positions, cache = torch.randn(2, 16), torch.zeros(2, dtype=torch.int64), torch.randn(8, 4)
    if inplace:  # 3 + 2 * (2**63 - 1) heads wrap to 1
        return ns.split_qkv_rmsnorm_rope_inplace(qkv, positions, cache, None, None, None, None, 3, 2**63 - 1, 1e-6,
                                                 1)
    huge = 2**62 + 1  # gated: 2 * huge + 2 * huge heads wrap to 4, huge * head_dim to 4
    outs = [torch.empty(2, 4) for _ in range(4)]
    return ns.split_qkv_rmsnorm_rope_out(qkv, positions, cache, None, None, None, None, huge, huge, 1e-6,
                                         encode_rope(True, q_gate=True), *outs)


def _cache_kwargs(case_layout: str = "NHD", cache_dtype=None, **changes) -> Dict[str, object]:
    """The cache-writing split's standard bad-call inputs: the split's (T = 3, Hq = 4, Hkv = 2, D = 64, bf16) and a
    poisoned 3-block cache of ``case_layout`` (block_size 16)."""
    from .cache import CacheCase, make_cache_inputs

    case = CacheCase(SplitCase(T=3, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32, dtype=torch.bfloat16,
                               bias=True, max_position=64), layout=case_layout, cache_dtype=cache_dtype)
    kw = make_cache_inputs(case, seed=0)
    del kw["storage"]
    return dict(kw, **changes)


def _cache(backend: str, case_layout: str = "NHD", cache_dtype=None, **changes):
    """The public cache op on :func:`_cache_kwargs` (``case_layout``'s caches) with ``changes``."""
    return qkvfuse.split_qkv_rmsnorm_rope_cache_(**_cache_kwargs(case_layout, cache_dtype, **changes),
                                                 backend=backend)


def _cache_untouched(backend: str, **changes):
    """A refused cache call (a bad value, found in the data) leaves qkv and both caches unchanged."""
    kw = _cache_kwargs(cache_dtype=torch.float8_e4m3fn)
    kw.update(changes)
    _untouched_after(lambda: qkvfuse.split_qkv_rmsnorm_rope_cache_(**kw, backend=backend), kw["qkv"],
                     kw["key_cache"].view(torch.uint8), kw["value_cache"].view(torch.uint8))


def _cache_out(backend: str, out=None, over: str = "", raw: bool = False):
    """The out-of-place cache op on :func:`_cache_kwargs` into ``out`` (default: poisoned fresh outputs); ``over``
    names an output placed inside the key cache's memory; ``raw``: the raw op (no public layer)."""
    kw = _cache_kwargs()
    qkv = kw["qkv"]
    if out is None:
        out = [torch.full((3, w), float("nan"), dtype=qkv.dtype) for w in (4 * 64, 2 * 64, 2 * 64)]
    out = list(out)
    if over:
        i = ("q_out", "k_out", "v_out").index(over)
        out[i] = kw["key_cache"].view(-1)[: out[i].numel()].view(out[i].shape)
    if not raw:
        return qkvfuse.split_qkv_rmsnorm_rope_cache(**kw, out=tuple(out), backend=backend)
    ops, static = _raw_ops(backend, {k: v for k, v in kw.items() if k not in (
        "key_cache", "value_cache", "slot_mapping", "layout", "k_scale", "v_scale", "fp8_rounding")})
    return ops.split_cache_out(qkv, kw["positions"], *static, kw["key_cache"], kw["value_cache"], kw["slot_mapping"],
                               0, None, None, *out)


def _raw_cache(backend: str, cache_mode: int = 0, fp8: bool = False, **changes):
    """The raw cache op (a loaded program's call): what the public layer cannot refuse for it."""
    kw = _cache_kwargs(cache_dtype=torch.float8_e4m3fn if fp8 else None)
    ops, static = _raw_ops(backend, {k: v for k, v in kw.items() if k not in (
        "key_cache", "value_cache", "slot_mapping", "layout", "k_scale", "v_scale", "fp8_rounding")})
    args = dict(key_cache=kw["key_cache"], value_cache=kw["value_cache"], slot_mapping=kw["slot_mapping"],
                cache_mode=cache_mode, k_scale=kw.get("k_scale"), v_scale=kw.get("v_scale"))
    args.update(changes)
    return ops.split_cache(kw["qkv"], kw["positions"], *static, *args.values())


def _cache_over(backend: str, what: str):
    kw = _cache_kwargs()
    if what == "same":
        kw["value_cache"] = kw["key_cache"]
    elif what == "qkv":  # the key cache's bytes inside qkv's
        qkv = kw["qkv"]
        buf = torch.zeros(3 * 16 * 2 * 64 + qkv.numel(), dtype=torch.bfloat16)
        buf[: qkv.numel()].copy_(qkv.flatten())
        kw["qkv"] = buf[: qkv.numel()].view_as(qkv)
        kw["key_cache"] = buf[64 : 64 + 3 * 16 * 2 * 64].view(3, 16, 2, 64)
    elif what == "expanded":  # every block the same memory
        kw["key_cache"] = kw["key_cache"][:1].expand(3, 16, 2, 64)
    return qkvfuse.split_qkv_rmsnorm_rope_cache_(**kw, backend=backend)


_NO_NORM = dict(q_weight=None, k_weight=None, q_bias=None, k_bias=None)
_META = torch.device("meta")
_B = BadCall
BAD_CALLS: List[BadCall] = [
    # split_qkv_rmsnorm_rope: qkv
    _B("qkv not a tensor", "qkv", lambda b: _split(b, qkv=[[0.0] * 512] * 3)),
    _B("qkv int dtype", "qkv", lambda b: _split(b, qkv=torch.zeros(3, 512, dtype=torch.int32))),
    _B("qkv float64", "qkv", lambda b: _split(b, qkv=torch.zeros(3, 512, dtype=torch.float64))),
    _B("qkv 1-D", "qkv", lambda b: _split(b, qkv=torch.zeros(512, dtype=torch.bfloat16))),
    _B("qkv width not (Hq+2Hkv)*D", "qkv", lambda b: _split(b, qkv=torch.zeros(3, 500, dtype=torch.bfloat16))),
    _B("qkv last dim not contiguous", "qkv",
       lambda b: _split(b, qkv=torch.zeros(3, 1024, dtype=torch.bfloat16)[:, ::2])),
    _B("qkv overlapping rows (row stride < width)", "qkv",
       lambda b: _split(b, qkv=torch.zeros(1024, dtype=torch.bfloat16).as_strided((3, 512), (64, 1)))),
    # head geometry
    _B("num_q_heads = 0", "num_q_heads", lambda b: _split(b, num_q_heads=0)),
    _B("num_kv_heads a float", "num_kv_heads", lambda b: _split(b, num_kv_heads=2.0)),
    _B("num_q_heads a bool", "num_q_heads", lambda b: _split(b, num_q_heads=True)),
    _B("num_q_heads 2**20 + 1", "num_q_heads", lambda b: _split(b, num_q_heads=2**20 + 1)),
    _B("num_kv_heads 2**63 - 1", "num_kv_heads", lambda b: _split(b, num_kv_heads=2**63 - 1)),
    _B("QKNormRope num_kv_heads 2**62 + 1", "num_kv_heads",
       lambda b: qkvfuse.QKNormRope(4, 2**62 + 1, 64, _split_kwargs()["cos_sin_cache"], backend=b)),
    _B("raw out op: gated head counts 2**62 + 1 (products wrap)", "num_q_heads",
       lambda b: _raw_wrapping_heads(b, False)),
    _B("raw in-place op: num_kv_heads 2**63 - 1 (products wrap)", "num_kv_heads",
       lambda b: _raw_wrapping_heads(b, True)),
    _B("head_dim odd", "head_dim", lambda b: _split(b, qkv=torch.zeros(3, 8 * 63, dtype=torch.bfloat16), head_dim=63,
                                                  cos_sin_cache=torch.zeros(8, 32))),
    _B("head_dim > 512", "head_dim", lambda b: _split(b, qkv=torch.zeros(3, 8 * 1024, dtype=torch.bfloat16),
                                                    head_dim=1024, cos_sin_cache=torch.zeros(8, 32))),
    # cos_sin_cache (the rotary dim)
    _B("cache int dtype", "cos_sin_cache", lambda b: _split(b, cos_sin_cache=torch.zeros(64, 32, dtype=torch.int64))),
    _B("cache 1-D", "cos_sin_cache", lambda b: _split(b, cos_sin_cache=torch.zeros(64 * 32))),
    _B("cache 0 rows", "cos_sin_cache", lambda b: _split(b, cos_sin_cache=torch.zeros(0, 32))),
    _B("rotary_dim odd", "cos_sin_cache", lambda b: _split(b, cos_sin_cache=torch.zeros(64, 31))),
    _B("rotary_dim > head_dim", "cos_sin_cache", lambda b: _split(b, cos_sin_cache=torch.zeros(64, 66))),
    _B("cache last dim not contiguous", "cos_sin_cache",
       lambda b: _split(b, cos_sin_cache=torch.zeros(64, 64)[:, ::2])),
    _B("cache on another device", "cos_sin_cache",
       lambda b: _split(b, cos_sin_cache=torch.zeros(64, 32, device=_META))),
    # positions
    _B("positions float", "positions", lambda b: _split(b, positions=torch.zeros(3))),
    _B("positions wrong length", "positions", lambda b: _split(b, positions=torch.zeros(4, dtype=torch.int64))),
    _B("positions [3, T] without mrope_section", "positions",
       lambda b: _split(b, positions=torch.zeros(3, 3, dtype=torch.int64))),
    _B("positions 1-D with mrope_section", "positions",
       lambda b: qkvfuse.split_qkv_rmsnorm_rope(**_mrope_kwargs(positions=torch.zeros(3, dtype=torch.int64)),
                                                backend=b)),
    _B("positions [4, T] (generate's text row) with mrope_section", "positions",
       lambda b: qkvfuse.split_qkv_rmsnorm_rope(**_mrope_kwargs(positions=torch.zeros(4, 3, dtype=torch.int64)),
                                                backend=b)),
    _B("positions negative (outputs untouched)", "positions", lambda b: _bad_positions_out_untouched(b, -1)),
    _B("positions == max_position (outputs untouched)", "positions", lambda b: _bad_positions_out_untouched(b, 64)),
    _B("positions far out of range (outputs untouched)", "positions",
       lambda b: _bad_positions_out_untouched(b, 2**31 - 1)),
    _B("mRoPE width row out of range (in-place qkv untouched)", "positions", _bad_positions_inplace_untouched),
    # mrope_section
    _B("mrope_section wrong sum", "mrope_section",
       lambda b: qkvfuse.split_qkv_rmsnorm_rope(**_mrope_kwargs(mrope_section=(6, 5, 6)), backend=b)),
    _B("mrope_section two entries", "mrope_section",
       lambda b: qkvfuse.split_qkv_rmsnorm_rope(**_mrope_kwargs(mrope_section=(8, 8)), backend=b)),
    _B("mrope_section negative entry", "mrope_section",
       lambda b: qkvfuse.split_qkv_rmsnorm_rope(**_mrope_kwargs(mrope_section=(18, -1, -1)), backend=b)),
    _B("mrope_interleaved not a bool", "mrope_interleaved",
       lambda b: qkvfuse.split_qkv_rmsnorm_rope(**_mrope_kwargs(mrope_interleaved="yes"), backend=b)),
    _B("is_neox an int", "is_neox", lambda b: _split(b, is_neox=1)),
    # norm weights and biases
    _B("only q_weight", "k_weight", lambda b: _split(b, k_weight=None, q_bias=None, k_bias=None)),
    _B("q_weight wrong length", "q_weight", lambda b: _split(b, q_weight=torch.ones(32))),
    _B("k_weight float64", "k_weight", lambda b: _split(b, k_weight=torch.ones(64, dtype=torch.float64))),
    _B("k_weight on another device", "k_weight", lambda b: _split(b, k_weight=torch.ones(64, device=_META))),
    _B("q_bias without weights", "q_bias", lambda b: _split(b, q_weight=None, k_weight=None, k_bias=None)),
    _B("k_bias wrong length", "k_bias", lambda b: _split(b, k_bias=torch.zeros(65))),
    _B("eps negative", "eps", lambda b: _split(b, eps=-1e-6)),
    _B("eps NaN", "eps", lambda b: _split(b, eps=float("nan"))),
    _B("eps a string", "eps", lambda b: _split(b, eps="1e-6")),
    _B("backend unknown", "backend", lambda b: qkvfuse.split_qkv_rmsnorm_rope(**_split_kwargs(), backend="cuda")),
    # out= buffers
    _B("out wrong shape", "q_out", lambda b: _split_with_out(b, "shape")),
    _B("out wrong dtype", "k_out", lambda b: _split_with_out(b, "dtype")),
    _B("out tensors overlap each other", "q_out", lambda b: _split_with_out(b, "overlap_outputs")),
    _B("out overlaps qkv (not its own slice)", "q_out", lambda b: _split_with_out(b, "overlap_qkv")),
    _B("out last dim not contiguous", "v_out", lambda b: _split_with_out(b, "last_dim_stride")),
    _B("out two tensors", "out", lambda b: _split_with_out(b, "pair")),
    _B("in-place qkv overlapping the cache", "qkv", _shared_storage_inplace),
    # the gated layout (q_gate) and Gemma norms (gemma_norm)
    _B("q_gate width not (2Hq+2Hkv)*D", "qkv", lambda b: _gated(b, qkv=torch.zeros(3, 700, dtype=torch.bfloat16))),
    _B("q_gate with an ungated-width qkv", "qkv", lambda b: _gated(b, qkv=torch.zeros(3, 512, dtype=torch.bfloat16))),
    _B("ungated call on a gated-width qkv", "qkv",
       lambda b: _split(b, qkv=torch.zeros(3, 768, dtype=torch.bfloat16))),
    _B("q_gate an int", "q_gate", lambda b: _gated(b, q_gate=1)),
    _B("q_gate a string", "q_gate", lambda b: _split(b, q_gate="yes")),
    _B("gemma_norm an int", "gemma_norm", lambda b: _gated(b, gemma_norm=1)),
    _B("gemma_norm None", "gemma_norm", lambda b: _split(b, gemma_norm=None)),
    _B("in-place q_gate an int", "q_gate",
       lambda b: qkvfuse.split_qkv_rmsnorm_rope_(**dict(_gated_kwargs(), q_gate=1), backend=b)),
    _B("QKNormRope q_gate None", "q_gate",
       lambda b: qkvfuse.QKNormRope(4, 2, 64, _gated_kwargs()["cos_sin_cache"], q_gate=None, backend=b)),
    _B("QKNormRope gemma_norm an int", "gemma_norm",
       lambda b: qkvfuse.QKNormRope(4, 2, 64, _gated_kwargs()["cos_sin_cache"], gemma_norm=0, backend=b)),
    # gemma_norm says how the q/k norm weights are stored: without weights it would be ignored
    _B("gemma_norm without norm weights", "gemma_norm", lambda b: _split(b, **_NO_NORM, gemma_norm=True)),
    _B("gated gemma_norm without norm weights", "gemma_norm", lambda b: _gated(b, q_weight=None, k_weight=None)),
    _B("out= gemma_norm without norm weights", "gemma_norm",
       lambda b: qkvfuse.split_qkv_rmsnorm_rope(**_split_kwargs(**_NO_NORM, gemma_norm=True),
                                                out=_split_out(_split_kwargs()), backend=b)),
    _B("in-place gemma_norm without norm weights", "gemma_norm",
       lambda b: qkvfuse.split_qkv_rmsnorm_rope_(**dict(_split_kwargs(**_NO_NORM, gemma_norm=True),
                                                        qkv=_split_kwargs()["qkv"].clone()), backend=b)),
    _B("QKNormRope gemma_norm without norm weights", "gemma_norm",
       lambda b: qkvfuse.QKNormRope(4, 2, 64, _split_kwargs()["cos_sin_cache"], gemma_norm=True, backend=b)),
    _B("gated out three tensors", "out", lambda b: _gated_with_out(b, "three")),
    _B("ungated out four tensors", "out",
       lambda b: qkvfuse.split_qkv_rmsnorm_rope(**_split_kwargs(), out=_split_out(_gated_kwargs()), backend=b)),
    _B("gate_out wrong shape", "gate_out", lambda b: _gated_with_out(b, "gate_shape")),
    _B("gate_out wrong dtype", "gate_out", lambda b: _gated_with_out(b, "gate_dtype")),
    _B("gate_out None", "gate_out", lambda b: _gated_with_out(b, "gate_none")),
    _B("gate_out overlapping qkv", "gate_out", lambda b: _gated_with_out(b, "gate_overlaps_qkv")),
    _B("gate_out overlapping q_out", "q_out", lambda b: _gated_with_out(b, "gate_overlaps_q")),
    _B("gated q_out over qkv's first Hq*D columns", "q_out", lambda b: _gated_with_out(b, "q_over_q_slots")),
    _B("raw op: gated width not a multiple of 2Hq+2Hkv", "qkv",
       lambda b: _raw_split(b, torch.zeros(3, 700, dtype=torch.bfloat16))),
    _B("raw op: gated width with an odd head_dim", "qkv",
       lambda b: _raw_split(b, torch.zeros(3, 12 * 63, dtype=torch.bfloat16))),
    _B("raw in-place op: gated width of the ungated layout", "qkv",
       lambda b: _raw_split(b, torch.zeros(3, 512, dtype=torch.bfloat16), inplace=True)),
    _B("raw out op: gate_out without the gated layout", "gate_out", lambda b: _raw_split_out(b, False)),
    _B("raw out op: no gate_out with the gated layout", "gate_out", lambda b: _raw_split_out(b, True)),
    # add_rmsnorm
    _B("x int dtype", "x", lambda b: _norm(b, x=torch.zeros(3, 64, dtype=torch.int32))),
    _B("x 3-D", "x", lambda b: _norm(b, x=torch.zeros(1, 3, 64, dtype=torch.bfloat16))),
    _B("x last dim not contiguous", "x", lambda b: _norm(b, x=torch.zeros(3, 128, dtype=torch.bfloat16)[:, ::2])),
    _B("residual dtype differs", "residual", lambda b: _norm(b, residual=torch.zeros(3, 64))),
    _B("residual shape differs", "residual", lambda b: _norm(b, residual=torch.zeros(4, 64, dtype=torch.bfloat16))),
    _B("weight wrong length", "weight", lambda b: _norm(b, weight=torch.ones(63))),
    _B("weight not a tensor", "weight", lambda b: _norm(b, weight=[1.0] * 64)),
    _B("bias wrong length", "bias", lambda b: _norm(b, bias=torch.zeros(128))),
    _B("add_rmsnorm eps inf", "eps", lambda b: _norm(b, eps=float("inf"))),
    _B("add_rmsnorm gemma_norm a string", "gemma_norm", lambda b: _norm(b, gemma_norm="yes")),
    _B("add_rmsnorm_ gemma_norm an int", "gemma_norm",
       lambda b: qkvfuse.add_rmsnorm_(**dict(make_norm_inputs(3, 64, torch.bfloat16), gemma_norm=1), backend=b)),
    _B("AddRMSNorm gemma_norm None", "gemma_norm",
       lambda b: qkvfuse.AddRMSNorm(torch.zeros(64), 1e-6, gemma_norm=None, backend=b)),
    _B("y_out overlapping residual", "y_out", lambda b: _norm_overlap(b, "y_out")),
    _B("residual_out overlapping x", "residual_out", lambda b: _norm_overlap(b, "residual_out")),
    # split_qkv_rmsnorm_rope_cache_: the caches, slots and scales
    _B("key_cache not a tensor", "key_cache", lambda b: _cache(b, key_cache=[0.0])),
    _B("key_cache fp16 for bf16 qkv", "key_cache",
       lambda b: _cache(b, key_cache=torch.zeros(3, 16, 2, 64, dtype=torch.float16))),
    _B("value_cache dtype not key_cache's", "value_cache",
       lambda b: _cache(b, value_cache=torch.zeros(3, 16, 2, 64, dtype=torch.float8_e4m3fn))),
    _B("key_cache 3-D", "key_cache", lambda b: _cache(b, key_cache=torch.zeros(48, 2, 64, dtype=torch.bfloat16))),
    _B("key_cache head count not num_kv_heads", "key_cache",
       lambda b: _cache(b, key_cache=torch.zeros(3, 16, 4, 64, dtype=torch.bfloat16),
                        value_cache=torch.zeros(3, 16, 4, 64, dtype=torch.bfloat16))),
    _B("key_cache head_dim not qkv's", "key_cache",
       lambda b: _cache(b, key_cache=torch.zeros(3, 16, 2, 32, dtype=torch.bfloat16),
                        value_cache=torch.zeros(3, 16, 2, 32, dtype=torch.bfloat16))),
    _B("value_cache shape not key_cache's", "value_cache",
       lambda b: _cache(b, value_cache=torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16))),
    _B("NHD-shaped caches with layout HND", "key_cache",
       lambda b: _cache(b, "HND", layout="HND", key_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16),
                        value_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16))),
    _B("key_cache on another device", "key_cache",
       lambda b: _cache(b, key_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16, device=_META))),
    _B("layout unknown", "layout", lambda b: _cache(b, layout="NDH")),
    _B("layout not a string", "layout", lambda b: _cache(b, layout=0)),
    _B("fp8_rounding unknown", "fp8_rounding", lambda b: _cache(b, fp8_rounding="up")),
    _B("amx layout with an FP8 cache", "key_cache", lambda b: _cache(b, "amx", torch.float8_e4m3fn)),
    _B("vec layout with a strided region", "key_cache",
       lambda b: _cache(b, "vec", key_cache=torch.zeros(3, 2, 64, 16, dtype=torch.bfloat16).transpose(2, 3),
                        value_cache=torch.zeros(3, 2, 64, 16, dtype=torch.bfloat16).transpose(2, 3))),
    _B("key_cache with elements reached twice", "key_cache", lambda b: _cache_over(b, "expanded")),
    _B("value_cache is key_cache", "value_cache", lambda b: _cache_over(b, "same")),
    _B("key_cache overlapping qkv", "key_cache", lambda b: _cache_over(b, "qkv")),
    _B("slot_mapping float", "slot_mapping", lambda b: _cache(b, slot_mapping=torch.zeros(3))),
    _B("slot_mapping 2-D", "slot_mapping", lambda b: _cache(b, slot_mapping=torch.zeros(1, 3, dtype=torch.int64))),
    _B("slot_mapping not a tensor", "slot_mapping", lambda b: _cache(b, slot_mapping=[0, 1, 2])),
    _B("slot past the cache (qkv and caches untouched)", "slot_mapping",
       lambda b: _cache_untouched(b, slot_mapping=torch.tensor([0, 48, 1]))),
    _B("FP8 cache without k_scale", "k_scale", lambda b: _cache(b, cache_dtype=torch.float8_e4m3fn, k_scale=None)),
    _B("k_scale float64", "k_scale",
       lambda b: _cache(b, cache_dtype=torch.float8_e5m2, k_scale=torch.tensor(1.0, dtype=torch.float64))),
    _B("v_scale two elements", "v_scale",
       lambda b: _cache(b, cache_dtype=torch.float8_e4m3fn, v_scale=torch.ones(2))),
    _B("k_scale a float", "k_scale", lambda b: _cache(b, cache_dtype=torch.float8_e4m3fn, k_scale=0.5)),
    _B("k_scale for a bf16 cache", "k_scale", lambda b: _cache(b, k_scale=torch.tensor(1.0))),
    _B("v_scale zero (qkv and caches untouched)", "v_scale",
       lambda b: _cache_untouched(b, v_scale=torch.tensor(0.0))),
    _B("raw cache_mode unknown", "cache_mode", lambda b: _raw_cache(b, cache_mode=7)),
    _B("raw cache_mode negative", "cache_mode", lambda b: _raw_cache(b, cache_mode=-1)),
    _B("raw FP8 cache without v_scale", "v_scale", lambda b: _raw_cache(b, fp8=True, v_scale=None)),
    # the out-of-place cache form: its outputs (the split's out= rules) and the caches' overlap with them
    _B("cache out= of 2 tensors", "out", lambda b: _cache_out(b, out=[torch.zeros(3, 256, dtype=torch.bfloat16)] * 2)),
    _B("cache out= k_out too narrow", "k_out",
       lambda b: _cache_out(b, out=[torch.zeros(3, w, dtype=torch.bfloat16) for w in (256, 64, 128)])),
    _B("cache out= k_out inside key_cache", "key_cache", lambda b: _cache_out(b, over="k_out")),
    _B("raw cache out= v_out inside key_cache", "key_cache", lambda b: _cache_out(b, over="v_out", raw=True)),
    _B("raw cache out= q_out fp32", "q_out",
       lambda b: _cache_out(b, out=[torch.zeros(3, 256)] + [torch.zeros(3, 128, dtype=torch.bfloat16)] * 2, raw=True)),
    # build_cos_sin_cache
    _B("cache builder rotary_dim odd", "rotary_dim", lambda b: build_cos_sin_cache(63, 16, 1e4)),
    _B("cache builder rotary_dim 0", "rotary_dim", lambda b: build_cos_sin_cache(0, 16, 1e4)),
    _B("cache builder max_position 0", "max_position", lambda b: build_cos_sin_cache(64, 0, 1e4)),
    _B("cache builder base 1", "base", lambda b: build_cos_sin_cache(64, 16, 1.0)),
    _B("cache builder base NaN", "base", lambda b: build_cos_sin_cache(64, 16, float("nan"))),
    _B("cache builder int dtype", "dtype", lambda b: build_cos_sin_cache(64, 16, 1e4, dtype=torch.int32)),
    _B("cache builder rope_scaling a list", "rope_scaling", lambda b: build_cos_sin_cache(64, 16, 1e4, [4.0])),
    _B("cache builder unknown rope_type", "rope_scaling",
       lambda b: build_cos_sin_cache(64, 16, 1e4, {"rope_type": "dynamic", "factor": 2.0})),
    _B("cache builder yarn without factor", "rope_scaling",
       lambda b: build_cos_sin_cache(64, 16, 1e4, {"rope_type": "yarn"})),
    _B("cache builder llama3 missing key", "rope_scaling",
       lambda b: build_cos_sin_cache(64, 16, 1e4, {"rope_type": "llama3", "factor": 8.0})),
]


def run_bad_call(bad: BadCall, backend: str) -> Tuple[bool, str]:
    """``(ok, detail)``: ok when the call raised ValueError/TypeError whose message starts with ``bad.arg``."""
    try:
        bad.call(backend)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        if not msg.startswith(bad.arg):
            return False, f"{type(exc).__name__} does not start with {bad.arg!r}: {msg}"
        return True, f"{type(exc).__name__}: {msg}"
    except Exception as exc:  # noqa: BLE001 -- any other exception type is the failure being reported
        return False, f"raised {type(exc).__name__} instead of ValueError/TypeError: {exc}"
    return False, "accepted (no error raised)"


# --------------------------------------------------------------------------------------------------------
# The space of valid configurations, for hypothesis (tests) and the fuzz-lite rows (verify).
# ``choose(options)`` returns one element; hypothesis shrinks towards the first, so it is the plainest.
# --------------------------------------------------------------------------------------------------------
Choose = Callable[[Sequence], object]


def draw_split_case(choose: Choose, small: bool = False) -> Tuple[SplitCase, int, str, int]:
    """A random valid ``(SplitCase, seed, mode, out_row_pad)``; ``small`` keeps it interpreter-sized."""
    T = choose((1, 0, 2, 3) if small else (1, 0, 2, 3, 7, 16, 33))
    D = choose((64, 2, 8, 80, 96, 128) if small else (64, 2, 4, 8, 30, 48, 80, 96, 128, 192, 256, 512))
    R = choose(sorted({r for r in (D, D // 2 - (D // 2) % 2, 2, 32, D - 2) if 2 <= r <= D}, reverse=True))
    num_kv_heads = choose((1, 2, 3) if small else (1, 2, 3, 4))
    num_q_heads = choose((1, 2, 3, 4) if small else (1, 2, 3, 4, 5, 8, 12))
    norm = choose((True, False))
    mode_rope = choose(("rope", "mrope", "mrope_interleaved"))
    sections = None
    if mode_rope != "rope":
        half = R // 2
        s_h = choose(range(0, half + 1))
        s_w = choose(range(0, half - s_h + 1))
        sections = (half - s_h - s_w, s_h, s_w)
    dtype = choose((torch.bfloat16, torch.float32, torch.float16))
    case = SplitCase(
        T=T, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=D, rotary_dim=R, dtype=dtype, norm=norm,
        bias=norm and choose((False, True)), is_neox=choose((True, False)), mrope_section=sections,
        mrope_interleaved=mode_rope == "mrope_interleaved", image=choose((True, False)),
        pos_dtype=choose((torch.int64, torch.int32)),
        cache_dtype=choose((torch.float32, torch.bfloat16, torch.float16)),
        weight_dtype=choose((None, dtype)), row_pad=choose((0, 8, 1)), max_position=choose((64, 2, 7, 4096)),
        eps=choose((1e-6, 1e-5, 0.1)), q_gate=choose((False, True)), gemma_norm=norm and choose((False, True)),
    )
    return case, choose(range(0, 1000)), choose(("out", "functional", "inplace")), choose((0, 16))


def draw_norm_case(choose: Choose, small: bool = False) -> Tuple[NormCase, int]:
    """A random valid ``(NormCase, seed)``."""
    T = choose((1, 0, 2, 3) if small else (1, 0, 2, 3, 7, 33))
    H = choose((64, 1, 3, 80, 128) if small else (64, 1, 3, 80, 128, 1000, 4096, 5120))
    case = NormCase(T=T, H=H, dtype=choose((torch.bfloat16, torch.float32, torch.float16)),
                    residual=choose((True, False)), bias=choose((False, True)), row_pad=choose((0, 8, 1)),
                    mode=choose(("out", "functional", "inplace")), gemma_norm=choose((False, True)))
    return case, choose(range(0, 1000))


def draw_cache_case(choose: Choose, small: bool = False) -> Tuple[CacheCase, int, str]:
    """A random valid ``(CacheCase, seed, form)`` for the cache-writing split: any :func:`draw_split_case`
    configuration, each KV-cache layout it may use, same-dtype and FP8 caches with either rounding, block sizes,
    slot patterns, K and V interleaved in one buffer or padded, and each of :data:`qkvfuse._verify.cache.FORMS`."""
    split, seed, _, _ = draw_split_case(choose, small)
    amx_ok = split.dtype != torch.float32 and split.head_dim % 16 == 0
    layout = choose(("NHD", "HND", "vec", "amx") if amx_ok else ("NHD", "HND", "vec"))
    cache_dtype = None if layout == "amx" else choose((None, torch.float8_e4m3fn, torch.float8_e5m2))
    block_size = 16 if layout == "amx" else choose((16, 1, 3, 32))
    interleaved = choose((False, True))
    case = CacheCase(
        split, layout=layout, cache_dtype=cache_dtype,
        rounding=choose(("nearest", "truncate")) if cache_dtype is not None else "nearest",
        num_blocks=-(-split.T // block_size) + choose((1, 0, 2)) or 1, block_size=block_size,
        slots=choose(("shuffled", "short", "skips", "saturate")), interleaved=interleaved,
        padded=layout in ("NHD", "HND") and not interleaved and choose((False, True)))
    return case, seed, choose(FORMS)


def check_cache_fuzz_case(backend: str, drawn, device="cpu") -> None:
    """Run and check one :func:`draw_cache_case` result on ``device``."""
    case, seed, form = drawn
    check_cache_case(backend, case, seed=seed, device=device, form=form)


def check_split_case(backend: str, drawn, device="cpu") -> None:
    """Run and check one :func:`draw_split_case` result on ``device``."""
    case, seed, mode, out_row_pad = drawn
    run_split(backend, make_split_inputs(case, seed=seed, device=device), out_row_pad=out_row_pad, mode=mode)


def check_norm_case(backend: str, drawn, device="cpu") -> None:
    """Run and check one :func:`draw_norm_case` result on ``device``."""
    case, seed = drawn
    run_norm(backend, case, seed=seed, device=device)


# --------------------------------------------------------------------------------------------------------
# Determinism and concurrency.
# --------------------------------------------------------------------------------------------------------
def _determinism_inputs(backend: str, count: int, T: int):
    small = backend == "triton"
    split_cases = [
        SplitCase(T=T, num_q_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=64, dtype=torch.bfloat16),
        SplitCase(T=T, num_q_heads=6, num_kv_heads=2, head_dim=128, rotary_dim=64, dtype=torch.bfloat16, bias=True),
        SplitCase(T=T, num_q_heads=2, num_kv_heads=1, head_dim=128, rotary_dim=128, dtype=torch.float16,
                  mrope_section=(24, 20, 20), mrope_interleaved=True),
        SplitCase(T=T, num_q_heads=3, num_kv_heads=1, head_dim=80, rotary_dim=40, dtype=torch.float32, row_pad=8),
    ][:count]
    split = [make_split_inputs(c, seed=i) for i, c in enumerate(split_cases)]
    norm = [make_norm_inputs(T, H, dt, residual=i % 2 == 0, bias=i >= 2, seed=i)
            for i, (H, dt) in enumerate([(256, torch.bfloat16), (96, torch.float32), (128, torch.float16),
                                         (512 if not small else 64, torch.bfloat16)][:count])]
    return split, norm


# The KV cache each determinism input set also writes (the out-of-place cache-writing split into fresh caches):
# a layout per set, the second set's cache FP8. Slots: a permutation with skips (duplicate slots keep one token's
# row, which only the native CPU kernel fixes: tests/backends/test_cpu_cache.py checks its thread splits).
_CACHE_LAYOUTS = ("vec", "NHD", "amx", "HND")


def _call_cache(backend: str, i: int, split_kw):
    qkv, H, D = split_kw["qkv"], split_kw["num_kv_heads"], split_kw["head_dim"]
    T, bs, layout = qkv.shape[0], 16, _CACHE_LAYOUTS[i]
    blocks = -(-T // bs) + 1
    dtype, scales = qkv.dtype, {}
    if i == 1:
        dtype, scales = torch.float8_e4m3fn, dict(k_scale=torch.tensor(0.05), v_scale=torch.tensor(0.07))
    shape = (blocks, bs, H, D) if layout == "NHD" else (blocks, H, bs, D)
    key, value = (torch.zeros(shape, dtype=torch.uint8 if dtype.itemsize == 1 else dtype).view(dtype)
                  for _ in range(2))
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(i))[:T]
    slots[::5] = -1
    qkvfuse.split_qkv_rmsnorm_rope_cache(**split_kw, key_cache=key, value_cache=value, slot_mapping=slots,
                                         layout=layout, **scales, backend=backend)
    return key, value


def _call_all(backend: str, i: int, split_kw, norm_kw):
    """Input set ``i`` through the split, add_rmsnorm and the cache-writing split (its caches)."""
    return (qkvfuse.split_qkv_rmsnorm_rope(**split_kw, backend=backend),
            qkvfuse.add_rmsnorm(**norm_kw, backend=backend), _call_cache(backend, i, split_kw))


def _same_bits(a, b) -> bool:
    flat_a = [t for group in a for t in group]
    flat_b = [t for group in b for t in group]
    return len(flat_a) == len(flat_b) and all(bits_equal(x, y) for x, y in zip(flat_a, flat_b))


def check_repeatable(backend: str, repeats: int = 5) -> None:
    """Repeated calls on the same inputs give identical bits (NaN payloads included)."""
    split, norm = _determinism_inputs(backend, 4, 3 if backend == "triton" else 64)
    for i, (s, n) in enumerate(zip(split, norm)):
        first = _call_all(backend, i, s, n)
        for _ in range(repeats - 1):
            assert _same_bits(first, _call_all(backend, i, s, n)), "a repeated call gave different bits"


def concurrency_unsupported(backend: str) -> Optional[str]:
    """Why concurrent calls cannot be checked for ``backend`` here, or ``None``."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        # triton/runtime/interpreter.py keeps the launch grid in one global builder (set_grid_dim), so two
        # threads launching at once trip its own grid assertion; device launches have no such state.
        return "Triton's CPU interpreter is not thread-safe (one global launch grid); runs on a device"
    return None


def check_concurrent_threads(backend: str, threads: int = 4, iterations: int = 4) -> None:
    """``threads`` Python threads calling the ops on different inputs at once give the serial bits."""
    split, norm = _determinism_inputs(backend, threads, 3 if backend == "triton" else 64)
    serial = [_call_all(backend, i, s, n) for i, (s, n) in enumerate(zip(split, norm))]
    barrier = threading.Barrier(threads)
    results: List[List[object]] = [[] for _ in range(threads)]
    errors: List[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(iterations):
                results[i].append(_call_all(backend, i, split[i], norm[i]))
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the calling thread below
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise AssertionError(f"a thread raised {type(errors[0]).__name__}: {errors[0]}") from errors[0]
    for i in range(threads):
        assert len(results[i]) == iterations
        for got in results[i]:
            assert _same_bits(serial[i], got), f"thread {i}: concurrent call gave different bits than serial"


def check_intra_op_threads(backend: str, T: int = 512) -> None:
    """1 vs 2 intra-op threads (``torch.set_num_threads``) give identical bits, at a T where work is split."""
    split, norm = _determinism_inputs(backend, 4, 3 if backend == "triton" else T)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [_call_all(backend, i, s, n) for i, (s, n) in enumerate(zip(split, norm))]
        torch.set_num_threads(2)
        two = [_call_all(backend, i, s, n) for i, (s, n) in enumerate(zip(split, norm))]
    finally:
        torch.set_num_threads(saved)
    for i, (a, b) in enumerate(zip(one, two)):
        assert _same_bits(a, b), f"input set {i}: 1 and 2 intra-op threads gave different bits"


DETERMINISM: Dict[str, Callable[[str], None]] = {
    "repeated calls": check_repeatable,
    "4 concurrent threads vs serial": check_concurrent_threads,
    "1 vs 2 intra-op threads": check_intra_op_threads,
}


# --------------------------------------------------------------------------------------------------------
# The verify section.
# --------------------------------------------------------------------------------------------------------
def _run(check: Callable[[], None]) -> Tuple[bool, str]:
    try:
        check()
    except Exception as exc:  # noqa: BLE001 -- a check that errors is a failed check, with its reason
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def section(opts: Options) -> Section:
    """``python -m qkvfuse verify`` section: pass counts per category and backend."""
    no_interpreter = triton_interpreter()
    skipped = {b: r for b, r in available_backends().items() if r}
    if no_interpreter:
        skipped["triton"] = no_interpreter
    quick = opts.quick
    wanted = opts.backends
    usable = [b for b in available_backends() if b not in skipped and (not wanted or b in wanted)]
    rows = []
    plans = {}
    for backend in usable:
        interp = backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
        fuzz_n = (4 if quick else 12) if interp else (8 if quick else 100)
        rng = random.Random(f"qkvfuse-fuzz-lite-{backend}")  # fixed: the same configurations every run
        choose = rng.choice
        sized = {"position reads deterministic at large T":
                 lambda: check_positions_deterministic_large_t(backend, 1024 if quick else 4096)}
        categories = {
            "failure modes": [(name, sized.get(name, lambda c=c: c(backend))) for name, c in FAILURE_MODES.items()
                              if not (quick and interp and name in HEAVY_ON_INTERPRETER)]
            + [("NaN/Inf propagate inside their head", lambda: check_nonfinite_propagates(backend, float("nan"))),
               ("Inf propagates inside its head", lambda: check_nonfinite_propagates(backend, float("inf")))],
            "bad input": [(bad.name, (lambda bad=bad: _bad_ok(bad, backend))) for bad in BAD_CALLS],
            "fuzz-lite": [(f"split #{i}", (lambda d=draw_split_case(choose, interp): check_split_case(backend, d)))
                          for i in range(fuzz_n)]
            + [(f"add_rmsnorm #{i}", (lambda d=draw_norm_case(choose, interp): check_norm_case(backend, d)))
               for i in range(fuzz_n)]
            + [(f"split + KV cache #{i}", (lambda d=draw_cache_case(choose, interp): check_cache_fuzz_case(backend, d)))
               for i in range(fuzz_n)],
            "determinism": [("repeated calls", lambda: check_repeatable(backend, 2 if quick else 5)),
                            ("4 concurrent threads vs serial", lambda: check_concurrent_threads(backend)),
                            ("1 vs 2 intra-op threads",
                             lambda: check_intra_op_threads(backend, 128 if quick else 512))],
        }
        if concurrency_unsupported(backend):
            categories["determinism"] = [(n, c) for n, c in categories["determinism"] if "concurrent" not in n]
        plans[backend] = categories
    planned(sum(len(checks) for categories in plans.values() for checks in categories.values()))
    for backend, categories in plans.items():
        for category, checks in categories.items():
            t0 = time.perf_counter()
            failed = []
            for name, check in checks:
                ok, detail = _run(check)
                advance()
                if not ok:
                    failed.append(f"{name}: {detail}")
            rows.append({"category": category, "backend": backend, "passed": len(checks) - len(failed),
                         "total": len(checks), "s": round(time.perf_counter() - t0, 1), "pass": not failed,
                         "detail": "; ".join(failed)[:2000]})
    unsupported = {b: concurrency_unsupported(b) for b in usable if concurrency_unsupported(b)}
    note = ("public failure modes of fused QK-norm/RoPE kernels, bad input (ValueError/TypeError naming the "
            "argument), fuzz-lite (fixed-seed random valid configurations vs the float64 oracle), determinism")
    if skipped:
        note += "\nunavailable backends: " + "; ".join(f"{b} ({r})" for b, r in skipped.items())
    if quick and any(b == "triton" for b in usable) and os.environ.get("TRITON_INTERPRET") == "1":
        note += "\n--quick: not run on the Triton interpreter: " + ", ".join(sorted(HEAVY_ON_INTERPRETER))
    if unsupported:
        note += "\nconcurrent-threads check not run: " + "; ".join(f"{b} ({r})" for b, r in unsupported.items())
    return Section("failure modes and hardening", ("category", "backend", "passed", "total", "s", "pass"), rows, note)


def _bad_ok(bad: BadCall, backend: str) -> None:
    ok, detail = run_bad_call(bad, backend)
    assert ok, detail


# --------------------------------------------------------------------------------------------------------
# Subprocess entry point: ``python -m qkvfuse._verify.failure_modes bad-input BACKEND``.
# --------------------------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> int:
    """Run the bad-input catalogue for one backend, one JSON line per call (a crash leaves a ``start`` line)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "bad-input":
        print("usage: python -m qkvfuse._verify.failure_modes bad-input BACKEND", file=sys.stderr)
        return 2
    backend = argv[1]
    for bad in BAD_CALLS:
        print(json.dumps({"start": bad.name}), flush=True)
        ok, detail = run_bad_call(bad, backend)
        print(json.dumps({"name": bad.name, "ok": ok, "detail": detail}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
