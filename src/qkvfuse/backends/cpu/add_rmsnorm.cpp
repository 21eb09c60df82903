// add_rmsnorm on CPU (semantics: qkvfuse/reference.py). One row per work item, two passes over the row:
// the first forms s = x + residual rounded to the I/O dtype (stored as residual_out) and sums its squares, the
// second normalises s -- re-read from residual_out, still in L1/L2 -- into y. Each row's bits depend only on
// that row, never on the thread split or on T.
#include "avx512.h"
#include "checks.h"
#include "optional_ref.h"
#include "vec_io.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace qkvfuse_cpu {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

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

template <typename T>
QKVFUSE_FLATTEN void norm_row(const NormPlan& p, int64_t t) {
  const int64_t H = p.H;
  const T* x = static_cast<const T*>(p.x) + t * p.x_rs;
  const T* r = p.r != nullptr ? static_cast<const T*>(p.r) + t * p.r_rs : nullptr;
  T* r_out = p.r_out != nullptr ? static_cast<T*>(p.r_out) + t * p.r_out_rs : nullptr;
  T* y = static_cast<T*>(p.y) + t * p.y_rs;

  // Pass 1: s (rounded to T exactly as the unfused add rounds it) and sum of s^2 in fp32.
  fVec acc0(0.f), acc1(0.f);
  double tail = 0.0;
  int64_t d = 0;
  for (; d + 2 * kF <= H; d += 2 * kF) {
    fVec a, b;
    Io<T>::load2(x + d, a, b);
    if (r != nullptr) {
      fVec ra, rb;
      Io<T>::load2(r + d, ra, rb);
      a = a + ra;
      b = b + rb;
      Io<T>::store2_rounded(r_out + d, a, b);
    }
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
  }
  for (; d < H; ++d) {
    float s = static_cast<float>(x[d]);
    if (r != nullptr) {
      r_out[d] = static_cast<T>(s + static_cast<float>(r[d]));
      s = static_cast<float>(r_out[d]);
    }
    tail = std::fma(s, s, tail);
  }
  double ss = 0.0;
  const float inv = inv_rms<T>(acc0, acc1, tail, H, p.eps, &ss);

  // Pass 2: y = (s * inv) * w (+ b), rounded once. s is re-read from where pass 1 left it (exactly aliased
  // outputs are safe: every element is read before its own position is written).
  const T* s = r != nullptr ? r_out : x;
  const fVec vinv(inv);
  auto norm = [&](const fVec& v, int64_t i) {
    fVec out = v * vinv * fVec::loadu(p.w + i);
    return p.b != nullptr ? out + fVec::loadu(p.b + i) : out;
  };
  // Finite row and weights: the bf16 stores may skip their NaN fix-up (see Io<BFloat16>::store2_finite).
  auto body = [&](auto store2) {
    int64_t i = 0;
    for (; i + 2 * kF <= H; i += 2 * kF) {
      fVec a, b;
      Io<T>::load2(s + i, a, b);
      store2(y + i, norm(a, i), norm(b, i + kF));
    }
    return i;
  };
  if (p.weights_finite && std::isfinite(ss)) {
    d = body([](T* q, const fVec& u, const fVec& v) { Io<T>::store2_finite(q, u, v); });
  } else {
    d = body([](T* q, const fVec& u, const fVec& v) { Io<T>::store2(q, u, v); });
  }
  for (; d < H; ++d) {
    float v = static_cast<float>(s[d]) * inv * p.w[d];
    if (p.b != nullptr) v = v + p.b[d];
    y[d] = static_cast<T>(v);
  }
}

// Rows split statically: thread i always takes the same contiguous block of rows (at::parallel_for), so a call
// on the same buffers (the residual stream of the next layer, an in-place x) finds its rows in the same core's
// L2. Dynamic chunks (parallel_chunks) moved rows between cores from call to call: 1.3-1.5x slower at T = 16-64.
template <typename F>
void for_rows(const NormPlan& p, const F& f) {
  if (p.T > 0) at::parallel_for(0, p.T, grain_items(p.H), f);
}

template <typename T>
void run_norm(const NormPlan& p) {
  for_rows(p, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row<T>(p, t);
  });
}

#if defined(CPU_CAPABILITY_AVX2)
// bf16 rows of a multiple of 16 values with finite weights, in the lane order of the split's specialised path
// (Bf16Block, pack_rne; p.w and p.b are in lane order): s = x + residual rounded once to bf16 (the unfused
// add's value), the sum of the rounded s^2 in fp32, y = (s * inv) * w (+ b) rounded once -- the generic row's
// sequence, except that the sum runs over even/odd lanes instead of halves (another fp32 summation order).
// Chosen by dtype, H and the weights only: every row of a call takes the same path. Any NaN reaching pack_rne
// comes from a bf16 input or is the default NaN (the weights are finite), so its rounding is exact.
// kBf16Weights: the weight (and bias) are bf16 and read as stored -- Bf16Block::load puts them in the same lane
// order, with the same fp32 values as the converted ones, so the bits are those of the fp32-weight rows. Any
// NaN then also comes from a bf16 input (a weight) or is the default NaN: no finiteness check is needed, and the
// call makes no conversion pass over the weights (~0.7-1 us of a decode row).
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
bool run_norm_bf16(NormPlan p) {
  if (p.H % 16 != 0) return false;
  // The weights in lane order, checked finite in the same pass, in a per-thread buffer that only grows: no
  // allocation, zero-filling or second pass per call (a decode row of 4096 costs ~1.2 us; these were ~0.7 us).
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

bool is_bf16_vector(const Tensor& t, int64_t n) {
  return t.scalar_type() == at::kBFloat16 && t.dim() == 1 && t.size(0) == n && t.stride(0) == 1 && t.device().is_cpu();
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// The specialised rows (avx512.h) for 16-bit activations and H % 32 == 0: bf16 in lane order, fp16 with the
// generic bits. Weights (and bias) in the activations' dtype are read as stored; fp32 ones are read in place
// (fp16) or from a lane-order copy made once per call (bf16), in a per-thread buffer that only grows.
bool is_vector_of(const Tensor& t, at::ScalarType dtype, int64_t n) {
  return t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == n && t.stride(0) == 1 && t.device().is_cpu();
}

template <typename T, typename W>
void run_norm_avx512_rows(const NormPlan& p, const W* w, const W* b) {
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
bool run_norm_avx512_typed(const NormPlan& p, const Tensor& weight, const OptRef& bias, at::ScalarType dtype,
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

bool run_norm_avx512(const NormPlan& p, at::ScalarType dtype, const Tensor& weight, const OptRef& bias,
                     const float* fp32_w) {
  return dtype == at::kBFloat16 ? run_norm_avx512_typed<c10::BFloat16>(p, weight, bias, dtype, fp32_w)
                                : run_norm_avx512_typed<c10::Half>(p, weight, bias, dtype, fp32_w);
}
#endif

void check_rows(const Tensor& t, const Tensor& x, const char* what) {
  TORCH_CHECK(t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() && t.device().is_cpu() &&
                  (t.numel() == 0 || (t.stride(1) == 1 && t.stride(0) >= t.size(1))),
              "qkvfuse cpu kernel: bad ", what, " ", t.sizes(), " ", t.strides());
}

// A 1-D weight or bias as fp32: a contiguous fp32 tensor is used where it is, anything else converted into buf.
const float* fp32_vector(const Tensor& t, int64_t n, std::vector<float>& buf) {
  if (is_fp32_vector(t, n)) return t.const_data_ptr<float>();
  buf.resize(n);
  vector_to_fp32(t, n, buf.data());
  return buf.data();
}

// generic_only: the specialised rows off (qkvfuse_cpu::add_rmsnorm_generic_out, for tests).
void add_rmsnorm_out_impl(const Tensor& x, const OptRef& residual, const Tensor& weight, const OptRef& bias,
                          double eps, const Tensor& y_out, const OptRef& residual_out, bool generic_only = false,
                          bool gemma = false) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                               x.scalar_type() == at::kHalf),
              "qkvfuse cpu kernel: bad x ", x.sizes());
  check_rows(x, x, "x");
  check_rows(y_out, x, "y_out");
  TORCH_CHECK(residual.has_value() == residual_out.has_value(),
              "qkvfuse cpu kernel: residual and residual_out come together");
  const int64_t T = x.size(0), H = x.size(1);
  if (T == 0 || H == 0) return;
  // Gemma norms: the weight is stored centred at 0; the rows use 1 + w, computed in fp32 as the models do (the
  // calling thread owns the buffer until the parallel loop has joined).
  thread_local std::vector<float> gemma_buf;
  const float* gemma_w = nullptr;
  if (gemma) {
    gemma_buf.resize(H);
    vector_to_fp32(weight, H, gemma_buf.data());
    for (int64_t i = 0; i < H; ++i) gemma_buf[i] = 1.0f + gemma_buf[i];
    gemma_w = gemma_buf.data();
  }
  NormPlan p{};
  p.T = T;
  p.H = H;
  p.x = x.const_data_ptr();
  p.x_rs = x.stride(0);
  p.y = y_out.data_ptr();
  p.y_rs = y_out.stride(0);
  if (residual.has_value()) {
    check_rows(*residual, x, "residual");
    check_rows(*residual_out, x, "residual_out");
    p.r = residual->const_data_ptr();
    p.r_rs = residual->stride(0);
    p.r_out = residual_out->data_ptr();
    p.r_out_rs = residual_out->stride(0);
  }
  p.eps = static_cast<float>(eps);
#if defined(CPU_CAPABILITY_AVX512)
  // bf16 / fp16 rows of whole 32-value blocks (avx512.h: the generic row's bits); a weight (and bias) in the
  // activations' dtype, contiguous, is widened as it is read -- no conversion pass per call.
  if (!generic_only && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) && H % 32 == 0 &&
      run_norm_avx512(p, x.scalar_type(), weight, bias, gemma_w)) {
    return;
  }
#endif
#if defined(CPU_CAPABILITY_AVX2)
  // A bf16 model's weights: read as stored, no conversion (the common case of an engine's decoder norms).
  if (!generic_only && gemma_w == nullptr && x.scalar_type() == at::kBFloat16 && H % 16 == 0 &&
      is_bf16_vector(weight, H) && (!bias.has_value() || is_bf16_vector(*bias, H))) {
    p.w16 = weight.const_data_ptr<c10::BFloat16>();
    p.b16 = bias.has_value() ? bias->const_data_ptr<c10::BFloat16>() : nullptr;
    for_rows(p, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) norm_row_bf16<true>(p, t);
    });
    return;
  }
#endif
  // std::vectors rather than stack arrays: H is the model's hidden size, unbounded here.
  std::vector<float> w_buf, b_buf;
  const float* w = gemma_w != nullptr ? gemma_w : fp32_vector(weight, H, w_buf);
  const float* b = bias.has_value() ? fp32_vector(*bias, H, b_buf) : nullptr;
  p.w = w;
  p.b = b;
#if defined(CPU_CAPABILITY_AVX2)
  if (!generic_only && x.scalar_type() == at::kBFloat16 && run_norm_bf16(p)) return;
#endif
  p.weights_finite = all_finite(w, H) && (b == nullptr || all_finite(b, H));
  switch (x.scalar_type()) {
    case at::kFloat: return run_norm<float>(p);
    case at::kBFloat16:
      return run_norm<c10::BFloat16>(p);
    default: return run_norm<c10::Half>(p);
  }
}

// Without a residual the second output is an empty placeholder (the public function returns x there).
std::tuple<Tensor, Tensor> add_rmsnorm_impl(const Tensor& x, const OptRef& residual, const Tensor& weight,
                                            const OptRef& bias, double eps, bool gemma) {
  Tensor y = at::empty(x.sizes(), x.options());
  if (!residual.has_value()) {
    add_rmsnorm_out_impl(x, residual, weight, bias, eps, y, OptRef(), false, gemma);
    return {y, at::empty({0}, x.options())};
  }
  Tensor r_out = at::empty(x.sizes(), x.options());
  add_rmsnorm_out_impl(x, residual, weight, bias, eps, y, r_out, false, gemma);
  return {y, r_out};
}

// The per-call rules of qkvfuse/_checks.py check_norm, in its order and with its messages (checks.h). `y_out`:
// the out= form's outputs (with residual_out); `inplace`: x and residual are the in-place targets.
void check_norm(const Tensor& x, const OptTensor& residual, const Tensor& weight, const OptTensor& bias,
                const Tensor* y_out, const OptTensor* residual_out, bool inplace) {
  namespace ck = checks;
  using ck::Kind;
  if (!ck::is_float(x.scalar_type())) {
    ck::fail(Kind::Type, "x", "dtype " + ck::py_dtype(x.scalar_type()), ck::kFloatNames);
  }
  if (x.dim() != 2 || x.size(1) < 1) {
    ck::fail(Kind::Value, "x", "shape " + ck::py_tuple(x.sizes()), "shape (T, H) with H >= 1");
  }
  const int64_t T = x.size(0), H = x.size(1);
  ck::rows("x", x, H);
  const c10::Device dev = x.device();
  if (residual.has_value()) {
    const Tensor& r = *residual;
    ck::device("residual", r, dev, "x");
    if (r.scalar_type() != x.scalar_type()) {
      ck::fail(Kind::Type, "residual", "dtype " + ck::py_dtype(r.scalar_type()),
               "dtype " + ck::py_dtype(x.scalar_type()) + " (x's)");
    }
    if (r.sizes() != x.sizes()) {
      ck::fail(Kind::Value, "residual", "shape " + ck::py_tuple(r.sizes()),
               "shape " + ck::py_tuple(x.sizes()) + " (x's)");
    }
    ck::rows("residual", r, H);
  }
  ck::vector("weight", weight, H, dev, "x");
  if (bias.has_value()) ck::vector("bias", *bias, H, dev, "x");
  const ck::Named w{"weight", &weight}, b{"bias", bias.has_value() ? &*bias : nullptr},
      xr{"x", &x}, rr{"residual", residual.has_value() ? &*residual : nullptr};
  ck::io_dtype("x", x.scalar_type(), {w, b});
  ck::no_grad({xr, rr, w, b});
  if (y_out != nullptr) {
    const bool has_r_out = residual_out->has_value();
    if (residual.has_value() != has_r_out) {
      ck::fail(Kind::Value, "residual_out", has_r_out ? "a tensor" : "None", "a tensor exactly when residual is given");
    }
    ck::out_tensor("y_out", *y_out, T, H, x, "x");
    if (has_r_out) ck::out_tensor("residual_out", **residual_out, T, H, x, "x");
    ck::outputs(ck::entries({{"y_out", y_out}, {"residual_out", has_r_out ? &**residual_out : nullptr}}),
                ck::entries({xr, rr, w, b}), [&](const char* name) {
                  const bool y = name[0] == 'y';
                  const Tensor* own = y ? &x : rr.t;
                  return own == nullptr ? ck::Own{"residual", 0, 0, 0, false}
                                        : ck::Own{y ? "x" : "residual", ck::address(*own), own->stride(0),
                                                  own->stride(1), true};
                });
  } else if (inplace) {
    ck::targets(ck::entries({xr, rr}), ck::entries({w, b}));
  }
}

// The dispatcher's kernels (TORCH_LIBRARY_IMPL below): the schema's optional tensors, borrowed.
void add_rmsnorm_out(const Tensor& x, const OptTensor& residual, const Tensor& weight, const OptTensor& bias,
                     double eps, const Tensor& y_out, const OptTensor& residual_out, bool gemma) {
  check_norm(x, residual, weight, bias, &y_out, &residual_out, false);
  add_rmsnorm_out_impl(x, borrow(residual), weight, borrow(bias), eps, y_out, borrow(residual_out), false, gemma);
}

// In place (the engines' form): y over x, the rounded sum over residual. Exact aliasing is safe (norm_row).
void add_rmsnorm_inplace(const Tensor& x, const OptTensor& residual, const Tensor& weight, const OptTensor& bias,
                         double eps, bool gemma) {
  check_norm(x, residual, weight, bias, nullptr, nullptr, true);
  add_rmsnorm_out_impl(x, borrow(residual), weight, borrow(bias), eps, x, borrow(residual), false, gemma);
}

void add_rmsnorm_generic_out(const Tensor& x, const OptTensor& residual, const Tensor& weight,
                             const OptTensor& bias, double eps, const Tensor& y_out, const OptTensor& residual_out,
                             bool gemma) {
  check_norm(x, residual, weight, bias, &y_out, &residual_out, false);
  add_rmsnorm_out_impl(x, borrow(residual), weight, borrow(bias), eps, y_out, borrow(residual_out), true, gemma);
}

std::tuple<Tensor, Tensor> add_rmsnorm(const Tensor& x, const OptTensor& residual, const Tensor& weight,
                                       const OptTensor& bias, double eps, bool gemma) {
  check_norm(x, residual, weight, bias, nullptr, nullptr, false);
  return add_rmsnorm_impl(x, borrow(residual), weight, borrow(bias), eps, gemma);
}

}  // namespace
}  // namespace qkvfuse_cpu

TORCH_LIBRARY_IMPL(qkvfuse, CPU, m) {
  m.impl("add_rmsnorm", &qkvfuse_cpu::add_rmsnorm);
  m.impl("add_rmsnorm_out", &qkvfuse_cpu::add_rmsnorm_out);
  m.impl("add_rmsnorm_inplace", &qkvfuse_cpu::add_rmsnorm_inplace);
}

// For tests: the out= kernel with the specialised rows off (compared bit for bit with the default).
TORCH_LIBRARY_FRAGMENT(qkvfuse_cpu, m) {
  m.def("add_rmsnorm_generic_out(Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps, "
        "Tensor(a!) y_out, Tensor(b!)? residual_out, bool gemma=False) -> ()",
        &qkvfuse_cpu::add_rmsnorm_generic_out);
}
