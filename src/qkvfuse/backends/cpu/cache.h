// The cache-writing split's store: one token's K or V head row into a paged KV cache (layouts and codes:
// qkvfuse/_cache_mode.py; the definition: qkvfuse/reference.py write_cache, quantize). The driver
// (split_qkv_rmsnorm_rope.cpp, run_split) calls it right after a token's K heads are written, while they are hot,
// and for the token's V heads as one more work item of the same pass.
//
// A cache of qkv's dtype gets the bits qkv gets (a row copy of the K just written, of V as it is). An FP8 cache
// gets each value quantised once from fp32: y = x / scale (nearest) or x * (1 / scale) (truncate), saturated to
// the format's finite range (NaN stays NaN), then rounded to nearest even (c10's conversion, whose constants
// fp8_bits repeats) or truncated toward zero -- reference.quantize's result for the same fp32 input.
#pragma once

#include "cache_mode.h"
#include "isa.h"
#include "vec_io.h"

#include <c10/util/bit_cast.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace qkvfuse_cpu {


// One cache tensor: its base and element strides (block, offset in block, head, dim) -- for "vec" and "amx" only
// block and head (the region base; the region's own index map is fixed).
struct CacheSide {
  char* base;
  int64_t sb, so, sh, sd;
  float scale;  // FP8: the divisor (nearest) or its reciprocal (truncate)
};

enum class Fp8 { None, E4M3, E5M2 };

struct CachePlan {
  int64_t layout;
  bool truncate;
  Fp8 fp8;
  int64_t elem;  // bytes per cache element
  bool stream;   // contiguous rows (and whole lines of the tiled layouts) written with non-temporal stores
                 // (isa::stream_cache_rows)
  int64_t block_size;
  CacheSide k, v;
  const void* slots;
  bool slots64;
  int64_t slot_stride, n_slots;
  // later[t]: a later token has token t's slot, so t is not written (the last token wins, as in a serial write);
  // nullptr when no slot repeats.
  const uint8_t* later;

  // Token t's slot, or -1 when it is not written.
  int64_t slot(int64_t t) const {
    if (t >= n_slots || (later != nullptr && later[t])) return -1;
    return slots64 ? static_cast<const int64_t*>(slots)[t * slot_stride]
                   : static_cast<const int32_t*>(slots)[t * slot_stride];
  }
};

// fp32 -> FP8 bits for |y| <= the format's max or NaN (the value saturated first): c10's round-to-nearest-even
// conversion (fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value) without its overflow branch, or truncation
// toward zero (reference.quantize: the rounded value one step toward zero where it rounded away from it).
// Branch-free, so a row's loop vectorises. kMant mantissa bits, exponent bias kBias.
template <int kMant, int kBias, bool kTrunc>
inline uint8_t fp8_bits(float y) {
  constexpr int kShift = 23 - kMant;
  constexpr uint32_t kMinNormal = uint32_t(127 - kBias + 1) << 23;
  constexpr uint32_t kRebias = uint32_t(127 - kBias) << 23;
  const uint32_t bits = c10::bit_cast<uint32_t>(y);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t a = bits ^ sign;
  const bool small = a < kMinNormal;
  uint32_t r;
  if constexpr (kTrunc) {
    // Below the smallest normal the format's step is 2^-(kBias - 1 + kMant): y scaled by its inverse (exact) and
    // truncated counts the steps.
    constexpr float kSteps = float(1 << (kBias - 1 + kMant));
    const float scaled = (small ? c10::bit_cast<float>(a) : 0.f) * kSteps;
    r = small ? static_cast<uint32_t>(scaled) : (a - kRebias) >> kShift;
  } else {
    constexpr uint32_t kDenormMagic = uint32_t(127 - kBias + kShift + 1) << 23;
    const uint32_t denorm =
        c10::bit_cast<uint32_t>(c10::bit_cast<float>(a) + c10::bit_cast<float>(kDenormMagic)) - kDenormMagic;
    const uint32_t normal = (a - kRebias + ((1u << (kShift - 1)) - 1) + ((a >> kShift) & 1)) >> kShift;
    r = small ? denorm : normal;
  }
  r = a > 0x7f800000u ? 0x7fu : r;  // NaN
  return static_cast<uint8_t>(r | (sign >> 24));
}

// kMul: y = x * scale (the truncating rule's reciprocal, or the nearest rule's divisor inverted where that is exact).
template <int kMant, int kBias, bool kTrunc, bool kMul>
inline void quantize_row_as(const float* x, int64_t n, float scale, float bound, uint8_t* out) {
  for (int64_t i = isa::quantize_fp8<kMant, kBias, kTrunc, kMul>(x, n, scale, bound, out); i < n; ++i) {
    float y = kMul ? x[i] * scale : x[i] / scale;
    y = y > bound ? bound : (y < -bound ? -bound : y);  // NaN stays NaN (torch.clamp)
    out[i] = fp8_bits<kMant, kBias, kTrunc>(y);
  }
}

// A normal power of two whose reciprocal is one too (1 / 2^k exact): x / s == x * (1 / s) for every x, each the
// correctly rounded value of the same real number -- the division (the rows' bottleneck) becomes a multiply.
inline bool exact_reciprocal(float s) {
  const uint32_t b = c10::bit_cast<uint32_t>(s);
  const uint32_t e = (b >> 23) & 0xff;
  return (b & 0x807fffffu) == 0 && e >= 2 && e <= 252;
}

template <int kMant, int kBias>
inline void quantize_row_in(bool truncate, const float* x, int64_t n, float scale, float bound, uint8_t* out) {
  if (truncate) return quantize_row_as<kMant, kBias, true, true>(x, n, scale, bound, out);
  if (exact_reciprocal(scale)) return quantize_row_as<kMant, kBias, false, true>(x, n, 1.f / scale, bound, out);
  quantize_row_as<kMant, kBias, false, false>(x, n, scale, bound, out);
}

inline void quantize_row(const CachePlan& c, const float* x, int64_t n, float scale, uint8_t* out) {
  if (c.fp8 == Fp8::E4M3) {
    quantize_row_in<3, 7>(c.truncate, x, n, scale, 448.f, out);
  } else {
    quantize_row_in<2, 15>(c.truncate, x, n, scale, 57344.f, out);
  }
}

// One head row (D elements of U, the cache element's bits) to (block, off, head) of one cache side, by the layout's
// index map (reference._store); a contiguous row goes through copy(dst, src, bytes).
template <typename U, typename Copy>
inline void store_row(const CacheSide& s, int64_t layout, bool is_key, int64_t block_size, int64_t D, int64_t block,
                      int64_t off, int64_t head, const U* src, const Copy& copy) {
  U* base = reinterpret_cast<U*>(s.base);
  if (layout == kNHD || layout == kHND) {
    U* dst = base + block * s.sb + off * s.so + head * s.sh;
    if (s.sd == 1) {
      copy(dst, src, static_cast<size_t>(D) * sizeof(U));
    } else {
      for (int64_t d = 0; d < D; ++d) dst[d * s.sd] = src[d];
    }
    return;
  }
  U* region = base + block * s.sb + head * s.sh;  // block_size * D contiguous elements
  if (layout == kVec) {
    if (is_key) {  // K transposed, [D, block_size]
      U* dst = region + off;
      for (int64_t d = 0; d < D; ++d) dst[d * block_size] = src[d];
    } else {  // V as [block_size, D]
      copy(region + off * D, src, static_cast<size_t>(D) * sizeof(U));
    }
  } else if (is_key) {  // amx K: [block_size / 16, D / 2, 16, 2], a token's dim pairs 32 elements apart
    U* dst = region + (off / 16) * 16 * D + (off % 16) * 2;
    for (int64_t d = 0; d < D; d += 2) std::memcpy(dst + d * 16, src + d, 2 * sizeof(U));
  } else {  // amx V: [D / 16, block_size / 2, 16, 2], a token's dims 2 apart in groups of 16
    U* dst = region + (off / 2) * 32 + off % 2;
    for (int64_t g = 0; g < D; g += 16) {
      U* group = dst + g * block_size;
      for (int64_t i = 0; i < 16; ++i) group[2 * i] = src[g + i];
    }
  }
}

// The tiled layouts' transposes: dst[d * stride + r] = src[r * src_stride + d] for n rows of m elements (kPair:
// pairs of elements, dst[(d * stride + r) * 2 + e] = src[r * src_stride + 2 * d + e], m pairs). The rows are ones
// the split just wrote (hot); each destination run of n elements is contiguous, so a block's tile of K is written
// line by line instead of one element per line per token.
template <bool kPair, typename U>
inline void transpose_rows(U* dst, int64_t stride, const U* src, int64_t src_stride, int64_t n, int64_t m,
                           bool stream) {
  constexpr int64_t kW = kPair ? 2 : 1;
  for (int64_t r0 = 0; r0 < n; r0 += 16) {  // the ISA's transpose takes up to 16 rows
    const int64_t rows = std::min<int64_t>(16, n - r0);
    U* tile = dst + r0 * kW;
    const U* first = src + r0 * src_stride;
    int64_t d = isa::cache_transpose(sizeof(U), kPair, tile, stride, first, src_stride, rows, m, stream);
    for (; d < m; ++d) {
      U* out = tile + d * stride * kW;
      const U* in = first + d * kW;
      for (int64_t r = 0; r < rows; ++r) {
        out[r * kW] = in[r * src_stride];
        if constexpr (kPair) out[r * kW + 1] = in[r * src_stride + 1];
      }
    }
  }
}

// Tokens 0 .. n - 1 of a batch (slots[i]: token i's slot, or -1), each with hkv head rows of D elements at
// src + i * tok_stride + h * D, into one side of a "vec" or "amx" cache. Consecutive tokens with consecutive slots
// in one block (one 16-token tile for amx K) are one run, written per head and dimension as contiguous runs.
// Distinct tokens never share a slot here (CachePlan::later), so the order of the writes does not matter.
template <typename U, typename Copy>
inline void store_tokens_tiled(const CachePlan& c, const CacheSide& s, bool is_key, int64_t hkv, int64_t D,
                               const int64_t* slots, int64_t n, const U* src, int64_t tok_stride, const Copy& copy) {
  U* base = reinterpret_cast<U*>(s.base);
  const int64_t bs = c.block_size;
  const bool amx = c.layout == kAmx;
  for (int64_t i = 0; i < n;) {
    if (slots[i] < 0) {
      ++i;
      continue;
    }
    const int64_t block = slots[i] / bs, off = slots[i] % bs;
    const int64_t room = amx && is_key ? 16 - off % 16 : bs - off;  // the run stays in its block (amx K: tile)
    int64_t j = i + 1;
    while (j < n && j - i < room && slots[j] == slots[i] + (j - i)) ++j;
    const int64_t len = j - i;
    for (int64_t h = 0; h < hkv; ++h) {
      U* region = base + block * s.sb + h * s.sh;
      const U* rows = src + i * tok_stride + h * D;
      if (!amx) {
        if (is_key) {  // K transposed, [D, block_size]
          transpose_rows<false>(region + off, bs, rows, tok_stride, len, D, c.stream);
        } else {  // V as [block_size, D]
          for (int64_t r = 0; r < len; ++r) {
            copy(region + (off + r) * D, rows + r * tok_stride, static_cast<size_t>(D) * sizeof(U));
          }
        }
      } else if (is_key) {  // amx K: [block_size / 16, D / 2, 16, 2]
        transpose_rows<true>(region + (off / 16) * 16 * D + (off % 16) * 2, 16, rows, tok_stride, len, D / 2,
                             c.stream);
      } else {  // amx V: [D / 16, block_size / 2, 16, 2]: a token pair's dims interleaved, 16 at a time
        for (int64_t r = 0; r < len; ++r) {
          const int64_t o = off + r;
          U* dst = region + (o / 2) * 32 + o % 2;
          const U* row = rows + r * tok_stride;
          if (o % 2 == 0 && r + 1 < len &&
              isa::cache_amx_v_pair(sizeof(U), dst, row, row + tok_stride, D, bs, c.stream)) {
            ++r;  // the pair's odd token too
            continue;
          }
          if (isa::cache_amx_v_row(sizeof(U), dst, row, D, bs, o % 2 != 0)) continue;
          for (int64_t g = 0; g < D; g += 16) {
            U* group = dst + g * bs;
            for (int64_t e = 0; e < 16; ++e) group[2 * e] = row[g + e];
          }
        }
      }
    }
    i = j;
  }
}

// A row of cache elements (elem bytes each) from its bits.
template <typename Copy>
inline void store_row_bytes(const CachePlan& c, const CacheSide& s, bool is_key, int64_t D, int64_t slot,
                            int64_t head, const void* src, const Copy& copy) {
  const int64_t block = slot / c.block_size, off = slot % c.block_size;
  switch (c.elem) {
    case 1:
      return store_row(s, c.layout, is_key, c.block_size, D, block, off, head, static_cast<const uint8_t*>(src), copy);
    case 2:
      return store_row(s, c.layout, is_key, c.block_size, D, block, off, head, static_cast<const uint16_t*>(src), copy);
    default:
      return store_row(s, c.layout, is_key, c.block_size, D, block, off, head, static_cast<const uint32_t*>(src), copy);
  }
}

}  // namespace qkvfuse_cpu
