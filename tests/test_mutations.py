"""Proof that the failure-mode tests have teeth: each deliberate mutation of the reference makes its check fail.

Every mutation reproduces one public bug of a fused kernel inside :mod:`qkvfuse.reference` (or, for the
layout checks, inside the public op), is applied with ``unittest.mock.patch`` and the check of
:mod:`qkvfuse._verify.failure_modes` that ``tests/test_failure_modes.py`` runs for it (the test's comment names
the mutation) is run on the reference backend, with the test's parametrisations. The KV-cache write's mutations
(slot -1 wrapping to the last slot, a short slot mapping padded with slot 0, FP8 without saturation, the scale
taken as its inverse, truncation ignored, K cached before QK-norm and RoPE, the tiled layouts' K not transposed or
packed) are judged by :func:`qkvfuse._verify.cache.check_cache_case` on the cases ``verify`` runs. A mutation is
caught only when at least one of them fails an assertion (``AssertionError`` or ``pytest.fail``); a check that
crashes with any other exception has not caught it, it has broken. ``python tests/test_mutations.py`` prints the table
(mutation, check, caught cases, crashes).
"""

import contextlib
import sys
import time
import warnings
from unittest import mock

import pytest
import torch

import qkvfuse
import qkvfuse._verify.failure_modes as fm
import qkvfuse.reference as ref
from qkvfuse import _library
from qkvfuse._cache_mode import AMX, HND, VEC, is_fp8
from qkvfuse._verify.cache import VERIFY_CASES, check_cache_case
from qkvfuse._verify.failure_modes import GATED_TP_HEADS, KNORM_RATIOS, NON_POW2_HEAD_DIMS, PARTIAL_ROTARY_THRESHOLD

_split = ref.split_qkv_rmsnorm_rope_out
_norm = ref.add_rmsnorm_out
_cos_sin = ref._cos_sin
_rotate = ref._rotate
_rms = ref._rms_norm_fp32
_public_split = qkvfuse.split_qkv_rmsnorm_rope
_write_cache = ref.write_cache
_quantize = ref.quantize
_store = ref._store


# The KV-cache write: ref.write_cache(k, v, target) with target a qkvfuse._library.CacheTarget (a NamedTuple).
def _negative_slot_wraps(k, v, target):
    """Padding tokens (slot -1) written: -1 // block_size and -1 % block_size index the last block's last slot."""
    slots = target.slot_mapping.long()
    wrapped = torch.where(slots < 0, slots + target.capacity, slots)
    _write_cache(k, v, target._replace(slot_mapping=wrapped))


def _short_slots_write_slot_0(k, v, target):
    """Tokens past the end of a short slot_mapping written to slot 0 (the mapping padded with zeros)."""
    slots = target.slot_mapping
    pad = torch.zeros(max(0, k.shape[0] - slots.shape[0]), dtype=slots.dtype)
    _write_cache(k, v, target._replace(slot_mapping=torch.cat([slots, pad])))


def _fp8_unsaturated(x, dtype, scale, truncate):
    """FP8 without the clamp: values past the format's largest become inf (e5m2) or NaN (e4m3fn)."""
    if not is_fp8(dtype):
        return _quantize(x, dtype, scale, truncate)
    return (x / scale.reshape(()).float()).to(dtype)


def _fp8_scale_multiplied(x, dtype, scale, truncate):
    """The scale applied as a multiplier (x * scale): the scale and its inverse confused."""
    return _quantize(x, dtype, None if scale is None else 1.0 / scale, truncate)


def _fp8_truncate_ignored(x, dtype, scale, truncate):
    """Rounded to nearest where the engine's reader expects truncation toward zero."""
    return _quantize(x, dtype, scale, False)


def _k_before_rope(qkv, positions, config, q_out, k_out, v_out, gate_out, target):
    """The cache gets K as projected: the cache write placed before QK-norm and RoPE."""
    q_cols = (2 if config.q_gate else 1) * config.num_q_heads * config.head_dim
    raw_k = qkv[:, q_cols: q_cols + config.num_kv_heads * config.head_dim].float()
    raw_k = raw_k.reshape(qkv.shape[0], config.num_kv_heads, config.head_dim).clone()
    q, k, v, gate = ref._split_fp32(qkv, positions, config)
    ref._write_split(q, k, v, gate, q_out, k_out, v_out, gate_out)
    ref.write_cache(raw_k, v.reshape(k.shape), target)


def _tiled_k_untransposed(cache, layout, is_key, blocks, offsets, rows):
    """vLLM-CPU's vec K stored like its V ([block_size, D]); amx K stored unpacked, as HND rows."""
    if is_key and layout == VEC:
        return _store(cache, layout, False, blocks, offsets, rows)
    if is_key and layout == AMX:
        return _store(cache, HND, True, blocks, offsets, rows)
    return _store(cache, layout, is_key, blocks, offsets, rows)


def check_verify_cache_case(backend, name):
    """One of the cache cases ``verify`` runs (qkvfuse._verify.cache.VERIFY_CASES), in place."""
    check_cache_case(backend, dict(VERIFY_CASES)[name])


# The reference kernel's signature: (qkv, positions, config, q_out, k_out, v_out, gate_out), config a
# qkvfuse._library.SplitConfig (a NamedTuple: a mutation changes a field with _replace).
def _partial_rotary_large(qkv, positions, config, *outs):
    _split(qkv, positions, config, *outs)
    q_out, R, hq, d = outs[0], config.cos_sin_cache.shape[1], config.num_q_heads, config.head_dim
    heads = q_out.view(q_out.shape[0], hq, d)
    flat = torch.arange(q_out.shape[0])[:, None] * hq + torch.arange(hq)[None, :]
    heads[..., R:][flat >= PARTIAL_ROTARY_THRESHOLD] = float("nan")


def _rotary_dim_default(qkv, positions, config, *outs):
    flat, d = config.cos_sin_cache.reshape(-1), config.head_dim
    rows = flat.numel() // d
    _split(qkv, positions, config._replace(cos_sin_cache=flat[: rows * d].view(rows, d)), *outs)


def _mrope_drop_hw(positions, cache, sections, interleaved):
    if sections:
        positions = positions[:1].expand_as(positions)
    return _cos_sin(positions, cache, sections, interleaved)


def _mrope_packed_positions(positions, cache, sections, interleaved):
    if sections:
        positions = positions.t().reshape(positions.shape)  # [3, T] read as if laid out [T, 3]
    return _cos_sin(positions, cache, sections, interleaved)


def _k_variance_zero(qkv, positions, config, *outs):
    k_w = config.k_weight

    def norm(x, weight, bias, eps, gemma=False):
        if weight is not k_w:
            return _rms(x, weight, bias, eps, gemma)
        y = x * torch.rsqrt(torch.zeros_like(x[..., :1]) + eps) * weight.float()
        return y + bias.float() if bias is not None else y

    with mock.patch.object(ref, "_rms_norm_fp32", norm):
        _split(qkv, positions, config, *outs)


def _skip_unlisted_head_dim(qkv, positions, config, *outs):
    hq, hkv, d = config.num_q_heads, config.num_kv_heads, config.head_dim
    if d in (64, 128, 256):
        return _split(qkv, positions, config, *outs)
    q_out, k_out, v_out = outs[:3]
    q_out.copy_(qkv[:, : hq * d])
    k_out.copy_(qkv[:, hq * d : (hq + hkv) * d])
    v_out.copy_(qkv[:, (hq + hkv) * d :])


def _racy_positions(positions, cache, sections, interleaved):
    if positions.shape[-1] > 2048:
        positions = positions.clone()
        racy = torch.nonzero(torch.rand(positions.shape[-1]) < 0.01).flatten().clamp_min(1)
        positions[..., racy] = positions[..., racy - 1]
    return _cos_sin(positions, cache, sections, interleaved)


def _bf16_between_norm_and_rope(y, cos, sin, is_neox):
    return _rotate(y.to(torch.bfloat16).float(), cos, sin, is_neox)


def _bf16_cos_sin(positions, cache, sections, interleaved):
    cos, sin = _cos_sin(positions, cache, sections, interleaved)
    return cos.to(torch.bfloat16).float(), sin.to(torch.bfloat16).float()


def _packed_rows(t):
    return torch.as_strided(t, t.shape, (t.shape[1], 1), t.storage_offset()) if t is not None else None


def _ignore_row_stride_split(qkv, *rest):
    _split(_packed_rows(qkv), *rest)


def _ignore_row_stride_norm(x, residual, *rest):
    _norm(_packed_rows(x), _packed_rows(residual), *rest)


def _accept_3d_views(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, **kwargs):
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.stride(-1) != 1:
        qkv = torch.as_strided(qkv, (qkv.numel() // width, width), (width, 1), qkv.storage_offset())
    return _public_split(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, **kwargs)


# The gated layout. The in-place form's outputs overlap qkv: mutations that rewrite the input read a contiguous copy
# of it, taken before anything is written.
def _copy(qkv):
    return qkv.clone(memory_format=torch.contiguous_format)


def _gated_mrope_drop_hw(qkv, positions, config, *outs):
    if config.q_gate and config.mode.mrope_section:
        positions = positions[:1].expand_as(positions)
    _split(qkv, positions, config, *outs)


def _gate_from_q(qkv, positions, config, *outs):
    src, hq, d = _copy(qkv), config.num_q_heads, config.head_dim
    _split(qkv, positions, config, *outs)
    if config.q_gate:
        T = src.shape[0]
        outs[3].copy_(src[:, : 2 * hq * d].reshape(T, hq, 2, d)[:, :, 0].reshape(T, hq * d))


def _q_from_gate(qkv, positions, config, *outs):
    if config.q_gate:
        hq, d = config.num_q_heads, config.head_dim
        qkv = _copy(qkv)
        pairs = qkv[:, : 2 * hq * d].view(qkv.shape[0], hq, 2, d)
        pairs[:, :, 0] = pairs[:, :, 1]
    _split(qkv, positions, config, *outs)


def _gated_blocks(qkv, positions, config, *outs):
    if config.q_gate:
        hq, d = config.num_q_heads, config.head_dim
        src, T, qw = _copy(qkv), qkv.shape[0], hq * d
        # What a kernel reading [Q heads | gate heads] sees, presented in the per-head layout the reference reads.
        src[:, : 2 * qw] = torch.stack([qkv[:, :qw].reshape(T, hq, d), qkv[:, qw : 2 * qw].reshape(T, hq, d)],
                                       2).reshape(T, 2 * qw)
        qkv = src
    _split(qkv, positions, config, *outs)


def _pass_through_unnormalised(qkv, positions, config, *outs):
    src = _copy(qkv)
    _split(qkv, positions, config, *outs)
    hq, hkv, d = config.num_q_heads, config.num_kv_heads, config.head_dim
    R, T = config.cos_sin_cache.shape[1], src.shape[0]
    q_region = (2 if config.q_gate else 1) * hq * d
    q_in = (src[:, :q_region].reshape(T, hq, 2, d)[:, :, 0] if config.q_gate
            else src[:, :q_region].reshape(T, hq, d))
    k_in = src[:, q_region : q_region + hkv * d].reshape(T, hkv, d)
    q_out, k_out = outs[0], outs[1]
    q_out.view(T, hq, d)[..., R:] = q_in[..., R:]
    k_out.view(T, hkv, d)[..., R:] = k_in[..., R:]


def _pass_through_rotated(y, cos, sin, is_neox):
    R = 2 * cos.shape[-1]
    if y.shape[-1] % R:
        return _rotate(y, cos, sin, is_neox)
    return torch.cat([_rotate(y[..., i : i + R], cos, sin, is_neox) for i in range(0, y.shape[-1], R)], dim=-1)


def _gated_kv_ungated_offsets(qkv, positions, config, *outs):
    if config.q_gate:
        src, qw, kvw = _copy(qkv), config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
        src[:, 2 * qw : 2 * qw + 2 * kvw] = qkv[:, qw : qw + 2 * kvw]
        qkv = src
    _split(qkv, positions, config, *outs)


def _gemma_weight_as_stored(qkv, positions, config, *outs):
    _split(qkv, positions, config._replace(mode=config.mode._replace(gemma=False)), *outs)


# name -> (patches [(object, attribute, replacement)], check, parametrisations of its test)
MUTATIONS = {
    "partial_rotary_large": ([(ref, "split_qkv_rmsnorm_rope_out", _partial_rotary_large)],
                             fm.check_partial_rotary_large, [{}]),
    "rotary_dim_default": ([(ref, "split_qkv_rmsnorm_rope_out", _rotary_dim_default)],
                           fm.check_rotary_dim_from_cache,
                           [dict(head_dim=d, rotary_dim=r) for d, r in ((128, 64), (128, 32), (80, 40))]),
    "mrope_drop_hw": ([(ref, "_cos_sin", _mrope_drop_hw)], fm.check_mrope_image_rows,
                      [dict(interleaved=True), dict(interleaved=False)]),
    "mrope_packed_positions": ([(ref, "_cos_sin", _mrope_packed_positions)], fm.check_mrope_decode_rows,
                               [dict(interleaved=True), dict(interleaved=False)]),
    "k_variance_zero": ([(ref, "split_qkv_rmsnorm_rope_out", _k_variance_zero)], fm.check_k_norm_ratio,
                        [dict(num_q_heads=hq, num_kv_heads=hkv) for hq, hkv in KNORM_RATIOS]),
    "skip_unlisted_head_dim": ([(ref, "split_qkv_rmsnorm_rope_out", _skip_unlisted_head_dim)],
                               fm.check_head_dim_not_skipped, [dict(head_dim=d) for d in NON_POW2_HEAD_DIMS]),
    "racy_positions": ([(ref, "_cos_sin", _racy_positions)], fm.check_positions_deterministic_large_t, [{}]),
    "bf16_between_norm_and_rope": ([(ref, "_rotate", _bf16_between_norm_and_rope)],
                                   fm.check_no_bf16_rounding_between_norm_and_rope, [{}]),
    "bf16_cos_sin": ([(ref, "_cos_sin", _bf16_cos_sin)], fm.check_no_bf16_rounding_between_norm_and_rope, [{}]),
    "ignore_row_stride": ([(ref, "split_qkv_rmsnorm_rope_out", _ignore_row_stride_split),
                           (ref, "add_rmsnorm_out", _ignore_row_stride_norm)],
                          fm.check_strided_and_3d_views, [{}]),
    "accept_3d_views": ([(qkvfuse, "split_qkv_rmsnorm_rope", _accept_3d_views)], fm.check_strided_and_3d_views,
                        [{}]),
    "gated_mrope_drop_hw": ([(ref, "split_qkv_rmsnorm_rope_out", _gated_mrope_drop_hw)],
                            fm.check_gated_mrope_image_rows, [{}]),
    "gate_from_q": ([(ref, "split_qkv_rmsnorm_rope_out", _gate_from_q)], fm.check_gate_not_mixed_with_q, [{}]),
    "q_from_gate": ([(ref, "split_qkv_rmsnorm_rope_out", _q_from_gate)], fm.check_gate_not_mixed_with_q, [{}]),
    "gated_blocks": ([(ref, "split_qkv_rmsnorm_rope_out", _gated_blocks)], fm.check_gate_not_mixed_with_q, [{}]),
    "pass_through_unnormalised": ([(ref, "split_qkv_rmsnorm_rope_out", _pass_through_unnormalised)],
                                  fm.check_pass_through_dims, [dict(dtype=torch.bfloat16), dict(dtype=torch.float32)]),
    "pass_through_rotated": ([(ref, "_rotate", _pass_through_rotated)], fm.check_pass_through_dims,
                             [dict(dtype=torch.bfloat16), dict(dtype=torch.float32)]),
    "gated_kv_ungated_offsets": ([(ref, "split_qkv_rmsnorm_rope_out", _gated_kv_ungated_offsets)],
                                 fm.check_gated_tp_heads,
                                 [dict(num_q_heads=hq, num_kv_heads=hkv) for hq, hkv in GATED_TP_HEADS]),
    "gemma_weight_as_stored": ([(ref, "split_qkv_rmsnorm_rope_out", _gemma_weight_as_stored)],
                               fm.check_gated_tp_heads,
                               [dict(num_q_heads=hq, num_kv_heads=hkv) for hq, hkv in GATED_TP_HEADS]),
    "negative_slot_wraps": ([(ref, "write_cache", _negative_slot_wraps)], check_verify_cache_case,
                            [dict(name="NHD e4m3 nearest")]),
    "short_slots_write_slot_0": ([(ref, "write_cache", _short_slots_write_slot_0)], check_verify_cache_case,
                                 [dict(name="NHD fp32 short slots")]),
    "fp8_unsaturated": ([(ref, "quantize", _fp8_unsaturated)], check_verify_cache_case,
                        [dict(name="HND e5m2 saturated")]),
    "fp8_scale_multiplied": ([(ref, "quantize", _fp8_scale_multiplied)], check_verify_cache_case,
                             [dict(name="NHD e4m3 nearest"), dict(name="vec e4m3 truncate")]),
    "fp8_truncate_ignored": ([(ref, "quantize", _fp8_truncate_ignored)], check_verify_cache_case,
                             [dict(name="vec e4m3 truncate")]),
    "k_cached_before_rope": ([(ref, "split_qkv_rmsnorm_rope_cache", _k_before_rope)], check_verify_cache_case,
                             [dict(name="NHD bf16"), dict(name="NHD gated mRoPE")]),
    "tiled_k_untransposed": ([(ref, "_store", _tiled_k_untransposed)], check_verify_cache_case,
                             [dict(name="vec bf16 interleaved"), dict(name="amx bf16 interleaved")]),
}

# What counts as a check catching a mutation: a failed assertion, nothing else.
CAUGHT = (AssertionError, pytest.fail.Exception)


def _late_bound_reference_kernels() -> torch.library.Library:
    """Register the reference backend's kernels once more, looking ``qkvfuse.reference``'s kernels up at
    call time, so a patched module attribute is what runs (the backend registry binds them at import). The
    dispatcher runs the latest registration; destroying the returned library restores the original."""
    lib = _library.impl_library("reference")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning only once for all operators")  # overriding, on purpose
        _library.register_kernels(lib, "CompositeExplicitAutograd",
                                  lambda *args: ref.split_qkv_rmsnorm_rope_out(*args),
                                  lambda *args: ref.add_rmsnorm_out(*args),
                                  lambda *args: ref.split_qkv_rmsnorm_rope_cache(*args))
    return lib


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"


def run_mutation(name):
    """``(caught, total, first assertion failure, crashes)`` of the mutation's check on the reference backend.

    ``caught`` counts the parametrisations that failed an assertion; ``crashes`` lists those that raised anything
    else (they do not count as caught)."""
    patches, check, params = MUTATIONS[name]
    caught, first, crashes = 0, "", []
    for kwargs in params:
        torch.manual_seed(0)
        with contextlib.ExitStack() as stack:
            stack.callback(_late_bound_reference_kernels()._destroy)
            for obj, attr, replacement in patches:
                stack.enter_context(mock.patch.object(obj, attr, replacement))
            try:
                check("reference", **kwargs)
            except CAUGHT as exc:  # the expected outcome: the check's assertion fires
                caught += 1
                first = first or _first_line(exc)
            except Exception as exc:  # noqa: BLE001 -- a crash is reported, and is not a catch
                crashes.append(f"{kwargs or ''} {_first_line(exc)}".strip())
    return caught, len(params), first, crashes


def verdict(name) -> str:
    """One line: ``caught k/n: first failure`` or ``not caught (crashed: ...)`` / ``not caught (... passed)``."""
    caught, total, first, crashes = run_mutation(name)
    crashed = f"crashed: {'; '.join(crashes)}" if crashes else ""
    if caught:
        return f"caught {caught}/{total}: {first}" + (f" (also {crashed})" if crashed else "")
    return f"not caught ({crashed or f'all {total} cases passed'})"


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(name):
    line = verdict(name)
    assert line.startswith("caught"), f"mutation {name!r}, {MUTATIONS[name][1].__name__}: {line}"


def test_the_reference_is_intact_after_a_mutation():
    assert verdict("ignore_row_stride").startswith("caught")
    fm.check_strided_and_3d_views("reference")  # the original kernels are registered again


if __name__ == "__main__":
    print(f"{'mutation':28s} {'check':46s} {'s':>5s}  verdict")
    missed = 0
    for name in MUTATIONS:
        t0 = time.perf_counter()
        line = verdict(name)
        missed += not line.startswith("caught")
        print(f"{name:28s} {MUTATIONS[name][1].__name__:46s} {time.perf_counter() - t0:5.1f}  {line}")
    print(f"\n{len(MUTATIONS) - missed}/{len(MUTATIONS)} mutations caught")
    sys.exit(1 if missed else 0)
