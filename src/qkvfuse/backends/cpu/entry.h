// The validating entry points of the native kernels, called from python_entry.cpp (the Python fast path of
// qkvfuse.ops). Each checks its tensors with predicates that mirror qkvfuse.ops' validator rule for rule
// (plainly_valid / plainly_valid_outputs in split_qkv_rmsnorm_rope.cpp, norm_plainly_valid in add_rmsnorm.cpp)
// and either runs the kernel or returns "not taken" ([] or false) without writing anything, so that the caller
// validates in Python and raises the documented error. The scalar arguments' Python types are checked by the
// caller. Optional tensors are borrowed references (empty: absent).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace qkvfuse_cpu {

// An optional tensor inside the library: a borrowed reference (copying a std::optional<Tensor> costs refcount
// traffic, which for a tensor owned by Python also touches its PyObject).
using OptRef = at::OptionalTensorRef;

inline OptRef borrow(const std::optional<at::Tensor>& t) { return t.has_value() ? OptRef(*t) : OptRef(); }

// Functional form: fresh (q, k, v), or [] when not taken.
std::vector<at::Tensor> split_checked(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cache,
                                      int64_t hq, int64_t hkv, int64_t D, const at::OptionalTensorRef& q_weight,
                                      const at::OptionalTensorRef& k_weight,
                                      const at::OptionalTensorRef& q_bias,
                                      const at::OptionalTensorRef& k_bias, double eps, bool is_neox,
                                      c10::IntArrayRef mrope_section, bool mrope, bool mrope_interleaved);

// out= form: writes q_out, k_out, v_out and returns true, or returns false when not taken.
bool split_checked_out(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cache, int64_t hq,
                       int64_t hkv, int64_t D, const at::OptionalTensorRef& q_weight,
                       const at::OptionalTensorRef& k_weight, const at::OptionalTensorRef& q_bias,
                       const at::OptionalTensorRef& k_bias, double eps, bool is_neox,
                       c10::IntArrayRef mrope_section, bool mrope, bool mrope_interleaved, const at::Tensor& q_out,
                       const at::Tensor& k_out, const at::Tensor& v_out);

// In-place form (qkvfuse.split_qkv_rmsnorm_rope_): rewrites qkv's Q and K heads and returns its (q, k, v)
// views, or [] when not taken (also when qkv overlaps another input).
std::vector<at::Tensor> split_checked_inplace(const at::Tensor& qkv, const at::Tensor& positions,
                                              const at::Tensor& cache, int64_t hq, int64_t hkv, int64_t D,
                                              const at::OptionalTensorRef& q_weight,
                                              const at::OptionalTensorRef& k_weight,
                                              const at::OptionalTensorRef& q_bias,
                                              const at::OptionalTensorRef& k_bias, double eps, bool is_neox,
                                              c10::IntArrayRef mrope_section, bool mrope, bool mrope_interleaved);

// add_rmsnorm, functional: (y, residual_out), residual_out being x itself without a residual; or [].
std::vector<at::Tensor> add_rmsnorm_checked(const at::Tensor& x, const at::OptionalTensorRef& residual,
                                           const at::Tensor& weight, const at::OptionalTensorRef& bias, double eps);

// add_rmsnorm, out= form: writes y_out (and residual_out, present exactly when residual is) and returns true,
// or returns false when not taken.
bool add_rmsnorm_checked_out(const at::Tensor& x, const at::OptionalTensorRef& residual, const at::Tensor& weight,
                             const at::OptionalTensorRef& bias, double eps, const at::Tensor& y_out,
                             const at::OptionalTensorRef& residual_out);

// Byte range [first, last) a strided tensor touches; empty for numel 0 (qkvfuse.ops._span).
inline std::pair<intptr_t, intptr_t> span(const at::Tensor& t) {
  if (t.numel() == 0) return {0, 0};
  const intptr_t size_of = t.element_size();
  intptr_t first = reinterpret_cast<intptr_t>(t.const_data_ptr()), last = first;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const intptr_t reach = (t.size(d) - 1) * t.stride(d) * size_of;
    (reach < 0 ? first : last) += reach;
  }
  return {first, last + size_of};
}

inline bool overlap(std::pair<intptr_t, intptr_t> a, std::pair<intptr_t, intptr_t> b) {
  return a.first < b.second && b.first < a.second;
}

}  // namespace qkvfuse_cpu
