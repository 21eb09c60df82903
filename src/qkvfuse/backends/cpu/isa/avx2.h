// The AVX2 build's specialised bf16 heads (split), rows (add_rmsnorm), and the cache-writing split's K transposes
// and FP8 rows, behind the interface of isa.h.
#pragma once

#include "../optional_ref.h"
#include "../plan.h"
#include "../vec_io.h"
#include "stream.h"

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace qkvfuse_cpu {
namespace isa {

constexpr const char* kName = "AVX2";

// bf16 in "lane order": a 16-value bf16 block is read as two fp32 vectors without a lane shuffle -- even elements
// (bits << 16) and odd elements (bits & 0xffff0000) -- and written back with word blends, so fp32 tables used with
// it (weights, cos/sin) are kept in the same order.
// Lane order of 16 consecutive values: the 8 even ones, then the 8 odd ones.
// Returns whether every value is finite (callers converting a weight need both: one pass instead of two).
inline bool to_lane_order(const float* src, float* dst, int64_t n) {  // n: a multiple of 16
  const __m256 zero = _mm256_setzero_ps();
  __m256 probe = zero;  // x * 0 is 0 for finite x, NaN for an infinity or a NaN
  for (int64_t i = 0; i < n; i += 16) {
    const auto [even, odd] = at::vec::deinterleave2(fVec::loadu(src + i), fVec::loadu(src + i + kF));
    even.store(dst + i);
    odd.store(dst + i + kF);
    probe = _mm256_add_ps(probe, _mm256_add_ps(_mm256_mul_ps(even, zero), _mm256_mul_ps(odd, zero)));
  }
  return _mm256_movemask_ps(_mm256_cmp_ps(probe, probe, _CMP_UNORD_Q)) == 0;
}

struct Bf16Block {
  __m256 even, odd;
  static Bf16Block of(__m256i raw) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
  static __m256i raw(const c10::BFloat16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Bf16Block load(const c10::BFloat16* p) { return of(raw(p)); }
  // 16 values, rounded to nearest even, in memory order: even's words in the low halves, odd's in the high.
  // Per 16-bit word: the truncated value hi and the dropped half lo; it rounds up iff lo + lsb(hi) > 0x8000,
  // i.e. iff avg_epu16(lo, 0x7ffe | lsb(hi)) = (lo + 0x7fff + lsb(hi)) >> 1 has its top bit set. The same bits
  // as (v + 0x7fff + lsb) >> 16 in 32-bit lanes (Io<BFloat16>::store2_finite; same argument for exactness),
  // in nine instructions instead of ten.
  static __m256i pack_rne(__m256 even, __m256 odd) {
    const __m256i e = _mm256_castps_si256(even), o = _mm256_castps_si256(odd);
    const __m256i hi = _mm256_blend_epi16(_mm256_srli_epi32(e, 16), o, 0xaa);
    const __m256i lo = _mm256_blend_epi16(e, _mm256_slli_epi32(o, 16), 0xaa);
    const __m256i k = _mm256_or_si256(_mm256_and_si256(hi, _mm256_set1_epi16(1)), _mm256_set1_epi16(0x7ffe));
    return _mm256_add_epi16(hi, _mm256_srli_epi16(_mm256_avg_epu16(lo, k), 15));
  }
  template <bool kStream>
  static void store(c10::BFloat16* p, __m256 even, __m256 odd) {
    const __m256i out = pack_rne(even, odd);
    if constexpr (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), out);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), out);
    }
  }
};

// ------------------------------------------------------------------------------------------------------------
// split
// ------------------------------------------------------------------------------------------------------------
// bf16, head_dim 128 or 256, rotary half 64 or 32, QK-norm with a weight and no bias or no QK-norm (the
// published models: Qwen3, GLM, Llama-style at 128; Qwen3-Next / Qwen3.5 at 256): a head specialised at compile
// time. A 16-value bf16 block is read as two fp32 vectors without a lane shuffle -- even elements (bits << 16)
// and odd elements (bits & 0xffff0000) -- and written back with one word blend, so every table is kept in that
// lane order. Per token the weights are folded into cos/sin:
//   out_a = inv * (x_a * (w_a c) - x_b * (w_b s)),  out_b = inv * (x_b * (w_b c) + x_a * (w_a s)),
// pass-through dims: out = (x * w) * inv. Every element of a head takes the same sequence whatever its
// position, and the choice of this path depends only on the head's shape, its token's cos/sin and the
// weights, so results stay independent of threads and batch.
constexpr int kFastMaxD = 256;
constexpr int kFastMaxHalf = 64;

struct FastWeights {  // one per weight set (Q, K), per call, shared by the threads; lane order
  alignas(32) float wa[kFastMaxHalf], wb[kFastMaxHalf];  // the pairs' weights
  alignas(32) float pass[kFastMaxD];                      // pass-through weights (from index 2 * half)
};

struct FastTables {  // one per weight set (Q, K), per token, per thread; lane order
  alignas(32) float p[kFastMaxHalf], q[kFastMaxHalf], r[kFastMaxHalf], s[kFastMaxHalf];
  const float* pass;  // FastWeights::pass
};

inline void fast_weights(const float* w, int64_t D, int64_t half, bool neox, FastWeights& t) {
  if (neox) {  // NeoX pair j = (j, half + j): its tables in lane order
    to_lane_order(w, t.wa, half);
    to_lane_order(w + half, t.wb, half);
  } else {  // GPT-J pair j = (2j, 2j + 1) sits in one block's even/odd lanes: its tables in natural order
    for (int64_t j = 0; j < half; j += kF) {
      const auto [even, odd] = at::vec::deinterleave2(fVec::loadu(w + 2 * j), fVec::loadu(w + 2 * j + kF));
      even.store(t.wa + j);
      odd.store(t.wb + j);
    }
  }
  to_lane_order(w + 2 * half, t.pass + 2 * half, D - 2 * half);
}

// This token's tables for both weight sets (Q, K); half is a multiple of 16. Without weights (no QK-norm)
// the tables are cos and sin as they are.
inline void fast_token(const float* cos, const float* sin, int64_t half, bool neox, const FastWeights* w,
                       FastTables* t) {
  alignas(32) float cs[2][kFastMaxHalf];
  const float* c = cos;
  const float* s = sin;
  if (neox) {  // into lane order
    to_lane_order(cos, cs[0], half);
    to_lane_order(sin, cs[1], half);
    c = cs[0];
    s = cs[1];
  }
  if (w == nullptr) {
    for (int k = 0; k < 2; ++k) {
      std::copy(c, c + half, t[k].p);
      std::copy(c, c + half, t[k].r);
      std::copy(s, s + half, t[k].q);
      std::copy(s, s + half, t[k].s);
    }
    return;
  }
  for (int k = 0; k < 2; ++k) {
    for (int64_t j = 0; j < half; j += kF) {
      const fVec wa = fVec::loadu(w[k].wa + j), wb = fVec::loadu(w[k].wb + j);
      const fVec cv = fVec::loadu(c + j), sv = fVec::loadu(s + j);
      (wa * cv).store(t[k].p + j);
      (wb * sv).store(t[k].q + j);
      (wb * cv).store(t[k].r + j);
      (wa * sv).store(t[k].s + j);
    }
  }
}

constexpr int kFastBatch = 8;

// The head's sum of squares (per lane).
template <int kD>
inline __m256 fast_sum_squares(const c10::BFloat16* src) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int c = 0; c < kD / 16; ++c) {
    const Bf16Block x = Bf16Block::load(src + 16 * c);
    acc0 = _mm256_fmadd_ps(x.even, x.even, acc0);
    acc1 = _mm256_fmadd_ps(x.odd, x.odd, acc1);
  }
  return _mm256_add_ps(acc0, acc1);
}

// Lane k: the sum of v[k]'s lanes, ((0+1)+(2+3))+((4+5)+(6+7)) whatever k is.
inline __m256 sum_lanes8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// kNorm false (no QK-norm): the tables are cos/sin themselves and inv is not applied, so a rotated element is
// fmsub(x_a, c, x_b * s) -- the generic path's own sequence, bit for bit -- and pass-through dims are copied.
// The head is read from src again (L1 after fast_sum_squares), each block before the outputs that overwrite it are
// written, so dst may be src (the in-place form); re-reading and re-widening costs less than keeping the widened
// values (two 256-bit stores and loads per 16 values).
template <int kD, int kHalf, bool kNeox, bool kStream, bool kNorm>
inline void fast_body(const c10::BFloat16* src, c10::BFloat16* dst, const FastTables& t,
                      float inv_scalar) {
  constexpr int kBlocks = kD / 16;
  auto load = [&](int off) { return Bf16Block::load(src + off); };
  const __m256 inv = _mm256_set1_ps(inv_scalar);
  auto scale = [&](__m256 v) { return kNorm ? _mm256_mul_ps(v, inv) : v; };
  auto rot = [&](__m256 xa, __m256 xb, int64_t j, __m256& oa, __m256& ob) {
    oa = scale(_mm256_fmsub_ps(xa, _mm256_load_ps(t.p + j), _mm256_mul_ps(xb, _mm256_load_ps(t.q + j))));
    ob = scale(_mm256_fmadd_ps(xb, _mm256_load_ps(t.r + j), _mm256_mul_ps(xa, _mm256_load_ps(t.s + j))));
  };
  if constexpr (kNeox) {
    for (int c = 0; c < kHalf / 16; ++c) {
      const Bf16Block a = load(16 * c), b = load(kHalf + 16 * c);
      __m256 ae, be, ao, bo;
      rot(a.even, b.even, 16 * c, ae, be);
      rot(a.odd, b.odd, 16 * c + 8, ao, bo);
      Bf16Block::store<kStream>(dst + 16 * c, ae, ao);
      Bf16Block::store<kStream>(dst + kHalf + 16 * c, be, bo);
    }
  } else {
    for (int c = 0; c < kHalf / 8; ++c) {
      const Bf16Block x = load(16 * c);
      __m256 oa, ob;
      rot(x.even, x.odd, 8 * c, oa, ob);
      Bf16Block::store<kStream>(dst + 16 * c, oa, ob);
    }
  }
  for (int c = kHalf / 8; c < kBlocks; ++c) {
    if constexpr (!kNorm) {  // widening and rounding back is the identity on bf16 values, NaN payloads included
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * c));
      if constexpr (kStream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 16 * c), x);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), x);
      }
      continue;
    }
    const Bf16Block x = load(16 * c);
    const float* w = t.pass + 16 * c;
    Bf16Block::store<kStream>(dst + 16 * c, _mm256_mul_ps(_mm256_mul_ps(x.even, _mm256_load_ps(w)), inv),
                     _mm256_mul_ps(_mm256_mul_ps(x.odd, _mm256_load_ps(w + 8)), inv));
  }
}

// Up to kFastBatch consecutive heads at once (n >= 1; src holds them src_stride values apart -- kD, or 2 * kD
// for the gated layout's Q heads -- and dst kD values apart, all with the tables t; unused slots repeat head 0
// and are not written): their sums of squares are reduced and scaled together so that the per-head reduction,
// square root and division overlap.
// Each head's value is computed the same way whatever its slot. Returns the heads whose sum of squares is
// not finite (bit k for slot k), left unwritten for the generic path. Without QK-norm there is no sum and
// every head is written: the rounding of Bf16Block::store is exact for any value a rotation computes (its
// NaNs are quiet, so none rounds into an infinity).
template <int kD, int kHalf, bool kNeox, bool kStream, bool kNorm>
QKVFUSE_FLATTEN int fast_heads(const c10::BFloat16* src, int64_t src_stride, c10::BFloat16* dst,
                               const FastTables& t, int n, float eps) {
  if constexpr (!kNorm) {
    for (int k = 0; k < n; ++k) {
      for (int c = 0; c < kD; c += 32) prefetch_ahead(src + k * src_stride + c);  // no first pass to make them
      fast_body<kD, kHalf, kNeox, kStream, false>(src + k * src_stride, dst + k * kD, t, 1.f);
    }
    return 0;
  }
  __m256 sums[kFastBatch];
  for (int k = 0; k < kFastBatch; ++k) {
    sums[k] = fast_sum_squares<kD>(src + (k < n ? k : 0) * src_stride);
  }
  const __m256 ss = sum_lanes8(sums);
  const __m256 inv = _mm256_div_ps(
      _mm256_set1_ps(1.f),
      _mm256_sqrt_ps(_mm256_add_ps(_mm256_div_ps(ss, _mm256_set1_ps(static_cast<float>(kD))),
                                   _mm256_set1_ps(eps))));
  // |ss| < inf, NaN compares false
  const __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), ss), _mm256_set1_ps(INFINITY),
                                      _CMP_LT_OQ);
  const int bad = ~_mm256_movemask_ps(finite) & ((1 << n) - 1);
  alignas(32) float inv_k[kFastBatch];
  _mm256_store_ps(inv_k, inv);
  for (int k = 0; k < n; ++k) {
    // Two batches on (16 heads: the AVX-512 heads' one batch): a batch of 8 computes for less time than its
    // requests take to arrive -- one batch on measured 3-7 % slower at T = 256 and 4096 (bench/log/zen3-avx2.md).
    request_next_batch(src + k * src_stride, 2 * n, src_stride * 2, kD * 2);
    if (bad >> k & 1) continue;
    fast_body<kD, kHalf, kNeox, kStream, true>(src + k * src_stride, dst + k * kD, t, inv_k[k]);
  }
  return bad;
}

using FastFn = int (*)(const c10::BFloat16*, int64_t, c10::BFloat16*, const FastTables&, int, float);

template <int kD, bool kNorm>
inline FastFn pick_fast_variant(const SplitPlan& p, bool stream) {
  const bool h64 = p.half == 64;
  if (stream) {
    return h64 ? (p.neox ? &fast_heads<kD, 64, true, true, kNorm> : &fast_heads<kD, 64, false, true, kNorm>)
               : (p.neox ? &fast_heads<kD, 32, true, true, kNorm> : &fast_heads<kD, 32, false, true, kNorm>);
  }
  return h64 ? (p.neox ? &fast_heads<kD, 64, true, false, kNorm> : &fast_heads<kD, 64, false, false, kNorm>)
             : (p.neox ? &fast_heads<kD, 32, true, false, kNorm> : &fast_heads<kD, 32, false, false, kNorm>);
}

// The specialised head for this call, or nullptr.
template <typename T>
inline FastFn pick_fast(const SplitPlan& p, int norm_mode, bool stream) {
  if constexpr (!std::is_same_v<T, c10::BFloat16>) {
    return nullptr;
  } else {
    if (norm_mode > 1 || (p.D != 128 && p.D != 256) || (p.half != 64 && p.half != 32)) return nullptr;
    if (p.D == 256) {
      return norm_mode == 1 ? pick_fast_variant<256, true>(p, stream) : pick_fast_variant<256, false>(p, stream);
    }
    return norm_mode == 1 ? pick_fast_variant<128, true>(p, stream) : pick_fast_variant<128, false>(p, stream);
  }
}


// The interface (isa.h): fast_heads where pick_fast takes the call, for tokens whose cos/sin and weights are
// finite; a head whose sum of squares is not finite goes to the generic head.
template <typename T>
class SplitHeads {
 public:
  SplitHeads(const SplitPlan& p, int norm_mode)
      : p_(p), norm_mode_(norm_mode), stream_(stream_outputs<T>(p)),
        fast_(p.generic_only ? nullptr : pick_fast<T>(p, norm_mode, stream_)) {
    if (fast_ != nullptr && norm_mode == 1) {
      fast_weights(p.wq, p.D, p.half, p.neox, w_[0]);
      fast_weights(p.wk, p.D, p.half, p.neox, w_[1]);
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
        : c_(call), fast_(call.fast_), D_(call.p_.D), eps_(call.p_.eps), cos_(cos), sin_(sin) {
      tables_[0].pass = call.w_[0].pass;
      tables_[1].pass = call.w_[1].pass;
    }

    void start(bool finite) {
      if (c_.fast_ != nullptr && finite) {
        fast_token(cos_, sin_, c_.p_.half, c_.p_.neox, c_.norm_mode_ == 1 ? c_.w_ : nullptr, tables_);
      }
    }

    template <typename Generic>
    int64_t run(const T* src, int64_t ss, T* dst, int64_t n, bool is_q, bool finite, const Generic& generic) const {
      if (fast_ == nullptr || !finite) return 0;
      const int m = static_cast<int>(std::min<int64_t>(kFastBatch, n));
      const int bad = fast_(reinterpret_cast<const c10::BFloat16*>(src), ss, reinterpret_cast<c10::BFloat16*>(dst),
                            tables_[is_q ? 0 : 1], m, eps_);
      for (int l = 0; l < m; ++l) {  // left unwritten by the batch: src is intact (a head never writes another's)
        if (bad >> l & 1) generic(src + l * ss, dst + l * D_);
      }
      return m;
    }

   private:
    const SplitHeads& c_;
    FastFn fast_;  // the call's, copied with its scalars: read per batch
    int64_t D_;
    float eps_;
    const float* cos_;
    const float* sin_;
    FastTables tables_[2];
  };

 private:
  const SplitPlan& p_;
  int norm_mode_;
  bool stream_;
  FastFn fast_;
  FastWeights w_[2];
};

// ------------------------------------------------------------------------------------------------------------
// add_rmsnorm
// ------------------------------------------------------------------------------------------------------------
// bf16 rows of a multiple of 16 values with finite weights, in the lane order of the split's specialised path
// (Bf16Block, pack_rne; p.w and p.b are in lane order): s = x + residual rounded once to bf16 (the unfused
// add's value), the sum of the rounded s^2 in fp32, y = (s * inv) * w (+ b) rounded once -- the generic row's
// sequence, except that the sum runs over even/odd lanes instead of halves (another fp32 summation order).
// Chosen by dtype, H and the weights only: every row of a call takes the same path. Any NaN reaching pack_rne
// comes from a bf16 input or is the default NaN (the weights are finite), so its rounding is exact.
// kBf16Weights: the weight (and bias) are bf16 and read as stored -- Bf16Block::load puts them in the same lane
// order, with the same fp32 values as the converted ones, so the bits are those of the fp32-weight rows. Any
// NaN then also comes from a bf16 input (a weight) or is the default NaN: no finiteness check is needed, and the
// call makes no conversion pass over the weights.
// Both passes load ahead of their stores (ahead_of_stores): the sum pass two blocks of x and residual (four
// would not fit AVX2's sixteen registers), the normalising pass four blocks of the sums; the weights are read in
// the step (no register left for them), and no placement of x, residual and weight tried was slower for it (the
// AVX-512 rows load them ahead: one was).
template <bool kBf16Weights>
QKVFUSE_FLATTEN void norm_row_bf16(const NormPlan& p, int64_t t) {
  using bf16 = c10::BFloat16;
  const int64_t H = p.H;
  const bf16* x = static_cast<const bf16*>(p.x) + t * p.x_rs;
  const bf16* r = p.r != nullptr ? static_cast<const bf16*>(p.r) + t * p.r_rs : nullptr;
  bf16* r_out = p.r_out != nullptr ? static_cast<bf16*>(p.r_out) + t * p.r_out_rs : nullptr;
  bf16* y = static_cast<bf16*>(p.y) + t * p.y_rs;
  struct XR {
    __m256i x, r;
  };
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  ahead_of_stores<16, 2, XR>(
      H, [&](int64_t i) { return XR{Bf16Block::raw(x + i), r != nullptr ? Bf16Block::raw(r + i) : __m256i{}}; },
      [&](int64_t i, const XR& v) {
        Bf16Block a = Bf16Block::of(v.x);
        if (r != nullptr) {
          const Bf16Block c = Bf16Block::of(v.r);
          const __m256i s = Bf16Block::pack_rne(_mm256_add_ps(a.even, c.even), _mm256_add_ps(a.odd, c.odd));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(r_out + i), s);
          a = Bf16Block::of(s);
        }
        acc0 = _mm256_fmadd_ps(a.even, a.even, acc0);
        acc1 = _mm256_fmadd_ps(a.odd, a.odd, acc1);
      });
  double ss = 0.0;
  const __m256 inv = _mm256_set1_ps(inv_rms<bf16>(fVec(acc0), fVec(acc1), 0.0, H, p.eps, &ss));
  const bf16* s = r != nullptr ? r_out : x;  // re-read after its own block is written: aliasing is safe
  ahead_of_stores<16, 4, __m256i>(
      H, [&](int64_t i) { return Bf16Block::raw(s + i); },
      [&](int64_t i, __m256i sv) {
        const Bf16Block v = Bf16Block::of(sv);
        __m256 even, odd;
        if constexpr (kBf16Weights) {
          const Bf16Block w = Bf16Block::load(p.w16 + i);
          even = _mm256_mul_ps(_mm256_mul_ps(v.even, inv), w.even);
          odd = _mm256_mul_ps(_mm256_mul_ps(v.odd, inv), w.odd);
          if (p.b16 != nullptr) {
            const Bf16Block b = Bf16Block::load(p.b16 + i);
            even = _mm256_add_ps(even, b.even);
            odd = _mm256_add_ps(odd, b.odd);
          }
        } else {
          even = _mm256_mul_ps(_mm256_mul_ps(v.even, inv), _mm256_loadu_ps(p.w + i));
          odd = _mm256_mul_ps(_mm256_mul_ps(v.odd, inv), _mm256_loadu_ps(p.w + i + 8));
          if (p.b != nullptr) {
            even = _mm256_add_ps(even, _mm256_loadu_ps(p.b + i));
            odd = _mm256_add_ps(odd, _mm256_loadu_ps(p.b + i + 8));
          }
        }
        Bf16Block::store<false>(y + i, even, odd);
      });
}

// The lane-order rows when they apply (see norm_row_bf16); returns whether they ran.
inline bool run_norm_bf16(NormPlan p) {
  if (p.H % 16 != 0) return false;
  // The weights in lane order, checked finite in the same pass, in a per-thread buffer that only grows: no
  // allocation, zero-filling or second pass per call (each costs as much as a decode row).
  // The calling thread owns the buffer until the parallel loop has joined.
  thread_local std::vector<float> lane;
  const size_t need = static_cast<size_t>(p.H) * (p.b != nullptr ? 2 : 1);
  if (lane.size() < need) lane.resize(need);
  bool finite = to_lane_order(p.w, lane.data(), p.H);
  p.w = lane.data();
  if (p.b != nullptr) {
    finite = to_lane_order(p.b, lane.data() + p.H, p.H) && finite;
    p.b = lane.data() + p.H;
  }
  if (!finite) return false;
  p.weights_finite = true;
  for_rows(p, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row_bf16<false>(p, t);
  });
  return true;
}

inline bool is_bf16_vector(const at::Tensor& t, int64_t n) {
  return t.scalar_type() == at::kBFloat16 && t.dim() == 1 && t.size(0) == n && t.stride(0) == 1 && t.device().is_cpu();
}

// A bf16 model's weights: read as stored, no conversion (the common case of an engine's decoder norms).
inline bool norm_rows_stored(NormPlan& p, at::ScalarType dtype, const at::Tensor& weight, const OptRef& bias,
                             const float* gemma_w) {
  if (gemma_w != nullptr || dtype != at::kBFloat16 || p.H % 16 != 0 || !is_bf16_vector(weight, p.H) ||
      (bias.has_value() && !is_bf16_vector(*bias, p.H))) {
    return false;
  }
  p.w16 = weight.const_data_ptr<c10::BFloat16>();
  p.b16 = bias.has_value() ? bias->const_data_ptr<c10::BFloat16>() : nullptr;
  for_rows(p, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row_bf16<true>(p, t);
  });
  return true;
}

inline bool norm_rows_fp32(const NormPlan& p, at::ScalarType dtype) {
  return dtype == at::kBFloat16 && run_norm_bf16(p);
}

// The rounding of Bf16Block::store on its own (16 values: 8 even lanes, then 8 odd lanes).
constexpr int64_t kPackBlock = 16;
inline void pack_rne_block(const float* src, c10::BFloat16* dst) {
  Bf16Block::store<false>(dst, _mm256_loadu_ps(src), _mm256_loadu_ps(src + 8));
}

// ------------------------------------------------------------------------------------------------------------
// The tiled KV caches' K transpose (cache.h transpose_rows): 8 x 8 blocks by unpacks, bits moved, never computed.
// ------------------------------------------------------------------------------------------------------------

// Eight rows of eight 16-bit elements, transposed in place: a[i] becomes column i.
inline void transpose8_epi16(__m128i* a) {
  __m128i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
    t[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7: columns (0, 1), (2, 3), (4, 5), (6, 7)
    u[4 * h] = _mm_unpacklo_epi32(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm_unpackhi_epi32(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm_unpacklo_epi32(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm_unpackhi_epi32(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    a[2 * c] = _mm_unpacklo_epi64(u[c], u[4 + c]);
    a[2 * c + 1] = _mm_unpackhi_epi64(u[c], u[4 + c]);
  }
}

// Eight rows of eight 32-bit elements, transposed in place: a[i] becomes column i.
inline void transpose8_epi32(__m256i* a) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {  // per 128-bit half: columns (0, 1) and (2, 3) of rows 2i, 2i + 1
    t[2 * i] = _mm256_unpacklo_epi32(a[2 * i], a[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(a[2 * i], a[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7: columns 0 | 4, 1 | 5, 2 | 6, 3 | 7
    u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    a[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
    a[c + 4] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
  }
}

// dst[d * stride + r] = src[r * src_stride + d] for rows r < n and columns d < m, E the element (strides in
// elements), in 8 x 8 blocks: each column's 8 rows one contiguous store. Returns the columns written (m rounded
// down to 8, every row of them; rows past the last whole 8 element by element), 0 for fewer than 8 rows.
template <typename E>
inline int64_t transpose8_blocks(E* dst, int64_t stride, const E* src, int64_t src_stride, int64_t n, int64_t m) {
  if (n < 8) return 0;
  const int64_t cols = m - m % 8, rows = n - n % 8;
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    for (int64_t d = 0; d < cols; d += 8) {
      if constexpr (sizeof(E) == 2) {
        __m128i a[8];
        for (int i = 0; i < 8; ++i) {
          a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (r0 + i) * src_stride + d));
        }
        transpose8_epi16(a);
        for (int i = 0; i < 8; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (d + i) * stride + r0), a[i]);
      } else {
        __m256i a[8];
        for (int i = 0; i < 8; ++i) {
          a[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (r0 + i) * src_stride + d));
        }
        transpose8_epi32(a);
        for (int i = 0; i < 8; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (d + i) * stride + r0), a[i]);
      }
    }
  }
  for (int64_t r = rows; r < n; ++r) {
    for (int64_t d = 0; d < cols; ++d) std::memcpy(dst + d * stride + r, src + r * src_stride + d, sizeof(E));
  }
  return cols;
}

// The tiled layouts' K transpose (isa.h cache_transpose): 16-bit columns (vec K of a bf16 / fp16 cache) and
// 32-bit ones (vec K of an fp32 cache; amx K's element pairs); 8-bit columns are left to cache.h's loop.
inline int64_t cache_transpose(int64_t elem, bool pair, void* dst, int64_t stride, const void* src,
                               int64_t src_stride, int64_t n, int64_t m, bool /*stream*/) {
  if (!pair && elem == 2) {
    return transpose8_blocks(static_cast<uint16_t*>(dst), stride, static_cast<const uint16_t*>(src), src_stride, n, m);
  }
  if (!pair && elem == 4) {
    return transpose8_blocks(static_cast<uint32_t*>(dst), stride, static_cast<const uint32_t*>(src), src_stride, n, m);
  }
  if (pair && elem == 2 && src_stride % 2 == 0) {  // a pair is one dword; pairs' strides in dwords
    return transpose8_blocks(static_cast<uint32_t*>(dst), stride, static_cast<const uint32_t*>(src), src_stride / 2,
                             n, m);
  }
  return 0;
}

// The amx V stores (isa.h): none here, cache.h's portable loops write them.
inline bool cache_amx_v_pair(int64_t, void*, const void*, const void*, int64_t, int64_t, bool) { return false; }
inline bool cache_amx_v_row(int64_t, void*, const void*, int64_t, int64_t, bool) { return false; }

// An FP8 cache row's bits (cache.h quantize_row_as), 8 lanes at a time: fp8_bits' sequence, lane by lane (the
// AVX-512 build's, with AVX2's signed compares: `a` has its sign cleared, so it compares as a non-negative int32;
// min/max keep a NaN operand, as the scalar clamp does). Returns how many values it wrote (a multiple of 8); the
// caller quantises the rest.
template <int kMant, int kBias, bool kTrunc, bool kMul>
inline int64_t quantize_fp8(const float* x, int64_t n, float scale, float bound, uint8_t* out) {
  constexpr int kShift = 23 - kMant;
  constexpr uint32_t kMinNormal = uint32_t(127 - kBias + 1) << 23;
  constexpr uint32_t kRebias = uint32_t(127 - kBias) << 23;
  const __m256 vs = _mm256_set1_ps(scale), hi = _mm256_set1_ps(bound), lo = _mm256_set1_ps(-bound);
  const __m256i sign_bit = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i min_normal = _mm256_set1_epi32(static_cast<int>(kMinNormal));
  const __m256i rebias = _mm256_set1_epi32(static_cast<int>(kRebias));
  const __m256i inf = _mm256_set1_epi32(0x7f800000), nan = _mm256_set1_epi32(0x7f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 y = _mm256_loadu_ps(x + i);
    y = kMul ? _mm256_mul_ps(y, vs) : _mm256_div_ps(y, vs);
    y = _mm256_max_ps(lo, _mm256_min_ps(hi, y));  // the second operand where either is NaN: y
    const __m256i bits = _mm256_castps_si256(y);
    const __m256i sign = _mm256_and_si256(bits, sign_bit);
    const __m256i a = _mm256_xor_si256(bits, sign);
    const __m256i small = _mm256_cmpgt_epi32(min_normal, a);
    __m256i r;
    if constexpr (kTrunc) {
      constexpr float kSteps = float(1 << (kBias - 1 + kMant));
      const __m256 scaled = _mm256_and_ps(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(kSteps)),
                                          _mm256_castsi256_ps(small));
      r = _mm256_blendv_epi8(_mm256_srli_epi32(_mm256_sub_epi32(a, rebias), kShift), _mm256_cvttps_epi32(scaled),
                             small);
    } else {
      const __m256i magic = _mm256_set1_epi32(static_cast<int>(uint32_t(127 - kBias + kShift + 1) << 23));
      const __m256i denorm = _mm256_sub_epi32(
          _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic))), magic);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, kShift), _mm256_set1_epi32(1));
      const __m256i normal = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_sub_epi32(a, rebias),
                           _mm256_add_epi32(_mm256_set1_epi32((1u << (kShift - 1)) - 1), odd)),
          kShift);
      r = _mm256_blendv_epi8(normal, denorm, small);
    }
    r = _mm256_blendv_epi8(r, nan, _mm256_cmpgt_epi32(a, inf));
    r = _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));  // every lane 0 .. 255: the packs below keep it
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packus_epi16(words, words));
  }
  return i;
}

}  // namespace isa
}  // namespace qkvfuse_cpu
