// Optional tensors inside the library: borrowed references. The dispatcher hands kernels a
// std::optional<Tensor>; copying one costs refcount traffic, which for a tensor owned by Python also touches its
// PyObject, so the kernels pass at::OptionalTensorRef (empty: absent) instead.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace qkvfuse_cpu {

using OptRef = at::OptionalTensorRef;

inline OptRef borrow(const std::optional<at::Tensor>& t) { return t.has_value() ? OptRef(*t) : OptRef(); }

}  // namespace qkvfuse_cpu
