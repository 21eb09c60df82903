"""Proof that the failure-mode tests have teeth: each deliberate mutation of the reference makes its test fail.

Every mutation reproduces one public bug of a fused kernel inside :mod:`qkvfuse.reference` (or, for the
layout checks, inside the public op), is applied with ``unittest.mock.patch`` and the matching test in
``tests/test_failure_modes.py`` is run on the reference backend: at least one of its parametrisations must
fail. ``python tests/test_mutations.py`` prints the table (mutation, test, failing cases).
"""

import contextlib
import sys
import time
from unittest import mock

import pytest
import torch

import qkvfuse
import qkvfuse.reference as ref
import test_failure_modes as t
from qkvfuse.testing.failure_modes import KNORM_RATIOS, NON_POW2_HEAD_DIMS, PARTIAL_ROTARY_THRESHOLD

_split = ref.split_qkv_rmsnorm_rope_out
_norm = ref.add_rmsnorm_out
_cos_sin = ref._cos_sin
_rotate = ref._rotate
_rms = ref._rms_norm_fp32
_public_split = qkvfuse.split_qkv_rmsnorm_rope


def _partial_rotary_large(qkv, positions, cache, hq, hkv, d, *rest):
    _split(qkv, positions, cache, hq, hkv, d, *rest)
    q_out, R = rest[-3], cache.shape[1]
    heads = q_out.view(q_out.shape[0], hq, d)
    flat = torch.arange(q_out.shape[0])[:, None] * hq + torch.arange(hq)[None, :]
    heads[..., R:][flat >= PARTIAL_ROTARY_THRESHOLD] = float("nan")


def _rotary_dim_default(qkv, positions, cache, hq, hkv, d, *rest):
    flat = cache.reshape(-1)
    rows = flat.numel() // d
    _split(qkv, positions, flat[: rows * d].view(rows, d), hq, hkv, d, *rest)


def _mrope_drop_hw(positions, cache, sections, interleaved):
    if sections:
        positions = positions[:1].expand_as(positions)
    return _cos_sin(positions, cache, sections, interleaved)


def _mrope_packed_positions(positions, cache, sections, interleaved):
    if sections:
        positions = positions.t().reshape(positions.shape)  # [3, T] read as if laid out [T, 3]
    return _cos_sin(positions, cache, sections, interleaved)


def _k_variance_zero(qkv, positions, cache, hq, hkv, d, q_w, k_w, *rest):
    def norm(x, weight, bias, eps):
        if weight is not k_w:
            return _rms(x, weight, bias, eps)
        y = x * torch.rsqrt(torch.zeros_like(x[..., :1]) + eps) * weight.float()
        return y + bias.float() if bias is not None else y

    with mock.patch.object(ref, "_rms_norm_fp32", norm):
        _split(qkv, positions, cache, hq, hkv, d, q_w, k_w, *rest)


def _skip_unlisted_head_dim(qkv, positions, cache, hq, hkv, d, *rest):
    if d in (64, 128, 256):
        return _split(qkv, positions, cache, hq, hkv, d, *rest)
    q_out, k_out, v_out = rest[-3:]
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


# name -> (patches [(object, attribute, replacement)], test function, parametrisations)
MUTATIONS = {
    "partial_rotary_large": ([(ref, "split_qkv_rmsnorm_rope_out", _partial_rotary_large)],
                             t.test_partial_rotary_above_10240_token_heads, [{}]),
    "rotary_dim_default": ([(ref, "split_qkv_rmsnorm_rope_out", _rotary_dim_default)],
                           t.test_rotary_dim_taken_from_cache,
                           [dict(head_dim=d, rotary_dim=r) for d, r in ((128, 64), (128, 32), (80, 40))]),
    "mrope_drop_hw": ([(ref, "_cos_sin", _mrope_drop_hw)], t.test_mrope_image_tokens_use_height_width_rows,
                      [dict(interleaved=True), dict(interleaved=False)]),
    "mrope_packed_positions": ([(ref, "_cos_sin", _mrope_packed_positions)], t.test_mrope_decode_equal_rows_is_rope,
                               [dict(interleaved=True), dict(interleaved=False)]),
    "k_variance_zero": ([(ref, "split_qkv_rmsnorm_rope_out", _k_variance_zero)],
                        t.test_k_norm_variance_every_head_ratio,
                        [dict(num_q_heads=hq, num_kv_heads=hkv) for hq, hkv in KNORM_RATIOS]),
    "skip_unlisted_head_dim": ([(ref, "split_qkv_rmsnorm_rope_out", _skip_unlisted_head_dim)],
                               t.test_head_dim_never_silently_skipped, [dict(head_dim=d) for d in NON_POW2_HEAD_DIMS]),
    "racy_positions": ([(ref, "_cos_sin", _racy_positions)], t.test_position_reads_deterministic_at_large_t, [{}]),
    "bf16_between_norm_and_rope": ([(ref, "_rotate", _bf16_between_norm_and_rope)],
                                   t.test_no_bf16_rounding_between_norm_and_rotation, [{}]),
    "bf16_cos_sin": ([(ref, "_cos_sin", _bf16_cos_sin)], t.test_no_bf16_rounding_between_norm_and_rotation, [{}]),
    "ignore_row_stride": ([(ref, "split_qkv_rmsnorm_rope_out", _ignore_row_stride_split),
                           (ref, "add_rmsnorm_out", _ignore_row_stride_norm)],
                          t.test_strided_views_handled_and_3d_views_rejected, [{}]),
    "accept_3d_views": ([(qkvfuse, "split_qkv_rmsnorm_rope", _accept_3d_views)],
                        t.test_strided_views_handled_and_3d_views_rejected, [{}]),
}


def _forget_resolved_kernels():
    getattr(qkvfuse.ops, "_KERNELS", {}).clear()


def run_mutation(name):
    """``(failing, total, first failure)`` of the mutation's test on the reference backend."""
    patches, test, params = MUTATIONS[name]
    failing, first = 0, ""
    for kwargs in params:
        torch.manual_seed(0)
        with contextlib.ExitStack() as stack:
            # qkvfuse.ops memoises the resolved kernel functions: forget them on the way in and out so the
            # patched reference is called, and nothing keeps calling it afterwards.
            _forget_resolved_kernels()
            stack.callback(_forget_resolved_kernels)
            for obj, attr, replacement in patches:
                stack.enter_context(mock.patch.object(obj, attr, replacement))
            try:
                test("reference", **kwargs)
            except Exception as exc:  # noqa: BLE001 -- the test failing (any exception) is the expected outcome
                failing += 1
                first = first or f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return failing, len(params), first


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(name):
    failing, total, _ = run_mutation(name)
    assert failing, f"mutation {name!r} passed all {total} cases of {MUTATIONS[name][1].__name__}"


if __name__ == "__main__":
    print(f"{'mutation':28s} {'test':52s} {'failing':>8s}  {'s':>5s}  first failure")
    missed = 0
    for name in MUTATIONS:
        t0 = time.perf_counter()
        failing, total, first = run_mutation(name)
        missed += failing == 0
        print(f"{name:28s} {MUTATIONS[name][1].__name__:52s} {failing:>3d}/{total:<4d}  "
              f"{time.perf_counter() - t0:5.1f}  {first}")
    print(f"\n{len(MUTATIONS) - missed}/{len(MUTATIONS)} mutations caught")
    sys.exit(1 if missed else 0)
