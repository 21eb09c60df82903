// No specialisation (the DEFAULT build): every head and row takes the generic kernel, nothing is streamed.
#pragma once

#include "../optional_ref.h"
#include "../plan.h"

#include <ATen/core/Tensor.h>

#include <cstring>

namespace qkvfuse_cpu {
namespace isa {

constexpr const char* kName = "none";

template <typename T>
class SplitHeads {
 public:
  SplitHeads(const SplitPlan&, int) {}
  void copy(void* dst, const void* src, size_t bytes) const { std::memcpy(dst, src, bytes); }
  void fence() const {}

  class Token {
   public:
    Token(const SplitHeads&, const float*, const float*) {}
    void start(bool) {}
    template <typename Generic>
    int64_t run(const T*, int64_t, T*, int64_t, bool, bool, const Generic&) const {
      return 0;
    }
  };
};

inline bool norm_rows_stored(NormPlan&, at::ScalarType, const at::Tensor&, const OptRef&, const float*) {
  return false;
}
inline bool norm_rows_fp32(const NormPlan&, at::ScalarType) { return false; }

// Nothing is streamed: the cache-writing split's row stores are plain copies.
inline bool stream_cache_rows(int64_t) { return false; }
inline void stream_copy(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
inline void stream_fence() {}

constexpr int64_t kPackBlock = 0;
inline void pack_rne_block(const float*, c10::BFloat16*) {}

// The tiled KV caches' stores and the FP8 rows (isa.h): none here, cache.h's portable loops write them.
inline int64_t cache_transpose(int64_t, bool, void*, int64_t, const void*, int64_t, int64_t, int64_t, bool) {
  return 0;
}
inline bool cache_amx_v_pair(int64_t, void*, const void*, const void*, int64_t, int64_t, bool) { return false; }
inline bool cache_amx_v_row(int64_t, void*, const void*, int64_t, int64_t, bool) { return false; }
template <int kMant, int kBias, bool kTrunc, bool kMul>
inline int64_t quantize_fp8(const float*, int64_t, float, float, uint8_t*) {
  return 0;
}

}  // namespace isa
}  // namespace qkvfuse_cpu
