// The ADInplaceOrView kernels of the auto ops' mutating forms (qkvfuse::split_qkv_rmsnorm_rope_out, ..._inplace,
// ..._cache, ..._cache_out, add_rmsnorm_out, add_rmsnorm_inplace): bump the version counter of every tensor
// argument the schema marks as written, then redispatch below ADInplaceOrView. They replace qkvfuse._library's
// Python kernels of the same job when this library loads, so a call outside inference mode pays no Python frame
// for it. Bumping an inference tensor outside inference mode raises, as for any in-place torch op.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/TensorImpl.h>
#include <torch/library.h>

namespace qkvfuse_cpu {
namespace {

void bump_written_then_redispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const auto first = stack->size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    const c10::IValue& value = (*stack)[first + i];
    if (alias != nullptr && alias->isWrite() && value.isTensor() && value.toTensor().defined()) {
      value.toTensor().unsafeGetTensorImpl()->bump_version();
    }
  }
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

}  // namespace
}  // namespace qkvfuse_cpu

TORCH_LIBRARY_IMPL(qkvfuse, ADInplaceOrView, m) {
  for (const char* name : {"split_qkv_rmsnorm_rope_out", "split_qkv_rmsnorm_rope_inplace", "add_rmsnorm_out",
                           "add_rmsnorm_inplace", "split_qkv_rmsnorm_rope_cache",
                           "split_qkv_rmsnorm_rope_cache_out"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&qkvfuse_cpu::bump_written_then_redispatch>());
  }
}
