"""The KV-cache layouts and FP8 formats of the cache-writing split, and their one-int encoding.

The bottom of the ops, beside :mod:`qkvfuse._rope_mode`: this module imports nothing of qkvfuse, and
:mod:`qkvfuse._checks`, :mod:`qkvfuse._library`, :mod:`qkvfuse.reference` and the backends read it, so each fact
is defined once.

A cache is two 4-D tensors, ``key_cache`` and ``value_cache`` (same shape and dtype); token ``t`` goes to slot
``s = slot_mapping[t]``, i.e. block ``s // block_size``, offset ``s % block_size``. Layouts (``layout=``):

* ``"NHD"`` -- ``[num_blocks, block_size, num_kv_heads, head_dim]`` (vLLM's CUDA flash layout; SGLang's token
  pool with ``block_size = 1``), any strides;
* ``"HND"`` -- ``[num_blocks, num_kv_heads, block_size, head_dim]`` (FlashInfer's HND), any strides;
* ``"vec"`` -- vLLM-CPU's ``vec`` / ``vec16`` attention layout: tensors shaped ``[num_blocks, num_kv_heads,
  block_size, head_dim]`` (what vLLM-CPU passes to its own writer) whose ``(block, head)`` region of
  ``block_size * head_dim`` contiguous elements holds K transposed, ``[head_dim, block_size]``, and V as
  ``[block_size, head_dim]``;
* ``"amx"`` -- vLLM-CPU's ``amx`` layout (16-bit caches, ``block_size`` and ``head_dim`` multiples of 16): the
  same tensors, the region holding K in tiles of 16 tokens with pairs of dims innermost, ``[block_size / 16,
  head_dim / 2, 16, 2]``, and V in tiles of 16 dims with pairs of tokens innermost, ``[head_dim / 16,
  block_size / 2, 16, 2]`` (the AMX tiles' VNNI packing).

Cache dtypes: ``qkv``'s dtype (the bits K and V get in ``qkv``), or an FP8 format (:data:`FP8_MAX`; engines pass a
``.view()`` of their uint8 storage) with per-tensor fp32 scales: stored = the fp32 result divided by the scale,
saturated to the format's finite range, rounded once to nearest even -- or, with ``fp8_rounding="truncate"``,
vLLM-CPU's own writer: multiplied by ``1 / scale``, saturated, truncated toward zero.

The code (the schema's ``cache_mode``): bits 0-3 the layout (:data:`LAYOUTS`), bit 4 :data:`TRUNCATE`. The C++
kernels decode the same bits (``backends/cpu/checks.h``).
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["LAYOUTS", "LAYOUT_NAMES", "NHD", "HND", "VEC", "AMX", "TRUNCATE", "FP8_MAX", "FP8_ROUNDINGS",
           "encode_cache", "decode_cache", "is_fp8", "cache_dims", "slot_strides"]

NHD, HND, VEC, AMX = 0, 1, 2, 3
LAYOUTS = {"NHD": NHD, "HND": HND, "vec": VEC, "amx": AMX}
LAYOUT_NAMES = {code: name for name, code in LAYOUTS.items()}
_LAYOUT_MASK = 15
TRUNCATE = 16
FP8_ROUNDINGS = ("nearest", "truncate")
# Largest finite value of each FP8 format: the saturation bound.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def encode_cache(layout: str, fp8_rounding: str = "nearest") -> int:
    """The ``cache_mode`` of a layout name and an FP8 rounding (both checked by the public layer)."""
    return LAYOUTS[layout] | (TRUNCATE if fp8_rounding == "truncate" else 0)


def decode_cache(code: int) -> Tuple[int, bool]:
    """``(layout, truncate)`` of a ``cache_mode``."""
    return code & _LAYOUT_MASK, bool(code & TRUNCATE)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


def cache_dims(layout: int, cache: torch.Tensor) -> Tuple[int, int, int, int]:
    """``(num_blocks, block_size, num_kv_heads, head_dim)`` of a 4-D cache tensor in ``layout``."""
    a, b, c, d = cache.shape
    return (a, b, c, d) if layout == NHD else (a, c, b, d)


def slot_strides(layout: int, cache: torch.Tensor) -> Tuple[int, int, int, int]:
    """Element strides ``(block, offset, head, dim)`` of a 4-D cache tensor in ``layout`` -- for ``"vec"`` and
    ``"amx"`` the plain ``[block_size, head_dim]`` view of a region (their kernels index the region themselves)."""
    s = cache.stride()
    return (s[0], s[1], s[2], s[3]) if layout == NHD else (s[0], s[2], s[1], s[3])
