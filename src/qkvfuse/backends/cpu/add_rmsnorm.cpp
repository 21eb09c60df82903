// add_rmsnorm on CPU (semantics: qkvfuse/reference.py). One row per work item, two passes over the row:
// the first forms s = x + residual rounded to the I/O dtype (stored as residual_out) and sums its squares, the
// second normalises s -- re-read from residual_out, still in L1/L2 -- into y. Each row's bits depend only on
// that row, never on the thread split or on T.
#include "checks.h"
#include "isa.h"
#include "optional_ref.h"
#include "plan.h"
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

template <typename T>
void run_norm(const NormPlan& p) {
  for_rows(p, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row<T>(p, t);
  });
}

// A row tensor as check_norm() checked it (checks::rows / out_tensor), or as the functional form allocated it.
void check_rows(const Tensor& t, const Tensor& x, const char* what) {
  QKVFUSE_DEBUG_ASSERT(t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() && t.device().is_cpu() &&
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

// From arguments check_norm() has checked: every registered op runs it first, so its memory-safety rules are
// asserted again only in a debug build. generic_only: the specialised rows off (qkvfuse_cpu::add_rmsnorm_generic_out,
// for tests).
void add_rmsnorm_out_impl(const Tensor& x, const OptRef& residual, const Tensor& weight, const OptRef& bias,
                          double eps, const Tensor& y_out, const OptRef& residual_out, bool generic_only = false,
                          bool gemma = false) {
  QKVFUSE_DEBUG_ASSERT(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                                        x.scalar_type() == at::kHalf),
                       "qkvfuse cpu kernel: bad x ", x.sizes());
  check_rows(x, x, "x");
  check_rows(y_out, x, "y_out");
  QKVFUSE_DEBUG_ASSERT(residual.has_value() == residual_out.has_value(),
                       "qkvfuse cpu kernel: residual and residual_out come together");
  QKVFUSE_DEBUG_ASSERT(weight.dim() == 1 && weight.size(0) == x.size(1) && (!bias.has_value() ||
                           (bias->dim() == 1 && bias->size(0) == x.size(1))),
                       "qkvfuse cpu kernel: bad weight or bias");
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
  // The build's specialised rows reading the weights as stored (isa.h), where they apply.
  if (!generic_only && isa::norm_rows_stored(p, x.scalar_type(), weight, bias, gemma_w)) return;
  // std::vectors rather than stack arrays: H is the model's hidden size, unbounded here.
  std::vector<float> w_buf, b_buf;
  const float* w = gemma_w != nullptr ? gemma_w : fp32_vector(weight, H, w_buf);
  const float* b = bias.has_value() ? fp32_vector(*bias, H, b_buf) : nullptr;
  p.w = w;
  p.b = b;
  if (!generic_only && isa::norm_rows_fp32(p, x.scalar_type())) return;
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

namespace qkvfuse_cpu {
// add_rmsnorm's argument rules (check_norm() above), for the Triton ops' host kernels (triton_host.cpp).
void check_norm_args(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, const at::Tensor* y_out,
                     const std::optional<at::Tensor>* residual_out, bool inplace) {
  check_norm(x, residual, weight, bias, y_out, residual_out, inplace);
}
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
