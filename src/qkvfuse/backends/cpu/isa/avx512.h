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

// ------------------------------------------------------------------------------------------------------------
// The tiled KV caches' stores (cache.h): a run of up to 16 tokens per gather, bits moved, never computed.
// ------------------------------------------------------------------------------------------------------------

// dst[d * stride + r] = src[r * src_stride + d] (pair: element pairs, dst[(d * stride + r) * 2 + e] =
// src[r * src_stride + 2 * d + e]) for rows r < n <= 16, elem bytes per element, strides in elements: each column
// (pair) of the n rows gathered as dwords, then stored as one contiguous run. Returns how many of the m columns
// (pairs) it wrote, from the first; the caller writes the rest.
inline int64_t cache_transpose(int64_t elem, bool pair, void* dst, int64_t stride, const void* src,
                               int64_t src_stride, int64_t n, int64_t m, bool stream) {
  const int64_t row_bytes = src_stride * elem;
  if (n < 1 || n > 16 || row_bytes > (int64_t{1} << 26)) return 0;
  const __mmask16 rows = static_cast<__mmask16>((1u << n) - 1);
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(row_bytes)));
  const char* s = static_cast<const char*>(src);
  char* o = static_cast<char*>(dst);
  auto gather = [&](int64_t byte) {
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, idx, s + byte, 1);
  };
  int64_t d = 0;
  if ((pair && elem == 2) || (!pair && elem == 4)) {  // a column (pair) is one dword per row
    const int64_t col_bytes = stride * 4;
    if (stream && n == 16 && reinterpret_cast<uintptr_t>(o) % 64 == 0 && col_bytes % 64 == 0) {
      for (; d < m; ++d) _mm512_stream_si512(reinterpret_cast<__m512i*>(o + d * col_bytes), gather(d * 4));
    }
    for (; d < m; ++d) _mm512_mask_storeu_epi32(o + d * col_bytes, rows, gather(d * 4));
  } else if (!pair && elem == 2) {  // two columns per dword: even and odd halves apart
    const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28, 26,
                                           24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);  // evens, then odds
    for (; d + 2 <= m; d += 2) {
      const __m512i v = _mm512_permutexvar_epi16(split, gather(d * 2));
      _mm256_mask_storeu_epi16(o + d * stride * 2, rows, _mm512_castsi512_si256(v));
      _mm256_mask_storeu_epi16(o + (d + 1) * stride * 2, rows, _mm512_extracti64x4_epi64(v, 1));
    }
  } else if (!pair && elem == 1) {  // four columns per dword: bytes grouped by column in each lane, then lanes
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (; d + 4 <= m; d += 4) {
      const __m512i v = _mm512_permutexvar_epi32(lanes, _mm512_shuffle_epi8(gather(d), bytes));
      _mm_mask_storeu_epi8(o + d * stride, rows, _mm512_castsi512_si128(v));
      _mm_mask_storeu_epi8(o + (d + 1) * stride, rows, _mm512_extracti32x4_epi32(v, 1));
      _mm_mask_storeu_epi8(o + (d + 2) * stride, rows, _mm512_extracti32x4_epi32(v, 2));
      _mm_mask_storeu_epi8(o + (d + 3) * stride, rows, _mm512_extracti32x4_epi32(v, 3));
    }
  }
  return d;
}

// FP8 quantisation of x[0 .. n) 16 values at a time (cache.h quantize_row_as, fp8_bits: the same operations on
// 16 lanes; min/max keep a NaN operand, as the scalar clamp does). Returns how many values it wrote (a multiple of
// 16); the caller quantises the rest.
template <int kMant, int kBias, bool kTrunc, bool kMul>
inline int64_t quantize_fp8(const float* x, int64_t n, float scale, float bound, uint8_t* out) {
  constexpr int kShift = 23 - kMant;
  constexpr uint32_t kMinNormal = uint32_t(127 - kBias + 1) << 23;
  constexpr uint32_t kRebias = uint32_t(127 - kBias) << 23;
  const __m512 vs = _mm512_set1_ps(scale), hi = _mm512_set1_ps(bound), lo = _mm512_set1_ps(-bound);
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i min_normal = _mm512_set1_epi32(static_cast<int>(kMinNormal));
  const __m512i rebias = _mm512_set1_epi32(static_cast<int>(kRebias));
  const __m512i inf = _mm512_set1_epi32(0x7f800000), nan = _mm512_set1_epi32(0x7f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 y = _mm512_loadu_ps(x + i);
    y = kMul ? _mm512_mul_ps(y, vs) : _mm512_div_ps(y, vs);
    y = _mm512_max_ps(lo, _mm512_min_ps(hi, y));  // the second operand where either is NaN: y
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i sign = _mm512_and_si512(bits, sign_bit);
    const __m512i a = _mm512_xor_si512(bits, sign);
    const __mmask16 small = _mm512_cmplt_epu32_mask(a, min_normal);
    __m512i r;
    if constexpr (kTrunc) {
      constexpr float kSteps = float(1 << (kBias - 1 + kMant));
      const __m512 scaled = _mm512_maskz_mul_ps(small, _mm512_castsi512_ps(a), _mm512_set1_ps(kSteps));
      r = _mm512_mask_blend_epi32(small, _mm512_srli_epi32(_mm512_sub_epi32(a, rebias), kShift),
                                  _mm512_cvttps_epu32(scaled));
    } else {
      const __m512i magic = _mm512_set1_epi32(static_cast<int>(uint32_t(127 - kBias + kShift + 1) << 23));
      const __m512i denorm = _mm512_sub_epi32(
          _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(magic))), magic);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, kShift), _mm512_set1_epi32(1));
      const __m512i normal = _mm512_srli_epi32(
          _mm512_add_epi32(_mm512_sub_epi32(a, rebias),
                           _mm512_add_epi32(_mm512_set1_epi32((1u << (kShift - 1)) - 1), odd)),
          kShift);
      r = _mm512_mask_blend_epi32(small, normal, denorm);
    }
    r = _mm512_mask_blend_epi32(_mm512_cmpgt_epu32_mask(a, inf), r, nan);
    r = _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(r));
  }
  return i;
}

// Two tokens' rows (an even offset and the next) of D 16-bit elements into an amx V region (line: their pair's
// first element): each 16 dims of the two interleaved into one whole 64-byte line, streamed when asked and aligned.
// Returns whether it wrote them.
inline bool cache_amx_v_pair(int64_t elem, void* line, const void* row0, const void* row1, int64_t D, int64_t bs,
                             bool stream) {
  if (elem != 2 || D % 16 != 0) return false;
  auto* o = static_cast<char*>(line);
  const auto* s0 = static_cast<const char*>(row0);
  const auto* s1 = static_cast<const char*>(row1);
  stream = stream && reinterpret_cast<uintptr_t>(o) % 64 == 0 && (bs * 32) % 64 == 0;
  for (int64_t g = 0; g < D; g += 16) {
    const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s0 + g * 2)));
    const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s1 + g * 2)));
    const __m512i v = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
    if (stream) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(o + g * bs * 2), v);
    } else {
      _mm512_storeu_si512(o + g * bs * 2, v);
    }
  }
  return true;
}

// One token's row of D 16-bit elements into an amx V region ([D / 16, bs / 2, 16, 2]; dst: the token's first
// element, at its pair's odd or even place): each 16 dims widened to dwords and stored to their 16 places of one
// 64-byte line. Returns whether it wrote the row (16-bit elements, D a multiple of 16).
inline bool cache_amx_v_row(int64_t elem, void* dst, const void* row, int64_t D, int64_t bs, bool odd) {
  if (elem != 2 || D % 16 != 0) return false;
  const __mmask32 lanes = odd ? 0xAAAAAAAAu : 0x55555555u;
  auto* o = static_cast<char*>(dst) - (odd ? 2 : 0);  // the pair's line
  const auto* s = static_cast<const char*>(row);
  for (int64_t g = 0; g < D; g += 16) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + g * 2)));
    if (odd) v = _mm512_slli_epi32(v, 16);
    _mm512_mask_storeu_epi16(o + g * bs * 2, lanes, v);
  }
  return true;
}

}  // namespace isa
}  // namespace qkvfuse_cpu
