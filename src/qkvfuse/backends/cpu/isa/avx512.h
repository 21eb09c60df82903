// The AVX-512 builds' specialised bf16 / fp16 heads (split) and rows (add_rmsnorm), behind the interface of isa.h;
// the kernels themselves are in avx512_kernels.h.
#pragma once

#include "../optional_ref.h"
#include "../plan.h"
#include "../vec_io.h"
#include "avx512_kernels.h"
#include "stream.h"

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace qkvfuse_cpu {
namespace isa {

constexpr const char* kName = "AVX-512";

// ------------------------------------------------------------------------------------------------------------
// split: a batch of heads at a time, bf16 in lane order where the rotary pairs allow it (its weights in lane
// order, once per call), else in natural order with the generic head's operations.
// ------------------------------------------------------------------------------------------------------------
template <typename T>
class SplitHeads {
 public:
  SplitHeads(const SplitPlan& p, int norm_mode) : p_(p), stream_(stream_outputs<T>(p)), batch_(avx512::batch_heads(p.D)) {
    if (!p.generic_only) {
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        fast_ = avx512::pick_lane_heads(p.D, p.half, norm_mode, p.neox);
        lanes_ = fast_ != nullptr;
      }
      if (fast_ == nullptr) fast_ = avx512::pick_heads<T>(p.D, p.half, norm_mode, p.neox);
    }
    const float* given[4] = {p.wq, p.wk, p.bq, p.bk};
    for (int i = 0; i < 4; ++i) {
      w_[i] = given[i];
      if (lanes_ && given[i] != nullptr) {
        avx512::to_lanes(given[i], lane_w_[i], p.D);
        w_[i] = lane_w_[i];
      }
    }
  }

  void copy(void* dst, const void* src, size_t bytes) const {
    if (stream_ && fast_ != nullptr) return stream_copy(dst, src, bytes);
    std::memcpy(dst, src, bytes);
  }

  void fence() const {
    if (stream_) _mm_sfence();  // the streamed stores are visible before the join
  }

  class Token {
   public:
    Token(const SplitHeads& call, const float* cos, const float* sin)
        : c_(call),
          fast_(call.fast_),
          D_(call.p_.D),
          half_(call.p_.half),
          eps_(call.p_.eps),
          stream_(call.stream_),
          cos_(cos),
          sin_(sin),
          lane_neox_(call.lanes_ && call.p_.neox),
          tables_{{call.w_[0], call.w_[2], lane_neox_ ? cos2_ : cos, lane_neox_ ? sin2_ : sin, cos2_, sin2_},
                  {call.w_[1], call.w_[3], lane_neox_ ? cos2_ : cos, lane_neox_ ? sin2_ : sin, cos2_, sin2_}} {}

    void start(bool) {
      if (lane_neox_) {
        avx512::to_lanes(cos_, cos2_, c_.p_.half);
        avx512::to_lanes(sin_, sin2_, c_.p_.half);
      } else if (c_.fast_ != nullptr && !c_.lanes_ && !c_.p_.neox) {
        avx512::gptj_tables(cos_, sin_, c_.p_.half, cos2_, sin2_);
      }
    }

    template <typename Generic>
    int64_t run(const T* src, int64_t ss, T* dst, int64_t n, bool is_q, bool, const Generic&) const {
      if (fast_ == nullptr) return 0;
      const int64_t m = std::min<int64_t>(c_.batch_, n);
      fast_(src, ss, dst, m, D_, half_, eps_, tables_[is_q ? 0 : 1], stream_);
      return m;
    }

   private:
    const SplitHeads& c_;
    avx512::HeadsFn<T> fast_;  // the call's, copied with its scalars: read per batch
    int64_t D_, half_;
    float eps_;
    bool stream_;
    const float* cos_;
    const float* sin_;
    bool lane_neox_;
    alignas(64) float cos2_[kMaxHeadDim], sin2_[kMaxHeadDim];  // GPT-J tables, or NeoX cos/sin in lane order
    avx512::HeadTables tables_[2];
  };

 private:
  const SplitPlan& p_;
  bool stream_;
  int64_t batch_;
  avx512::HeadsFn<T> fast_ = nullptr;
  bool lanes_ = false;
  const float* w_[4];                        // q weight, k weight, q bias, k bias as the heads read them
  alignas(64) float lane_w_[4][kMaxHeadDim];  // their lane-order copies (lane heads only)
};

// ------------------------------------------------------------------------------------------------------------
// add_rmsnorm
// ------------------------------------------------------------------------------------------------------------
// The specialised rows (avx512_kernels.h) for 16-bit activations and H % 32 == 0: bf16 in lane order, fp16 with the
// generic bits. Weights (and bias) in the activations' dtype are read as stored; fp32 ones are read in place
// (fp16) or from a lane-order copy made once per call (bf16), in a per-thread buffer that only grows.
inline bool is_vector_of(const at::Tensor& t, at::ScalarType dtype, int64_t n) {
  return t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == n && t.stride(0) == 1 && t.device().is_cpu();
}

template <typename T, typename W>
inline void run_norm_avx512_rows(const NormPlan& p, const W* w, const W* b) {
  for_rows(p, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = static_cast<const T*>(p.x) + t * p.x_rs;
      const T* r = p.r != nullptr ? static_cast<const T*>(p.r) + t * p.r_rs : nullptr;
      T* r_out = p.r_out != nullptr ? static_cast<T*>(p.r_out) + t * p.r_out_rs : nullptr;
      T* y = static_cast<T*>(p.y) + t * p.y_rs;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        avx512::norm_row_bf16<W>(x, r, r_out, y, w, b, p.H, p.eps);
      } else {
        avx512::norm_row_fp16<W>(x, r, r_out, y, w, b, p.H, p.eps);
      }
    }
  });
}

// fp32_w: an fp32 weight to use instead of `weight` (the Gemma rows' 1 + w), or nullptr.
template <typename T>
inline bool run_norm_avx512_typed(const NormPlan& p, const at::Tensor& weight, const OptRef& bias, at::ScalarType dtype,
                           const float* fp32_w) {
  if (fp32_w == nullptr && is_vector_of(weight, dtype, p.H) && (!bias.has_value() || is_vector_of(*bias, dtype, p.H))) {
    run_norm_avx512_rows<T, T>(p, static_cast<const T*>(weight.const_data_ptr()),
                               bias.has_value() ? static_cast<const T*>(bias->const_data_ptr()) : nullptr);
    return true;
  }
  if ((fp32_w == nullptr && !is_vector_of(weight, at::kFloat, p.H)) ||
      (bias.has_value() && !is_vector_of(*bias, at::kFloat, p.H))) {
    return false;
  }
  const float* w = fp32_w != nullptr ? fp32_w : weight.const_data_ptr<float>();
  const float* b = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // The calling thread owns the buffer until the parallel loop has joined.
    thread_local std::vector<float> lanes;
    const size_t need = static_cast<size_t>(p.H) * (b != nullptr ? 2 : 1);
    if (lanes.size() < need) lanes.resize(need);
    avx512::to_lanes(w, lanes.data(), p.H);
    if (b != nullptr) avx512::to_lanes(b, lanes.data() + p.H, p.H);
    w = lanes.data();
    b = b != nullptr ? lanes.data() + p.H : nullptr;
  }
  run_norm_avx512_rows<T, float>(p, w, b);
  return true;
}

inline bool run_norm_avx512(const NormPlan& p, at::ScalarType dtype, const at::Tensor& weight, const OptRef& bias,
                     const float* fp32_w) {
  return dtype == at::kBFloat16 ? run_norm_avx512_typed<c10::BFloat16>(p, weight, bias, dtype, fp32_w)
                                : run_norm_avx512_typed<c10::Half>(p, weight, bias, dtype, fp32_w);
}

// bf16 / fp16 rows of whole 32-value blocks; a weight (and bias) in the activations' dtype, contiguous, is widened
// as it is read -- no conversion pass per call.
inline bool norm_rows_stored(NormPlan& p, at::ScalarType dtype, const at::Tensor& weight, const OptRef& bias,
                             const float* gemma_w) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && p.H % 32 == 0 &&
         run_norm_avx512(p, dtype, weight, bias, gemma_w);
}

inline bool norm_rows_fp32(const NormPlan&, at::ScalarType) { return false; }

// The rounding of the lane-order stores on its own (32 values: 16 even lanes, then 16 odd lanes).
constexpr int64_t kPackBlock = 32;
inline void pack_rne_block(const float* src, c10::BFloat16* dst) {
  _mm512_storeu_si512(dst, avx512::round_lanes(_mm512_loadu_ps(src), _mm512_loadu_ps(src + 16)));
}

}  // namespace isa
}  // namespace qkvfuse_cpu
