// The AVX-512 builds' bf16 / fp16 kernels (CPU_CAPABILITY_AVX512; selected by isa.h, adapted in avx512.h),
// shared by the split and add_rmsnorm.
//
// Values in natural order are kept 16 per __m512: a 16-bit block widens exactly with one instruction pair and
// rounds back with one conversion. The natural-order heads (heads_impl: fp16, and bf16 where the rotary pairs do
// not fill lane-order blocks) and the fp16 rows compute the generic kernel's arithmetic sequence (same operations,
// same order, same reduction tree as at::vec::vec_reduce_all), so their bits are the generic path's for every
// input whose outputs are not NaN (a NaN stays a NaN; its payload may differ). What they save is the generic
// path's per-head overheads: one head's reduction, square root and division at a time, staging through ATen's
// converters, a call per head.
// The bf16 heads and rows in lane order (below) take the same operations per element, but sum a head's or row's
// squares over even/odd lanes: another fp32 summation order, so a normed bf16 output is within one ulp of the
// generic one (without a norm, and the rounded residual sum, bit for bit).
//
// bf16 rounding is to nearest even with denormals kept (torch's `.to(torch.bfloat16)`). With AVX512-BF16
// (QKVFUSE_AVX512_BF16: the AVX512_BF16 capability) it is one VCVTNEPS2BF16, which flushes denormal inputs to
// zero: a block holding a denormal (one VFPCLASSPS test) takes ATen's integer rounding instead.
// In lane order (below) the same holds for VCVTNE2PS2BF16 (round_lanes) and the integer pack_rne.
#pragma once

#include "../vec_io.h"

#include <immintrin.h>

namespace qkvfuse_cpu {
namespace avx512 {

template <typename T>
struct Block;

template <>
struct Block<c10::BFloat16> {
  static __m512 widen(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
  static __m512 load(const c10::BFloat16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static __m256i round(__m512 v) {
#if defined(QKVFUSE_AVX512_BF16)
    if (_mm512_fpclass_ps_mask(v, 0x20) == 0) return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#endif
    return at::vec::cvtfp32_bf16(v);
  }
};

template <>
struct Block<c10::Half> {
  static __m512 widen(__m256i bits) { return _mm512_cvtph_ps(bits); }
  static __m512 load(const c10::Half* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static __m256i round(__m512 v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
};

template <typename T, bool kStream = false>
inline void store(T* p, __m512 v) {
  const __m256i bits = Block<T>::round(v);
  if constexpr (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bits);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
  }
}

template <typename T>
inline void store(T* p, __m512 v, bool stream) {
  stream ? store<T, true>(p, v) : store<T, false>(p, v);
}

// Every lane: the sum of v's lanes in at::vec::vec_reduce_all's tree (an XOR butterfly, so all lanes agree).
inline __m512 sum_all_lanes(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
  return _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
}

// 1 / sqrt(ss / n + eps) per lane: the generic bf16/fp16 inv_rms, with the same correctly rounded operations.
inline __m512 inv_rms(__m512 ss, int64_t n, float eps) {
  const __m512 mean = _mm512_div_ps(ss, _mm512_set1_ps(static_cast<float>(n)));
  return _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_sqrt_ps(_mm512_add_ps(mean, _mm512_set1_ps(eps))));
}

// ------------------------------------------------------------------------------------------------------
// bf16 in "lane order" (the AVX2 kernels' idea at 512 bits): a block of 32 bf16 is one load; its even elements
// widen as bits << 16 and its odd ones as bits & 0xffff0000 (no shuffle), and round_lanes writes both back in
// memory order. Tables used with such blocks (weights, cos/sin) are kept in the same order (to_lanes).
// ------------------------------------------------------------------------------------------------------
struct Lanes {
  __m512 even, odd;
  static Lanes of(__m512i raw) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
  static Lanes load(const c10::BFloat16* p) { return of(_mm512_loadu_si512(p)); }
};

// 32 values rounded to nearest even, in memory order (even's words low, odd's high), with integer operations
// only: per 16-bit word, the truncated value hi rounds up iff avg_epu16(lo, 0x7ffe | lsb(hi)) has its top bit
// set (Bf16Block::pack_rne's argument). Exact for denormals, infinities and every NaN a kernel computes (their
// quiet bit keeps them NaN); only a signalling NaN with a low payload could round into an infinity, and none
// reaches a store without passing through an arithmetic operation, which quiets it.
inline __m512i pack_rne(__m512 even, __m512 odd) {
  const __m512i e = _mm512_castps_si512(even), o = _mm512_castps_si512(odd);
  const __m512i hi = _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(e, 16), o);
  const __m512i lo = _mm512_mask_blend_epi16(0xAAAAAAAAu, e, _mm512_slli_epi32(o, 16));
  const __m512i k = _mm512_ternarylogic_epi32(hi, _mm512_set1_epi16(1), _mm512_set1_epi16(0x7ffe), 0xEA);  // (hi & 1) | 0x7ffe
  return _mm512_add_epi16(hi, _mm512_srli_epi16(_mm512_avg_epu16(lo, k), 15));
}

// pack_rne's result, with AVX512-BF16 (QKVFUSE_AVX512_BF16) from one VCVTNE2PS2BF16 (even's values in the low
// half, odd's in the high) and a word permutation back to memory order. The conversion flushes denormal inputs
// to zero, so a block holding one (two VFPCLASSPS tests) takes pack_rne; a NaN stays a NaN either way.
inline __m512i round_lanes(__m512 even, __m512 odd) {
#if defined(QKVFUSE_AVX512_BF16)
  if ((_mm512_fpclass_ps_mask(even, 0x20) | _mm512_fpclass_ps_mask(odd, 0x20)) == 0) {
    const __m512i to_memory = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                               6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(to_memory, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even)));
  }
#endif
  return pack_rne(even, odd);
}

// fp32 weights in lane order (n a multiple of 32).
inline void to_lanes(const float* src, float* dst, int64_t n) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t i = 0; i < n; i += 32) {
    const __m512 a = _mm512_loadu_ps(src + i), b = _mm512_loadu_ps(src + i + 16);
    _mm512_storeu_ps(dst + i, _mm512_permutex2var_ps(a, even, b));
    _mm512_storeu_ps(dst + i + 16, _mm512_permutex2var_ps(a, odd, b));
  }
}

// ------------------------------------------------------------------------------------------------------
// split: up to kMaxBatch consecutive Q (or K) heads of one token, src_stride values apart in src (D; 2 * D for
// the gated layout's Q heads) and D apart in dst.
// ------------------------------------------------------------------------------------------------------
struct HeadTables {  // one token's, for one weight set
  const float* w;     // norm weight (fp32, D values) or nullptr
  const float* b;     // post-norm bias or nullptr
  const float* cos;   // half values (NeoX)
  const float* sin;
  const float* cos2;  // GPT-J: 2 * half values, [c0, c0, c1, c1, ...] and [-s0, s0, -s1, s1, ...]
  const float* sin2;
};

constexpr int64_t kMaxBatch = 16;

// Heads per batch for head_dim D: the staging buffer stays at 8 KB (16 heads of 128 dims).
inline int64_t batch_heads(int64_t D) { return std::max<int64_t>(1, std::min(kMaxBatch, 2048 / D)); }

// Whether the specialised heads take this geometry: whole 32-value blocks per head (the generic loops then
// have no scalar tail) and whole 16-value blocks of rotary pairs.
inline bool takes_heads(int64_t D, int64_t half) { return D % 32 == 0 && half % 16 == 0 && D <= kMaxHeadDim; }

// kNorm: 0 no QK-norm, 1 weight, 2 weight and bias (the generic qk_head's template argument).
// kStream: non-temporal stores. The tables are copied into a local first: the stores (through may-alias vector
// types) would otherwise make the compiler reload every table pointer after each one.
template <typename T, int kNorm, bool kNeox, bool kStream>
QKVFUSE_FLATTEN void heads_impl(const T* src, int64_t src_stride, T* dst, int64_t n, int64_t D, int64_t half,
                                float eps, const HeadTables& tables) {
  const HeadTables t = tables;
  constexpr bool stream = kStream;
  alignas(64) float staged[2048];
  __m512 inv = _mm512_set1_ps(1.f);
  if constexpr (kNorm > 0) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; ++k) {
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      const T* x = src + k * src_stride;
      float* s = staged + k * D;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512 a = Block<T>::load(x + d), c = Block<T>::load(x + d + 16);
        _mm512_store_ps(s + d, a);
        _mm512_store_ps(s + d + 16, c);
        acc0 = _mm512_fmadd_ps(a, a, acc0);
        acc1 = _mm512_fmadd_ps(c, c, acc1);
      }
      ss = _mm512_mask_mov_ps(ss, static_cast<__mmask16>(1u << k), sum_all_lanes(_mm512_add_ps(acc0, acc1)));
    }
    inv = inv_rms(ss, D, eps);
  }
  alignas(64) float inv_k[kMaxBatch];
  _mm512_store_ps(inv_k, inv);
  for (int64_t k = 0; k < n; ++k) {
    const float* s = staged + k * D;
    const T* x = src + k * src_stride;
    T* y = dst + k * D;
    if constexpr (kNorm == 0) {  // no first pass: the requests are made here
      for (int64_t d = 0; d < D; d += 32) prefetch_ahead(x + d);
    } else {
      request_next_batch(x, n, src_stride * int64_t(sizeof(T)), D * int64_t(sizeof(T)));
    }
    const __m512 vinv = _mm512_set1_ps(inv_k[k]);
    auto norm = [&](int64_t i) {
      if constexpr (kNorm == 0) {
        return Block<T>::load(x + i);
      } else {
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(s + i), vinv), _mm512_loadu_ps(t.w + i));
        if constexpr (kNorm > 1) v = _mm512_add_ps(v, _mm512_loadu_ps(t.b + i));
        return v;
      }
    };
    if constexpr (kNeox) {
      for (int64_t j = 0; j < half; j += 16) {
        const __m512 a = norm(j), b = norm(half + j);
        const __m512 c = _mm512_loadu_ps(t.cos + j), sn = _mm512_loadu_ps(t.sin + j);
        store<T>(y + j, _mm512_fmsub_ps(a, c, _mm512_mul_ps(b, sn)), stream);
        store<T>(y + half + j, _mm512_fmadd_ps(b, c, _mm512_mul_ps(a, sn)), stream);
      }
    } else {
      // GPT-J pairs (2j, 2j + 1) share a block: out = v * cos2 + swap(v) * sin2, lane for lane the generic
      // fmsub(a, c, b * s) / fmadd(b, c, a * s) (negating a product is exact).
      for (int64_t i = 0; i < 2 * half; i += 16) {
        const __m512 v = norm(i);
        const __m512 swapped = _mm512_permute_ps(v, 0xB1);
        store<T>(y + i, _mm512_fmadd_ps(v, _mm512_loadu_ps(t.cos2 + i),
                                        _mm512_mul_ps(swapped, _mm512_loadu_ps(t.sin2 + i))), stream);
      }
    }
    for (int64_t i = 2 * half; i < D; i += 16) store<T>(y + i, norm(i), stream);
  }
}

template <typename T, int kNorm, bool kNeox>
void heads(const T* src, int64_t src_stride, T* dst, int64_t n, int64_t D, int64_t half, float eps,
           const HeadTables& t, bool stream) {
  stream ? heads_impl<T, kNorm, kNeox, true>(src, src_stride, dst, n, D, half, eps, t)
         : heads_impl<T, kNorm, kNeox, false>(src, src_stride, dst, n, D, half, eps, t);
}

template <typename T>
using HeadsFn = void (*)(const T*, int64_t, T*, int64_t, int64_t, int64_t, float, const HeadTables&, bool);

template <typename T, int kNorm>
HeadsFn<T> pick_style(bool neox) {
  return neox ? &heads<T, kNorm, true> : &heads<T, kNorm, false>;
}

template <typename T>
HeadsFn<T> pick_heads(int64_t D, int64_t half, int norm_mode, bool neox) {
  if constexpr (std::is_same_v<T, float>) {
    return nullptr;
  } else {
    if (!takes_heads(D, half)) return nullptr;
    return norm_mode == 0 ? pick_style<T, 0>(neox) : norm_mode == 1 ? pick_style<T, 1>(neox) : pick_style<T, 2>(neox);
  }
}

// GPT-J tables of one token: cos/sin of each pair repeated over its two lanes, the sine negated on the first.
inline void gptj_tables(const float* cos, const float* sin, int64_t half, float* cos2, float* sin2) {
  for (int64_t j = 0; j < half; ++j) {
    cos2[2 * j] = cos2[2 * j + 1] = cos[j];
    sin2[2 * j] = -sin[j];
    sin2[2 * j + 1] = sin[j];
  }
}

// bf16 heads in lane order (takes_lane_heads): the same operations per element as heads(), from lane-order
// tables (HeadTables' w and b, and for NeoX cos and sin, through to_lanes; GPT-J pairs sit in one block's
// even/odd lanes and read cos/sin as they are). No staging: a head is re-read (from L1) after the batch's sums,
// each block before its own outputs are written, so the in-place form is safe. The sums of squares run over
// even/odd lanes (another fp32 summation order than the generic head's); without QK-norm every bit is the
// generic head's.
inline bool takes_lane_heads(int64_t D, int64_t half, bool neox) {
  return D % 32 == 0 && D <= kMaxHeadDim && half % (neox ? 32 : 16) == 0;
}

// kPack: round with the integer pack_rne rather than round_lanes (the same bits). The normed heads take it: their
// multiplies keep the FP pipes busy, and the conversion's two denormal tests, mask moves and word permutation cost
// more than the integer rounding. Without QK-norm the conversion is the faster (bench/ has both).
template <bool kPack>
inline void store_lanes(c10::BFloat16* p, __m512 even, __m512 odd, bool stream) {
  const __m512i bits = kPack ? pack_rne(even, odd) : round_lanes(even, odd);
  if (stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_castsi512_si256(bits));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p + 16), _mm512_extracti64x4_epi64(bits, 1));
  } else {
    _mm512_storeu_si512(p, bits);
  }
}

template <int kNorm, bool kNeox, bool kStream>
QKVFUSE_FLATTEN void lane_heads_impl(const c10::BFloat16* src, int64_t src_stride, c10::BFloat16* dst, int64_t n,
                                     int64_t D, int64_t half, float eps, const HeadTables& tables) {
  using bf16 = c10::BFloat16;
  const HeadTables t = tables;  // as in heads_impl
  constexpr bool stream = kStream;
  constexpr bool kPack = kNorm > 0;  // store_lanes' rounding
  __m512 inv = _mm512_set1_ps(1.f);
  if constexpr (kNorm > 0) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; ++k) {
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 32) {
        const Lanes x = Lanes::load(src + k * src_stride + d);
        acc0 = _mm512_fmadd_ps(x.even, x.even, acc0);
        acc1 = _mm512_fmadd_ps(x.odd, x.odd, acc1);
      }
      ss = _mm512_mask_mov_ps(ss, static_cast<__mmask16>(1u << k), sum_all_lanes(_mm512_add_ps(acc0, acc1)));
    }
    inv = inv_rms(ss, D, eps);
  }
  alignas(64) float inv_k[kMaxBatch];
  _mm512_store_ps(inv_k, inv);
  for (int64_t k = 0; k < n; ++k) {
    const bf16* x = src + k * src_stride;
    bf16* y = dst + k * D;
    if constexpr (kNorm == 0) {  // no first pass: the requests are made here
      for (int64_t d = 0; d < D; d += 32) prefetch_ahead(x + d);
    } else {
      request_next_batch(x, n, src_stride * int64_t(sizeof(bf16)), D * int64_t(sizeof(bf16)));
    }
    const __m512 vinv = _mm512_set1_ps(inv_k[k]);
    auto norm = [&](int64_t i) {
      Lanes v = Lanes::load(x + i);
      if constexpr (kNorm > 0) {
        v.even = _mm512_mul_ps(_mm512_mul_ps(v.even, vinv), _mm512_loadu_ps(t.w + i));
        v.odd = _mm512_mul_ps(_mm512_mul_ps(v.odd, vinv), _mm512_loadu_ps(t.w + i + 16));
      }
      if constexpr (kNorm > 1) {
        v.even = _mm512_add_ps(v.even, _mm512_loadu_ps(t.b + i));
        v.odd = _mm512_add_ps(v.odd, _mm512_loadu_ps(t.b + i + 16));
      }
      return v;
    };
    if constexpr (kNeox) {
      for (int64_t j = 0; j < half; j += 32) {
        const Lanes a = norm(j), b = norm(half + j);
        const __m512 c0 = _mm512_loadu_ps(t.cos + j), c1 = _mm512_loadu_ps(t.cos + j + 16);
        const __m512 s0 = _mm512_loadu_ps(t.sin + j), s1 = _mm512_loadu_ps(t.sin + j + 16);
        store_lanes<kPack>(y + j, _mm512_fmsub_ps(a.even, c0, _mm512_mul_ps(b.even, s0)),
                           _mm512_fmsub_ps(a.odd, c1, _mm512_mul_ps(b.odd, s1)), stream);
        store_lanes<kPack>(y + half + j, _mm512_fmadd_ps(b.even, c0, _mm512_mul_ps(a.even, s0)),
                           _mm512_fmadd_ps(b.odd, c1, _mm512_mul_ps(a.odd, s1)), stream);
      }
    } else {
      for (int64_t i = 0; i < 2 * half; i += 32) {
        const Lanes v = norm(i);  // pair i / 2 + l: even lane l and odd lane l
        const __m512 c = _mm512_loadu_ps(t.cos + i / 2), sn = _mm512_loadu_ps(t.sin + i / 2);
        store_lanes<kPack>(y + i, _mm512_fmsub_ps(v.even, c, _mm512_mul_ps(v.odd, sn)),
                           _mm512_fmadd_ps(v.odd, c, _mm512_mul_ps(v.even, sn)), stream);
      }
    }
    for (int64_t i = 2 * half; i < D; i += 32) {
      if constexpr (kNorm == 0) {  // widening and rounding back is the identity on bf16 values: copy the bits
        const __m512i raw = _mm512_loadu_si512(x + i);
        if (stream) {
          _mm256_stream_si256(reinterpret_cast<__m256i*>(y + i), _mm512_castsi512_si256(raw));
          _mm256_stream_si256(reinterpret_cast<__m256i*>(y + i + 16), _mm512_extracti64x4_epi64(raw, 1));
        } else {
          _mm512_storeu_si512(y + i, raw);
        }
      } else {
        const Lanes v = norm(i);
        store_lanes<kPack>(y + i, v.even, v.odd, stream);
      }
    }
  }
}

template <int kNorm, bool kNeox>
void lane_heads(const c10::BFloat16* src, int64_t src_stride, c10::BFloat16* dst, int64_t n, int64_t D, int64_t half,
                float eps, const HeadTables& t, bool stream) {
  stream ? lane_heads_impl<kNorm, kNeox, true>(src, src_stride, dst, n, D, half, eps, t)
         : lane_heads_impl<kNorm, kNeox, false>(src, src_stride, dst, n, D, half, eps, t);
}

inline HeadsFn<c10::BFloat16> pick_lane_heads(int64_t D, int64_t half, int norm_mode, bool neox) {
  if (!takes_lane_heads(D, half, neox)) return nullptr;
  if (neox) {
    return norm_mode == 0 ? &lane_heads<0, true> : norm_mode == 1 ? &lane_heads<1, true> : &lane_heads<2, true>;
  }
  return norm_mode == 0 ? &lane_heads<0, false> : norm_mode == 1 ? &lane_heads<1, false> : &lane_heads<2, false>;
}

// ------------------------------------------------------------------------------------------------------
// add_rmsnorm, bf16: rows of whole 32-value blocks in lane order. The weights are read the same way (bf16) or
// from a lane-order fp32 copy, so every element meets its own weight. s = x + residual is rounded once (the unfused
// add's bits), y = (s * inv) * w (+ b) rounded once -- the generic row's operations; only the sum of squares
// runs over even/odd lanes instead of 16-value halves (another fp32 summation order).
// ------------------------------------------------------------------------------------------------------
// W: c10::BFloat16 (read as stored) or float (a lane-order copy: to_lanes).
template <typename W>
inline Lanes weight_lanes(const W* p) {
  if constexpr (std::is_same_v<W, float>) {
    return {_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)};
  } else {
    return Lanes::load(p);
  }
}

// The normalising pass of a row with bias b (or none): ahead_of_stores over load(i, bias) and step(i, v, bias),
// bias a std::bool_constant saying whether b is given. The pass is compiled for each, so the bias-free one keeps
// its registers for four blocks loaded ahead (two with a bias).
template <int64_t kBlock, typename V, typename Load, typename Step>
inline void normalising_pass(int64_t H, const void* b, const Load& load, const Step& step) {
  auto run = [&](auto bias) {
    ahead_of_stores<kBlock, decltype(bias)::value ? 2 : 4, V>(
        H, [&](int64_t i) { return load(i, bias); }, [&](int64_t i, const V& v) { step(i, v, bias); });
  };
  if (b != nullptr) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}

// One add+RMSNorm row: the rounded sum over r_out (when r is given), then y. Each pass loads everything it reads
// a group of blocks ahead of its stores (ahead_of_stores): r_out may lie just past x, y just past r_out or w, modulo
// 4 KiB, and the weights are loaded ahead too (loading them in the step made some placements wait on 4 KiB aliasing).
template <typename W>
QKVFUSE_FLATTEN void norm_row_bf16(const c10::BFloat16* x, const c10::BFloat16* r, c10::BFloat16* r_out,
                                   c10::BFloat16* y, const W* w, const W* b, int64_t H, float eps) {
  struct XR {
    __m512i x, r;
  };
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  ahead_of_stores<32, 4, XR>(
      H, [&](int64_t d) { return XR{_mm512_loadu_si512(x + d), r != nullptr ? _mm512_loadu_si512(r + d) : __m512i{}}; },
      [&](int64_t d, const XR& v) {
        Lanes s = Lanes::of(v.x);
        if (r != nullptr) {
          const Lanes a = Lanes::of(v.r);
          const __m512i packed = round_lanes(_mm512_add_ps(s.even, a.even), _mm512_add_ps(s.odd, a.odd));
          _mm512_storeu_si512(r_out + d, packed);
          s = Lanes::of(packed);  // the rounded sum, as stored
        }
        acc0 = _mm512_fmadd_ps(s.even, s.even, acc0);
        acc1 = _mm512_fmadd_ps(s.odd, s.odd, acc1);
      });
  const __m512 inv = inv_rms(sum_all_lanes(_mm512_add_ps(acc0, acc1)), H, eps);
  const c10::BFloat16* src = r != nullptr ? r_out : x;  // re-read after its own block is written: aliasing is safe
  struct SWB {
    __m512i s;
    Lanes w, b;
  };
  normalising_pass<32, SWB>(
      H, b,
      [&](int64_t i, auto bias) {
        return SWB{_mm512_loadu_si512(src + i), weight_lanes(w + i), bias ? weight_lanes(b + i) : Lanes{}};
      },
      [&](int64_t i, const SWB& v, auto bias) {
        const Lanes s = Lanes::of(v.s);
        __m512 even = _mm512_mul_ps(_mm512_mul_ps(s.even, inv), v.w.even);
        __m512 odd = _mm512_mul_ps(_mm512_mul_ps(s.odd, inv), v.w.odd);
        if constexpr (decltype(bias)::value) {
          even = _mm512_add_ps(even, v.b.even);
          odd = _mm512_add_ps(odd, v.b.odd);
        }
        _mm512_storeu_si512(y + i, round_lanes(even, odd));
      });
}

// fp16 rows (natural order; the widening is one conversion either way): the generic row's sequence and bits,
// everything a pass reads loaded ahead of its stores, as in the bf16 rows.
template <typename W>
QKVFUSE_FLATTEN void norm_row_fp16(const c10::Half* x, const c10::Half* r, c10::Half* r_out, c10::Half* y,
                                   const W* w, const W* b, int64_t H, float eps) {
  using T = c10::Half;
  auto weight = [](const W* p) {
    if constexpr (std::is_same_v<W, float>) {
      return _mm512_loadu_ps(p);
    } else {
      return Block<T>::load(p);
    }
  };
  struct XR {
    __m512i x, r;
  };
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  ahead_of_stores<32, 4, XR>(
      H, [&](int64_t d) { return XR{_mm512_loadu_si512(x + d), r != nullptr ? _mm512_loadu_si512(r + d) : __m512i{}}; },
      [&](int64_t d, const XR& v) {
        __m512 a = Block<T>::widen(_mm512_castsi512_si256(v.x)), c = Block<T>::widen(_mm512_extracti64x4_epi64(v.x, 1));
        if (r != nullptr) {
          const __m256i sa = Block<T>::round(_mm512_add_ps(a, Block<T>::widen(_mm512_castsi512_si256(v.r))));
          const __m256i sc = Block<T>::round(_mm512_add_ps(c, Block<T>::widen(_mm512_extracti64x4_epi64(v.r, 1))));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(r_out + d), sa);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(r_out + d + 16), sc);
          a = Block<T>::widen(sa);
          c = Block<T>::widen(sc);
        }
        acc0 = _mm512_fmadd_ps(a, a, acc0);
        acc1 = _mm512_fmadd_ps(c, c, acc1);
      });
  const __m512 inv = inv_rms(sum_all_lanes(_mm512_add_ps(acc0, acc1)), H, eps);
  const T* s = r != nullptr ? r_out : x;
  struct SWB {
    __m256i s;
    __m512 w, b;
  };
  normalising_pass<16, SWB>(
      H, b,
      [&](int64_t i, auto bias) {
        return SWB{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)), weight(w + i),
                   bias ? weight(b + i) : __m512{}};
      },
      [&](int64_t i, const SWB& v, auto bias) {
        __m512 out = _mm512_mul_ps(_mm512_mul_ps(Block<T>::widen(v.s), inv), v.w);
        if constexpr (decltype(bias)::value) out = _mm512_add_ps(out, v.b);
        store<T>(y + i, out);
      });
}

}  // namespace avx512
}  // namespace qkvfuse_cpu
