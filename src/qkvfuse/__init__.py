"""qkvfuse: verified fused operators for the attention-prepare and MoE stages of LLM inference.

Public ops (see each docstring for shapes, dtypes and layouts):

* :func:`split_qkv_rmsnorm_rope` / :func:`split_qkv_rmsnorm_rope_` -- split packed QKV, QK-RMSNorm, RoPE/mRoPE;
* :func:`split_qkv_rmsnorm_rope_cache_` / :func:`split_qkv_rmsnorm_rope_cache` -- the split that also writes K and V
  into a paged KV cache, in place or out of place;
* :func:`add_rmsnorm` / :func:`add_rmsnorm_` -- fused residual add + RMSNorm (+ post-norm bias), the second in place;
* :func:`build_cos_sin_cache` -- the rotary table the fused op reads (its width is the rotary dim);
* :class:`QKNormRope` / :class:`AddRMSNorm` -- the same ops bound to one layer's static configuration (validated
  once; the per-call form for decode loops).

The plain-PyTorch specification is :mod:`qkvfuse.reference`; published model shapes are in
:mod:`qkvfuse.presets`.
"""

from .ops import (AddRMSNorm, QKNormRope, add_rmsnorm, add_rmsnorm_, split_qkv_rmsnorm_rope, split_qkv_rmsnorm_rope_,
                  split_qkv_rmsnorm_rope_cache, split_qkv_rmsnorm_rope_cache_)
from .presets import PRESETS, ModelPreset, get_preset
from .rope import build_cos_sin_cache

__version__ = "0.1.0"

__all__ = [
    "split_qkv_rmsnorm_rope",
    "split_qkv_rmsnorm_rope_",
    "split_qkv_rmsnorm_rope_cache_",
    "split_qkv_rmsnorm_rope_cache",
    "add_rmsnorm",
    "add_rmsnorm_",
    "QKNormRope",
    "AddRMSNorm",
    "build_cos_sin_cache",
    "PRESETS",
    "ModelPreset",
    "get_preset",
]
