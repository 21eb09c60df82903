"""The cache-writing split's launcher on the Triton backend: one launch of
:func:`.cache_kernels.split_qkv_rmsnorm_rope_cache_kernel` (the split, in place or out=, and the cache stores
together).

Like :mod:`.launch`: checked input (the op's kernel ran :func:`qkvfuse._checks.check_split`,
:func:`qkvfuse._checks.check_cache` and the host value rules where they apply), host arithmetic on shapes and
strides, no host synchronisation (slots and FP8 scales are read by the kernel only), no allocation except the
gated scratch buffer of :func:`.launch.split_qkv_rmsnorm_rope_out` for Q/gate regions wider than
:data:`.launch.GPU_MAX_GATED_Q` and a unit-stride copy of a strided ``[D]`` norm weight -- so it is safe under
CUDA-graph capture. Block sizes are the split's (:func:`.launch.split_config`).
"""

from __future__ import annotations

from typing import Optional

import torch
from triton import knobs

from ..._cache_mode import AMX, VEC, cache_dims, slot_strides
from ..._library import CHECK_POSITIONS_ON_ACCELERATORS, CacheTarget, SplitConfig
from .. import native_host
from . import launch
from .cache_kernels import E4M3, E5M2
from .launch import _cdiv, _compiled, _constexpr_names, _dense, _is_column_view, _on_device, split_config

__all__ = ["split_qkv_rmsnorm_rope_cache"]

_FP8_CODES = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}
_CACHE_CONSTEXPRS = _constexpr_names(launch.split_qkv_rmsnorm_rope_cache_kernel)


def _strides(layout: int, cache: torch.Tensor, is_key: bool):
    """``(block, offset, head, dim)`` element strides the kernel addresses ``cache`` with (``amx``: block and
    head only; the kernel packs the region itself)."""
    s_block, s_off, s_head, s_dim = slot_strides(layout, cache)
    if layout == VEC and is_key:  # K region [head_dim, block_size]
        _, block_size, _, _ = cache_dims(layout, cache)
        s_off, s_dim = 1, block_size
    return s_block, s_off, s_head, s_dim


def split_qkv_rmsnorm_rope_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    config: SplitConfig,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    gate_out: Optional[torch.Tensor],
    target: CacheTarget,
    stage: Optional[bool] = None,
) -> None:
    """Triton ``split_qkv_rmsnorm_rope_cache`` and ``..._cache_out``: the split of ``qkv`` in place
    (``config.inplace``: ``q_out .. gate_out`` are :func:`qkvfuse._library.inplace_views`) or into the out= form's
    outputs, and each token's K and V in the cache ``target`` (a :class:`qkvfuse._library.CacheTarget`), one kernel
    launch (:mod:`.cache_kernels`). ``stage`` (True from a host kernel that has no compiled launch kept for this
    call's key): a device launch's compiled kernel is handed to the host kernel
    (:func:`qkvfuse.backends.native_host.stage_launch`), which makes the same launch itself on later calls of that
    key, as for the split (:func:`.launch.split_entry`)."""
    num_q_heads, num_kv_heads, head_dim, eps = config.num_q_heads, config.num_kv_heads, config.head_dim, config.eps
    is_neox, mrope_section, mrope_interleaved, q_gate, gemma = config.mode
    cos_sin_cache = config.cos_sin_cache
    T = qkv.shape[0]
    if T == 0:
        return
    q_width, kv_width = num_q_heads * head_dim, num_kv_heads * head_dim
    k_col = (2 if q_gate else 1) * q_width
    gate_in_place = bool(q_gate) and config.inplace
    cfg = split_config(T, num_q_heads, num_kv_heads, head_dim, whole_q_region=gate_in_place)
    # As in the split's launch: a program writes what it reads in place, and out= where q_out / k_out is exactly
    # its own slice of qkv (the checks accept that alias).
    in_place = (config.inplace or q_out.data_ptr() == qkv.data_ptr()
                or k_out.data_ptr() == qkv.data_ptr() + k_col * qkv.element_size())
    copy_v = not _is_column_view(v_out, qkv, k_col + kv_width)
    scratch = None
    if gate_in_place and not (cfg["Q_HEADS"] >= num_q_heads and _is_column_view(q_out, qkv, 0)
                              and _is_column_view(gate_out, qkv, q_width)):
        # The split launcher's scheme for a gated Q/gate region too wide for one program: Q and gate go to a
        # stream-ordered scratch buffer (captured with the launch under graph capture), moved into place after.
        scratch = qkv.new_empty((T, 2 * q_width))
        final_q, final_gate = q_out, gate_out
        q_out, gate_out = scratch[:, :q_width], scratch[:, q_width:]
    gate = gate_out if q_gate else q_out
    mrope = bool(mrope_section)
    s_t, s_h, s_w = mrope_section if mrope else (0, 0, 0)
    pos_stride_axis, pos_stride_tok = (positions.stride(0), positions.stride(1)) if mrope else (0, positions.stride(0))
    norm = config.q_weight is not None
    q_weight, k_weight = _dense(config.q_weight), _dense(config.k_weight)
    q_bias, k_bias = _dense(config.q_bias), _dense(config.k_bias)
    q_w, k_w = (q_weight, k_weight) if norm else (qkv, qkv)  # absent tensors are never read: any pointer fills
    q_b = q_bias if q_bias is not None else q_w
    k_b = k_bias if k_bias is not None else k_w

    key_cache, value_cache, slots = target.key_cache, target.value_cache, target.slot_mapping
    layout = target.layout
    blocks, block_size, _, _ = cache_dims(layout, key_cache)
    fp8 = _FP8_CODES.get(key_cache.dtype, 0)
    if fp8:  # the kernel stores the encoded bytes
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    k_scale = target.k_scale if fp8 else qkv
    v_scale = target.v_scale if fp8 else qkv
    grid = (_cdiv(T, cfg["BLOCK_T"]), _cdiv(num_q_heads, cfg["Q_HEADS"]) + _cdiv(num_kv_heads, cfg["KV_HEADS"]))
    constexprs = dict(HEAD_DIM=head_dim, ROT_DIM=cos_sin_cache.shape[1], NORM=norm, Q_BIAS=q_bias is not None,
                      K_BIAS=k_bias is not None, GEMMA=bool(gemma) and norm, IS_NEOX=bool(is_neox), MROPE=mrope,
                      MROPE_INTERLEAVED=bool(mrope_interleaved), Q_GATE=bool(q_gate), AMX=layout == AMX, FP8=fp8,
                      TRUNCATE=target.truncate, IN_PLACE=in_place, COPY_V=copy_v, BLOCK_D=cfg["BLOCK_D"],
                      BLOCK_T=cfg["BLOCK_T"], Q_HEADS=cfg["Q_HEADS"], KV_HEADS=cfg["KV_HEADS"])
    with _on_device(qkv):
        launched = launch.split_qkv_rmsnorm_rope_cache_kernel[grid](
            qkv, positions, cos_sin_cache, q_w, k_w, q_b, k_b, q_out, k_out, v_out, gate, key_cache, value_cache,
            slots, k_scale, v_scale,
            T, slots.shape[0], num_q_heads, num_kv_heads, float(eps), cos_sin_cache.shape[0], s_t, s_h, s_w,
            qkv.stride(0), pos_stride_axis, pos_stride_tok, cos_sin_cache.stride(0), q_out.stride(0),
            k_out.stride(0), v_out.stride(0), gate.stride(0), slots.stride(0), blocks * block_size, block_size,
            *_strides(layout, key_cache, True), *_strides(layout, value_cache, False),
            **constexprs, num_warps=cfg["num_warps"],  # V_BLOCK unused: the KV programs copy V
        )
        if scratch is not None:  # every program has read qkv: the Q/gate region may now be overwritten
            final_q.copy_(q_out)
            final_gate.copy_(gate_out)
        elif stage and not CHECK_POSITIONS_ON_ACCELERATORS:  # the value rules are this launcher's alone
            c = _compiled(launched)
            if c is not None:
                native_host.stage_launch(c.run, c.function, c.packed_metadata,
                                         tuple(constexprs[name] for name in _CACHE_CONSTEXPRS), cfg["BLOCK_T"],
                                         grid[1], (s_t, s_h, s_w), vars(launch), knobs.runtime)
