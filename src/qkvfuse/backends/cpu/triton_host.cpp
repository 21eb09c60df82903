// The host path of the Triton ops in C++: the kernels of the qkvfuse_triton ops (every device key) and of the
// qkvfuse ops' CUDA, XPU and PrivateUse1 keys once this library is loaded (qkvfuse.backends.native_host), and the
// ADInplaceOrView kernels of the qkvfuse_triton ops' mutating forms.
//
// Each kernel checks its arguments with the code the CPU kernels run (check_split_args / check_norm_args /
// check_cache_args: the rules of checks.h, shapes, strides, dtypes, devices and overlaps, never tensor data), checks
// the position range (and the cache-writing split's slots and scales) for CPU tensors (the interpreter;
// accelerators clamp positions and skip bad slots in the kernel), allocates the functional form's outputs, and
// then calls the Triton launcher -- a Python callable registered once (qkvfuse_set_triton_launchers) -- with the
// checked arguments and the derived head_dim. So a call pays one Python frame (the launcher's) and no Python
// argument checks; later device launches of a key the launcher has handed over are made here, without the
// launcher's frame (see launch_split, launch_norm, launch_cache). Without Python headers at build time this file
// compiles to nothing and the Python kernels stay registered.
#if __has_include(<Python.h>) && defined(QKVFUSE_PYTHON_HOST)

#include <Python.h>

#include "cache_mode.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
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
int64_t check_cache_args(const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
                         const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq,
                         int64_t hkv, int64_t rope, const Tensor& key_cache, const Tensor& value_cache,
                         const Tensor& slot_mapping, int64_t cache_mode, const OptTensor& k_scale,
                         const OptTensor& v_scale, const Tensor* const* outs);
void check_cpu_cache_values(const Tensor& key_cache, const Tensor& slot_mapping, int64_t cache_mode,
                            int64_t num_tokens, const OptTensor& k_scale, const OptTensor& v_scale);

namespace {

constexpr int64_t kQGate = 8;  // the rope code's gated-layout bit (qkvfuse._rope_mode.Q_GATE)
constexpr int64_t kMRope = 2;  // the rope code's mRoPE bit

// The launchers per namespace: 0 the auto ops (qkvfuse), 1 the triton ops (qkvfuse_triton). Set once, with the GIL
// held, before the kernels are reached; never released (they live as long as the process).
PyObject* g_split[2] = {nullptr, nullptr};
PyObject* g_norm[2] = {nullptr, nullptr};
PyObject* g_cache[2] = {nullptr, nullptr};

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
void call(PyObject* fn, PyObject** argv, size_t n) {
  bool ok = true;
  for (size_t i = 0; i < n; ++i) ok = ok && argv[i] != nullptr;
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
// eps, rope, head_dim, form, q_out, k_out, v_out, gate_out, stage), then, on a device, the compiled launch here.
//
// A device launch of the Triton launcher (qkvfuse.backends.triton.launch.split_entry) that reused a compiled kernel
// stages it (qkvfuse_stage_launch, when this call passed stage=True): Triton's compiled launcher and the
// launch's constant arguments. This file keeps it under a key of everything the launcher's choice of plan and
// compiled kernel reads -- the namespace and its launcher, the geometry, the form, the launcher module's kernel,
// driver, interpreter flag and tile settings, the dtypes, the row strides, the output aliasing that decides the V
// blocks and the barrier, the large-offset flag, the device -- and a later call with the same key makes the same
// launch itself: the integer arguments from the tensors, the current device's stream from the launcher module's
// driver, then Triton's compiled launcher. Anything else (a launch hook set, another current device, misaligned
// or non-contiguous weights, no staged launch yet) goes through the Python launcher.
// ------------------------------------------------------------------------------------------------------------
using SplitKey = std::array<int64_t, 34>;

// A kept compiled launch (the split's and add_rmsnorm's), with the N integer arguments its key fixes.
template <size_t N>
struct KeptLaunch {
  PyObject* owned[8];  // references held: the key's objects and the launch's
  PyObject* run;  // Triton's compiled launcher: run(grid0, grid1, grid2, stream, function, packed_metadata,
                  // launch_metadata, enter_hook, exit_hook, *args)
  PyObject* function;
  PyObject* packed_metadata;
  PyObject* values;  // the constexprs' values (a tuple), after the integer arguments
  PyObject* driver;
  int64_t block_t;
  PyObject* fixed[N];  // the launch's integer arguments fixed by the key, made once
};

// The split's fixed arguments: grid1, hq, hkv, s_t, s_h, s_w, row stride of qkv, positions' token stride, the
// table's row stride, the outputs' row strides.
using SplitLaunch = KeptLaunch<13>;

std::map<SplitKey, SplitLaunch> g_split_launches;  // guarded by the GIL
PyObject* g_launch_globals = nullptr;  // the launcher module's globals (a dict), set by the first staged launch
PyObject* g_knobs_runtime = nullptr;   // triton.knobs.runtime (the launch hooks)

struct Staged {
  bool set = false;
  PyObject *run = nullptr, *function = nullptr, *packed_metadata = nullptr, *values = nullptr;
  int64_t block_t = 0, grid1 = 0, s_t = 0, s_h = 0, s_w = 0;
};
thread_local Staged t_staged;
thread_local bool t_stage_wanted = false;

PyObject* interned(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);
  if (s == nullptr) throw python_error();
  return s;  // kept for the life of the process
}

// What a launch reads of the launcher module's globals: its kernel, the driver, the interpreter flag and three
// integer tile settings, by name (the names interned once).
struct ModuleNames {
  const char* kernel;
  const char* settings[3];
  PyObject* interned[6] = {};
};

// The launcher module's kernel and driver (borrowed) and its tile settings, with the interpreter off; false (no
// error pending) where one is missing or of an unexpected type.
bool launch_module(ModuleNames& m, int64_t (&settings)[3], PyObject*& kernel, PyObject*& driver) {
  if (m.interned[0] == nullptr) {
    const char* names[6] = {m.kernel, "driver", "INTERPRET", m.settings[0], m.settings[1], m.settings[2]};
    for (int i = 0; i < 6; ++i) m.interned[i] = interned(names[i]);
  }
  PyObject* v[6];
  for (int i = 0; i < 6; ++i) v[i] = PyDict_GetItemWithError(g_launch_globals, m.interned[i]);
  bool ok = v[0] != nullptr && v[1] != nullptr && v[2] == Py_False;
  for (int i = 0; ok && i < 3; ++i) {
    ok = v[3 + i] != nullptr && PyLong_Check(v[3 + i]);
    if (ok) {
      settings[i] = PyLong_AsLongLong(v[3 + i]);
      ok = !(settings[i] == -1 && PyErr_Occurred());
    }
  }
  if (!ok) {
    PyErr_Clear();
    return false;
  }
  kernel = v[0];
  driver = v[1];
  return true;
}

int64_t dtype_code(const OptTensor& t) { return t.has_value() ? static_cast<int64_t>(t->scalar_type()) : -1; }

// The integer arguments of a launch, in the kernel's order from qkv's pointer to the gate's row stride.
struct SplitArgs {
  int64_t ptr[11];  // qkv, positions, cache, q_w, k_w, q_b, k_b, q_out, k_out, v_out, gate
  int64_t T, max_position, rs, pos_axis, pos_tok, cs, q_s, k_s, v_s, g_s;
};

// The key of this call, and its launch arguments; false where only the Python launcher may launch (the module not
// known yet, T = 0, non-contiguous or misaligned operands, or a launcher-module global of an unexpected type).
bool split_key(int ns, const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
               const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq, int64_t hkv,
               int64_t rope, int64_t D, Form form, const Tensor* q_out, const Tensor* k_out, const Tensor* v_out,
               const Tensor* gate_out, SplitKey& key, SplitArgs& a) {
  if (g_launch_globals == nullptr) return false;
  const int64_t T = qkv.size(0);
  if (T == 0) return false;
  const bool norm = q_weight.has_value(), bias = q_bias.has_value(), gated = (rope & kQGate) != 0;
  const bool mrope = (rope & kMRope) != 0;
  if (norm && !(q_weight->is_contiguous() && k_weight->is_contiguous())) return false;
  if (bias && !(q_bias->is_contiguous() && k_bias->is_contiguous())) return false;
  static ModuleNames names{"split_qkv_rmsnorm_rope_kernel",
                           {"GPU_SPLIT_TILE", "GPU_SPLIT_PER_THREAD", "GPU_MAX_GATED_Q"}};
  int64_t settings[3];
  PyObject *kernel, *driver;
  if (!launch_module(names, settings, kernel, driver)) return false;
  const int64_t tile = settings[0], per_thread = settings[1], max_gated = settings[2];
  const int64_t item = qkv.element_size(), q_width = hq * D, k_col = (gated ? 2 : 1) * q_width;
  const int64_t v_col = k_col + hkv * D;
  const int64_t qp = reinterpret_cast<int64_t>(qkv.data_ptr());
  a.ptr[0] = qp;
  a.ptr[1] = reinterpret_cast<int64_t>(positions.data_ptr());
  a.ptr[2] = reinterpret_cast<int64_t>(cache.data_ptr());
  if (norm) {
    a.ptr[3] = reinterpret_cast<int64_t>(q_weight->data_ptr());
    a.ptr[4] = reinterpret_cast<int64_t>(k_weight->data_ptr());
    a.ptr[5] = bias ? reinterpret_cast<int64_t>(q_bias->data_ptr()) : a.ptr[3];
    a.ptr[6] = bias ? reinterpret_cast<int64_t>(k_bias->data_ptr()) : a.ptr[4];
  } else {
    a.ptr[3] = a.ptr[4] = a.ptr[5] = a.ptr[6] = qp;
  }
  a.rs = qkv.stride(0);
  bool v_own, barrier;
  if (form == kInplace) {
    a.ptr[7] = qp;
    a.ptr[8] = qp + k_col * item;
    a.ptr[9] = qp + v_col * item;
    a.ptr[10] = gated ? qp + q_width * item : qp;
    a.q_s = a.k_s = a.v_s = a.g_s = a.rs;
    v_own = barrier = true;
  } else {
    a.ptr[7] = reinterpret_cast<int64_t>(q_out->data_ptr());
    a.ptr[8] = reinterpret_cast<int64_t>(k_out->data_ptr());
    a.ptr[9] = reinterpret_cast<int64_t>(v_out->data_ptr());
    a.q_s = q_out->stride(0);
    a.k_s = k_out->stride(0);
    a.v_s = v_out->stride(0);
    a.ptr[10] = gate_out != nullptr ? reinterpret_cast<int64_t>(gate_out->data_ptr()) : a.ptr[7];
    a.g_s = gate_out != nullptr ? gate_out->stride(0) : a.q_s;
    v_own = a.ptr[9] == qp + v_col * item && (T < 2 || a.v_s == a.rs);
    barrier = a.ptr[7] == qp || a.ptr[8] == qp + k_col * item;
  }
  int64_t any = 0;
  for (const int64_t p : a.ptr) any |= p;
  if ((any & 15) != 0) return false;
  constexpr int64_t kI32 = int64_t{1} << 31;
  a.T = T;
  a.max_position = cache.size(0);
  a.cs = cache.stride(0);
  a.pos_tok = positions.stride(-1);
  a.pos_axis = mrope ? positions.stride(0) : 0;
  const int64_t pos_axis_code =
      a.pos_axis < 2 ? a.pos_axis : ((a.pos_axis & 15) == 0) + 2 + (a.pos_axis >= kI32 ? 4 : 0);
  key = {ns,
         reinterpret_cast<int64_t>(g_split[ns]),
         reinterpret_cast<int64_t>(kernel),
         reinterpret_cast<int64_t>(driver),
         tile,
         per_thread,
         max_gated,
         hq,
         hkv,
         D,
         cache.size(1),
         rope,
         form,
         norm,
         bias,
         v_own,
         barrier,
         static_cast<int64_t>(qkv.scalar_type()),
         static_cast<int64_t>(positions.scalar_type()),
         static_cast<int64_t>(cache.scalar_type()),
         dtype_code(q_weight),
         dtype_code(k_weight),
         dtype_code(q_bias),
         a.rs,
         pos_axis_code,
         a.pos_tok,
         a.cs,
         a.q_s,
         a.k_s,
         a.v_s,
         a.g_s,
         T >= kI32 || a.max_position >= kI32,
         qkv.get_device(),
         positions.dim()};
  return true;
}

PyObject* ll(int64_t v) { return PyLong_FromLongLong(v); }

// The current stream of Triton's driver for a kept launch on `device` (-1: the current one), a new reference; nullptr
// (nothing to launch here) where the Python launcher must launch: a launch hook is set, or the tensors are on
// another device than the current one.
PyObject* kept_stream(PyObject* driver, int64_t device) {
  static PyObject *n_active = interned("active"), *n_device = interned("get_current_device"),
                  *n_stream = interned("get_current_stream"), *n_enter = interned("launch_enter_hook"),
                  *n_calls = interned("calls");
  // The Python launcher's rule: hooks are called when getattr(enter, "calls", enter) is true (a hook chain with
  // hooks, or a plain callable).
  PyObject* enter = PyObject_GetAttr(g_knobs_runtime, n_enter);
  if (enter == nullptr) throw python_error();
  int hooked = 0;
  if (enter != Py_None) {
    PyObject* calls = PyObject_GetAttr(enter, n_calls);
    if (calls == nullptr) {
      PyErr_Clear();
      calls = Py_NewRef(enter);
    }
    hooked = PyObject_IsTrue(calls);
    Py_DECREF(calls);
  }
  Py_DECREF(enter);
  if (hooked < 0) throw python_error();
  if (hooked) return nullptr;
  PyObject* active = PyObject_GetAttr(driver, n_active);
  if (active == nullptr) throw python_error();
  PyObject* current_obj = PyObject_CallMethodNoArgs(active, n_device);
  if (current_obj == nullptr) {
    Py_DECREF(active);
    throw python_error();
  }
  const int64_t current = PyLong_AsLongLong(current_obj);
  Py_DECREF(current_obj);
  if (current == -1 && PyErr_Occurred()) {
    Py_DECREF(active);
    throw python_error();
  }
  const int64_t index = device < 0 ? current : device;
  if (index != current) {
    Py_DECREF(active);
    return nullptr;
  }
  PyObject* index_obj = ll(index);
  PyObject* stream = index_obj != nullptr ? PyObject_CallMethodOneArg(active, n_stream, index_obj) : nullptr;
  Py_XDECREF(index_obj);
  Py_DECREF(active);
  if (stream == nullptr) throw python_error();
  return stream;
}

// Triton's compiled launcher run(grid0, grid1, 1, stream, function, packed_metadata, None, None, None, *args) with
// the launch's arguments in argv[9:n] (new references, released here; a nullptr among them raises the pending
// Python error).
void run_compiled(PyObject* run, PyObject* function, PyObject* packed_metadata, PyObject* grid1, int64_t grid0,
                  PyObject* stream, PyObject** argv, Py_ssize_t n) {
  argv[0] = ll(grid0);
  argv[1] = Py_NewRef(grid1);
  argv[2] = ll(1);
  argv[3] = stream;
  argv[4] = Py_NewRef(function);
  argv[5] = Py_NewRef(packed_metadata);
  for (int i = 6; i < 9; ++i) argv[i] = Py_NewRef(Py_None);
  bool ok = true;
  for (Py_ssize_t i = 0; i < n; ++i) ok = ok && argv[i] != nullptr;
  PyObject* result = ok ? PyObject_Vectorcall(run, argv, n, nullptr) : nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) Py_XDECREF(argv[i]);
  if (result == nullptr) throw python_error();
  Py_DECREF(result);
}

// A kept launch's argument vector: run_compiled's nine leading slots, then the kernel's integer arguments (at most
// kMaxIntArgs) and the constexprs' values (at most kMaxValues).
constexpr Py_ssize_t kMaxIntArgs = 64, kMaxValues = 64;
struct LaunchArgs {
  PyObject* argv[9 + kMaxIntArgs + kMaxValues];
  Py_ssize_t n = 9;
  void owned(PyObject* o) { argv[n++] = o; }
  void borrowed(PyObject* o) { argv[n++] = Py_NewRef(o); }
  void borrowed(PyObject* const* fixed, int from, int to) {
    for (int i = from; i < to; ++i) borrowed(fixed[i]);
  }
};

// The compiled launch of a kept entry, with the integer arguments `append(args)` adds (new references, or nullptr
// with a Python error set): returns false (nothing launched) where the Python launcher must launch -- too many
// constexprs, a launch hook set, another current device.
template <size_t N, class Append>
bool launch_kept(const KeptLaunch<N>& e, int64_t device, int64_t T, Append&& append) {
  const Py_ssize_t n_values = PyTuple_GET_SIZE(e.values);
  if (n_values > kMaxValues) return false;
  PyObject* stream = kept_stream(e.driver, device);
  if (stream == nullptr) return false;
  LaunchArgs args;
  append(args);
  for (Py_ssize_t i = 0; i < n_values; ++i) args.borrowed(PyTuple_GET_ITEM(e.values, i));
  run_compiled(e.run, e.function, e.packed_metadata, e.fixed[0], (T + e.block_t - 1) / e.block_t, stream, args.argv,
               args.n);
  return true;
}

bool launch_split_kept(const SplitLaunch& e, const SplitArgs& a, int64_t device, double eps) {
  return launch_kept(e, device, a.T, [&](LaunchArgs& v) {
    for (const int64_t p : a.ptr) v.owned(ll(p));
    v.owned(ll(a.T));
    v.borrowed(e.fixed, 1, 3);  // hq, hkv
    v.owned(PyFloat_FromDouble(eps));
    v.owned(ll(a.max_position));
    v.borrowed(e.fixed, 3, 7);  // s_t, s_h, s_w, qkv's row stride
    v.owned(ll(a.pos_axis));
    v.borrowed(e.fixed, 7, 13);  // positions' token stride, the table's, the outputs'
  });
}

// New references to `n` integers in `out`; false (none held, no error pending) where one cannot be made.
bool make_fixed(const int64_t* values, PyObject** out, int n) {
  for (int i = 0; i < n; ++i) {
    out[i] = ll(values[i]);
    if (out[i] == nullptr) {
      for (int j = 0; j < i; ++j) Py_DECREF(out[j]);
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

// A kept launch's references to its key's objects and its launch's (held for the life of the process).
void hold(PyObject* const (&objects)[8], PyObject* (&owned)[8]) {
  for (int i = 0; i < 8; ++i) {
    owned[i] = objects[i];
    Py_XINCREF(objects[i]);
  }
}

// The staged launch (its references are this thread's), kept under key unless one is kept there already: key[1],
// key[2] and key[3] are the launcher, the launcher module's kernel and its driver (held with the launch), `fixed`
// the launch's integer arguments the key fixes.
template <size_t N, size_t K>
void keep_staged(std::map<std::array<int64_t, K>, KeptLaunch<N>>& kept, const std::array<int64_t, K>& key,
                 const int64_t (&fixed)[N]) {
  const Staged& s = t_staged;
  if (!s.set || !PyTuple_Check(s.values) || kept.count(key) != 0) return;
  KeptLaunch<N> e{};
  e.run = s.run;
  e.function = s.function;
  e.packed_metadata = s.packed_metadata;
  e.values = s.values;
  e.driver = reinterpret_cast<PyObject*>(key[3]);
  e.block_t = s.block_t;
  if (!make_fixed(fixed, e.fixed, static_cast<int>(N))) return;
  PyObject* owned[8] = {s.run, s.function, s.packed_metadata, s.values, reinterpret_cast<PyObject*>(key[1]),
                        reinterpret_cast<PyObject*>(key[2]), e.driver, nullptr};
  hold(owned, e.owned);
  kept.emplace(key, e);
}

// The kept launch under a call's key (nullptr where none), and whether the Python launcher is to stage its compiled
// launch: the key is new, or the launcher module is not known yet (the first launches; keyed is then false).
template <class Kept, class Key>
const typename Kept::mapped_type* find_kept(const Kept& kept, bool keyed, const Key& key, int64_t T, bool& stage) {
  stage = g_launch_globals == nullptr && T > 0;
  if (!keyed) return nullptr;
  const auto it = kept.find(key);
  if (it != kept.end()) return &it->second;
  stage = true;
  return nullptr;
}

void clear_staged() {
  Staged& s = t_staged;
  if (s.set) {
    Py_XDECREF(s.run);
    Py_XDECREF(s.function);
    Py_XDECREF(s.packed_metadata);
    Py_XDECREF(s.values);
  }
  s = Staged{};
}

// The Python launcher with these arguments (new references, stolen) and `stage` appended: with stage, a launch
// through a compiled kernel is staged for the caller to keep (t_staged).
void call_staging(bool stage, PyObject* fn, std::initializer_list<PyObject*> args) {
  clear_staged();
  t_stage_wanted = stage;
  PyObject* argv[24];
  size_t n = 0;
  for (PyObject* a : args) argv[n++] = a;
  argv[n++] = Py_NewRef(stage ? Py_True : Py_None);
  try {
    call(fn, argv, n);
  } catch (...) {
    t_stage_wanted = false;
    clear_staged();
    throw;
  }
  t_stage_wanted = false;
}

void launch_split(int ns, const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
                  const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq, int64_t hkv,
                  double eps, int64_t rope, int64_t D, Form form, const Tensor* q_out, const Tensor* k_out,
                  const Tensor* v_out, const Tensor* gate_out) {
  check_cpu_positions(positions, cache.size(0));
  Gil gil;
  SplitKey key;
  SplitArgs args;
  bool keyed = split_key(ns, qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope, D, form,
                         q_out, k_out, v_out, gate_out, key, args);
  bool stage;
  const SplitLaunch* kept = find_kept(g_split_launches, keyed, key, qkv.size(0), stage);
  if (kept != nullptr && launch_split_kept(*kept, args, key[32], eps)) return;
  call_staging(stage, launcher(g_split, ns),
               {wrap(qkv), wrap(positions), wrap(cache), wrap(q_weight), wrap(k_weight), wrap(q_bias), wrap(k_bias),
                PyLong_FromLongLong(hq), PyLong_FromLongLong(hkv), PyFloat_FromDouble(eps), PyLong_FromLongLong(rope),
                PyLong_FromLongLong(D), PyLong_FromLongLong(form), wrap(q_out), wrap(k_out), wrap(v_out),
                wrap(gate_out)});
  if (t_staged.set && (keyed || split_key(ns, qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv,
                                          rope, D, form, q_out, k_out, v_out, gate_out, key, args))) {
    const int64_t fixed[13] = {t_staged.grid1, key[7], key[8], t_staged.s_t, t_staged.s_h, t_staged.s_w, key[23],
                               key[25], key[26], key[27], key[28], key[29], key[30]};
    keep_staged(g_split_launches, key, fixed);
  }
  clear_staged();
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
// add_rmsnorm: launcher(x, residual, weight, bias, eps, gemma, y_out, residual_out, stage).
//
// Its compiled launch is kept the split's way (the launcher stages it, see launch_split): under a key of what the
// launcher's plan and compiled kernel read -- the namespace and its launcher, the launcher module's kernel, driver,
// interpreter flag and tile settings, the row width, residual / bias / gemma, the dtypes, the row strides, the
// large-offset flag, the device.
using NormKey = std::array<int64_t, 20>;

// add_rmsnorm's fixed arguments: the grid's second dimension (1), H, the row strides of x, residual, y and
// residual_out.
using NormLaunch = KeptLaunch<6>;

std::map<NormKey, NormLaunch> g_norm_launches;  // guarded by the GIL

struct NormArgs {
  int64_t ptr[6];  // x, residual, weight, bias, y, residual_out
  int64_t T;
};

// The key of this call and its launch arguments; false where only the Python launcher may launch (as split_key).
bool norm_key(int ns, const Tensor& x, const OptTensor& residual, const Tensor& weight, const OptTensor& bias,
              bool gemma, const Tensor& y_out, const Tensor* residual_out, NormKey& key, NormArgs& a) {
  if (g_launch_globals == nullptr) return false;
  const int64_t T = x.size(0);
  if (T == 0 || !weight.is_contiguous() || (bias.has_value() && !bias->is_contiguous())) return false;
  static ModuleNames names{"add_rmsnorm_kernel", {"GPU_NORM_TILE", "GPU_MAX_ROW", "GPU_NORM_PER_THREAD"}};
  int64_t settings[3];
  PyObject *kernel, *driver;
  if (!launch_module(names, settings, kernel, driver)) return false;
  const int64_t tile = settings[0], max_row = settings[1], per_thread = settings[2];
  const bool has_res = residual.has_value();
  if (has_res && residual_out == nullptr) return false;
  a.T = T;
  a.ptr[0] = reinterpret_cast<int64_t>(x.data_ptr());
  a.ptr[2] = reinterpret_cast<int64_t>(weight.data_ptr());
  a.ptr[3] = bias.has_value() ? reinterpret_cast<int64_t>(bias->data_ptr()) : a.ptr[2];
  a.ptr[4] = reinterpret_cast<int64_t>(y_out.data_ptr());
  const int64_t xs = x.stride(0), ys = y_out.stride(0);
  const int64_t rs = has_res ? residual->stride(0) : xs, ros = has_res ? residual_out->stride(0) : ys;
  a.ptr[1] = has_res ? reinterpret_cast<int64_t>(residual->data_ptr()) : a.ptr[0];
  a.ptr[5] = has_res ? reinterpret_cast<int64_t>(residual_out->data_ptr()) : a.ptr[4];
  int64_t any = 0;
  for (const int64_t p : a.ptr) any |= p;
  if ((any & 15) != 0) return false;
  constexpr int64_t kI32 = int64_t{1} << 31;
  key = {ns,
         reinterpret_cast<int64_t>(g_norm[ns]),
         reinterpret_cast<int64_t>(kernel),
         reinterpret_cast<int64_t>(driver),
         tile,
         max_row,
         per_thread,
         x.size(1),
         has_res,
         bias.has_value(),
         gemma,
         static_cast<int64_t>(x.scalar_type()),
         static_cast<int64_t>(weight.scalar_type()),
         dtype_code(bias),
         xs,
         rs,
         ys,
         ros,
         T >= kI32,
         x.get_device()};
  return true;
}

bool launch_norm_kept(const NormLaunch& e, const NormArgs& a, int64_t device, double eps) {
  return launch_kept(e, device, a.T, [&](LaunchArgs& v) {
    for (const int64_t p : a.ptr) v.owned(ll(p));
    v.owned(ll(a.T));
    v.borrowed(e.fixed[1]);  // H
    v.owned(PyFloat_FromDouble(eps));
    v.borrowed(e.fixed, 2, 6);  // the row strides
  });
}

void launch_norm(int ns, const Tensor& x, const OptTensor& residual, const Tensor& weight, const OptTensor& bias,
                 double eps, bool gemma, const Tensor& y_out, const Tensor* residual_out) {
  Gil gil;
  NormKey key;
  NormArgs args;
  const bool keyed = norm_key(ns, x, residual, weight, bias, gemma, y_out, residual_out, key, args);
  bool stage;
  const NormLaunch* kept = find_kept(g_norm_launches, keyed, key, x.size(0), stage);
  if (kept != nullptr && launch_norm_kept(*kept, args, key[19], eps)) return;
  call_staging(stage, launcher(g_norm, ns),
               {wrap(x), wrap(residual), wrap(weight), wrap(bias), PyFloat_FromDouble(eps), PyBool_FromLong(gemma),
                wrap(y_out), wrap(residual_out)});
  if (t_staged.set && (keyed || norm_key(ns, x, residual, weight, bias, gemma, y_out, residual_out, key, args))) {
    const int64_t fixed[6] = {t_staged.grid1, key[7], key[14], key[15], key[16], key[17]};
    keep_staged(g_norm_launches, key, fixed);
  }
  clear_staged();
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

// ------------------------------------------------------------------------------------------------------------
// The cache-writing split: launcher(qkv, positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias, num_q_heads,
// num_kv_heads, eps, rope, head_dim, key_cache, value_cache, slot_mapping, cache_mode, k_scale, v_scale, q_out,
// k_out, v_out, gate_out, stage), the outputs None in place. The CPU kernel's rules first, in its order: the split's
// and the caches' (check_cache_args), then for CPU tensors the position range and the cache's value rules (slots,
// FP8 scales) -- on accelerators the launcher applies those where QKVFUSE_CHECK_POSITIONS asks for them.
//
// Its compiled launch is kept the split's way (the launcher stages it, see launch_split), under the split's key
// facts plus the cache's: its layout and rounding (cache_mode), the cache, slot and scale dtypes, the slot stride,
// the capacity, the block size and the eight element strides the kernel addresses the caches with.
using CacheKey = std::array<int64_t, 48>;

// The cache-writing split's fixed arguments: grid1, hq, hkv, s_t, s_h, s_w, qkv's row stride, positions' token
// stride, the table's row stride, the outputs' row strides (4), the slot stride, the capacity, the block size, the
// key cache's strides (4), the value cache's (4).
using CacheLaunch = KeptLaunch<24>;

std::map<CacheKey, CacheLaunch> g_cache_launches;  // guarded by the GIL

struct CacheArgs {
  // qkv, positions, cos_sin_cache, q_w, k_w, q_b, k_b, q_out, k_out, v_out, gate, key_cache, value_cache, slots,
  // k_scale, v_scale
  int64_t ptr[16];
  int64_t T, num_slots, max_position, pos_axis;
};

// The element strides (block, offset in block, head, dim) the kernel addresses a cache with
// (qkvfuse.backends.triton.cache._strides): the layout's slot strides, the vec layout's K region transposed
// ([head_dim, block_size]).
std::array<int64_t, 4> kernel_cache_strides(int64_t layout, const Tensor& c, bool is_key) {
  std::array<int64_t, 4> s = cache_slot_strides(layout, c);
  if (layout == kVec && is_key) {
    s[1] = 1;
    s[3] = cache_block_size(layout, c);
  }
  return s;
}

bool is_fp8(const Tensor& t) {
  return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
}

// The key of this call and its launch arguments; false where only the Python launcher may launch (as split_key).
bool cache_key(int ns, const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
               const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq, int64_t hkv,
               int64_t rope, int64_t D, const Tensor& key_cache, const Tensor& value_cache,
               const Tensor& slot_mapping, int64_t cache_mode, const OptTensor& k_scale, const OptTensor& v_scale,
               const Tensor* const* outs, CacheKey& key, CacheArgs& a) {
  if (g_launch_globals == nullptr) return false;
  const int64_t T = qkv.size(0);
  if (T == 0) return false;
  const bool norm = q_weight.has_value(), bias = q_bias.has_value(), gated = (rope & kQGate) != 0;
  const bool mrope = (rope & kMRope) != 0, fp8 = is_fp8(key_cache);
  if (norm && !(q_weight->is_contiguous() && k_weight->is_contiguous())) return false;
  if (bias && !(q_bias->is_contiguous() && k_bias->is_contiguous())) return false;
  if (fp8 && !(k_scale.has_value() && v_scale.has_value())) return false;
  static ModuleNames names{"split_qkv_rmsnorm_rope_cache_kernel",
                           {"GPU_SPLIT_TILE", "GPU_SPLIT_PER_THREAD", "GPU_MAX_GATED_Q"}};
  int64_t settings[3];
  PyObject *kernel, *driver;
  if (!launch_module(names, settings, kernel, driver)) return false;
  const int64_t item = qkv.element_size(), q_width = hq * D, k_col = (gated ? 2 : 1) * q_width;
  const int64_t v_col = k_col + hkv * D;
  const auto ptr = [](const Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); };
  const int64_t qp = ptr(qkv);
  a.ptr[0] = qp;
  a.ptr[1] = ptr(positions);
  a.ptr[2] = ptr(cache);
  a.ptr[3] = norm ? ptr(*q_weight) : qp;
  a.ptr[4] = norm ? ptr(*k_weight) : qp;
  a.ptr[5] = bias ? ptr(*q_bias) : a.ptr[3];
  a.ptr[6] = bias ? ptr(*k_bias) : a.ptr[4];
  const int64_t rs = qkv.stride(0);
  int64_t q_s, k_s, v_s, g_s;
  bool copy_v, in_place;
  if (outs == nullptr) {  // in place: the outputs are qkv's own columns
    a.ptr[7] = qp;
    a.ptr[8] = qp + k_col * item;
    a.ptr[9] = qp + v_col * item;
    a.ptr[10] = gated ? qp + q_width * item : qp;
    q_s = k_s = v_s = g_s = rs;
    copy_v = false;
    in_place = true;
  } else {
    a.ptr[7] = ptr(*outs[0]);
    a.ptr[8] = ptr(*outs[1]);
    a.ptr[9] = ptr(*outs[2]);
    q_s = outs[0]->stride(0);
    k_s = outs[1]->stride(0);
    v_s = outs[2]->stride(0);
    const bool has_gate = gated && outs[3] != nullptr;
    a.ptr[10] = has_gate ? ptr(*outs[3]) : a.ptr[7];
    g_s = has_gate ? outs[3]->stride(0) : q_s;
    copy_v = !(a.ptr[9] == qp + v_col * item && (T < 2 || v_s == rs));
    in_place = a.ptr[7] == qp || a.ptr[8] == qp + k_col * item;
  }
  a.ptr[11] = ptr(key_cache);
  a.ptr[12] = ptr(value_cache);
  a.ptr[13] = ptr(slot_mapping);
  a.ptr[14] = fp8 ? ptr(*k_scale) : qp;
  a.ptr[15] = fp8 ? ptr(*v_scale) : qp;
  int64_t any = 0;
  for (const int64_t p : a.ptr) any |= p;
  if ((any & 15) != 0) return false;
  constexpr int64_t kI32 = int64_t{1} << 31;
  const int64_t layout = cache_mode & kLayoutMask;
  const int64_t blocks = key_cache.size(0), block_size = cache_block_size(layout, key_cache);
  const std::array<int64_t, 4> ks = kernel_cache_strides(layout, key_cache, true);
  const std::array<int64_t, 4> vs = kernel_cache_strides(layout, value_cache, false);
  a.T = T;
  a.num_slots = slot_mapping.size(0);
  a.max_position = cache.size(0);
  a.pos_axis = mrope ? positions.stride(0) : 0;
  const int64_t pos_axis_code =
      a.pos_axis < 2 ? a.pos_axis : ((a.pos_axis & 15) == 0) + 2 + (a.pos_axis >= kI32 ? 4 : 0);
  key = {ns,
         reinterpret_cast<int64_t>(g_cache[ns]),
         reinterpret_cast<int64_t>(kernel),
         reinterpret_cast<int64_t>(driver),
         settings[0],
         settings[1],
         settings[2],
         hq,
         hkv,
         D,
         cache.size(1),
         rope,
         outs == nullptr,
         norm,
         bias,
         copy_v,
         in_place,
         static_cast<int64_t>(qkv.scalar_type()),
         static_cast<int64_t>(positions.scalar_type()),
         static_cast<int64_t>(cache.scalar_type()),
         dtype_code(q_weight),
         dtype_code(q_bias),
         static_cast<int64_t>(key_cache.scalar_type()),
         static_cast<int64_t>(slot_mapping.scalar_type()),
         fp8 ? dtype_code(k_scale) : -1,
         cache_mode,
         rs,
         pos_axis_code,
         positions.stride(-1),
         cache.stride(0),
         q_s,
         k_s,
         v_s,
         g_s,
         slot_mapping.stride(0),
         blocks * block_size,
         block_size,
         ks[0],
         ks[1],
         ks[2],
         ks[3],
         vs[0],
         vs[1],
         vs[2],
         vs[3],
         T >= kI32 || a.max_position >= kI32 || a.num_slots >= kI32,
         qkv.get_device(),
         positions.dim()};
  return true;
}

bool launch_cache_kept(const CacheLaunch& e, const CacheArgs& a, int64_t device, double eps) {
  return launch_kept(e, device, a.T, [&](LaunchArgs& v) {
    for (const int64_t p : a.ptr) v.owned(ll(p));
    v.owned(ll(a.T));
    v.owned(ll(a.num_slots));
    v.borrowed(e.fixed, 1, 3);  // hq, hkv
    v.owned(PyFloat_FromDouble(eps));
    v.owned(ll(a.max_position));
    v.borrowed(e.fixed, 3, 7);  // s_t, s_h, s_w, qkv's row stride
    v.owned(ll(a.pos_axis));
    v.borrowed(e.fixed, 7, 24);  // the strides, the slot stride, capacity, block size, the caches' strides
  });
}

void launch_cache(int ns, const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
                  const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq, int64_t hkv,
                  double eps, int64_t rope, const Tensor& key_cache, const Tensor& value_cache,
                  const Tensor& slot_mapping, int64_t cache_mode, const OptTensor& k_scale, const OptTensor& v_scale,
                  const Tensor* const* outs) {
  const int64_t D = check_cache_args(qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope,
                                     key_cache, value_cache, slot_mapping, cache_mode, k_scale, v_scale, outs);
  check_cpu_positions(positions, cache.size(0));
  check_cpu_cache_values(key_cache, slot_mapping, cache_mode, qkv.size(0), k_scale, v_scale);
  auto out = [&](int i) { return outs != nullptr ? outs[i] : nullptr; };
  Gil gil;
  CacheKey key;
  CacheArgs args;
  const auto make_key = [&] {
    return cache_key(ns, qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, rope, D, key_cache,
                     value_cache, slot_mapping, cache_mode, k_scale, v_scale, outs, key, args);
  };
  const bool keyed = make_key();
  bool stage;
  const CacheLaunch* kept = find_kept(g_cache_launches, keyed, key, qkv.size(0), stage);
  if (kept != nullptr && launch_cache_kept(*kept, args, key[46], eps)) return;
  call_staging(stage, launcher(g_cache, ns),
               {wrap(qkv), wrap(positions), wrap(cache), wrap(q_weight), wrap(k_weight), wrap(q_bias), wrap(k_bias),
                PyLong_FromLongLong(hq), PyLong_FromLongLong(hkv), PyFloat_FromDouble(eps), PyLong_FromLongLong(rope),
                PyLong_FromLongLong(D), wrap(key_cache), wrap(value_cache), wrap(slot_mapping),
                PyLong_FromLongLong(cache_mode), wrap(k_scale), wrap(v_scale), wrap(out(0)), wrap(out(1)),
                wrap(out(2)), wrap(out(3))});
  if (t_staged.set && (keyed || make_key())) {
    const Staged& st = t_staged;
    const int64_t fixed[24] = {st.grid1, hq,      hkv,     st.s_t,  st.s_h,  st.s_w,  key[26], key[28],
                               key[29],  key[30], key[31], key[32], key[33], key[34], key[35], key[36],
                               key[37],  key[38], key[39], key[40], key[41], key[42], key[43], key[44]};
    keep_staged(g_cache_launches, key, fixed);
  }
  clear_staged();
}

template <int NS>
void cache_inplace(const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
                   const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq,
                   int64_t hkv, double eps, int64_t rope, const Tensor& key_cache, const Tensor& value_cache,
                   const Tensor& slot_mapping, int64_t cache_mode, const OptTensor& k_scale, const OptTensor& v_scale) {
  launch_cache(NS, qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, eps, rope, key_cache,
               value_cache, slot_mapping, cache_mode, k_scale, v_scale, nullptr);
}

template <int NS>
void cache_out(const Tensor& qkv, const Tensor& positions, const Tensor& cache, const OptTensor& q_weight,
               const OptTensor& k_weight, const OptTensor& q_bias, const OptTensor& k_bias, int64_t hq, int64_t hkv,
               double eps, int64_t rope, const Tensor& key_cache, const Tensor& value_cache,
               const Tensor& slot_mapping, int64_t cache_mode, const OptTensor& k_scale, const OptTensor& v_scale,
               const Tensor& q_out, const Tensor& k_out, const Tensor& v_out, const OptTensor& gate_out) {
  const Tensor* const outs[4] = {&q_out, &k_out, &v_out, gate_out.has_value() ? &*gate_out : nullptr};
  launch_cache(NS, qkv, positions, cache, q_weight, k_weight, q_bias, k_bias, hq, hkv, eps, rope, key_cache,
               value_cache, slot_mapping, cache_mode, k_scale, v_scale, outs);
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
  m.impl("split_qkv_rmsnorm_rope_cache", &cache_inplace<NS>);
  m.impl("split_qkv_rmsnorm_rope_cache_out", &cache_out<NS>);
}

}  // namespace
}  // namespace qkvfuse_cpu

// Called from Python through ctypes.PyDLL (the GIL held) by a Triton launcher (the split's, add_rmsnorm's or the
// cache-writing split's), inside a call this file made with stage=True, once that launch went through a compiled
// kernel: Triton's compiled launcher and its handles, the constexprs' values, the token block, the grid's second
// dimension, the mRoPE sections (zeros for add_rmsnorm), the launcher module's globals and triton.knobs.runtime. The
// caller keeps it under the call's key when the launcher returns.
// Returns 0 when staged, 1 when this thread's call asked for nothing.
extern "C" __attribute__((visibility("default"))) int qkvfuse_stage_launch(
    PyObject* run, PyObject* function, PyObject* packed_metadata, PyObject* values, long long block_t,
    long long grid1, long long s_t, long long s_h, long long s_w, PyObject* launch_globals, PyObject* knobs_runtime) {
  using namespace qkvfuse_cpu;
  if (!t_stage_wanted || block_t <= 0 || !PyDict_Check(launch_globals)) return 1;
  if (g_launch_globals == nullptr) {
    Py_INCREF(launch_globals);
    Py_INCREF(knobs_runtime);
    g_launch_globals = launch_globals;
    g_knobs_runtime = knobs_runtime;
  } else if (g_launch_globals != launch_globals) {
    return 1;
  }
  clear_staged();
  for (PyObject* o : {run, function, packed_metadata, values}) Py_INCREF(o);
  t_staged = Staged{true, run, function, packed_metadata, values, block_t, grid1, s_t, s_h, s_w};
  return 0;
}

// Called from Python through ctypes.PyDLL (the GIL held), by qkvfuse.backends.native_host once it has taken the
// Python kernels of the same keys away: the launchers of the auto ops (ns 0) and of the triton ops (ns 1), kept for
// the life of the process, then (register != 0, once) the C++ kernels: the triton ops on every device key and their
// ADInplaceOrView kernels, the auto ops on the accelerator keys. Loading the library registers none of them, so a
// process that loads it for the CPU kernels keeps the Python kernels until this call. The version-counter kernels
// cover every mutating form of the triton ops (their Python ones go with the switch). Returns 0 on success.
extern "C" __attribute__((visibility("default"))) int qkvfuse_set_triton_launchers(int ns, PyObject* split,
                                                                                   PyObject* norm, PyObject* cache,
                                                                                   int do_register) {
  if (ns < 0 || ns > 1) return 1;
  Py_XINCREF(split);
  Py_XINCREF(norm);
  Py_XINCREF(cache);
  qkvfuse_cpu::g_split[ns] = split;
  qkvfuse_cpu::g_norm[ns] = norm;
  qkvfuse_cpu::g_cache[ns] = cache;
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
                             "add_rmsnorm_inplace", "split_qkv_rmsnorm_rope_cache",
                           "split_qkv_rmsnorm_rope_cache_out"}) {
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
