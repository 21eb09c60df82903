// split_qkv_rmsnorm_rope on CPU: one pass over packed QKV (semantics: qkvfuse/reference.py).
//
// Work items are (token, head) pairs, token-major, split over threads by parallel_chunks; a token's V heads
// form one more item (a row memcpy), and so do its gate heads in the gated layout (q_gate: Q heads interleaved
// with gate heads, [q_0 | g_0 | q_1 | g_1 | ... | k | v]; the gate heads are copied bit-exact). The gated
// in-place form de-interleaves the row's Q/gate region into [Q heads | gate heads]: a token's whole region is
// then one item, copied to a per-thread buffer before it is rewritten. A Q/K item reads its head once into an
// fp32 stack buffer (summing squares on the way), then normalises, rotates and rounds it straight into the
// output. Each item's bits depend only on its own head, the token's cos/sin row and the weights, never on how
// items are split over threads or on the other tokens in the batch.
// Where the build's instruction set has specialised heads for the call (isa.h: AVX2 bf16 heads of the published
// shapes, AVX-512 bf16/fp16 heads of D % 32 == 0), they take a batch of heads a given stride apart, so the gated
// layout's Q heads (2 * D apart) take them too; README.md lists the paths and their bit contracts.
// The cache-writing split is the in-place or out= form with a KV cache (SplitPlan::kv, cache.h): a token's K heads
// are stored to its slot by their own item right after it writes them, its V heads by one more item of the token;
// the tiled layouts ("vec", "amx") are stored a batch of whole tokens at a time instead (CacheWriter).
#include "cache.h"
#include "checks.h"
#include "isa.h"
#include "optional_ref.h"
#include "plan.h"
#include "vec_io.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace qkvfuse_cpu {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// The mRoPE axis rule of qkvfuse.rope.mrope_axis_map (the Python function is the definition; the op
// qkvfuse_cpu::mrope_axis_map exposes this copy so a test compares the two on every layout).
int64_t mrope_axis(int64_t j, int64_t s_t, int64_t s_h, int64_t s_w, bool interleaved) {
  if (interleaved) {
    if (j % 3 == 1 && j < 3 * s_h) return 1;
    if (j % 3 == 2 && j < 3 * s_w) return 2;
    return 0;
  }
  return j < s_t ? 0 : (j < s_t + s_h ? 1 : 2);
}

int64_t read_pos(const SplitPlan& p, int64_t axis, int64_t t) {
  const int64_t off = axis * p.pos_s_axis + t * p.pos_s_t;
  return p.pos64 ? static_cast<const int64_t*>(p.pos)[off] : static_cast<const int32_t*>(p.pos)[off];
}

// Raises before any output is written. Positions are clamped again where they are used, so the table is
// never read out of bounds even if a caller reaches the kernel some other way.
void check_positions(const SplitPlan& p) {
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
  for (int64_t a = 0; a < (p.mrope ? 3 : 1); ++a) {
    for (int64_t t = 0; t < p.T; ++t) {
      const int64_t v = read_pos(p, a, t);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  TORCH_CHECK_VALUE(lo >= 0 && hi < p.max_pos, "positions: expected values in [0, ", p.max_pos,
                    ") (cos_sin_cache rows), got values in [", lo, ", ", hi, "]");
}

// Returns whether every gathered value is finite (see qk_head).
template <typename C>
bool gather_cos_sin(const SplitPlan& p, int64_t t, float* cos, float* sin) {
  const C* table = static_cast<const C*>(p.cache);
  auto row = [&](int64_t axis) {
    const int64_t pos = std::clamp<int64_t>(read_pos(p, axis, t), 0, p.max_pos - 1);
    return table + pos * p.cache_rs;
  };
  if (!p.mrope) {
    const C* r = row(0);
    int64_t j = 0;
    for (; j + kF <= p.half; j += kF) {  // widening is exact: the same values as the scalar loop
      Io<C>::load1(r + j).store(cos + j);
      Io<C>::load1(r + p.half + j).store(sin + j);
    }
    for (; j < p.half; ++j) {
      cos[j] = static_cast<float>(r[j]);
      sin[j] = static_cast<float>(r[p.half + j]);
    }
  } else {  // each slot from its axis' row: the three rows' values blended under the axis masks
    const C* rows[3] = {row(0), row(1), row(2)};
    int64_t j = 0;
    auto pick = [&](int64_t off) {
      const fVec h = fVec::loadu(p.on_h + j), w = fVec::loadu(p.on_w + j);
      const fVec th = fVec::blendv(Io<C>::load1(rows[0] + off), Io<C>::load1(rows[1] + off), h);
      return fVec::blendv(th, Io<C>::load1(rows[2] + off), w);
    };
    for (; j + kF <= p.half; j += kF) {
      pick(j).store(cos + j);
      pick(p.half + j).store(sin + j);
    }
    for (; j < p.half; ++j) {
      const C* r = rows[p.axis[j]];
      cos[j] = static_cast<float>(r[j]);
      sin[j] = static_cast<float>(r[p.half + j]);
    }
  }
  return all_finite(cos, p.half) && all_finite(sin, p.half);
}

// Requests token t's cos/sin rows (1 or 3) into the cache: issued one token ahead, the gather of a batch with
// scattered positions (image tokens, shuffled requests) does not wait on memory.
void prefetch_cos_sin(const SplitPlan& p, int64_t t) {
  const int64_t row_bytes = 2 * p.half * static_cast<int64_t>(c10::elementSize(p.cache_dtype));
  const int64_t row_stride = p.cache_rs * static_cast<int64_t>(c10::elementSize(p.cache_dtype));
  for (int64_t a = 0; a < (p.mrope ? 3 : 1); ++a) {
    const int64_t pos = std::clamp<int64_t>(read_pos(p, a, t), 0, p.max_pos - 1);
    const char* row = static_cast<const char*>(p.cache) + pos * row_stride;
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off);
  }
}

bool token_cos_sin(const SplitPlan& p, int64_t t, float* cos, float* sin) {
  switch (p.cache_dtype) {
    case at::kFloat: return gather_cos_sin<float>(p, t, cos, sin);
    case at::kBFloat16: return gather_cos_sin<c10::BFloat16>(p, t, cos, sin);
    default: return gather_cos_sin<c10::Half>(p, t, cos, sin);
  }
}

// kNorm: 0 no QK-norm, 1 weight, 2 weight and bias. One head: src -> dst, `half` rotary pairs then D - 2*half
// pass-through dims. The norm is (x * inv) * w (+ b) in the vector body and the scalar tail alike; the
// rotation is fused multiply-adds in both, so an element's value never depends on which path computed it.
// `finite` says the weights and this token's cos/sin are finite; with a finite head on top (its sum of
// squares is finite) the 16-wide stores may skip the NaN fix-up of the bf16 rounding (Io::store2_finite).
// O: the output's type, T's own or float (the values before the rounding, for an FP8 cache's quantisation).
template <typename T, int kNorm, bool kNeox, typename O = T>
QKVFUSE_FLATTEN void qk_head(const T* src, O* dst, const float* w, const float* b, float eps, int64_t D,
                             int64_t half, const float* cos, const float* sin, bool finite) {
  alignas(64) float x[kMaxHeadDim];
  fVec acc0(0.f), acc1(0.f);
  int64_t d = 0;
  for (; d + 2 * kF <= D; d += 2 * kF) {
    fVec a, c;
    Io<T>::load2(src + d, a, c);
    a.store(x + d);
    c.store(x + d + kF);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(c, c, acc1);
  }
  double tail = 0.0;
  for (; d < D; ++d) {
    x[d] = static_cast<float>(src[d]);
    tail = std::fma(x[d], x[d], tail);
  }
  double ss = 0.0;
  const float inv = inv_rms<T>(acc0, acc1, tail, D, eps, &ss);  // also the finiteness probe when kNorm == 0
  const fVec vinv(inv);
  auto norm = [&](int64_t i) {
    fVec v = fVec::loadu(x + i);
    if constexpr (kNorm > 0) v = v * vinv * fVec::loadu(w + i);
    if constexpr (kNorm > 1) v = v + fVec::loadu(b + i);
    return v;
  };
  auto norm1 = [&](int64_t i) {
    float v = x[i];
    if constexpr (kNorm > 0) v = v * inv * w[i];
    if constexpr (kNorm > 1) v = v + b[i];
    return v;
  };
  auto rot1 = [&](int64_t ia, int64_t ib, int64_t j) {
    const float ya = norm1(ia), yb = norm1(ib);
    dst[ia] = static_cast<O>(std::fma(ya, cos[j], -(yb * sin[j])));
    dst[ib] = static_cast<O>(std::fma(yb, cos[j], ya * sin[j]));
  };

  // The 16-wide loops, once per store flavour; 8-wide steps and scalar tails always use the plain stores.
  auto body = [&](auto store2) {
    int64_t j = 0;
    if constexpr (kNeox) {
      for (; j + 2 * kF <= half; j += 2 * kF) {
        const fVec a0 = norm(j), a1 = norm(j + kF), b0 = norm(half + j), b1 = norm(half + j + kF);
        const fVec c0 = fVec::loadu(cos + j), c1 = fVec::loadu(cos + j + kF);
        const fVec s0 = fVec::loadu(sin + j), s1 = fVec::loadu(sin + j + kF);
        store2(dst + j, at::vec::fmsub(a0, c0, b0 * s0), at::vec::fmsub(a1, c1, b1 * s1));
        store2(dst + half + j, at::vec::fmadd(b0, c0, a0 * s0), at::vec::fmadd(b1, c1, a1 * s1));
      }
      for (; j + kF <= half; j += kF) {
        const fVec a = norm(j), bb = norm(half + j), c = fVec::loadu(cos + j), s = fVec::loadu(sin + j);
        Io<O>::store1(dst + j, at::vec::fmsub(a, c, bb * s));
        Io<O>::store1(dst + half + j, at::vec::fmadd(bb, c, a * s));
      }
      for (; j < half; ++j) rot1(j, half + j, j);
    } else {
      for (; j + kF <= half; j += kF) {
        const auto [a, bb] = at::vec::deinterleave2(norm(2 * j), norm(2 * j + kF));
        const fVec c = fVec::loadu(cos + j), s = fVec::loadu(sin + j);
        const auto [o0, o1] = at::vec::interleave2(at::vec::fmsub(a, c, bb * s), at::vec::fmadd(bb, c, a * s));
        store2(dst + 2 * j, o0, o1);
      }
      for (; j < half; ++j) rot1(2 * j, 2 * j + 1, j);
    }
    int64_t i = 2 * half;  // partial rotary: the rest is normalised but not rotated
    for (; i + 2 * kF <= D; i += 2 * kF) store2(dst + i, norm(i), norm(i + kF));
    for (; i + kF <= D; i += kF) Io<O>::store1(dst + i, norm(i));
    for (; i < D; ++i) dst[i] = static_cast<O>(norm1(i));
  };
  if (finite && std::isfinite(ss)) {
    body([](O* p, const fVec& u, const fVec& v) { Io<O>::store2_finite(p, u, v); });
  } else {
    body([](O* p, const fVec& u, const fVec& v) { Io<O>::store2(p, u, v); });
  }
}

template <typename T, typename O = T>
using HeadFn = void (*)(const T*, O*, const float*, const float*, float, int64_t, int64_t, const float*,
                        const float*, bool);

template <typename T, int kNorm, typename O = T>
HeadFn<T, O> pick_style(bool neox) {
  return neox ? &qk_head<T, kNorm, true, O> : &qk_head<T, kNorm, false, O>;
}

template <typename T, typename O = T>
HeadFn<T, O> pick_head(int norm_mode, bool neox) {
  return norm_mode == 0 ? pick_style<T, 0, O>(neox) : norm_mode == 1 ? pick_style<T, 1, O>(neox)
                                                                     : pick_style<T, 2, O>(neox);
}

// The cache-writing split's per-thread part: token t's K heads (as the split wrote them, or their fp32 values for
// an FP8 cache) and V heads into the cache at the token's slot (cache.h). NHD/HND rows, and any layout in a chunk
// that is not whole tokens (a decode token split between threads), are stored per head as they are written; the
// tiled layouts ("vec", "amx") in a chunk of whole tokens are stored a batch of kBatch tokens at a time, right
// after the split wrote them (still in L1/L2), as contiguous runs (store_tokens_tiled).
template <typename T>
class CacheWriter {
 public:
  static constexpr int64_t kBatch = 32;

  CacheWriter(const SplitPlan& p, int norm_mode)
      : p_(p), c_(*p.kv), fp32_k_(p.kv->fp8 != Fp8::None && !std::is_same_v<T, float>),
        tiled_(p.kv->layout == kVec || p.kv->layout == kAmx), head32_(pick_head<T, float>(norm_mode, p.neox)) {}

  // A chunk starting at token t0; whole_tokens: it holds only whole tokens (its items start and end on tokens).
  void begin(bool whole_tokens, int64_t t0) {
    batched_ = tiled_ && whole_tokens;
    t0_ = t0;
    if (batched_ && c_.fp8 != Fp8::None && stage_k_.empty()) {
      stage_k_.resize(static_cast<size_t>(kBatch * p_.hkv * p_.D));
      stage_v_.resize(stage_k_.size());
    }
  }

  // Before the split rewrites them: an FP8 cache's K from the generic head's fp32 values (qkv then gets the
  // build's own heads, as the in-place split does). fp32 qkv: its own K is the fp32 value (after()).
  void before_k(int64_t slot, int64_t t, const T* src, int64_t first, int64_t n, const float* cos, const float* sin,
                bool finite) {
    if (slot < 0 || !fp32_k_) return;
    for (int64_t i = 0; i < n; ++i) {
      head32_(src + i * p_.D, x_, p_.wk, p_.bk, p_.eps, p_.D, p_.half, cos, sin, finite);
      if (batched_) {
        quantize_row(c_, x_, p_.D, c_.k.scale, stage_k_.data() + ((t - t0_) * p_.hkv + first + i) * p_.D);
      } else {
        quantize_row(c_, x_, p_.D, c_.k.scale, q8_);
        store_row_bytes(c_, c_.k, true, p_.D, slot, first + i, q8_, copy_);
      }
    }
  }

  // After the split wrote K heads first .. first + n - 1 at k: their bits (or, fp32 qkv, their quantised values).
  void after_k(int64_t slot, const T* k, int64_t first, int64_t n) {
    if (slot < 0 || fp32_k_ || batched_) return;
    for (int64_t i = 0; i < n; ++i) store(c_.k, true, slot, first + i, k + i * p_.D);
  }

  // The token's V heads (v: its first, the rest D apart), bit-exact or quantised from their exact values.
  void v(int64_t slot, const T* v) {
    if (slot < 0 || batched_) return;
    for (int64_t h = 0; h < p_.hkv; ++h) store(c_.v, false, slot, h, v + h * p_.D);
  }

  // Token t's items are all done: a full batch is stored.
  void token_done(int64_t t) {
    if (batched_ && t + 1 - t0_ == kBatch) flush(t + 1);
  }

  // The chunk ends before token t_end: what is left of the batch is stored.
  void finish(int64_t t_end) {
    if (batched_ && t_end > t0_) flush(t_end);
  }

 private:
  // Tokens t0_ .. t_end - 1 (their K and V rows in qkv, as the split left them) into the tiled cache.
  void flush(int64_t t_end) {
    const int64_t n = t_end - t0_, hd = p_.hkv * p_.D;
    bool any = false;
    for (int64_t i = 0; i < n; ++i) {
      slots_[i] = c_.slot(t0_ + i);
      any = any || slots_[i] >= 0;
    }
    const T* qkv = static_cast<const T*>(p_.qkv);
    const T* k = static_cast<const T*>(p_.k) + t0_ * p_.k_rs;
    const T* v = qkv + t0_ * p_.qkv_rs + p_.k_col + hd;
    if (any && c_.fp8 == Fp8::None) {
      using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;
      store_tokens_tiled(c_, c_.k, true, p_.hkv, p_.D, slots_, n, reinterpret_cast<const U*>(k), p_.k_rs, copy_);
      store_tokens_tiled(c_, c_.v, false, p_.hkv, p_.D, slots_, n, reinterpret_cast<const U*>(v), p_.qkv_rs,
                         copy_);
    } else if (any) {
      for (int64_t i = 0; i < n; ++i) {
        if (slots_[i] < 0) continue;
        for (int64_t h = 0; h < p_.hkv; ++h) {
          if (!fp32_k_) quantize(k + i * p_.k_rs + h * p_.D, c_.k.scale, stage_k_.data() + i * hd + h * p_.D);
          quantize(v + i * p_.qkv_rs + h * p_.D, c_.v.scale, stage_v_.data() + i * hd + h * p_.D);
        }
      }
      store_tokens_tiled(c_, c_.k, true, p_.hkv, p_.D, slots_, n, stage_k_.data(), hd, copy_);
      store_tokens_tiled(c_, c_.v, false, p_.hkv, p_.D, slots_, n, stage_v_.data(), hd, copy_);
    }
    t0_ = t_end;
  }

  // A head row's FP8 bits, quantised from its exact values.
  void quantize(const T* row, float scale, uint8_t* out) {
    const float* x;
    if constexpr (std::is_same_v<T, float>) {
      x = row;
    } else {
      int64_t d = 0;
      for (; d + kF <= p_.D; d += kF) Io<T>::load1(row + d).store(x_ + d);
      for (; d < p_.D; ++d) x_[d] = static_cast<float>(row[d]);
      x = x_;
    }
    quantize_row(c_, x, p_.D, scale, out);
  }

  void store(const CacheSide& side, bool is_key, int64_t slot, int64_t head, const T* row) {
    if (c_.fp8 == Fp8::None) return store_row_bytes(c_, side, is_key, p_.D, slot, head, row, copy_);
    quantize(row, side.scale, q8_);
    store_row_bytes(c_, side, is_key, p_.D, slot, head, q8_, copy_);
  }

  // A contiguous cache row: streamed under the plan's policy where it starts and ends on 32-byte boundaries.
  struct RowCopy {
    bool stream;
    void operator()(void* dst, const void* src, size_t bytes) const {
      if (stream && reinterpret_cast<uintptr_t>(dst) % 32 == 0 && bytes % 32 == 0) {
        isa::stream_copy(dst, src, bytes);
      } else {
        std::memcpy(dst, src, bytes);
      }
    }
  };

  const SplitPlan& p_;
  const CachePlan& c_;
  bool fp32_k_;
  bool tiled_;
  bool batched_ = false;
  int64_t t0_ = 0;
  HeadFn<T, float> head32_;
  RowCopy copy_{c_.stream};
  std::vector<uint8_t> stage_k_, stage_v_;  // FP8, batched: the batch's quantised K and V rows, [kBatch, hkv, D]
  int64_t slots_[kBatch];
  alignas(64) float x_[kMaxHeadDim];
  alignas(64) uint8_t q8_[kMaxHeadDim];
};


template <typename T>
void run_split(const SplitPlan& p) {
  const int norm_mode = p.wq == nullptr ? 0 : (p.bq == nullptr ? 1 : 2);
  const HeadFn<T> head = pick_head<T>(norm_mode, p.neox);
  const T* qkv = static_cast<const T*>(p.qkv);
  T* q = static_cast<T*>(p.q);
  T* k = static_cast<T*>(p.k);
  T* v = static_cast<T*>(p.v);
  T* gate = static_cast<T*>(p.gate);
  // A token's work items: its Q heads (the gated in-place form: one item, the whole Q/gate region), its K heads,
  // then one item copying V (unless aliased), one copying the gate heads (the gated out= forms), and one storing
  // V in the KV cache (the cache-writing split: its K heads are stored by their own items, as they are written).
  const int64_t q_items = p.gated_inplace ? 1 : p.hq;
  const int64_t qk_items = q_items + p.hkv;
  const int64_t v_item = v != nullptr ? qk_items : -1;
  const int64_t gate_item = gate != nullptr ? qk_items + (v != nullptr ? 1 : 0) : -1;
  const int64_t per_token = qk_items + (v != nullptr ? 1 : 0) + (gate != nullptr ? 1 : 0) + (p.kv != nullptr ? 1 : 0);
  const size_t v_bytes = static_cast<size_t>(p.hkv * p.D) * sizeof(T);
  const size_t head_bytes = static_cast<size_t>(p.D) * sizeof(T);
  // The build's specialised heads for this call, if any (isa.h), and its per-call tables.
  const isa::SplitHeads<T> fast(p, norm_mode);
  // The tiled caches: chunks of whole cache lines of tokens where the batch allows (two threads never write one
  // line of a block's vec K, which holds 64 bytes of consecutive tokens per dim).
  const int64_t line_tokens = p.kv == nullptr || (p.kv->layout != kVec && p.kv->layout != kAmx) ? 1
                              : p.kv->layout == kVec ? 64 / p.kv->elem
                                                     : 16;
  const int64_t align = per_token * (p.T >= 2 * line_tokens ? line_tokens : 1);
  parallel_chunks(p.T * per_token, grain_items(p.D), align, [&](int64_t begin, int64_t end) {
    alignas(64) float cos[kMaxHalf], sin[kMaxHalf];
    int64_t t = begin / per_token, h = begin % per_token, cos_sin_token = -1;
    bool finite = false;
    std::vector<T> region(p.gated_inplace ? 2 * p.hq * p.D : 0);  // gated in place: a token's Q/gate region
    typename isa::SplitHeads<T>::Token fast_token(fast, cos, sin);
    std::optional<CacheWriter<T>> cache;
    if (p.kv != nullptr) {
      cache.emplace(p, norm_mode);
      cache->begin(begin % per_token == 0 && (end % per_token == 0), begin / per_token);
    }
    // n consecutive heads of one weight set (Q when is_q, else K) of this token: from src, ss values apart,
    // to dst, D values apart; the specialised heads a batch at a time where they apply.
    auto heads = [&](const T* src, int64_t ss, T* dst, int64_t n, bool is_q) {
      const float* w = is_q ? p.wq : p.wk;
      const float* b = is_q ? p.bq : p.bk;
      auto generic = [&](const T* s, T* d) { head(s, d, w, b, p.eps, p.D, p.half, cos, sin, finite); };
      for (int64_t j = 0; j < n;) {
        const int64_t m = fast_token.run(src + j * ss, ss, dst + j * p.D, n - j, is_q, finite, generic);
        if (m > 0) {
          j += m;
          continue;
        }
        generic(src + j * ss, dst + j * p.D);
        ++j;
      }
    };
    for (int64_t i = begin; i < end; ++i) {
      const T* row = qkv + t * p.qkv_rs;
      if (h < qk_items) {
        if (cos_sin_token != t) {  // once per token per thread: each thread gathers its own copy
          if (t + 1 < p.T) prefetch_cos_sin(p, t + 1);
          finite = token_cos_sin(p, t, cos, sin) && p.weights_finite;
          cos_sin_token = t;
          fast_token.start(finite);
        }
        if (p.gated_inplace && h == 0) {
          // [q_0 | g_0 | q_1 | g_1 | ...] -> [Q heads | gate heads]: each write lands on other heads' inputs, so
          // the region is read whole first.
          std::memcpy(region.data(), row, region.size() * sizeof(T));
          T* out = q + t * p.q_rs;
          heads(region.data(), 2 * p.D, out, p.hq, true);
          for (int64_t hh = 0; hh < p.hq; ++hh) {
            std::memcpy(out + (p.hq + hh) * p.D, region.data() + hh * 2 * p.D + p.D, head_bytes);
          }
        } else if (h < q_items) {  // this token's next Q heads within the range
          const int64_t n = std::min(p.hq - h, end - i);
          heads(row + h * p.q_hs, p.q_hs, q + t * p.q_rs + h * p.D, n, true);
          i += n - 1;
          h += n - 1;
        } else {  // this token's next K heads within the range
          const int64_t j = h - q_items, n = std::min(p.hkv - j, end - i);
          const int64_t slot = cache ? p.kv->slot(t) : -1;
          if (slot >= 0) cache->before_k(slot, t, row + p.k_col + j * p.D, j, n, cos, sin, finite);
          heads(row + p.k_col + j * p.D, p.D, k + t * p.k_rs + j * p.D, n, false);
          if (slot >= 0) cache->after_k(slot, k + t * p.k_rs + j * p.D, j, n);
          i += n - 1;
          h += n - 1;
        }
      } else if (h == v_item) {
        fast.copy(v + t * p.v_rs, row + p.k_col + p.hkv * p.D, v_bytes);
      } else if (h != gate_item) {  // the KV cache's V heads
        cache->v(p.kv->slot(t), row + p.k_col + p.hkv * p.D);
      } else {  // the gate heads, bit-exact
        for (int64_t hh = 0; hh < p.hq; ++hh) {
          fast.copy(gate + t * p.gate_rs + hh * p.D, row + hh * p.q_hs + p.D, head_bytes);
        }
      }
      if (++h == per_token) {
        if (cache) cache->token_done(t);
        h = 0;
        ++t;
      }
    }
    if (cache) cache->finish(t);
    if (cache && p.kv->stream) isa::stream_fence();
    fast.fence();
  });
}

// An optional weight or bias as fp32 (nullptr when absent): in place when it already is contiguous fp32, else
// converted into out.
// gemma: the weight is stored centred at 0 and 1 + w (in fp32, as the models compute it) is returned.
const float* to_fp32(const OptRef& t, int64_t D, float* out, bool gemma = false) {
  if (!t.has_value()) return nullptr;
  if (!gemma && is_fp32_vector(*t, D)) return (*t).const_data_ptr<float>();
  vector_to_fp32(*t, D, out);
  if (gemma) {
    for (int64_t i = 0; i < D; ++i) out[i] = 1.0f + out[i];
  }
  return out;
}

bool is_float_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// An output as head_dim() checked it (checks::out_tensor), or as the functional form allocated it.
void check_out(const Tensor& out, const Tensor& qkv, int64_t width) {
  QKVFUSE_DEBUG_ASSERT(out.dim() == 2 && out.size(0) == qkv.size(0) && out.size(1) == width &&
                           out.scalar_type() == qkv.scalar_type() && out.device().is_cpu() &&
                           (out.numel() == 0 || (out.stride(1) == 1 && out.stride(0) >= width)),
                       "qkvfuse cpu kernel: bad output ", out.sizes(), " ", out.strides());
}

// Everything the kernel needs, from arguments head_dim() has checked: every registered op runs it first, so the
// rules below (the memory-safety ones among its rules) are asserted only in a debug build.
SplitPlan make_plan(const Tensor& qkv, const Tensor& positions, const Tensor& cache, int64_t hq, int64_t hkv,
                    int64_t D, const OptRef& q_weight, const OptRef& k_weight, const OptRef& q_bias,
                    const OptRef& k_bias, double eps, bool is_neox, c10::IntArrayRef mrope_section,
                    bool mrope_interleaved, float* weight_buffers, bool gemma = false, bool q_gate = false) {
  QKVFUSE_DEBUG_ASSERT(hq >= 1 && hkv >= 1 && hq <= checks::kMaxHeads && hkv <= checks::kMaxHeads && D >= 2 &&
                           D % 2 == 0 && D <= kMaxHeadDim,
                       "qkvfuse cpu kernel: bad head geometry");
  const int64_t width = ((q_gate ? 2 : 1) * hq + 2 * hkv) * D;
  QKVFUSE_DEBUG_ASSERT(qkv.dim() == 2 && qkv.size(1) == width && is_float_type(qkv.scalar_type()) &&
                           (qkv.numel() == 0 || (qkv.stride(1) == 1 && qkv.stride(0) >= width)),
                       "qkvfuse cpu kernel: bad qkv ", qkv.sizes(), " ", qkv.strides());
  QKVFUSE_DEBUG_ASSERT(cache.dim() == 2 && cache.size(0) >= 1 && cache.size(1) >= 2 && cache.size(1) % 2 == 0 &&
                           cache.size(1) <= D && cache.stride(1) == 1 && cache.stride(0) >= cache.size(1) &&
                           is_float_type(cache.scalar_type()) && cache.device().is_cpu(),
                       "qkvfuse cpu kernel: bad cos_sin_cache ", cache.sizes());
  const bool mrope = !mrope_section.empty();
  const int64_t T = qkv.size(0), R = cache.size(1);
  QKVFUSE_DEBUG_ASSERT((positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt) &&
                           positions.device().is_cpu() &&
                           (mrope ? (positions.dim() == 2 && positions.size(0) == 3 && positions.size(1) == T)
                                  : (positions.dim() == 1 && positions.size(0) == T)),
                       "qkvfuse cpu kernel: bad positions ", positions.sizes());
  QKVFUSE_DEBUG_ASSERT(q_weight.has_value() == k_weight.has_value() && (q_weight.has_value() || !q_bias.has_value()) &&
                           q_bias.has_value() == k_bias.has_value(),
                       "qkvfuse cpu kernel: norm weights and biases come in pairs (both Q and K)");

  SplitPlan p{};
  p.T = T;
  p.hq = hq;
  p.hkv = hkv;
  p.D = D;
  p.R = R;
  p.half = R / 2;
  p.max_pos = cache.size(0);
  p.qkv = qkv.const_data_ptr();
  p.qkv_rs = qkv.stride(0);
  p.q_hs = q_gate ? 2 * D : D;
  p.k_col = hq * p.q_hs;
  p.pos = positions.const_data_ptr();
  p.pos64 = positions.scalar_type() == at::kLong;
  p.pos_s_axis = mrope ? positions.stride(0) : 0;
  p.pos_s_t = positions.stride(-1);
  p.mrope = mrope;
  if (mrope) {
    QKVFUSE_DEBUG_ASSERT(mrope_section.size() == 3 && mrope_section[0] + mrope_section[1] + mrope_section[2] == p.half,
                         "qkvfuse cpu kernel: mrope_section must be three sizes summing to rotary_dim // 2");
    const float on = c10::bit_cast<float>(~uint32_t{0});
    for (int64_t j = 0; j < p.half; ++j) {
      p.axis[j] = static_cast<uint8_t>(
          mrope_axis(j, mrope_section[0], mrope_section[1], mrope_section[2], mrope_interleaved));
      p.on_h[j] = p.axis[j] == 1 ? on : 0.f;
      p.on_w[j] = p.axis[j] == 2 ? on : 0.f;
    }
  }
  p.cache = cache.const_data_ptr();
  p.cache_dtype = cache.scalar_type();
  p.cache_rs = cache.stride(0);
  p.wq = to_fp32(q_weight, D, weight_buffers, gemma);
  p.wk = to_fp32(k_weight, D, weight_buffers + kMaxHeadDim, gemma);
  p.bq = to_fp32(q_bias, D, weight_buffers + 2 * kMaxHeadDim);
  p.bk = to_fp32(k_bias, D, weight_buffers + 3 * kMaxHeadDim);
  p.weights_finite = true;
  for (const float* v : {p.wq, p.wk, p.bq, p.bk}) p.weights_finite = p.weights_finite && (!v || all_finite(v, D));
  p.eps = static_cast<float>(eps);
  p.neox = is_neox;
  return p;
}

// The out= forms' outputs (gate_out: the gated layout's, nullptr otherwise).
void set_outputs(SplitPlan& p, const Tensor& qkv, const Tensor& q_out, const Tensor& k_out, const Tensor& v_out,
                 const Tensor* gate_out) {
  const int64_t kv = p.hkv * p.D;
  QKVFUSE_DEBUG_ASSERT((gate_out != nullptr) == (p.q_hs != p.D),
                       "qkvfuse cpu kernel: gate_out is given exactly when gated");
  check_out(q_out, qkv, p.hq * p.D);
  check_out(k_out, qkv, kv);
  check_out(v_out, qkv, kv);
  p.q = q_out.data_ptr();
  p.q_rs = q_out.stride(0);
  p.k = k_out.data_ptr();
  p.k_rs = k_out.stride(0);
  if (gate_out != nullptr) {
    check_out(*gate_out, qkv, p.hq * p.D);
    p.gate = gate_out->data_ptr();
    p.gate_rs = gate_out->stride(0);
  }
  const char* v_in = static_cast<const char*>(p.qkv) + (p.k_col + kv) * qkv.element_size();
  // Exactly aliasing V (the in-place form) needs no copy; ops.py rejects any other overlap.
  const bool v_aliased = v_out.const_data_ptr() == v_in && (p.T <= 1 || v_out.stride(0) == p.qkv_rs);
  p.v = v_aliased ? nullptr : v_out.data_ptr();
  p.v_rs = v_out.stride(0);
}

void run(const SplitPlan& p, at::ScalarType dtype) {
  if (p.T == 0) return;
  check_positions(p);
  switch (dtype) {
    case at::kFloat: return run_split<float>(p);
    case at::kBFloat16: return run_split<c10::BFloat16>(p);
    default: return run_split<c10::Half>(p);
  }
}

// The rope argument of the schemas (qkvfuse._library.encode_rope, the definition): bit 0 NeoX pairs, bit 1
// mRoPE, bit 2 interleaved mRoPE, bit 3 the gated Q layout, bit 4 Gemma norm weights, then the three section
// sizes in 10 bits each from bit 8.
struct Rope {
  bool neox, mrope, interleaved, q_gate, gemma;
  int64_t sections[3];
  c10::IntArrayRef section_list() const { return mrope ? c10::IntArrayRef(sections, 3) : c10::IntArrayRef(); }
};

Rope decode_rope(int64_t code) {
  Rope r{(code & 1) != 0, (code & 2) != 0, (code & 4) != 0, (code & 8) != 0, (code & 16) != 0, {0, 0, 0}};
  if (r.mrope) {
    for (int i = 0; i < 3; ++i) r.sections[i] = (code >> (8 + 10 * i)) & 1023;
  }
  return r;
}

// The plan of one call from checked arguments (head_dim D as check_split derived it).
SplitPlan plan_for(const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
                   const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq,
                   int64_t hkv, int64_t D, double eps, const Rope& r, float* weights) {
  return make_plan(qkv, positions, cache, hq, hkv, D, borrow(q_weight), borrow(k_weight), borrow(q_bias),
                   borrow(k_bias), eps, r.neox, r.section_list(), r.interleaved, weights, r.gemma, r.q_gate);
}

// The per-call rules of qkvfuse/_checks.py check_split, in its order and with its messages (checks.h); returns
// head_dim, qkv's width over the head count (the schema does not repeat it). `outs`: the out= form's three
// outputs; `inplace`: qkv is the in-place target.
int64_t head_dim(const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
                 const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq,
                 int64_t hkv, int64_t rope, const Tensor* const* outs, bool inplace) {
  namespace ck = checks;
  using ck::Kind;
  if (!ck::is_float(qkv.scalar_type())) {
    ck::fail(Kind::Type, "qkv", "dtype " + ck::py_dtype(qkv.scalar_type()), ck::kFloatNames);
  }
  ck::head_count("num_q_heads", hq);
  ck::head_count("num_kv_heads", hkv);
  const Rope r = decode_rope(rope);
  const int64_t heads = (r.q_gate ? 2 : 1) * hq + 2 * hkv;
  if (qkv.dim() != 2 || qkv.size(1) % heads != 0 || (qkv.size(1) / heads) % 2 != 0 || qkv.size(1) / heads <= 0 ||
      qkv.size(1) / heads > kMaxHeadDim) {
    ck::fail(Kind::Value, "qkv", "shape " + ck::py_tuple(qkv.sizes()),
             std::string(r.q_gate ? "shape (T, (2*num_q_heads + 2*num_kv_heads) * head_dim)"
                                  : "shape (T, (num_q_heads + 2*num_kv_heads) * head_dim)") +
                 " with an even head_dim <= " + std::to_string(kMaxHeadDim) + " for num_q_heads=" +
                 std::to_string(hq) + ", num_kv_heads=" + std::to_string(hkv) +
                 (r.q_gate ? " (q_gate: each Q head followed by its gate head)" : ""));
  }
  const int64_t T = qkv.size(0), width = qkv.size(1), D = width / heads;
  ck::rows("qkv", qkv, width);
  const c10::Device dev = qkv.device();
  ck::device("positions", positions, dev, "qkv");
  if (positions.scalar_type() != at::kInt && positions.scalar_type() != at::kLong) {
    ck::fail(Kind::Type, "positions", "dtype " + ck::py_dtype(positions.scalar_type()), "torch.int32 or torch.int64");
  }
  if (r.mrope) {
    if (positions.dim() != 2 || positions.size(0) != 3 || positions.size(1) != T) {
      ck::fail(Kind::Value, "positions", "shape " + ck::py_tuple(positions.sizes()),
               "shape (3, " + std::to_string(T) + ") (temporal, height, width) with mrope_section");
    }
  } else if (positions.dim() != 1 || positions.size(0) != T) {
    const std::string hint = positions.dim() == 2 ? " (3-D positions need mrope_section)" : "";
    ck::fail(Kind::Value, "positions", "shape " + ck::py_tuple(positions.sizes()),
             "shape (" + std::to_string(T) + ",) for RoPE" + hint);
  }
  ck::device("cos_sin_cache", cache, dev, "qkv");
  if (!ck::is_float(cache.scalar_type())) {
    ck::fail(Kind::Type, "cos_sin_cache", "dtype " + ck::py_dtype(cache.scalar_type()), ck::kFloatNames);
  }
  if (cache.dim() != 2 || cache.size(0) < 1) {
    ck::fail(Kind::Value, "cos_sin_cache", "shape " + ck::py_tuple(cache.sizes()),
             "shape (max_position >= 1, rotary_dim)");
  }
  const int64_t R = cache.size(1);
  if (R < 2 || R % 2 != 0 || R > D) {
    ck::fail(Kind::Value, "cos_sin_cache", "rotary_dim (shape[1]) = " + std::to_string(R),
             "an even rotary_dim in [2, head_dim=" + std::to_string(D) + "]");
  }
  if (cache.stride(1) != 1 || cache.stride(0) < R) {
    ck::fail(Kind::Value, "cos_sin_cache", "strides " + ck::py_tuple(cache.strides()),
             "a contiguous last dim and row stride >= rotary_dim");
  }
  if (r.mrope) {
    const int64_t sum = r.sections[0] + r.sections[1] + r.sections[2];
    if (sum != R / 2) {
      ck::fail(Kind::Value, "mrope_section",
               ck::py_tuple(c10::IntArrayRef(r.sections, 3)) + " (sum " + std::to_string(sum) + ")",
               "sections summing to rotary_dim // 2 = " + std::to_string(R / 2));
    }
  }
  if (q_weight.has_value() != k_weight.has_value()) {
    const bool q_given = q_weight.has_value();
    ck::fail(Kind::Value, q_given ? "k_weight" : "q_weight", "None",
             std::string("a tensor since ") + (q_given ? "q_weight" : "k_weight") +
                 " is given (QK-norm takes both q_weight and k_weight, or neither)");
  }
  if (q_weight.has_value()) {
    ck::vector("q_weight", *q_weight, D, dev, "qkv");
    ck::vector("k_weight", *k_weight, D, dev, "qkv");
  }
  const std::pair<const char*, const OptTensor*> biases[2] = {{"q_bias", &q_bias}, {"k_bias", &k_bias}};
  for (const auto& [name, bias] : biases) {
    if (bias->has_value()) {
      if (!q_weight.has_value()) {
        ck::fail(Kind::Value, name, "a bias without norm weights", "q_weight and k_weight when a norm bias is given");
      }
      ck::vector(name, **bias, D, dev, "qkv");
    }
  }
  if (q_bias.has_value() != k_bias.has_value()) {
    const bool q_given = q_bias.has_value();
    ck::fail(Kind::Value, q_given ? "k_bias" : "q_bias", "None",
             std::string("a tensor since ") + (q_given ? "q_bias" : "k_bias") +
                 " is given (a post-norm bias for Q and K: both or neither)");
  }
  if (r.gemma && !q_weight.has_value()) ck::gemma_without_weights();
  auto opt = [](const OptTensor& t) { return t.has_value() ? &*t : nullptr; };
  const ck::Named qw{"q_weight", opt(q_weight)}, kw{"k_weight", opt(k_weight)}, qb{"q_bias", opt(q_bias)},
      kb{"k_bias", opt(k_bias)};
  ck::io_dtype("qkv", qkv.scalar_type(), {qw, kw, qb, kb});
  ck::no_grad({{"qkv", &qkv}, qw, kw, qb, kb, {"cos_sin_cache", &cache}});
  const int64_t q_width = hq * D, kv_width = hkv * D;
  if (outs != nullptr) {
    // outs[3] is the optional gate_out (nullptr when None): given exactly when the layout is gated.
    if (r.q_gate != (outs[3] != nullptr)) {
      ck::fail(Kind::Value, "gate_out", outs[3] != nullptr ? "a tensor" : "None",
               "a (" + std::to_string(T) + ", " + std::to_string(q_width) +
                   ") tensor exactly when the layout is gated (q_gate)");
    }
    static constexpr const char* kNames[4] = {"q_out", "k_out", "v_out", "gate_out"};
    const int64_t widths[4] = {q_width, kv_width, kv_width, q_width};
    const int n = r.q_gate ? 4 : 3;
    for (int i = 0; i < n; ++i) ck::out_tensor(kNames[i], *outs[i], T, widths[i], qkv, "qkv");
    const int64_t size_of = static_cast<int64_t>(qkv.element_size());
    ck::outputs(ck::entries({{kNames[0], outs[0]}, {kNames[1], outs[1]}, {kNames[2], outs[2]},
                             {kNames[3], n == 4 ? outs[3] : nullptr}}),
                ck::entries({{"qkv", &qkv}, {"positions", &positions}, {"cos_sin_cache", &cache}, qw, kw, qb, kb}),
                [&](const char* name) {
                  // Gated, Q and gate heads interleave in qkv: q_out and gate_out have no slice of their own.
                  if (name[0] == 'g' || (r.q_gate && name[0] == 'q')) return ck::Own{"qkv", 0, 0, 0, false};
                  const int64_t col = name[0] == 'q' ? 0 : (name[0] == 'k' ? width - 2 * kv_width : width - kv_width);
                  return ck::Own{"qkv", ck::address(qkv) + col * size_of, qkv.stride(0), qkv.stride(1), true};
                });
  } else if (inplace) {
    ck::targets(ck::entries({{"qkv", &qkv}}),
                ck::entries({{"positions", &positions}, {"cos_sin_cache", &cache}, qw, kw, qb, kb}));
  }
  return D;
}

// The dispatcher's kernels (TORCH_LIBRARY_IMPL below): the schema's optional tensors, borrowed.
void split_qkv_rmsnorm_rope_out(const Tensor& qkv, const Tensor& positions, const Tensor& cache,
                                const OptTensor& q_weight, const OptTensor& k_weight, const OptTensor& q_bias,
                                const OptTensor& k_bias, int64_t hq, int64_t hkv, double eps, int64_t rope,
                                const Tensor& q_out, const Tensor& k_out, const Tensor& v_out,
                                const OptTensor& gate_out) {
  const Tensor* const outs[4] = {&q_out, &k_out, &v_out, gate_out.has_value() ? &*gate_out : nullptr};
  const int64_t D = head_dim(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope, outs, false);
  alignas(64) float weights[4 * kMaxHeadDim];
  SplitPlan p = plan_for(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, D, eps,
                         decode_rope(rope), weights);
  set_outputs(p, qkv, q_out, k_out, v_out, outs[3]);
  run(p, qkv.scalar_type());
}

std::tuple<Tensor, Tensor, Tensor, Tensor> split_qkv_rmsnorm_rope(
    const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
    const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq, int64_t hkv, double eps,
    int64_t rope) {
  const int64_t D = head_dim(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope, nullptr, false);
  const Rope r = decode_rope(rope);
  alignas(64) float weights[4 * kMaxHeadDim];
  SplitPlan p = plan_for(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, D, eps, r, weights);
  const int64_t T = qkv.size(0);
  Tensor q = at::empty({T, hq * D}, qkv.options());
  Tensor k = at::empty({T, hkv * D}, qkv.options());
  Tensor v = at::empty({T, hkv * D}, qkv.options());
  Tensor gate = r.q_gate ? at::empty({T, hq * D}, qkv.options()) : at::empty({0}, qkv.options());
  set_outputs(p, qkv, q, k, v, r.q_gate ? &gate : nullptr);
  run(p, qkv.scalar_type());
  return {q, k, v, gate};
}

// The in-place form's outputs: qkv itself.
void set_inplace(SplitPlan& p, const Tensor& qkv) {
  char* base = static_cast<char*>(qkv.data_ptr());
  p.q = base;  // gated: the Q heads from column 0, the gate heads after them (SplitPlan::gated_inplace)
  p.q_rs = p.qkv_rs;
  p.k = base + p.k_col * qkv.element_size();
  p.k_rs = p.qkv_rs;
  p.v = nullptr;  // V stays where it is
  p.gated_inplace = p.q_hs != p.D;
}

void split_qkv_rmsnorm_rope_inplace(const Tensor& qkv, const Tensor& positions, const Tensor& cache,
                                    const OptTensor& q_weight, const OptTensor& k_weight, const OptTensor& q_bias,
                                    const OptTensor& k_bias, int64_t hq, int64_t hkv, double eps, int64_t rope) {
  const int64_t D = head_dim(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope, nullptr, true);
  alignas(64) float weights[4 * kMaxHeadDim];
  SplitPlan p = plan_for(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, D, eps,
                         decode_rope(rope), weights);
  set_inplace(p, qkv);
  run(p, qkv.scalar_type());
}

// A cache side from its checked tensor (checks::cache): element strides in the layout's (block, offset, head, dim)
// order; FP8: the scale as the quantisation applies it.
CacheSide cache_side(const Tensor& c, int64_t layout, const OptTensor& scale, bool truncate) {
  const std::array<int64_t, 4> st = cache_slot_strides(layout, c);
  CacheSide s{static_cast<char*>(c.data_ptr()), st[0], st[1], st[2], st[3], 1.f};
  if (scale.has_value()) {
    const float value = *scale->const_data_ptr<float>();
    s.scale = truncate ? 1.f / value : value;  // torch.reciprocal's value, correctly rounded
  }
  return s;
}

// A cache plan's slots: slot_mapping's data, width and stride, and how many of them num_tokens tokens read.
void set_slots(CachePlan& c, const Tensor& slot_mapping, int64_t num_tokens) {
  c.slots = slot_mapping.const_data_ptr();
  c.slots64 = slot_mapping.scalar_type() == at::kLong;
  c.slot_stride = slot_mapping.stride(0);
  c.n_slots = std::min(num_tokens, slot_mapping.size(0));
}

// _library.check_cache_values, in its order and with its messages: the first min(T, len(slot_mapping)) slots below
// the capacity, the FP8 scales positive and finite. Also marks each token whose slot a later token takes (`later`,
// filled only when some slot repeats): the kernel writes each slot once, from the last of its tokens, whichever
// threads run them.
void check_cache_values(const CachePlan& c, int64_t capacity, const OptTensor& k_scale, const OptTensor& v_scale,
                        std::vector<uint8_t>& later) {
  const int64_t n = c.n_slots;
  int64_t hi = std::numeric_limits<int64_t>::min();
  for (int64_t t = 0; t < n; ++t) hi = std::max(hi, c.slot(t));
  if (n > 0 && hi >= capacity) {
    checks::fail(checks::Kind::Value, "slot_mapping", std::to_string(hi),
                 "values < " + std::to_string(capacity) +
                     " (the cache's num_blocks * block_size) or negative (not written)");
  }
  const std::pair<const char*, const OptTensor*> scales[2] = {{"k_scale", &k_scale}, {"v_scale", &v_scale}};
  for (const auto& [name, scale] : scales) {
    if (!scale->has_value()) continue;
    const double value = *(*scale)->const_data_ptr<float>();
    if (!(0.0 < value && value < std::numeric_limits<double>::infinity())) {
      checks::fail(checks::Kind::Value, name, checks::py_float(value), "a positive finite scale");
    }
  }
  if (n < 2) return;
  // Open addressing over the slots, last token first: a slot already present belongs to a later token.
  size_t size = 16;
  while (size < 2 * static_cast<size_t>(n)) size *= 2;
  std::vector<int64_t> table(size, -1);
  bool repeats = false;
  for (int64_t t = n - 1; t >= 0; --t) {
    const int64_t slot = c.slot(t);
    if (slot < 0) continue;
    const uint64_t hash = static_cast<uint64_t>(slot) * 0x9E3779B97F4A7C15ull;
    size_t i = (hash ^ (hash >> 32)) & (size - 1);
    while (table[i] != -1 && table[i] != slot) i = (i + 1) & (size - 1);
    if (table[i] == slot) {
      if (!repeats) later.assign(n, 0);
      repeats = true;
      later[t] = 1;
    } else {
      table[i] = slot;
    }
  }
}

// The cache-writing split's argument rules without the data: the split's (head_dim above), then the caches'
// (checks::cache). Returns head_dim. `outs` nullptr: the in-place form.
int64_t cache_head_dim(const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
                       const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq,
                       int64_t hkv, int64_t rope, const Tensor& key_cache, const Tensor& value_cache,
                       const Tensor& slot_mapping, int64_t cache_mode, const OptTensor& k_scale,
                       const OptTensor& v_scale, const Tensor* const* outs) {
  const int64_t D =
      head_dim(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope, outs, outs == nullptr);
  auto opt = [](const OptTensor& t) { return t.has_value() ? &*t : nullptr; };
  auto out = [&](int i) { return outs != nullptr ? outs[i] : nullptr; };
  checks::cache(qkv, key_cache, value_cache, slot_mapping, cache_mode, k_scale, v_scale, hkv, D,
                {{"positions", &positions}, {"cos_sin_cache", &cache}, {"q_weight", opt(q_weight)},
                 {"k_weight", opt(k_weight)}, {"q_bias", opt(q_bias)}, {"k_bias", opt(k_bias)}, {"q_out", out(0)},
                 {"k_out", out(1)}, {"v_out", out(2)}, {"gate_out", out(3)}});
  return D;
}

// The split that also stores each token's K and V in a paged KV cache, in the same pass (cache.h): in place
// (`outs` nullptr) or into the out= form's outputs (q_out, k_out, v_out, gate_out or nullptr).
void split_cache(const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
                 const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq, int64_t hkv,
                 double eps, int64_t rope, const Tensor& key_cache, const Tensor& value_cache,
                 const Tensor& slot_mapping, int64_t cache_mode, const OptTensor& k_scale, const OptTensor& v_scale,
                 const Tensor* const* outs) {
  const int64_t D = cache_head_dim(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope,
                                   key_cache, value_cache, slot_mapping, cache_mode, k_scale, v_scale, outs);
  alignas(64) float weights[4 * kMaxHeadDim];
  SplitPlan p = plan_for(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, D, eps,
                         decode_rope(rope), weights);
  if (outs != nullptr) {
    set_outputs(p, qkv, *outs[0], *outs[1], *outs[2], outs[3]);
  } else {
    set_inplace(p, qkv);
  }
  if (p.T > 0) check_positions(p);  // before the cache's value rules, as the Python kernels check
  CachePlan c{};
  c.layout = cache_mode & kLayoutMask;
  c.truncate = (cache_mode & kTruncateBit) != 0;
  const at::ScalarType cache_dtype = key_cache.scalar_type();
  c.fp8 = cache_dtype == at::ScalarType::Float8_e4m3fn ? Fp8::E4M3
          : cache_dtype == at::ScalarType::Float8_e5m2 ? Fp8::E5M2
                                                       : Fp8::None;
  c.elem = static_cast<int64_t>(key_cache.element_size());
  c.block_size = cache_block_size(c.layout, key_cache);
  c.k = cache_side(key_cache, c.layout, k_scale, c.truncate);
  c.v = cache_side(value_cache, c.layout, v_scale, c.truncate);
  set_slots(c, slot_mapping, p.T);
  c.stream = isa::stream_cache_rows(2 * c.n_slots * hkv * D * c.elem);
  std::vector<uint8_t> later;
  check_cache_values(c, key_cache.size(0) * c.block_size, k_scale, v_scale, later);
  c.later = later.empty() ? nullptr : later.data();
  p.kv = &c;
  if (p.T == 0) return;
  switch (qkv.scalar_type()) {
    case at::kFloat: return run_split<float>(p);
    case at::kBFloat16: return run_split<c10::BFloat16>(p);
    default: return run_split<c10::Half>(p);
  }
}

// The dispatcher's kernels of the two cache-writing forms.
void split_qkv_rmsnorm_rope_cache(const Tensor& qkv, const Tensor& positions, const Tensor& cache,
                                  const OptTensor& q_weight, const OptTensor& k_weight, const OptTensor& q_bias,
                                  const OptTensor& k_bias, int64_t hq, int64_t hkv, double eps, int64_t rope,
                                  const Tensor& key_cache, const Tensor& value_cache, const Tensor& slot_mapping,
                                  int64_t cache_mode, const OptTensor& k_scale, const OptTensor& v_scale) {
  split_cache(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, eps, rope, key_cache, value_cache,
              slot_mapping, cache_mode, k_scale, v_scale, nullptr);
}

void split_qkv_rmsnorm_rope_cache_out(const Tensor& qkv, const Tensor& positions, const Tensor& cache,
                                      const OptTensor& q_weight, const OptTensor& k_weight, const OptTensor& q_bias,
                                      const OptTensor& k_bias, int64_t hq, int64_t hkv, double eps, int64_t rope,
                                      const Tensor& key_cache, const Tensor& value_cache, const Tensor& slot_mapping,
                                      int64_t cache_mode, const OptTensor& k_scale, const OptTensor& v_scale,
                                      const Tensor& q_out, const Tensor& k_out, const Tensor& v_out,
                                      const OptTensor& gate_out) {
  const Tensor* const outs[4] = {&q_out, &k_out, &v_out, gate_out.has_value() ? &*gate_out : nullptr};
  split_cache(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, eps, rope, key_cache, value_cache,
              slot_mapping, cache_mode, k_scale, v_scale, outs);
}

// The out= kernel with the specialised heads off: tests compare the two paths bit for bit.
void split_generic_out(const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
                       const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq,
                       int64_t hkv, double eps, int64_t rope, const Tensor& q_out, const Tensor& k_out,
                       const Tensor& v_out, const OptTensor& gate_out) {
  const Tensor* const outs[4] = {&q_out, &k_out, &v_out, gate_out.has_value() ? &*gate_out : nullptr};
  const int64_t D = head_dim(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope, outs, false);
  alignas(64) float weights[4 * kMaxHeadDim];
  SplitPlan p = plan_for(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, D, eps,
                         decode_rope(rope), weights);
  set_outputs(p, qkv, q_out, k_out, v_out, outs[3]);
  p.generic_only = true;
  run(p, qkv.scalar_type());
}

std::vector<int64_t> decoded_rope(int64_t code) {
  const Rope r = decode_rope(code);
  return {r.neox, r.mrope, r.interleaved, r.sections[0], r.sections[1], r.sections[2], r.q_gate, r.gemma};
}

}  // namespace

namespace {

std::vector<int64_t> mrope_axis_map(int64_t half, c10::IntArrayRef section, bool interleaved) {
  TORCH_CHECK(section.size() == 3, "mrope_axis_map: three sections expected");
  // The kernels' bounds (rotary_dim // 2 <= 256, sections in the rope code's 10 bits): the table stays small and
  // 3 * s_h, s_t + s_h cannot wrap.
  if (half < 0 || half > kMaxHalf) {
    checks::fail(checks::Kind::Value, "half", std::to_string(half),
                 "an int in [0, " + std::to_string(kMaxHalf) + "]");
  }
  for (const int64_t s : section) {
    if (s < 0 || s > 1023) {
      checks::fail(checks::Kind::Value, "mrope_section", checks::py_tuple(section), "three ints in [0, 1023]");
    }
  }
  std::vector<int64_t> axes(half);
  for (int64_t j = 0; j < half; ++j) axes[j] = mrope_axis(j, section[0], section[1], section[2], interleaved);
  return axes;
}

// The specialised paths' bf16 rounding on its own, for tests (builds with isa::kPackBlock > 0): x (fp32, a multiple
// of 32 values) in blocks of B = kPackBlock values (AVX2's Bf16Block: 16; AVX-512's round_lanes: 32), the first B/2
// as even lanes and the last B/2 as odd lanes, so out[B c + 2j] = bf16(x[B c + j]) and
// out[B c + 2j + 1] = bf16(x[B c + B/2 + j]).
Tensor pack_rne_blocks(const Tensor& x) {
  TORCH_CHECK(isa::kPackBlock > 0 && x.scalar_type() == at::kFloat && x.dim() == 1 && x.is_contiguous() &&
                  x.numel() % 32 == 0,
              "pack_rne_blocks: a contiguous 1-D fp32 tensor of 32k values");
  Tensor out = at::empty({x.numel()}, x.options().dtype(at::kBFloat16));
  const float* src = x.const_data_ptr<float>();
  auto* dst = out.mutable_data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < x.numel(); i += isa::kPackBlock) isa::pack_rne_block(src + i, dst + i);
  return out;
}

int64_t pack_rne_block_size() { return isa::kPackBlock; }

}  // namespace
}  // namespace qkvfuse_cpu

namespace qkvfuse_cpu {
// The cache-writing split's argument rules (cache_head_dim() above), for the Triton ops' host kernels.
int64_t check_cache_args(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cache,
                         const std::optional<at::Tensor>& q_weight, const std::optional<at::Tensor>& k_weight,
                         const std::optional<at::Tensor>& q_bias, const std::optional<at::Tensor>& k_bias, int64_t hq,
                         int64_t hkv, int64_t rope, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& slot_mapping, int64_t cache_mode, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale, const at::Tensor* const* outs) {
  return cache_head_dim(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope, key_cache,
                        value_cache, slot_mapping, cache_mode, k_scale, v_scale, outs);
}

// The cache's value rules (check_cache_values above) for CPU tensors, for the Triton ops' host kernels: the first
// min(num_tokens, len(slot_mapping)) slots below the capacity, the FP8 scales positive and finite.
void check_cpu_cache_values(const at::Tensor& key_cache, const at::Tensor& slot_mapping, int64_t cache_mode,
                            int64_t num_tokens, const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale) {
  if (!slot_mapping.device().is_cpu()) return;
  CachePlan c{};
  set_slots(c, slot_mapping, num_tokens);
  const int64_t block_size = cache_block_size(cache_mode & kLayoutMask, key_cache);
  std::vector<uint8_t> later;
  check_cache_values(c, key_cache.size(0) * block_size, k_scale, v_scale, later);
}

// The split's argument rules (head_dim() above), for the Triton ops' host kernels (triton_host.cpp).
int64_t check_split_args(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cache,
                         const std::optional<at::Tensor>& q_weight, const std::optional<at::Tensor>& k_weight,
                         const std::optional<at::Tensor>& q_bias, const std::optional<at::Tensor>& k_bias, int64_t hq,
                         int64_t hkv, int64_t rope, const at::Tensor* const* outs, bool inplace) {
  return head_dim(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope, outs, inplace);
}
}  // namespace qkvfuse_cpu

TORCH_LIBRARY_IMPL(qkvfuse, CPU, m) {
  m.impl("split_qkv_rmsnorm_rope", &qkvfuse_cpu::split_qkv_rmsnorm_rope);
  m.impl("split_qkv_rmsnorm_rope_out", &qkvfuse_cpu::split_qkv_rmsnorm_rope_out);
  m.impl("split_qkv_rmsnorm_rope_inplace", &qkvfuse_cpu::split_qkv_rmsnorm_rope_inplace);
  m.impl("split_qkv_rmsnorm_rope_cache", &qkvfuse_cpu::split_qkv_rmsnorm_rope_cache);
  m.impl("split_qkv_rmsnorm_rope_cache_out", &qkvfuse_cpu::split_qkv_rmsnorm_rope_cache_out);
}

// Introspection for tests: the kernel's copy of the mRoPE axis rule, its parallel grain, its bf16 rounding.
TORCH_LIBRARY(qkvfuse_cpu, m) {
  m.def("mrope_axis_map(int half, int[] mrope_section, bool interleaved) -> int[]", &qkvfuse_cpu::mrope_axis_map);
  m.def("decode_rope(int rope) -> int[]", &qkvfuse_cpu::decoded_rope);
  m.def("grain_items(int elems_per_item) -> int", [](int64_t n) {
    // grain_items divides by n: the kernels pass head_dim or the hidden size, both >= 1.
    namespace ck = qkvfuse_cpu::checks;
    if (n < 1) ck::fail(ck::Kind::Value, "elems_per_item", std::to_string(n), "an int >= 1");
    return qkvfuse_cpu::grain_items(n);
  });
  m.def("split_generic_out(Tensor qkv, Tensor positions, Tensor cos_sin_cache, Tensor? q_weight, Tensor? k_weight, "
        "Tensor? q_bias, Tensor? k_bias, int num_q_heads, int num_kv_heads, float eps, int rope, Tensor(a!) q_out, "
        "Tensor(b!) k_out, Tensor(c!) v_out, Tensor(d!)? gate_out=None) -> ()",
        &qkvfuse_cpu::split_generic_out);
  if (qkvfuse_cpu::isa::kPackBlock > 0) {  // the DEFAULT build has no specialised rounding
    m.def("pack_rne_blocks(Tensor x) -> Tensor", &qkvfuse_cpu::pack_rne_blocks);
    m.def("pack_rne_block_size() -> int", &qkvfuse_cpu::pack_rne_block_size);
  }
}
