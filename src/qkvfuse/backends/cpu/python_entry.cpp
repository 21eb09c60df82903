// The Python fast path of qkvfuse.ops.split_qkv_rmsnorm_rope / split_qkv_rmsnorm_rope_ / add_rmsnorm for CPU
// tensors.
//
// A decode step (T = 1) of Qwen3-8B is about 2 us of kernel work; a torch.ops call with the split's 17
// arguments costs about 5 us on its own (IValue conversion, schema matching, dispatch), and a Python-level
// validator about as much again. These functions take the arguments straight from the interpreter
// (METH_FASTCALL), check the Python types of the scalars here and the tensors with the kernels' predicates
// (entry.h), and run the kernel. Anything they are not sure of -- a scalar of another type, a tensor subclass,
// a tensor that needs autograd, an active dispatch or torch-function mode, profiler callbacks, input the
// predicates doubt -- returns None without touching any output, and qkvfuse.ops then takes the ordinary path:
// the Python validator (with its error messages) and the op registered with the dispatcher. Kernel errors
// (positions outside the cache) are raised as the dispatcher would raise them.
#include "entry.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <vector>

namespace qkvfuse_cpu {
namespace {

// Dispatch keys of a plain dense CPU tensor, inference tensors included (set at import): a tensor carrying
// any other key (functorch wrappers, conjugate or negative views, Python dispatch) goes through the dispatcher.
c10::DispatchKeySet g_plain_keys;

c10::DispatchKeySet plain_cpu_keys() {
  return at::empty({0}).key_set() | c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView) |
         c10::DispatchKeySet(c10::DispatchKey::AutogradCPU);
}

bool plain(const at::Tensor& t) {
  return g_plain_keys.isSupersetOf(t.key_set()) && !(t.requires_grad() && at::GradMode::is_enabled());
}

// Nothing that expects to see every op: no dispatch or torch-function mode, no RecordFunction callbacks.
bool no_observers() {
  return c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !at::impl::torch_function_mode_enabled() &&
         !at::hasCallbacks();
}

bool tensor_arg(PyObject* o, const at::Tensor** out) {
  if (!THPVariable_CheckExact(o)) return false;
  const at::Tensor& t = THPVariable_Unpack(o);
  if (!plain(t)) return false;
  *out = &t;
  return true;
}

// None or a plain tensor, borrowed: the caller's Python object owns it for the whole call.
bool optional_tensor_arg(PyObject* o, at::OptionalTensorRef* out) {
  if (o == Py_None) return true;
  const at::Tensor* t = nullptr;
  if (!tensor_arg(o, &t)) return false;
  *out = at::OptionalTensorRef(*t);
  return true;
}

// Python `type(o) is int` (bool excluded), within int64.
bool int_arg(PyObject* o, int64_t* out) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(o, &overflow);
  return overflow == 0 && !(*out == -1 && PyErr_Occurred());
}

// Python `type(o) in (float, int)` (bool excluded) as a double.
bool number_arg(PyObject* o, double* out) {
  if (PyFloat_CheckExact(o)) {
    *out = PyFloat_AS_DOUBLE(o);
    return true;
  }
  int64_t i = 0;
  if (!int_arg(o, &i)) return false;
  *out = static_cast<double>(i);
  return true;
}

// Whether a call's `backend` argument selects this library, as qkvfuse.backends.resolve_backend would for a
// CPU tensor: "cpu" or "auto", or None with $QKVFUSE_BACKEND unset, empty, "cpu" or "auto" -- and the
// registry still has this library's backend module loaded as "cpu" (register_backend may have replaced it).
// bind() gives the objects it reads: os.environ's own mapping and encoded key (so the variable is read as
// os.environ holds it, about 20 ns), the registry's dict of loaded backends, and the backend module. Until
// bind() runs, or for anything unusual, the answer is no and the call takes the ordinary path.
struct Binding {
  PyObject* env_data = nullptr;  // os.environ._data (a dict), strong reference
  PyObject* env_key = nullptr;   // os.environ.encodekey("QKVFUSE_BACKEND")
  PyObject* loaded = nullptr;    // qkvfuse.backends._loaded
  PyObject* module = nullptr;    // qkvfuse.backends.cpu
  PyObject* cpu = nullptr;       // interned "cpu"
} g_binding;

bool names_this_backend(PyObject* name, bool env) {
  if (env && PyBytes_CheckExact(name)) {
    const char* v = PyBytes_AS_STRING(name);
    return v[0] == '\0' || std::strcmp(v, "cpu") == 0 || std::strcmp(v, "auto") == 0;
  }
  if (!PyUnicode_CheckExact(name)) return false;
  return (env && PyUnicode_GET_LENGTH(name) == 0) || PyUnicode_CompareWithASCIIString(name, "cpu") == 0 ||
         PyUnicode_CompareWithASCIIString(name, "auto") == 0;
}

bool selects_this_backend(PyObject* backend) {
  const Binding& b = g_binding;
  if (b.module == nullptr) return false;
  if (backend == Py_None) {
    PyObject* env = PyDict_GetItemWithError(b.env_data, b.env_key);  // borrowed
    if (env == nullptr && PyErr_Occurred()) return false;
    if (env != nullptr && !names_this_backend(env, true)) return false;
  } else if (!names_this_backend(backend, false)) {
    return false;
  }
  PyObject* loaded = PyDict_GetItemWithError(b.loaded, b.cpu);
  return loaded == b.module;
}

// A call of `fixed` arguments, or of those and then the public function's `backend` argument when it selects
// this library.
bool takes(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t fixed) {
  return nargs == fixed || (nargs == fixed + 1 && selects_this_backend(args[fixed]));
}

// bind(env_data, env_key, loaded, module) -> None
PyObject* bind(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyDict_CheckExact(args[0]) || !PyDict_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError, "bind(env_data: dict, env_key, loaded: dict, module)");
    return nullptr;
  }
  PyObject* cpu = PyUnicode_InternFromString("cpu");
  if (cpu == nullptr) return nullptr;
  Binding next{args[0], args[1], args[2], args[3], cpu};
  for (PyObject* o : {next.env_data, next.env_key, next.loaded, next.module}) Py_INCREF(o);
  Binding old = g_binding;
  g_binding = next;
  for (PyObject* o : {old.env_data, old.env_key, old.loaded, old.module, old.cpu}) Py_XDECREF(o);
  Py_RETURN_NONE;
}

struct SplitArgs {
  const at::Tensor *qkv = nullptr, *positions = nullptr, *cache = nullptr;
  int64_t hq = 0, hkv = 0, D = 0;
  at::OptionalTensorRef q_weight, k_weight, q_bias, k_bias;
  double eps = 0.0;
  bool neox = true, mrope = false, interleaved = false;
  int64_t section[3] = {0, 0, 0};
};

constexpr Py_ssize_t kSplitArgs = 14;

// The 14 leading arguments of qkvfuse.ops.split_qkv_rmsnorm_rope, in its order; false: not taken.
bool parse_split(PyObject* const* a, SplitArgs& s) {
  if (!tensor_arg(a[0], &s.qkv) || !tensor_arg(a[1], &s.positions) || !tensor_arg(a[2], &s.cache)) return false;
  if (!int_arg(a[3], &s.hq) || !int_arg(a[4], &s.hkv) || !int_arg(a[5], &s.D)) return false;
  if (!optional_tensor_arg(a[6], &s.q_weight) || !optional_tensor_arg(a[7], &s.k_weight) ||
      !optional_tensor_arg(a[8], &s.q_bias) || !optional_tensor_arg(a[9], &s.k_bias)) {
    return false;
  }
  if (!number_arg(a[10], &s.eps)) return false;
  if (!PyBool_Check(a[11]) || !PyBool_Check(a[13])) return false;
  s.neox = a[11] == Py_True;
  s.interleaved = a[13] == Py_True;
  PyObject* section = a[12];
  if (section != Py_None) {
    const bool tuple = PyTuple_CheckExact(section);
    if (!tuple && !PyList_CheckExact(section)) return false;
    if ((tuple ? PyTuple_GET_SIZE(section) : PyList_GET_SIZE(section)) != 3) return false;
    for (Py_ssize_t i = 0; i < 3; ++i) {
      if (!int_arg(tuple ? PyTuple_GET_ITEM(section, i) : PyList_GET_ITEM(section, i), &s.section[i])) return false;
    }
    s.mrope = true;
  }
  return no_observers();
}

c10::IntArrayRef sections(const SplitArgs& s) {
  return s.mrope ? c10::IntArrayRef(s.section, 3) : c10::IntArrayRef();
}

// Large calls run without the GIL (other Python threads keep going); a decode step is shorter than the
// release and re-acquire.
constexpr int64_t kReleaseGilElems = 1 << 16;

template <typename F>
auto maybe_without_gil(const at::Tensor& qkv, F&& f) {
  if (qkv.numel() < kReleaseGilElems) return f();
  pybind11::gil_scoped_release no_gil;
  return f();
}

PyObject* wrap_all(std::vector<at::Tensor>&& ts) {
  if (ts.empty()) Py_RETURN_NONE;
  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(ts.size()));
  if (result == nullptr) return nullptr;
  for (size_t i = 0; i < ts.size(); ++i) {
    PyObject* t = THPVariable_Wrap(std::move(ts[i]));
    if (t == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), t);
  }
  return result;
}

// split(qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, q_weight, k_weight, q_bias, k_bias,
//       eps, is_neox, mrope_section, mrope_interleaved, out[, backend]) -> (q, k, v) or None
// `out` is None (fresh outputs) or a tuple/list of three tensors (returned as a tuple). With `backend` (the
// public function's argument) the call is taken only when it selects this library (selects_this_backend);
// without it the caller has chosen the library itself.
PyObject* split(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  SplitArgs s;
  if (!takes(args, nargs, kSplitArgs + 1) || !parse_split(args, s)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  PyObject* out = args[kSplitArgs];
  if (out == Py_None) {
    std::vector<at::Tensor> qkv_out = maybe_without_gil(*s.qkv, [&] {
      return split_checked(*s.qkv, *s.positions, *s.cache, s.hq, s.hkv, s.D, s.q_weight, s.k_weight, s.q_bias,
                           s.k_bias, s.eps, s.neox, sections(s), s.mrope, s.interleaved);
    });
    return wrap_all(std::move(qkv_out));
  }
  const bool tuple = PyTuple_CheckExact(out);
  if ((!tuple && !PyList_CheckExact(out)) || (tuple ? PyTuple_GET_SIZE(out) : PyList_GET_SIZE(out)) != 3) {
    Py_RETURN_NONE;
  }
  const at::Tensor* outs[3];
  for (Py_ssize_t i = 0; i < 3; ++i) {
    if (!tensor_arg(tuple ? PyTuple_GET_ITEM(out, i) : PyList_GET_ITEM(out, i), &outs[i])) Py_RETURN_NONE;
  }
  const bool done = maybe_without_gil(*s.qkv, [&] {
    return split_checked_out(*s.qkv, *s.positions, *s.cache, s.hq, s.hkv, s.D, s.q_weight, s.k_weight, s.q_bias,
                             s.k_bias, s.eps, s.neox, sections(s), s.mrope, s.interleaved, *outs[0], *outs[1],
                             *outs[2]);
  });
  if (!done) Py_RETURN_NONE;
  if (tuple) {
    Py_INCREF(out);
    return out;
  }
  return PyList_AsTuple(out);
  END_HANDLE_TH_ERRORS
}

// split_inplace(<the 14 arguments of split>[, backend]) -> (q, k, v) views of qkv, or None
PyObject* split_inplace(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  SplitArgs s;
  if (!takes(args, nargs, kSplitArgs) || !parse_split(args, s)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  std::vector<at::Tensor> views = maybe_without_gil(*s.qkv, [&] {
    return split_checked_inplace(*s.qkv, *s.positions, *s.cache, s.hq, s.hkv, s.D, s.q_weight, s.k_weight,
                                 s.q_bias, s.k_bias, s.eps, s.neox, sections(s), s.mrope, s.interleaved);
  });
  return wrap_all(std::move(views));
  END_HANDLE_TH_ERRORS
}

// add_rmsnorm(x, residual, weight, eps, bias, out[, backend]) -> (y, residual_out) or None, residual_out being
// x itself without a residual. `out` is None or a tuple/list (y_out, residual_out); residual_out is ignored
// without a residual, as qkvfuse.ops.add_rmsnorm ignores it.
PyObject* add_rmsnorm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const at::Tensor *x = nullptr, *weight = nullptr;
  at::OptionalTensorRef residual, bias;
  double eps = 0.0;
  if (!takes(args, nargs, 6) || !tensor_arg(args[0], &x) || !optional_tensor_arg(args[1], &residual) ||
      !tensor_arg(args[2], &weight) || !number_arg(args[3], &eps) || !optional_tensor_arg(args[4], &bias) ||
      !no_observers()) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  PyObject* out = args[5];
  if (out == Py_None) {
    std::vector<at::Tensor> result =
        maybe_without_gil(*x, [&] { return add_rmsnorm_checked(*x, residual, *weight, bias, eps); });
    return wrap_all(std::move(result));
  }
  const bool tuple = PyTuple_CheckExact(out);
  if ((!tuple && !PyList_CheckExact(out)) || (tuple ? PyTuple_GET_SIZE(out) : PyList_GET_SIZE(out)) != 2) {
    Py_RETURN_NONE;
  }
  PyObject* y_obj = tuple ? PyTuple_GET_ITEM(out, 0) : PyList_GET_ITEM(out, 0);
  PyObject* r_obj = residual.has_value() ? (tuple ? PyTuple_GET_ITEM(out, 1) : PyList_GET_ITEM(out, 1)) : args[0];
  const at::Tensor *y_out = nullptr, *r_out = nullptr;
  if (!tensor_arg(y_obj, &y_out) || (residual.has_value() && !tensor_arg(r_obj, &r_out))) Py_RETURN_NONE;
  const at::OptionalTensorRef residual_out = r_out != nullptr ? at::OptionalTensorRef(*r_out) : at::OptionalTensorRef();
  const bool done = maybe_without_gil(
      *x, [&] { return add_rmsnorm_checked_out(*x, residual, *weight, bias, eps, *y_out, residual_out); });
  if (!done) Py_RETURN_NONE;
  return PyTuple_Pack(2, y_obj, r_obj);
  END_HANDLE_TH_ERRORS
}

PyMethodDef g_methods[] = {
    {"split", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&split)), METH_FASTCALL,
     "Fast path of qkvfuse.ops.split_qkv_rmsnorm_rope for CPU tensors: (q, k, v), or None (not taken)."},
    {"split_inplace", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&split_inplace)), METH_FASTCALL,
     "Fast path of qkvfuse.ops.split_qkv_rmsnorm_rope_ for CPU tensors: views of qkv, or None (not taken)."},
    {"add_rmsnorm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&add_rmsnorm)), METH_FASTCALL,
     "Fast path of qkvfuse.ops.add_rmsnorm for CPU tensors: (y, residual_out), or None (not taken)."},
    {"bind", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&bind)), METH_FASTCALL,
     "bind(env_data, env_key, loaded, module): what a call's backend argument is checked against."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace qkvfuse_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  qkvfuse_cpu::g_plain_keys = qkvfuse_cpu::plain_cpu_keys();
  if (PyModule_AddFunctions(m.ptr(), qkvfuse_cpu::g_methods) != 0) throw pybind11::error_already_set();
}
