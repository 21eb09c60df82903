// What a kernel call needs once its arguments are checked: the split's SplitPlan and add_rmsnorm's NormPlan,
// shared by the drivers (split_qkv_rmsnorm_rope.cpp, add_rmsnorm.cpp) and the ISA heads and rows (isa.h).
#pragma once

#include "vec_io.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdint>

// A rule the entry's validator (checks.h, head_dim(), check_norm()) has already enforced on every path into the
// kernel: checked only in a debug build (-DQKVFUSE_DEBUG), where it names the broken invariant. The condition is
// not evaluated otherwise.
#if defined(QKVFUSE_DEBUG)
#define QKVFUSE_DEBUG_ASSERT(cond, ...) TORCH_INTERNAL_ASSERT(cond, __VA_ARGS__)
#else
#define QKVFUSE_DEBUG_ASSERT(cond, ...) static_cast<void>(sizeof(!(cond)))
#endif

namespace qkvfuse_cpu {

constexpr int64_t kMaxHalf = kMaxHeadDim / 2;

struct CachePlan;  // cache.h

struct SplitPlan {
  int64_t T, hq, hkv, D, R, half, max_pos;
  const void* qkv;
  int64_t qkv_rs;  // row strides in elements
  // The row's layout: Q head h at column h * q_hs, K head j at k_col + j * D, V at k_col + hkv * D. Plain:
  // q_hs = D, k_col = hq * D; gated (q_gate): [q_0 | g_0 | q_1 | g_1 | ...], q_hs = 2 * D (gate head h at
  // column h * q_hs + D), k_col = 2 * hq * D.
  int64_t q_hs, k_col;
  void* q;
  int64_t q_rs;
  void* k;
  int64_t k_rs;
  void* v;  // nullptr when v_out already is qkv's own V slice
  int64_t v_rs;
  void* gate;  // the gated out= forms' gate_out (gate heads copied), nullptr otherwise
  int64_t gate_rs;
  // The gated in-place form: each token's Q/gate region is one work item, read whole (into a per-thread copy)
  // before its Q heads and then its gate heads are written back over it; q is qkv itself (Q heads from column
  // 0, gate heads from column hq * D after them).
  bool gated_inplace;
  const void* pos;
  bool pos64;
  int64_t pos_s_axis, pos_s_t;
  bool mrope;
  uint8_t axis[kMaxHalf];
  alignas(64) float on_h[kMaxHalf], on_w[kMaxHalf];  // axis == 1 / axis == 2 as all-ones lane masks
  const void* cache;
  at::ScalarType cache_dtype;
  int64_t cache_rs;
  const float *wq, *wk, *bq, *bk;  // fp32 copies, nullptr when absent
  bool weights_finite;
  float eps;
  bool neox;
  bool generic_only;  // the specialised heads off (qkvfuse_cpu::split_generic_out, for tests)
  const CachePlan* kv;  // the cache-writing split's KV cache (in place only), nullptr otherwise
};

struct NormPlan {
  int64_t T, H;
  const void* x;
  int64_t x_rs;
  const void* r;  // nullptr without residual
  int64_t r_rs;
  void* y;
  int64_t y_rs;
  void* r_out;  // nullptr without residual
  int64_t r_out_rs;
  const float* w;
  const float* b;  // nullptr without bias
  // bf16 weight / bias read as stored (the lane-order bf16 rows only; then w and b are unused)
  const c10::BFloat16* w16;
  const c10::BFloat16* b16;
  bool weights_finite;
  float eps;
};

// Rows split statically: thread i always takes the same contiguous block of rows (at::parallel_for), so a call
// on the same buffers (the residual stream of the next layer, an in-place x) finds its rows in the same core's
// L2; dynamic chunks (parallel_chunks) moved rows between cores from call to call.
template <typename F>
void for_rows(const NormPlan& p, const F& f) {
  if (p.T > 0) at::parallel_for(0, p.T, grain_items(p.H), f);
}

}  // namespace qkvfuse_cpu
