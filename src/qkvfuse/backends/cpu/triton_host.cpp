// The host path of the Triton ops in C++: the kernels of the qkvfuse_triton ops (every device key) and of the
// qkvfuse ops' CUDA, XPU and PrivateUse1 keys once this library is loaded (qkvfuse.backends.native_host), and the
// ADInplaceOrView kernels of the qkvfuse_triton ops' mutating forms.
//
// Each kernel checks its arguments with the code the CPU kernels run (check_split_args / check_norm_args: the
// rules of checks.h, shapes, strides, dtypes, devices and overlaps, never tensor data), checks the position range
// for CPU tensors (the interpreter; accelerators clamp in the kernel), allocates the functional form's outputs, and
// then calls the Triton launcher -- a Python callable registered once (qkvfuse_set_triton_launchers) -- with the
// checked arguments and the derived head_dim. So a call pays one Python frame (the launcher's), as a Triton op must,
// and no Python argument checks. Without Python headers at build time this file compiles to nothing and the
// Python kernels stay registered.
#if __has_include(<Python.h>) && defined(QKVFUSE_PYTHON_HOST)

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>
#include <optional>
#include <tuple>

namespace qkvfuse_cpu {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// The CPU kernels' argument rules (split_qkv_rmsnorm_rope.cpp, add_rmsnorm.cpp).
int64_t check_split_args(const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
                         const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq,
                         int64_t hkv, int64_t rope, const Tensor* const* outs, bool inplace);
void check_norm_args(const Tensor& x, const OptTensor& residual, const Tensor& weight, const OptTensor& bias,
                     const Tensor* y_out, const OptTensor* residual_out, bool inplace);

namespace {

constexpr int64_t kQGate = 8;  // the rope code's gated-layout bit (qkvfuse._rope_mode.Q_GATE)
constexpr int64_t kMRope = 2;  // the rope code's mRoPE bit

// The launchers per namespace: 0 the auto ops (qkvfuse), 1 the triton ops (qkvfuse_triton). Set once, with the GIL
// held, before the kernels are reached; never released (they live as long as the process).
PyObject* g_split[2] = {nullptr, nullptr};
PyObject* g_norm[2] = {nullptr, nullptr};

// Forms of a call, as the launcher entries take them.
enum Form : int64_t { kOut = 0, kFunctional = 1, kInplace = 2 };

struct Gil {
  PyGILState_STATE state = PyGILState_Ensure();
  ~Gil() { PyGILState_Release(state); }
};

PyObject* wrap(const Tensor& t) { return THPVariable_Wrap(t); }

PyObject* wrap(const OptTensor& t) {
  if (t.has_value()) return THPVariable_Wrap(*t);
  Py_RETURN_NONE;
}

PyObject* wrap(const Tensor* t) {
  if (t != nullptr) return THPVariable_Wrap(*t);
  Py_RETURN_NONE;
}

// Calls fn with the given new references (stolen); raises the Python error as a C++ exception the Python
// binding restores (same type and message).
void call(PyObject* fn, std::initializer_list<PyObject*> args) {
  PyObject* argv[24];
  size_t n = 0;
  bool ok = true;
  for (PyObject* a : args) {
    ok = ok && a != nullptr;
    argv[n++] = a;
  }
  PyObject* result = ok ? PyObject_Vectorcall(fn, argv, n, nullptr) : nullptr;
  for (size_t i = 0; i < n; ++i) Py_XDECREF(argv[i]);
  if (result == nullptr) throw python_error();
  Py_DECREF(result);
}

PyObject* launcher(PyObject* const* table, int ns) {
  PyObject* fn = table[ns];
  TORCH_CHECK(fn != nullptr, "qkvfuse: the Triton launchers are not registered with the native library");
  return fn;
}

// The position range rule of qkvfuse._library.check_positions for CPU tensors (no host sync is involved): raises
// before any output is written. Accelerator kernels clamp positions into the table.
void check_cpu_positions(const Tensor& positions, int64_t max_position) {
  if (!positions.device().is_cpu() || positions.numel() == 0) return;
  const int64_t rows = positions.dim() == 2 ? positions.size(0) : 1, T = positions.size(-1);
  const int64_t s_row = positions.dim() == 2 ? positions.stride(0) : 0, s_t = positions.stride(-1);
  const bool wide = positions.scalar_type() == at::kLong;
  const void* data = positions.const_data_ptr();
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
  for (int64_t a = 0; a < rows; ++a) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t off = a * s_row + t * s_t;
      const int64_t v = wide ? static_cast<const int64_t*>(data)[off] : static_cast<const int32_t*>(data)[off];
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  TORCH_CHECK_VALUE(lo >= 0 && hi < max_position, "positions: expected values in [0, ", max_position,
                    ") (cos_sin_cache rows), got values in [", lo, ", ", hi, "]");
}

// ------------------------------------------------------------------------------------------------------------
// The split: launcher(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads, num_kv_heads,
// eps, rope, head_dim, form, q_out, k_out, v_out, gate_out).
// ------------------------------------------------------------------------------------------------------------
void launch_split(int ns, const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
                  const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq, int64_t hkv,
                  double eps, int64_t rope, int64_t D, Form form, const Tensor* q_out, const Tensor* k_out,
                  const Tensor* v_out, const Tensor* gate_out) {
  check_cpu_positions(positions, cache.size(0));
  Gil gil;
  call(launcher(g_split, ns),
       {wrap(qkv), wrap(positions), wrap(cache), wrap(q_weight), wrap(k_weight), wrap(q_bias), wrap(k_bias),
        PyLong_FromLongLong(hq), PyLong_FromLongLong(hkv), PyFloat_FromDouble(eps), PyLong_FromLongLong(rope),
        PyLong_FromLongLong(D), PyLong_FromLongLong(form), wrap(q_out), wrap(k_out), wrap(v_out), wrap(gate_out)});
}

template <int NS>
void split_out(const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
               const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq, int64_t hkv,
               double eps, int64_t rope, const Tensor& q_out, const Tensor& k_out, const Tensor& v_out,
               const OptTensor& gate_out) {
  const Tensor* const outs[4] = {&q_out, &k_out, &v_out, gate_out.has_value() ? &*gate_out : nullptr};
  const int64_t D = check_split_args(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope, outs,
                                     false);
  launch_split(NS, qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, eps, rope, D, kOut, outs[0],
               outs[1], outs[2], outs[3]);
}

template <int NS>
std::tuple<Tensor, Tensor, Tensor, Tensor> split(const Tensor& qkv, const Tensor& positions, const Tensor& cache,
                                                 const OptTensor& q_weight, const OptTensor& k_weight,
                                                 const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq,
                                                 int64_t hkv, double eps, int64_t rope) {
  const int64_t D = check_split_args(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope, nullptr,
                                     false);
  const bool gated = (rope & kQGate) != 0;
  const int64_t T = qkv.size(0);
  Tensor q = at::empty({T, hq * D}, qkv.options()), k = at::empty({T, hkv * D}, qkv.options());
  Tensor v = at::empty({T, hkv * D}, qkv.options());
  Tensor gate = gated ? at::empty({T, hq * D}, qkv.options()) : at::empty({0}, qkv.options());
  launch_split(NS, qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, eps, rope, D, kFunctional, &q,
               &k, &v, gated ? &gate : nullptr);
  return {q, k, v, gate};
}

template <int NS>
void split_inplace(const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
                   const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq,
                   int64_t hkv, double eps, int64_t rope) {
  const int64_t D = check_split_args(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope, nullptr,
                                     true);
  launch_split(NS, qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, eps, rope, D, kInplace,
               nullptr, nullptr, nullptr, nullptr);
}

// ------------------------------------------------------------------------------------------------------------
// add_rmsnorm: launcher(x, residual, weight, bias, eps, gemma, y_out, residual_out).
// ------------------------------------------------------------------------------------------------------------
void launch_norm(int ns, const Tensor& x, const OptTensor& residual, const Tensor& weight, const OptTensor& bias,
                 double eps, bool gemma, const Tensor& y_out, const Tensor* residual_out) {
  Gil gil;
  call(launcher(g_norm, ns), {wrap(x), wrap(residual), wrap(weight), wrap(bias), PyFloat_FromDouble(eps),
                              PyBool_FromLong(gemma), wrap(y_out), wrap(residual_out)});
}

template <int NS>
void norm_out(const Tensor& x, const OptTensor& residual, const Tensor& weight, const OptTensor& bias, double eps,
              const Tensor& y_out, const OptTensor& residual_out, bool gemma) {
  check_norm_args(x, residual, weight, bias, &y_out, &residual_out, false);
  launch_norm(NS, x, residual, weight, bias, eps, gemma, y_out, residual_out.has_value() ? &*residual_out : nullptr);
}

template <int NS>
void norm_inplace(const Tensor& x, const OptTensor& residual, const Tensor& weight, const OptTensor& bias, double eps,
                  bool gemma) {
  check_norm_args(x, residual, weight, bias, nullptr, nullptr, true);
  launch_norm(NS, x, residual, weight, bias, eps, gemma, x, residual.has_value() ? &*residual : nullptr);
}

template <int NS>
std::tuple<Tensor, Tensor> norm(const Tensor& x, const OptTensor& residual, const Tensor& weight,
                                const OptTensor& bias, double eps, bool gemma) {
  check_norm_args(x, residual, weight, bias, nullptr, nullptr, false);
  Tensor y = at::empty(x.sizes(), x.options());
  Tensor r_out = residual.has_value() ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  launch_norm(NS, x, residual, weight, bias, eps, gemma, y, residual.has_value() ? &r_out : nullptr);
  return {y, r_out};
}

// The version counters of the written arguments (inplace_versions.cpp's rule), then the kernel below.
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

template <int NS>
void register_kernels(torch::Library& m) {
  m.impl("split_qkv_rmsnorm_rope", &split<NS>);
  m.impl("split_qkv_rmsnorm_rope_out", &split_out<NS>);
  m.impl("split_qkv_rmsnorm_rope_inplace", &split_inplace<NS>);
  m.impl("add_rmsnorm", &norm<NS>);
  m.impl("add_rmsnorm_out", &norm_out<NS>);
  m.impl("add_rmsnorm_inplace", &norm_inplace<NS>);
}

}  // namespace
}  // namespace qkvfuse_cpu

// Called from Python through ctypes.PyDLL (the GIL held), by qkvfuse.backends.native_host once it has taken the
// Python kernels of the same keys away: the launchers of the auto ops (ns 0) and of the triton ops (ns 1), kept for
// the life of the process, then (register != 0, once) the C++ kernels: the triton ops on every device key and their
// ADInplaceOrView kernels, the auto ops on the accelerator keys. Loading the library registers none of them, so a
// process that loads it for the CPU kernels keeps the Python kernels until this call. The version-counter kernels
// cover every mutating form of the triton ops (their Python ones go with the switch); the cache-writing split keeps
// its Python kernel. Returns 0 on success.
extern "C" __attribute__((visibility("default"))) int qkvfuse_set_triton_launchers(int ns, PyObject* split,
                                                                                   PyObject* norm, int do_register) {
  if (ns < 0 || ns > 1) return 1;
  Py_XINCREF(split);
  Py_XINCREF(norm);
  qkvfuse_cpu::g_split[ns] = split;
  qkvfuse_cpu::g_norm[ns] = norm;
  if (!do_register) return 0;
  static std::vector<std::unique_ptr<torch::Library>> libraries;
  if (!libraries.empty()) return 0;
  try {
    auto library = [](const char* ns_name, std::optional<c10::DispatchKey> key) -> torch::Library& {
      libraries.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, ns_name, key, __FILE__, __LINE__));
      return *libraries.back();
    };
    for (const c10::DispatchKey key : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::XPU,
                                       c10::DispatchKey::PrivateUse1}) {
      qkvfuse_cpu::register_kernels<1>(library("qkvfuse_triton", key));
      if (key != c10::DispatchKey::CPU) qkvfuse_cpu::register_kernels<0>(library("qkvfuse", key));
    }
    torch::Library& versions = library("qkvfuse_triton", c10::DispatchKey::ADInplaceOrView);
    for (const char* name : {"split_qkv_rmsnorm_rope_out", "split_qkv_rmsnorm_rope_inplace", "add_rmsnorm_out",
                             "add_rmsnorm_inplace", "split_qkv_rmsnorm_rope_cache"}) {
      versions.impl(name,
                    torch::CppFunction::makeFromBoxedFunction<&qkvfuse_cpu::bump_written_then_redispatch>());
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return 2;
  }
  return 0;
}

#endif
