// The cache-writing split's cache_mode codes (qkvfuse/_cache_mode.py): bits 0-3 the layout, bit 4 truncating FP8
// rounding. Shared by the CPU kernel's store (cache.h) and the Triton host kernels (triton_host.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>

namespace qkvfuse_cpu {

constexpr int64_t kNHD = 0, kHND = 1, kVec = 2, kAmx = 3, kLayoutMask = 15, kTruncateBit = 16;

// A 4-D cache tensor's block size in `layout` (NHD [blocks, block_size, heads, dim]; the others [blocks, heads,
// block_size, dim]) -- qkvfuse._cache_mode.cache_dims.
inline int64_t cache_block_size(int64_t layout, const at::Tensor& c) { return c.size(layout == kNHD ? 1 : 2); }

// Its element strides in (block, offset in block, head, dim) order -- qkvfuse._cache_mode.slot_strides.
inline std::array<int64_t, 4> cache_slot_strides(int64_t layout, const at::Tensor& c) {
  const bool nhd = layout == kNHD;
  return {c.stride(0), c.stride(nhd ? 1 : 2), c.stride(nhd ? 2 : 1), c.stride(3)};
}

}  // namespace qkvfuse_cpu
