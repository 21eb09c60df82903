"""Launchers: the signatures of :mod:`qkvfuse.reference` (the split's takes a :class:`qkvfuse._library.SplitConfig`),
running the kernels of :mod:`.kernels`.

The op's kernel checks every argument before it calls a launcher (shapes, strides, dtypes, devices, overlaps): the
native host kernels in C++ (``backends/cpu/triton_host.cpp``, the CPU kernels' rules; they call
:func:`split_entry` / :func:`add_rmsnorm_out`), else the Python kernels of :func:`qkvfuse._library.register_kernels`
(:func:`qkvfuse._checks.check_split` / ``check_norm``), so a raw ``torch.ops.qkvfuse_triton.*`` call -- e.g. from a
loaded ``torch.export`` program -- never reaches a launch that would read or write out of bounds. A launcher does
host arithmetic on shapes and strides and one kernel launch: no host synchronisation, no allocation (except a
unit-stride copy of a non-contiguous ``[D]`` norm weight or bias, and the scratch buffer -- plus two copies -- of
the gated in-place form when its Q/gate region is too wide for one program, see
:func:`split_qkv_rmsnorm_rope_out`), no loop over heads, so it is safe under CUDA-graph capture and inside
``torch.compile`` (where it runs behind the opaque ``torch.ops.qkvfuse`` op).

Block sizes on a device depend on the head geometry only, never on T: a new batch size reuses the compiled
kernel (T is also excluded from Triton's integer specialisation). What depends on the geometry is a cached plan, and
a device launch reuses the compiled kernel and calls Triton's compiled launcher directly (see "Reusing the compiled
kernel" below). Under the CPU interpreter nothing is compiled, so there the token block follows T to keep the
number of (slow, Python-level) programs small.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from triton import knobs
from triton.runtime import driver

from ..._library import CHECK_POSITIONS_ON_ACCELERATORS, SplitConfig, check_positions, config_of, inplace_outputs
from ..._rope_mode import decode_mode
from .. import native_host
from .cache_kernels import split_qkv_rmsnorm_rope_cache_kernel
from .kernels import add_rmsnorm_kernel, split_qkv_rmsnorm_rope_kernel

__all__ = ["INTERPRET", "OUT", "FUNCTIONAL", "INPLACE", "split_config", "norm_config", "split_qkv_rmsnorm_rope_out",
           "split_entry", "add_rmsnorm_out"]

# This module's globals are what the native host kernels read to key a kept launch (triton_host.cpp): the three
# kernels (the cache-writing one is launched by .cache through this module), the driver, INTERPRET and the tile
# settings below. Kernels were decorated under TRITON_INTERPRET=1 (decided by triton when this module was
# imported).
INTERPRET = type(split_qkv_rmsnorm_rope_kernel).__name__ == "InterpretedFunction"

# The split kernel on a device: fp32 elements of work per program (several heads of one token) and per thread
# (num_warps = tile / (32 * per thread), 1..16). More bytes in flight per thread hide more memory latency: one warp
# with four 16-byte loads in flight per thread was the fastest pair of the sweep on an H200
# (`python -m qkvfuse bench --device cuda --tile-sweep`; the numbers are in bench/README.md).
GPU_SPLIT_TILE = 1024
GPU_SPLIT_PER_THREAD = 32
# add_rmsnorm on a device: rows per program up to this many elements, 8 per thread (at a same-size copy's
# bandwidth for T >= 4096 on an H200).
GPU_NORM_TILE = 2048
GPU_NORM_PER_THREAD = 8
# Under the interpreter each program costs Python overhead per operation: few, large programs.
INTERPRETER_TILE = 1 << 15
# Widest add_rmsnorm row held in one tile on a device; wider rows take two passes over chunks.
GPU_MAX_ROW = 8192
# The gated in-place form on a device: the most Q-head elements per token (Hq * D, its gates as many again) one
# program holds, so that it owns its tokens' whole Q/gate region; wider regions go through a scratch buffer.
GPU_MAX_GATED_Q = 8192


# Host arithmetic in plain Python: triton.next_power_of_2 and triton.cdiv are constexpr-function wrappers in recent
# Triton (~2.5 us a call, four to seven calls a launch).
def _pow2(n: int) -> int:
    """The smallest power of two >= ``max(n, 1)``."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_warps(tile_elements: int, per_thread: int) -> int:
    return max(1, min(16, tile_elements // (32 * per_thread)))


def split_config(T: int, num_q_heads: int, num_kv_heads: int, head_dim: int, interpret: Optional[bool] = None,
                 tile: Optional[int] = None, whole_q_region: bool = False) -> Dict[str, int]:
    """Block sizes (constexprs) and ``num_warps`` of the split kernel; ``T`` is used only when ``interpret``.

    ``whole_q_region`` (the gated in-place form): one Q block holds all ``num_q_heads`` heads when their
    ``Hq * D`` elements fit :data:`GPU_MAX_GATED_Q` (the interpreter's tile under the interpreter), so that a
    program owns its tokens' whole Q/gate region; the caller checks ``Q_HEADS >= num_q_heads``.
    """
    interpret = INTERPRET if interpret is None else interpret
    tile = tile or (INTERPRETER_TILE if interpret else GPU_SPLIT_TILE)
    max_q = INTERPRETER_TILE if interpret else GPU_MAX_GATED_Q
    return dict(_split_config(_pow2(T) if interpret else 0, num_q_heads, num_kv_heads, head_dim, tile,
                              whole_q_region, max_q, GPU_SPLIT_PER_THREAD))


# The configurations, cached per geometry and setting (a launch's host time is what a decode step pays per call);
# every module-level setting they read is an argument, so a changed setting (the tile sweep, tests) is a new key.
@functools.lru_cache(maxsize=512)
def _split_config(t_pow2: int, num_q_heads: int, num_kv_heads: int, head_dim: int, tile: int, whole_q_region: bool,
                  max_q: int, per_thread: int) -> Dict[str, int]:
    block_d = _pow2(head_dim)
    heads_cap = max(1, tile // block_d)
    q_heads = min(_pow2(num_q_heads), heads_cap)
    if whole_q_region and _pow2(num_q_heads) * block_d <= max_q:
        q_heads = _pow2(num_q_heads)
    kv_heads = min(_pow2(num_kv_heads), heads_cap)
    block_t = max(1, tile // (q_heads * block_d))
    if t_pow2:  # the interpreter: no more tokens per program than T
        block_t = min(block_t, t_pow2)
    return dict(BLOCK_D=block_d, BLOCK_T=block_t, Q_HEADS=q_heads, KV_HEADS=kv_heads, V_BLOCK=kv_heads * block_d,
                num_warps=_num_warps(block_t * q_heads * block_d, per_thread))


def norm_config(T: int, H: int, interpret: Optional[bool] = None, tile: Optional[int] = None) -> Dict[str, int]:
    """Block sizes (constexprs) and ``num_warps`` of the add_rmsnorm kernel; ``T`` used only when ``interpret``."""
    interpret = INTERPRET if interpret is None else interpret
    tile = tile or (INTERPRETER_TILE if interpret else GPU_NORM_TILE)
    max_row = INTERPRETER_TILE if interpret else GPU_MAX_ROW
    return dict(_norm_config(_pow2(T) if interpret else 0, H, tile, max_row, GPU_NORM_PER_THREAD))


@functools.lru_cache(maxsize=512)
def _norm_config(t_pow2: int, H: int, tile: int, max_row: int, per_thread: int) -> Dict[str, int]:
    block_h = _pow2(H)
    single = block_h <= max_row
    if not single:
        block_h = max_row // 2
    block_t = max(1, tile // block_h) if single else 1
    if t_pow2:
        block_t = min(block_t, t_pow2)
    return dict(BLOCK_T=block_t, BLOCK_H=block_h, SINGLE_TILE=single,
                num_warps=_num_warps(block_t * block_h, per_thread))


def _on_device(t: torch.Tensor):
    """Make ``t``'s device current for the launch (Triton launches on the current device)."""
    if t.device.type == "cpu" or t.device.index is None:
        return contextlib.nullcontext()
    module = torch.get_device_module(t.device)
    if module.current_device() == t.device.index:
        return contextlib.nullcontext()
    return module.device(t.device)


def _is_column_view(t: Optional[torch.Tensor], qkv: torch.Tensor, col: int) -> bool:
    """Whether ``t`` is ``qkv``'s column slice starting at column ``col`` (same rows, same row stride)."""
    return t is not None and t.data_ptr() == qkv.data_ptr() + col * qkv.element_size() and (
        t.shape[0] < 2 or t.stride(0) == qkv.stride(0))


def _dense(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` with unit stride for a kernel that reads a 1-D vector as contiguous (norm weights and biases): the
    validator accepts any strides (a stride-2 view, a stride-0 ``expand``). ``t`` itself when already contiguous
    (no cost in the common case); otherwise a copy of a ``[D]`` vector -- an allocation on the current stream,
    which is safe under CUDA-graph capture (the copy is captured with the launch)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


# --------------------------------------------------------------------------------------------------------
# Reusing the compiled kernel on a device. Triton's JIT launch binds every argument and computes a
# specialisation key from all of them on each call (microseconds of Python). For a geometry the launch differs
# from call to call only in pointers, T and strides, so a device launch here looks up the compiled kernel by the
# plan's key plus the specialisation facts that can change (the strides, dtypes, int32 range) and calls Triton's
# compiled launcher with integer pointers. A call whose pointers are not all 16-byte aligned takes Triton's JIT
# launch (which specialises on alignment per pointer), as does the first call of each key, whose compiled kernel
# is then kept. Under the interpreter every launch is the JIT launch.
# --------------------------------------------------------------------------------------------------------
OUT, FUNCTIONAL, INPLACE = 0, 1, 2  # the forms of a split call, as the native host kernels pass them
_I32 = 1 << 31
_Interpreted = type(split_qkv_rmsnorm_rope_kernel) if INTERPRET else None  # Triton's interpreted kernels


class _Compiled(NamedTuple):
    """A compiled kernel's launch handles: ``run(grid0, grid1, grid2, stream, function, packed_metadata,
    launch_metadata, enter_hook, exit_hook, *args)`` is Triton's compiled launcher."""

    run: object
    function: object
    packed_metadata: object
    kernel: object


def _compiled(kernel) -> Optional[_Compiled]:
    """The launch handles of what a JIT launch returned (a ``CompiledKernel``), or None."""
    try:
        return _Compiled(kernel.run, kernel.function, kernel.packed_metadata, kernel)
    except AttributeError:
        return None


def _launch_compiled(c: _Compiled, grid0: int, grid1: int, t: torch.Tensor, args: tuple) -> None:
    """The final launch, on the current stream of ``t``'s device: Triton's compiled launcher, with the launch hooks
    a JIT launch passes (none when none are set)."""
    active = driver.active
    current = active.get_current_device()
    index = t.get_device()
    if index < 0:
        index = current
    stream = active.get_current_stream(index)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if getattr(enter, "calls", enter):
        metadata = c.kernel.launch_metadata((grid0, grid1, 1), stream, *args)
    else:
        enter = leave = metadata = None
    if index == current:
        c.run(grid0, grid1, 1, stream, c.function, c.packed_metadata, metadata, enter, leave, *args)
    else:
        with torch.get_device_module(t.device).device(index):
            c.run(grid0, grid1, 1, stream, c.function, c.packed_metadata, metadata, enter, leave, *args)


def _constexpr_names(kernel) -> Tuple[str, ...]:
    """The kernel's constexpr parameters, in its order (a compiled launch takes every parameter)."""
    return tuple(name for name, p in inspect.signature(kernel.fn).parameters.items()
                 if "constexpr" in str(p.annotation))


_SPLIT_CONSTEXPRS = _constexpr_names(split_qkv_rmsnorm_rope_kernel)
_NORM_CONSTEXPRS = _constexpr_names(add_rmsnorm_kernel)


class _SplitPlan(NamedTuple):
    """What a split launch needs besides its tensors, for one geometry, form and setting."""

    constexprs: Dict[str, object]  # block sizes, flags and num_warps (in-place barrier and V blocks: see below)
    block_t: int
    q_blocks: int  # grid columns of the Q and K programs
    v_blocks: int  # grid columns of the V programs when v_out is not qkv's own V slice
    k_col: int  # first K column of a qkv row
    v_col: int
    q_width: int
    scratch: bool  # the gated in-place form through a scratch buffer (general path)
    q_gate: bool
    mrope: bool
    sections: Tuple[int, int, int]  # mRoPE's (s_t, s_h, s_w)
    values: Tuple[tuple, tuple]  # the constexprs' values in the kernel's order, without and with the barrier
    compiled: dict  # specialisation key -> _Compiled


_split_plans: Dict[tuple, _SplitPlan] = {}
_norm_plans: Dict[tuple, tuple] = {}


def _split_plan(T: int, hq: int, hkv: int, D: int, rot: int, mode, inplace: bool, norm: bool, q_bias: bool,
                k_bias: bool) -> _SplitPlan:
    is_neox, mrope_section, mrope_interleaved, q_gate, gemma = mode
    gate_in_place = q_gate and inplace
    cfg = split_config(T, hq, hkv, D, whole_q_region=gate_in_place)
    q_width, kv_width = hq * D, hkv * D
    k_col = (2 if q_gate else 1) * q_width
    constexprs = dict(HEAD_DIM=D, ROT_DIM=rot, NORM=norm, Q_BIAS=q_bias, K_BIAS=k_bias, GEMMA=bool(gemma) and norm,
                      IS_NEOX=bool(is_neox), MROPE=bool(mrope_section), MROPE_INTERLEAVED=bool(mrope_interleaved),
                      Q_GATE=bool(q_gate), IN_PLACE=inplace, **cfg)
    values = tuple(tuple(dict(constexprs, IN_PLACE=barrier)[name] for name in _SPLIT_CONSTEXPRS)
                   for barrier in (False, True))
    return _SplitPlan(constexprs, cfg["BLOCK_T"], _cdiv(hq, cfg["Q_HEADS"]) + _cdiv(hkv, cfg["KV_HEADS"]),
                      _cdiv(kv_width, cfg["V_BLOCK"]), k_col, k_col + kv_width, q_width,
                      gate_in_place and cfg["Q_HEADS"] < hq, bool(q_gate), bool(mrope_section),
                      tuple(mrope_section) if mrope_section else (0, 0, 0), values, {})


def _split_launch(qkv, positions, config: SplitConfig, q_out, k_out, v_out, gate_out):
    """The JIT launch (any device, the interpreter, a first call): returns what Triton's launch returned."""
    num_q_heads, num_kv_heads, head_dim, eps = config.num_q_heads, config.num_kv_heads, config.head_dim, config.eps
    is_neox, mrope_section, mrope_interleaved, q_gate, gemma = config.mode
    cos_sin_cache = config.cos_sin_cache
    T = qkv.shape[0]
    q_width, kv_width = num_q_heads * head_dim, num_kv_heads * head_dim
    k_col = (2 if q_gate else 1) * q_width  # first K column of a qkv row
    item = qkv.element_size()
    # Gated Q/gate outputs overlap qkv only in the in-place form (the checked out= form never overlaps them).
    gate_in_place = q_gate and config.inplace
    cfg = split_config(T, num_q_heads, num_kv_heads, head_dim, whole_q_region=gate_in_place)
    scratch = None
    if gate_in_place:
        own_rows = (cfg["Q_HEADS"] >= num_q_heads and _is_column_view(q_out, qkv, 0)
                    and _is_column_view(gate_out, qkv, q_width))
        if not own_rows:
            # An allocation from the stream-ordered caching allocator: no host sync, and captured with the launch
            # under CUDA-graph capture (graph-private pool). Only for gated Q regions wider than GPU_MAX_GATED_Q.
            scratch = qkv.new_empty((T, 2 * q_width))
            final_q, final_gate = q_out, gate_out
            q_out, gate_out = scratch[:, :q_width], scratch[:, q_width:]
    # v_out being qkv's own V slice (the in-place form) makes the copy a no-op: launch no V blocks.
    v_in_place = _is_column_view(v_out, qkv, k_col + kv_width)
    v_blocks = 0 if v_in_place else _cdiv(kv_width, cfg["V_BLOCK"])
    grid = (_cdiv(T, cfg["BLOCK_T"]),
            _cdiv(num_q_heads, cfg["Q_HEADS"]) + _cdiv(num_kv_heads, cfg["KV_HEADS"]) + v_blocks)
    mrope = bool(mrope_section)
    s_t, s_h, s_w = mrope_section if mrope else (0, 0, 0)
    pos_stride_axis, pos_stride_tok = (positions.stride(0), positions.stride(1)) if mrope else (0, positions.stride(0))
    # Q/K (and, gated, the gate) written over what their own program reads need a barrier between reads and writes:
    # the in-place form, and an out= call whose q_out / k_out is exactly its own slice of qkv (the checks accept
    # that alias; ungated only, as a gated Q head is no column slice).
    in_place = (config.inplace or q_out.data_ptr() == qkv.data_ptr()
                or k_out.data_ptr() == qkv.data_ptr() + k_col * item)
    norm = config.q_weight is not None
    q_weight, k_weight = _dense(config.q_weight), _dense(config.k_weight)
    q_bias, k_bias = _dense(config.q_bias), _dense(config.k_bias)
    # Absent weights/biases/gate are never read or written (constexpr flags); any pointer of the right device
    # fills the slot.
    q_w, k_w = (q_weight, k_weight) if norm else (qkv, qkv)
    q_b = q_bias if q_bias is not None else q_w
    k_b = k_bias if k_bias is not None else k_w
    gate = gate_out if q_gate else q_out
    with _on_device(qkv):
        launched = split_qkv_rmsnorm_rope_kernel[grid](
            qkv, positions, cos_sin_cache, q_w, k_w, q_b, k_b, q_out, k_out, v_out, gate,
            T, num_q_heads, num_kv_heads, float(eps), cos_sin_cache.shape[0], s_t, s_h, s_w,
            qkv.stride(0), pos_stride_axis, pos_stride_tok, cos_sin_cache.stride(0),
            q_out.stride(0), k_out.stride(0), v_out.stride(0), gate.stride(0),
            HEAD_DIM=head_dim, ROT_DIM=cos_sin_cache.shape[1], NORM=norm, Q_BIAS=q_bias is not None,
            K_BIAS=k_bias is not None, GEMMA=bool(gemma) and norm,
            IS_NEOX=bool(is_neox), MROPE=mrope, MROPE_INTERLEAVED=bool(mrope_interleaved), Q_GATE=bool(q_gate),
            IN_PLACE=in_place, **cfg,
        )
        if scratch is not None:  # every program has read qkv: the Q/gate region may now be overwritten
            final_q.copy_(q_out)
            final_gate.copy_(gate_out)
            return None
    return launched


def split_qkv_rmsnorm_rope_out(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    config: SplitConfig,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    gate_out: Optional[torch.Tensor] = None,
) -> None:
    """Triton ``split_qkv_rmsnorm_rope`` into ``q_out, k_out, v_out`` (and ``gate_out`` when ``config.q_gate``;
    ``config`` a :class:`qkvfuse._library.SplitConfig`, checked input).

    Positions outside ``[0, cos_sin_cache.shape[0])`` are clamped inside the kernel (the public range check is
    skipped under graph capture and ``torch.compile``). Outputs may exactly alias their own slice of ``qkv``.

    Gated, ``q_out``/``gate_out`` overlap ``qkv`` only in the in-place form (``config.inplace``; the outputs are
    ``_library.inplace_views``: the row becomes ``[Q | gate | K | V]``), where a program's writes land on other Q
    programs' input. Then either one program holds all Q heads of its tokens (``split_config(whole_q_region=True)``:
    its reads of the whole Q/gate region come before its writes, one barrier) or, when that region is too wide for
    one program, the kernel writes Q and gate into a scratch ``[T, 2 * Hq * D]`` buffer that two copies move into
    place afterwards.
    """
    split_entry(qkv, positions, *config.schema_args(), config.head_dim, INPLACE if config.inplace else OUT, q_out,
                k_out, v_out, gate_out)


def split_entry(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads: int,
                num_kv_heads: int, eps: float, rope: int, head_dim: int, form: int, q_out=None, k_out=None,
                v_out=None, gate_out=None, stage=None) -> None:
    """The split launcher the native host kernels call (``backends/cpu/triton_host.cpp``), after they have checked
    every argument: the schema's arguments, the derived ``head_dim``, the form (:data:`OUT`, :data:`FUNCTIONAL` --
    fresh outputs -- or :data:`INPLACE`, whose outputs are ``qkv``'s own columns: ``q_out`` .. ``gate_out`` None
    or :func:`qkvfuse._library.inplace_views`) and the outputs ``[T, Hq*D]``, ``[T, Hkv*D]`` x 2 and, gated,
    ``[T, Hq*D]``. ``stage`` (True from a host kernel that has no compiled launch kept for this call's key): a
    launch through a compiled kernel is handed to the host kernel (:func:`qkvfuse.backends.native_host.stage_launch`),
    which makes the same launch itself on later calls of that key."""
    T = qkv.shape[0]
    if T == 0:
        return
    if CHECK_POSITIONS_ON_ACCELERATORS and positions.device.type != "cpu":
        check_positions(positions, cos_sin_cache.shape[0])
    norm = q_weight is not None
    spec = plan = None
    # A device's launch (not the interpreter's, whose block sizes follow T): the plan of this geometry and form.
    if not INTERPRET and type(split_qkv_rmsnorm_rope_kernel) is not _Interpreted:
        max_position, rot = cos_sin_cache.shape
        key = (num_q_heads, num_kv_heads, head_dim, rot, rope, form == INPLACE, norm,
               q_bias is not None, GPU_SPLIT_TILE, GPU_SPLIT_PER_THREAD, GPU_MAX_GATED_Q)
        plan = _split_plans.get(key)
        if plan is None:
            plan = _split_plans[key] = _split_plan(T, num_q_heads, num_kv_heads, head_dim, rot,
                                                    decode_mode(rope), form == INPLACE, norm, q_bias is not None,
                                                    k_bias is not None)
    if plan is not None and not plan.scratch and (not norm or (
            q_weight.is_contiguous() and k_weight.is_contiguous()
            and (q_bias is None or (q_bias.is_contiguous() and k_bias.is_contiguous())))):
        qp, item, rs = qkv.data_ptr(), qkv.element_size(), qkv.stride()[0]
        if form == INPLACE:
            q_o, k_o, v_o = qp, qp + plan.k_col * item, qp + plan.v_col * item
            g_o = qp + plan.q_width * item if plan.q_gate else q_o
            q_s = k_s = v_s = g_s = rs
            v_blocks, barrier = 0, True
        else:
            q_o, k_o, v_o, q_s, k_s, v_s = (q_out.data_ptr(), k_out.data_ptr(), v_out.data_ptr(), q_out.stride()[0],
                                            k_out.stride()[0], v_out.stride()[0])
            g_o, g_s = (gate_out.data_ptr(), gate_out.stride()[0]) if gate_out is not None else (q_o, q_s)
            v_blocks = 0 if v_o == qp + plan.v_col * item and (T < 2 or v_s == rs) else plan.v_blocks
            barrier = q_o == qp or k_o == qp + plan.k_col * item
        pp, cp = positions.data_ptr(), cos_sin_cache.data_ptr()
        if norm:
            wq, wk = q_weight.data_ptr(), k_weight.data_ptr()
            bq, bk = (q_bias.data_ptr(), k_bias.data_ptr()) if q_bias is not None else (wq, wk)
        else:
            wq = wk = bq = bk = qp
        if (qp | pp | cp | wq | wk | bq | bk | q_o | k_o | v_o | g_o) & 15 == 0:
            if plan.mrope:
                pos_axis, pos_tok = positions.stride()
                s_t, s_h, s_w = plan.sections
            else:
                (pos_tok,), pos_axis, s_t, s_h, s_w = positions.stride(), 0, 0, 0, 0
            cs = cos_sin_cache.stride()[0]
            # What Triton specialises on besides the plan (pointer alignment: all aligned, checked above).
            spec = (v_blocks, barrier, qkv.dtype, positions.dtype, cos_sin_cache.dtype,
                    q_weight.dtype if norm else None, q_bias.dtype if q_bias is not None else None,
                    rs, pos_axis if pos_axis < 2 else (pos_axis & 15 == 0) + 2 + (pos_axis >= _I32) * 4, pos_tok,
                    cs, q_s, k_s, v_s, g_s, T >= _I32 or max_position >= _I32, qkv.get_device())
            c = plan.compiled.get(spec)
            if c is not None:
                _launch_compiled(c, -(-T // plan.block_t), plan.q_blocks + v_blocks, qkv, (
                    qp, pp, cp, wq, wk, bq, bk, q_o, k_o, v_o, g_o, T, num_q_heads, num_kv_heads, eps, max_position,
                    s_t, s_h, s_w, rs, pos_axis, pos_tok, cs, q_s, k_s, v_s, g_s, *plan.values[barrier]))
                if stage:
                    _stage(c, plan, v_blocks, barrier)
                return
    config = config_of((cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads, num_kv_heads, eps, rope),
                       head_dim, form == INPLACE)
    if form == INPLACE:
        q_out, k_out, v_out, gate_out = inplace_outputs(qkv, num_q_heads, num_kv_heads, config.q_gate)
    launched = _split_launch(qkv, positions, config, q_out, k_out, v_out, gate_out)
    if spec is not None:
        c = _compiled(launched)
        if c is not None:
            plan.compiled[spec] = c
            if stage:
                _stage(c, plan, v_blocks, barrier)


def _stage(c: _Compiled, plan: _SplitPlan, v_blocks: int, barrier: bool) -> None:
    """Hand a compiled launch to the calling host kernel (it keeps it under its call's key; see ``stage`` of
    :func:`split_entry`). Not with the position range check on accelerators, which only this launcher makes."""
    if not CHECK_POSITIONS_ON_ACCELERATORS:
        native_host.stage_launch(c.run, c.function, c.packed_metadata, plan.values[barrier], plan.block_t,
                                 plan.q_blocks + v_blocks, plan.sections, globals(), knobs.runtime)


def _norm_plan(T: int, H: int, has_res: bool, has_bias: bool, gemma: bool):
    cfg = norm_config(T, H)
    constexprs = dict(HAS_RESIDUAL=has_res, HAS_BIAS=has_bias, GEMMA=bool(gemma), **cfg)
    return constexprs, cfg["BLOCK_T"], tuple(constexprs[name] for name in _NORM_CONSTEXPRS), {}


def add_rmsnorm_out(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    gemma: bool,
    y_out: torch.Tensor,
    residual_out: Optional[torch.Tensor],
    stage: Optional[bool] = None,
) -> None:
    """Triton ``add_rmsnorm`` into ``y_out`` (and ``residual_out`` with a residual); reference signature (checked
    input: also the launcher the native host kernels call). ``x``, ``residual``, ``y_out``, ``residual_out``:
    ``[T, H]`` rows; ``weight``, ``bias``: ``[H]``. ``stage`` (True from a host kernel with no compiled launch kept
    for its call's key): a launch through a compiled kernel is handed to it, as :func:`split_entry` does."""
    T, H = x.shape
    if T == 0:
        return
    has_res, has_bias = residual is not None, bias is not None
    key = (H, has_res, has_bias, gemma, _pow2(T) if INTERPRET else 0, INTERPRET, GPU_NORM_TILE, GPU_MAX_ROW,
           GPU_NORM_PER_THREAD)
    plan = _norm_plans.get(key)
    if plan is None:
        plan = _norm_plans[key] = _norm_plan(T, H, has_res, has_bias, gemma)
    constexprs, block_t, values, compiled = plan
    kernel = add_rmsnorm_kernel
    spec = None
    if not INTERPRET and type(kernel) is not _Interpreted and weight.is_contiguous() and (
            not has_bias or bias.is_contiguous()):
        xp, yp, wp = x.data_ptr(), y_out.data_ptr(), weight.data_ptr()
        bp = bias.data_ptr() if has_bias else wp
        xs, ys = x.stride()[0], y_out.stride()[0]
        if has_res:
            rp, rop = residual.data_ptr(), residual_out.data_ptr()
            rs, ros = residual.stride()[0], residual_out.stride()[0]
        else:
            rp, rop, rs, ros = xp, yp, xs, ys
        if (xp | yp | wp | bp | rp | rop) & 15 == 0:
            spec = (x.dtype, weight.dtype, bias.dtype if has_bias else None, xs, rs, ys, ros, T >= _I32,
                    x.get_device())
            c = compiled.get(spec)
            if c is not None:
                _launch_compiled(c, _cdiv(T, block_t), 1, x,
                                 (xp, rp, wp, bp, yp, rop, T, H, eps, xs, rs, ys, ros, *values))
                if stage:
                    native_host.stage_launch(c.run, c.function, c.packed_metadata, values, block_t, 1, (0, 0, 0),
                                             globals(), knobs.runtime)
                return
    res, res_out = (residual, residual_out) if has_res else (x, y_out)
    weight, bias = _dense(weight), _dense(bias)
    with _on_device(x):
        launched = kernel[(_cdiv(T, block_t),)](
            x, res, weight, bias if bias is not None else weight, y_out, res_out, T, H, float(eps),
            x.stride(0), res.stride(0), y_out.stride(0), res_out.stride(0), **constexprs,
        )
    if spec is not None:
        c = _compiled(launched)
        if c is not None:
            compiled[spec] = c
            if stage:
                native_host.stage_launch(c.run, c.function, c.packed_metadata, values, block_t, 1, (0, 0, 0),
                                         globals(), knobs.runtime)
