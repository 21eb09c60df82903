"""One test per public failure mode of fused QK-norm/RoPE kernels (the list in the project notes).

Each test runs every backend through a check in :mod:`qkvfuse._verify.failure_modes` (the verify section
runs the same checks). The comment above each test names the deliberate mutation of the reference that it
catches; ``tests/test_mutations.py`` applies each mutation and shows that the test then fails.
"""

import pytest
import torch

import qkvfuse._verify.failure_modes as fm


# Mutation "partial_rotary_large": pass-through dims [R, D) of Q heads whose token x head index is at or
# above 10 240 come out as NaN (vLLM #51049: a warp shuffle in a divergent branch).
def test_partial_rotary_above_10240_token_heads(backend):
    fm.check_partial_rotary_large(backend)


# Mutation "rotary_dim_default": the kernel assumes rotary_dim = head_dim and reads the cache buffer with a
# row stride of head_dim (what a call site that forgot rotary_dim did in vLLM #43676).
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 64), (128, 32), (80, 40)])
def test_rotary_dim_taken_from_cache(backend, head_dim, rotary_dim):
    fm.check_rotary_dim_from_cache(backend, head_dim, rotary_dim)


# Mutation "mrope_drop_hw": every rotary pair reads the temporal row; height/width rows are ignored
# (SGLang #35345 / #34446). Text-only or decode inputs cannot see this one.
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "contiguous"])
def test_mrope_image_tokens_use_height_width_rows(backend, interleaved):
    fm.check_mrope_image_rows(backend, interleaved)


# Mutation "mrope_packed_positions": the kernel reads positions as a packed [T, 3] buffer, ignoring the
# strides of the [3, T] tensor (decode passes p.expand(3, T), row stride 0).
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "contiguous"])
def test_mrope_decode_equal_rows_is_rope(backend, interleaved):
    fm.check_mrope_decode_rows(backend, interleaved)


# Mutation "k_variance_zero": K heads are normalised with a variance of 0, i.e. x * rsqrt(eps) * w
# (vllm-ascend #12642).
@pytest.mark.parametrize("num_q_heads,num_kv_heads", fm.KNORM_RATIOS, ids=lambda v: str(v))
def test_k_norm_variance_every_head_ratio(backend, num_q_heads, num_kv_heads):
    fm.check_k_norm_ratio(backend, num_q_heads, num_kv_heads)


# Mutation "skip_unlisted_head_dim": for a head_dim outside {64, 128, 256} the kernel returns the split
# Q/K/V unnormalised and unrotated (vLLM #53115).
@pytest.mark.parametrize("head_dim", fm.NON_POW2_HEAD_DIMS)
def test_head_dim_never_silently_skipped(backend, head_dim):
    fm.check_head_dim_not_skipped(backend, head_dim)


# Mutation "racy_positions": above 2 048 tokens a random ~1 % of tokens read their neighbour's position,
# differently on every call (vllm-ascend #16674).
def test_position_reads_deterministic_at_large_t(backend):
    fm.check_positions_deterministic_large_t(backend)


# Mutations "bf16_between_norm_and_rope" (the normalised head is rounded to bf16 before rotating) and
# "bf16_cos_sin" (an fp32 cache is rounded to bf16 before use) (sgl-kernel-npu #535).
def test_no_bf16_rounding_between_norm_and_rotation(backend):
    fm.check_no_bf16_rounding_between_norm_and_rope(backend)


# Mutations "ignore_row_stride" (both kernels read input rows as if packed, ignoring the row stride, as
# vLLM's CPU rms_norm did) and "accept_3d_views" (the public op takes any qkv of the right size and reads
# its storage as [T, width], as vLLM's CPU rotary_embedding did with 3-D input).
def test_strided_views_handled_and_3d_views_rejected(backend):
    fm.check_strided_and_3d_views(backend)


# The gated attention of Qwen3-Next / Qwen3.5 (q_gate, Gemma norms, head_dim 256 with rotary 64).
# Mutation "gated_mrope_drop_hw": in the gated layout every rotary pair reads the temporal row (the dropped
# height/width rows of SGLang #35345 / #34446, in a gated fused path).
def test_gated_mrope_image_tokens_use_height_width_rows(backend):
    fm.check_gated_mrope_image_rows(backend)


# Mutations "gate_from_q" (the gate is copied from the Q slots), "q_from_gate" (Q is read from the gate slots) and
# "gated_blocks" (the Q region is read as [Q heads | gate heads] blocks instead of per-head [q_h | g_h] pairs).
def test_gate_and_q_not_mixed_up(backend):
    fm.check_gate_not_mixed_with_q(backend)


# Mutations "pass_through_unnormalised" (dims R..D of Q and K heads copied from the input, unnormalised) and
# "pass_through_rotated" (the head rotated in R-wide chunks, all with the cache's frequencies).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pass_through_dims_normalised_and_unrotated(backend, dtype):
    fm.check_pass_through_dims(backend, dtype)


# Mutations "gated_kv_ungated_offsets" (K and V read at the ungated layout's offsets, Hq*D on, inside the Q/gate
# region) and "gemma_weight_as_stored" (gemma_norm ignored: heads multiplied by w instead of 1 + w).
@pytest.mark.parametrize("num_q_heads,num_kv_heads", fm.GATED_TP_HEADS, ids=lambda v: str(v))
def test_gated_tp_sized_head_counts(backend, num_q_heads, num_kv_heads):
    fm.check_gated_tp_heads(backend, num_q_heads, num_kv_heads)
