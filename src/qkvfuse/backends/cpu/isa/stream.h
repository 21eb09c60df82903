// Non-temporal output stores, shared by the AVX2 and AVX-512 heads.
#pragma once

#include "../plan.h"

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace qkvfuse_cpu {
namespace isa {

// Outputs far larger than the caches (a prefill batch) are written with non-temporal stores, as a large
// memcpy is: no read-for-ownership of lines that are only overwritten. Needs 32-byte aligned rows, and not
// the in-place form (its lines are already cached by the read).
constexpr int64_t kStreamBytes = int64_t{16} << 20;

inline bool aligned32(const void* ptr, int64_t row_stride_bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % 32 == 0 && row_stride_bytes % 32 == 0;
}

template <typename T>
inline bool stream_outputs(const SplitPlan& p) {
  const int64_t e = sizeof(T);
  const int64_t gate_heads = p.gate != nullptr ? p.hq : 0;
  return p.v != nullptr && p.T * (p.hq + gate_heads + 2 * p.hkv) * p.D * e >= kStreamBytes &&
         aligned32(p.q, p.q_rs * e) && aligned32(p.k, p.k_rs * e) && aligned32(p.v, p.v_rs * e) &&
         (p.hkv * p.D * e) % 32 == 0 &&
         (p.gate == nullptr || (aligned32(p.gate, p.gate_rs * e) && (p.D * e) % 32 == 0));
}

// V rows and gate heads under the same policy (a V row is hkv * D values, a gate head D values: multiples of 32
// bytes when streaming).
inline void stream_copy(void* dst, const void* src, size_t bytes) {
  auto* d = static_cast<__m256i*>(dst);
  const auto* s = static_cast<const __m256i*>(src);
  for (size_t i = 0; i < bytes / 32; ++i) _mm256_stream_si256(d + i, _mm256_loadu_si256(s + i));
}

// The cache-writing split's row stores (cache.h) under the same policy: streamed when a call writes this many
// bytes to its caches (each row still needs a 32-byte aligned start and length); fenced after a thread's last.
inline bool stream_cache_rows(int64_t bytes) { return bytes >= kStreamBytes; }
inline void stream_fence() { _mm_sfence(); }

}  // namespace isa
}  // namespace qkvfuse_cpu
