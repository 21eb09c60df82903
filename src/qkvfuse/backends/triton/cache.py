"""The cache-writing split's launcher on the Triton backend."""

from __future__ import annotations

from ... import reference
from .launch import split_qkv_rmsnorm_rope_out

__all__ = ["split_qkv_rmsnorm_rope_cache"]


def split_qkv_rmsnorm_rope_cache(qkv, positions, config, q_out, k_out, v_out, gate_out, target) -> None:
    """The Triton split in place, then the reference cache write from its rounded K and V (checked input)."""
    split_qkv_rmsnorm_rope_out(qkv, positions, config, q_out, k_out, v_out, gate_out)
    T, heads, dim = qkv.shape[0], config.num_kv_heads, config.head_dim
    reference.write_cache(k_out.float().reshape(T, heads, dim), v_out.reshape(T, heads, dim), target)
