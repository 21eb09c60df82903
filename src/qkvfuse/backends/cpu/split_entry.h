// The validating entry points of the native split kernel, called from python_entry.cpp (the Python fast path
// of qkvfuse.ops). Each checks its tensors with predicates that mirror qkvfuse.ops' validator rule for rule
// (plainly_valid, plainly_valid_outputs in split_qkv_rmsnorm_rope.cpp) and either runs the kernel or returns
// "not taken" ([] or false) without writing anything, so that the caller validates in Python and raises the
// documented error. The scalar arguments' Python types are checked by the caller. Optional weights and
// biases are borrowed references (empty: absent).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace qkvfuse_cpu {

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

}  // namespace qkvfuse_cpu
