// The cache-writing split's cache_mode codes (qkvfuse/_cache_mode.py): bits 0-3 the layout, bit 4 truncating FP8
// rounding. Shared by the CPU kernel's store (cache.h) and the Triton host kernels (triton_host.cpp).
#pragma once

#include <cstdint>

namespace qkvfuse_cpu {

constexpr int64_t kNHD = 0, kHND = 1, kVec = 2, kAmx = 3, kLayoutMask = 15, kTruncateBit = 16;

}  // namespace qkvfuse_cpu
