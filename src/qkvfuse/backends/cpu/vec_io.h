// Loads and stores between fp32 registers and fp32/bf16/fp16 memory, shared by the qkvfuse CPU kernels.
//
// All arithmetic happens in Vectorized<float>. Narrow types are widened on load (exact) and rounded once on
// store, to nearest even -- the same rounding as torch's `.to(torch.bfloat16)` / `.to(torch.float16)`, in the
// vector path (ATen's converters) and in the scalar tails (c10::BFloat16 / c10::Half constructors) alike.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace qkvfuse_cpu {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kF = fVec::size();  // fp32 lanes per register (8 with AVX2, 16 with AVX-512)

// On a per-row/per-head kernel: inline every call in it. GCC otherwise keeps ATen's fp32 -> bf16 converter
// out of line, and the call spills the vectors to memory on every store.
#if defined(__GNUC__)
#define QKVFUSE_FLATTEN __attribute__((flatten))
#else
#define QKVFUSE_FLATTEN
#endif

// Widest head a kernel's on-stack fp32 staging buffer holds (ops.MAX_HEAD_DIM).
constexpr int64_t kMaxHeadDim = 512;

// The specialised heads without QK-norm (one pass) request the line this many bytes past each line they read: a
// row's V columns, which the in-place and V-aliased forms never touch, interrupt the hardware's sequential prefetch
// at every token. With QK-norm the heads request the next batch during their second pass instead
// (request_next_batch, below).
constexpr int64_t kPrefetchAhead = 2048;

// A prefetch never faults, so the address may lie past the tensor's end; it is formed as an integer.
inline void prefetch_past(const void* p, int64_t bytes) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)));
}

inline void prefetch_ahead(const void* p) { prefetch_past(p, kPrefetchAhead); }

// With QK-norm a batch's first pass (the sums of squares) makes no requests; its second pass requests, as it
// reaches head k, the memory one batch further on (head k's lines + n * src_stride): the next batch of Q heads,
// after the last one the K and V heads, after the K heads the V columns. A batch of 16 normed heads computes for
// longer than a line takes to arrive, so the next batch's first pass finds its heads in cache, and the requests
// stay sequential through the V columns (which nothing reads in place), so the hardware's stream prefetcher
// carries on into the next token (the AVX-512 heads and the AVX2 fast_heads); requesting exactly the next heads
// instead (K, then the next token's Q) breaks that stream. Without QK-norm (one pass) there is no computing to hide a
// request behind and prefetch_ahead stays the faster (bench/ has the measurements).
inline void request_next_batch(const void* head, int64_t n, int64_t src_stride_bytes, int64_t head_bytes) {
  for (int64_t b = 0; b < head_bytes; b += 64) prefetch_past(head, n * src_stride_bytes + b);
}

// A row pass that reads one buffer and writes another: step(i, load(i)) for the blocks i = 0, kBlock, ... < n,
// with the loads one group of kAhead blocks ahead of the steps' stores. A load issued after a store whose address
// matches its own in the low 12 bits waits on that store (4 KiB aliasing), so when the buffer written lies just
// past the one read modulo 4 KiB -- as two allocations may fall -- a pass loading each block right after storing the
// previous one waits at every block; loading a group ahead makes a pass's speed independent of where its buffers
// lie (bench/ has the sweep over offsets). A step may store over its own block, never over a later one: the next
// group is loaded before it runs.
template <int64_t kBlock, int kAhead, typename V, typename Load, typename Step>
inline void ahead_of_stores(int64_t n, const Load& load, const Step& step) {
  constexpr int64_t kGroup = kBlock * kAhead;
  const int64_t full = n / kGroup * kGroup;
  if (full > 0) {
    V cur[kAhead], next[kAhead];
#pragma GCC unroll 16
    for (int k = 0; k < kAhead; ++k) cur[k] = load(kBlock * k);
    for (int64_t i = 0; i < full; i += kGroup) {
      if (i + kGroup < full) {
#pragma GCC unroll 16
        for (int k = 0; k < kAhead; ++k) next[k] = load(i + kGroup + kBlock * k);
      }
#pragma GCC unroll 16
      for (int k = 0; k < kAhead; ++k) step(i + kBlock * k, cur[k]);
#pragma GCC unroll 16
      for (int k = 0; k < kAhead; ++k) cur[k] = next[k];
    }
  }
  for (int64_t i = full; i < n; i += kBlock) step(i, load(i));
}

// Minimum elements a thread's share must hold before at::parallel_for forks: below it the fork/join costs
// more than the work (a decode token of Qwen3-8B is 40 heads x 128 = 5 120 elements: one thread).
constexpr int64_t kGrainElems = 16384;

inline int64_t grain_items(int64_t elems_per_item) {
  return elems_per_item >= kGrainElems ? 1 : (kGrainElems + elems_per_item - 1) / elems_per_item;
}

// Chunks handed out per thread by parallel_chunks: enough that a thread slowed down by a busy sibling core
// (a shared VM, another process) leaves its share to the others instead of holding up the join.
constexpr int64_t kChunksPerThread = 8;

// f(begin, end) over [0, n): on one thread when n is within `grain` items (or inside a parallel region),
// otherwise on up to torch.get_num_threads() threads of at::parallel_for that take chunks from a shared
// counter until none are left. `n` is a whole number of rows of `align` items (a row's items share per-row
// setup), and chunks are whole rows unless all the work is less than a row per thread. Callers compute every
// item independently of the others, so the bits never depend on which thread ran which chunk.
template <typename F>
void parallel_chunks(int64_t n, int64_t grain, int64_t align, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) f(0, n);
    return;
  }
  // Each thread's share of whole rows, cut into at most kChunksPerThread chunks of about a grain or more:
  // long runs of consecutive rows per chunk keep the hardware prefetchers streaming; a share that is a few
  // grains long is cut evenly (grain-sized chunks of 6 rows over 2 threads would run 4 rows against 2).
  // A single row (a decode token) is split evenly between the threads.
  const int64_t rows = n / align;
  int64_t chunk;
  if (rows < threads) {
    chunk = (n + threads - 1) / threads;
  } else {
    const int64_t share = (rows + threads - 1) / threads;
    const int64_t pieces = std::min(kChunksPerThread, (share * align + grain - 1) / grain);
    chunk = (share + pieces - 1) / pieces * align;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(chunk, std::memory_order_relaxed); b < n;
         b = next.fetch_add(chunk, std::memory_order_relaxed)) {
      f(b, std::min(n, b + chunk));
    }
  });
}

inline float reduce_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](const fVec& x, const fVec& y) { return x + y; }, v);
}

// Sum of two accumulators' lanes plus a scalar tail, in double and a fixed tree order: the per-lane partial
// sums are fp32, the cross-lane reduction (where most of an fp32 reduction's rounding happens) is not. The
// order depends only on the row length, never on threads or batch.
inline double sum_lanes(const fVec& a, const fVec& b, double tail) {
  alignas(64) float v[2 * kF];
  a.store(v);
  b.store(v + kF);
  double t[kF];
  for (int64_t i = 0; i < kF; ++i) t[i] = static_cast<double>(v[i]) + static_cast<double>(v[i + kF]);
  for (int64_t n = kF / 2; n >= 1; n /= 2) {
    for (int64_t i = 0; i < n; ++i) t[i] += t[i + n];
  }
  return t[0] + tail;
}

// 1 / sqrt(mean of squares + eps). For fp32 outputs (judged against the unfused path to within an ulp) the
// lanes are summed and the scale evaluated in double, rounded once; for bf16/fp16 outputs float is far
// below their half ulp, and the double divide and square root would sit on every head's critical path.
template <typename T>
inline float inv_rms(const fVec& a, const fVec& b, double tail, int64_t n, float eps, double* sum_sq) {
  if constexpr (std::is_same_v<T, float>) {
    *sum_sq = sum_lanes(a, b, tail);
    return static_cast<float>(1.0 / std::sqrt(*sum_sq / static_cast<double>(n) + eps));
  } else {
    const float ss = reduce_sum(a + b) + static_cast<float>(tail);
    *sum_sq = ss;
    return 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  }
}

inline bool all_finite(const float* v, int64_t n) {
  fVec probe(0.f);  // x * 0 is 0 for finite x, NaN for an infinity or a NaN
  int64_t i = 0;
  for (; i + kF <= n; i += kF) probe = probe + fVec::loadu(v + i) * fVec(0.f);
  bool ok = reduce_sum(probe) == 0.f;
  for (; i < n; ++i) ok = ok && std::isfinite(v[i]);
  return ok;
}

template <typename T>
struct Io;

template <>
struct Io<float> {
  static void load2(const float* p, fVec& a, fVec& b) {
    a = fVec::loadu(p);
    b = fVec::loadu(p + kF);
  }
  static fVec load1(const float* p) { return fVec::loadu(p); }
  static void store2(float* p, const fVec& a, const fVec& b) {
    a.store(p);
    b.store(p + kF);
  }
  static void store1(float* p, const fVec& a) { a.store(p); }
  static void store2_finite(float* p, const fVec& a, const fVec& b) { store2(p, a, b); }
  // Store a, b and replace them by the stored (rounded) values: a no-op rounding for fp32.
  static void store2_rounded(float* p, fVec& a, fVec& b) { store2(p, a, b); }
};

template <typename T>
struct Io16 {
  using bVec = at::vec::Vectorized<T>;
  static_assert(bVec::size() == 2 * kF, "a 16-bit vector holds two fp32 vectors");
  static void load2(const T* p, fVec& a, fVec& b) { at::vec::load_to_float<T>(p, a, b); }
  static fVec load1(const T* p) {
    fVec a;
    at::vec::load_to_float<T>(p, a);
    return a;
  }
  static void store2(T* p, const fVec& a, const fVec& b) { at::vec::convert_from_float<T>(a, b).store(p); }
  static void store1(T* p, const fVec& a) { at::vec::convert_from_float<T>(a, a).store(p, kF); }
  // Store for outputs of finite inputs (see Io<BFloat16>); the plain store elsewhere.
  static void store2_finite(T* p, const fVec& a, const fVec& b) { store2(p, a, b); }
  static void store2_rounded(T* p, fVec& a, fVec& b) {
    bVec rounded = at::vec::convert_from_float<T>(a, b);
    rounded.store(p);
    std::tie(a, b) = at::vec::convert_to_float<T>(rounded);
  }
};

template <>
struct Io<c10::BFloat16> : Io16<c10::BFloat16> {
#if defined(CPU_CAPABILITY_AVX2)
  // Round to nearest even without ATen's NaN fix-up (two of the ~ten instructions per 8 values). Exact for
  // every value a kernel computes from finite inputs: finite, +-inf, and the default NaN 0xffc00000 (which
  // stays a NaN); only a NaN with a low payload could round into an infinity, and those come from inputs.
  static __m256i round_bits(const fVec& v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  }
  static void store2_finite(c10::BFloat16* p, const fVec& a, const fVec& b) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bits(a), round_bits(b)), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  }
#endif
};
template <>
struct Io<c10::Half> : Io16<c10::Half> {};

// A weight or bias the kernels can read in place: a contiguous fp32 vector of n values.
inline bool is_fp32_vector(const at::Tensor& t, int64_t n) {
  return t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == n && t.stride(0) == 1 && t.device().is_cpu();
}

// A 1-D weight or bias (fp32/bf16/fp16, any stride) as fp32: read once per call, shared by every row.
inline void vector_to_fp32(const at::Tensor& t, int64_t n, float* out) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.device().is_cpu(), "qkvfuse cpu kernel: bad weight/bias ",
              t.sizes());
  const int64_t s = t.stride(0);
  // Typed pointers hoisted out of the loops: const_data_ptr<T>() checks the dtype on every call.
  switch (t.scalar_type()) {
    case at::kFloat: {
      const float* p = t.const_data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) out[i] = p[i * s];
      break;
    }
    case at::kBFloat16: {
      const c10::BFloat16* p = t.const_data_ptr<c10::BFloat16>();
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i * s]);
      break;
    }
    case at::kHalf: {
      const c10::Half* p = t.const_data_ptr<c10::Half>();
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i * s]);
      break;
    }
    default:
      TORCH_CHECK(false, "qkvfuse cpu kernel: weight/bias dtype ", t.scalar_type());
  }
}

}  // namespace qkvfuse_cpu
