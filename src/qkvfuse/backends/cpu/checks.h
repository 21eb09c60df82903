// The per-call argument rules of the ops, the C++ copy of qkvfuse/_checks.py (the Python copy is the definition;
// the bad-call catalogue, qkvfuse._verify.failure_modes.BAD_CALLS, runs every case on every backend and requires
// the same exception type and message). Messages are "<arg>: expected <expectation>, got <value>", formatted as
// Python formats them (tuples, dtypes, devices); TORCH_CHECK_VALUE / TORCH_CHECK_TYPE / TORCH_CHECK raise
// ValueError / TypeError / RuntimeError in Python. Every check is a few compares per tensor: nanoseconds, so a
// raw torch.ops call is as safe as the public one and the public layer stays thin.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace qkvfuse_cpu {
namespace checks {

using at::Tensor;

enum class Kind { Value, Type, Runtime };

inline void fail(Kind kind, const std::string& arg, const std::string& got, const std::string& expected) {
  const std::string msg = arg + ": expected " + expected + ", got " + got;
  if (kind == Kind::Value) TORCH_CHECK_VALUE(false, msg);
  if (kind == Kind::Type) TORCH_CHECK_TYPE(false, msg);
  TORCH_CHECK(false, msg);
}

// Python's tuple(...): "()", "(5,)", "(3, 512)".
inline std::string py_tuple(c10::IntArrayRef v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + (v.size() == 1 ? ",)" : ")");
}

// Python's str(dtype): "torch.bfloat16".
inline std::string py_dtype(at::ScalarType t) {
  switch (t) {
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kHalf: return "torch.float16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    case at::kBool: return "torch.bool";
    case at::kBFloat16: return "torch.bfloat16";
    case at::ScalarType::Float8_e5m2: return "torch.float8_e5m2";
    case at::ScalarType::Float8_e4m3fn: return "torch.float8_e4m3fn";
    case at::ScalarType::UInt16: return "torch.uint16";
    case at::ScalarType::UInt32: return "torch.uint32";
    case at::ScalarType::UInt64: return "torch.uint64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

inline bool is_float(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// Head counts are bounded before anything is derived from them (qkvfuse._checks.MAX_HEADS): with Hq, Hkv <= 2^20
// and head_dim <= 512, (2 Hq + 2 Hkv) * head_dim, Hq * head_dim and T * heads stay far inside int64; unbounded,
// they wrap to small numbers that pass every shape check and the kernel writes out of bounds.
constexpr int64_t kMaxHeads = int64_t{1} << 20;

inline void head_count(const char* arg, int64_t value) {
  if (value < 1 || value > kMaxHeads) {
    fail(Kind::Value, arg, std::to_string(value), "an int in [1, " + std::to_string(kMaxHeads) + "]");
  }
}

// The Gemma flag says how the q/k norm weights are stored: without weights it would be silently ignored.
inline void gemma_without_weights() {
  fail(Kind::Value, "gemma_norm", "True without norm weights",
       "q_weight and k_weight when gemma_norm is set (norm weights stored centred at 0)");
}

constexpr const char* kFloatNames = "torch.float32, torch.bfloat16 or torch.float16";

inline void device(const char* arg, const Tensor& t, const c10::Device& dev, const char* anchor) {
  if (t.device() != dev) {
    fail(Kind::Value, arg, "a tensor on " + t.device().str(),
         "a tensor on " + dev.str() + " (the device of " + anchor + ")");
  }
}

// 2-D rows: a unit last stride and a row stride of at least `width` (empty tensors pass).
inline void rows(const char* arg, const Tensor& t, int64_t width) {
  if ((t.stride(1) != 1 || t.stride(0) < width) && t.numel() != 0) {
    fail(Kind::Value, arg, "strides " + py_tuple(t.strides()),
         "a contiguous last dim (stride 1) and row stride >= " + std::to_string(width));
  }
}

inline void vector(const char* arg, const Tensor& t, int64_t length, const c10::Device& dev, const char* anchor) {
  device(arg, t, dev, anchor);
  if (!is_float(t.scalar_type())) {
    fail(Kind::Type, arg, "dtype " + py_dtype(t.scalar_type()),
         "torch.float32 or the activations' dtype (one of [torch.float32, torch.bfloat16, torch.float16])");
  }
  if (t.dim() != 1 || t.size(0) != length) {
    fail(Kind::Value, arg, "shape " + py_tuple(t.sizes()), "shape (" + std::to_string(length) + ",)");
  }
}

struct Named {
  const char* name;
  const Tensor* t;  // nullptr: absent
};

// Norm weights and biases are fp32 or the activations' dtype.
inline void io_dtype(const char* arg, at::ScalarType dtype, std::initializer_list<Named> named) {
  for (const Named& n : named) {
    if (n.t != nullptr && n.t->scalar_type() != at::kFloat && n.t->scalar_type() != dtype) {
      fail(Kind::Type, n.name, "dtype " + py_dtype(n.t->scalar_type()),
           std::string("torch.float32 or ") + arg + "'s dtype " + py_dtype(dtype));
    }
  }
}

// Inference only: with grad mode on no input may require grad (the ops have no autograd formula).
inline void no_grad(std::initializer_list<Named> named) {
  if (!at::GradMode::is_enabled()) return;
  for (const Named& n : named) {
    if (n.t != nullptr && n.t->requires_grad()) {
      fail(Kind::Runtime, n.name, "one that requires grad",
           "a tensor that does not require grad (qkvfuse ops are inference only: call them under torch.no_grad() "
           "or torch.inference_mode(), or detach)");
    }
  }
}

inline void out_tensor(const char* name, const Tensor& t, int64_t T, int64_t width, const Tensor& like,
                       const char* like_name) {
  device(name, t, like.device(), like_name);
  if (t.scalar_type() != like.scalar_type()) {
    fail(Kind::Type, name, "dtype " + py_dtype(t.scalar_type()),
         "dtype " + py_dtype(like.scalar_type()) + " (" + like_name + "'s)");
  }
  if (t.dim() != 2 || t.size(0) != T || t.size(1) != width) {
    fail(Kind::Value, name, "shape " + py_tuple(t.sizes()), "shape " + py_tuple({T, width}));
  }
  rows(name, t, width);
}

// ------------------------------------------------------------------------------------------------------------
// The exact overlap rule (_checks.py: _layout, _span, share_elements, _check_outputs, _check_targets).
// ------------------------------------------------------------------------------------------------------------
inline int64_t floor_div(int64_t a, int64_t b) {  // Python's a // b
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

struct Entry {
  const char* name;
  const Tensor* t;
  bool has_rows;
  int64_t first, row_stride, count, width;  // the row layout, in bytes
  int64_t lo, hi;                           // the byte span [lo, hi)
};

inline int64_t address(const Tensor& t) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())); }

inline Entry entry(const char* name, const Tensor& t) {
  const int64_t size_of = static_cast<int64_t>(t.element_size());
  const auto shape = t.sizes();
  const auto stride = t.strides();
  Entry e{name, &t, false, address(t), 0, 0, 0, 0, 0};
  if (shape.size() == 2 && (shape[1] <= 1 || stride[1] == 1) && stride[0] >= 0) {
    e.has_rows = true;
    e.row_stride = shape[0] > 1 ? stride[0] * size_of : 0;
    e.count = shape[0];
    e.width = shape[1] * size_of;
  } else if (shape.size() == 1 && (shape[0] <= 1 || stride[0] == 1)) {
    e.has_rows = true;
    e.count = 1;
    e.width = shape[0] * size_of;
  }
  if (e.has_rows) {
    e.lo = e.first;
    e.hi = e.first + (e.count - 1) * e.row_stride + e.width;
  } else {
    int64_t start = e.first, end = e.first;
    for (size_t d = 0; d < shape.size(); ++d) {
      const int64_t reach = (shape[d] - 1) * stride[d] * size_of;
      if (reach < 0) {
        start += reach;
      } else {
        end += reach;
      }
    }
    e.lo = start;
    e.hi = end + size_of;
  }
  return e;
}

inline std::vector<Entry> entries(std::initializer_list<Named> named) {
  std::vector<Entry> out;
  out.reserve(named.size());
  for (const Named& n : named) {
    if (n.t != nullptr && n.t->numel() != 0) out.push_back(entry(n.name, *n.t));
  }
  return out;
}

inline bool share_elements(const Entry& a, const Entry& b) {
  if (!a.has_rows || !b.has_rows || (a.count > 1 && b.count > 1 && a.row_stride != b.row_stride)) return true;
  const int64_t stride = a.count > 1 ? a.row_stride : b.row_stride;
  const int64_t d = b.first - a.first;
  if (stride == 0) return -b.width < d && d < a.width;
  const int64_t k_lo = std::max<int64_t>(1 - a.count, floor_div(-b.width - d, stride) + 1);
  const int64_t k_hi = std::min<int64_t>(b.count - 1, -floor_div(d - a.width, stride) - 1);
  return k_lo <= k_hi;
}

inline bool meet(const Entry& a, const Entry& b) { return a.lo < b.hi && b.lo < a.hi && share_elements(a, b); }

// The view an output may exactly be: its input's name, data pointer and strides (shape: the output's, checked).
struct Own {
  const char* name;
  int64_t ptr;
  int64_t stride0, stride1;
  bool present;
};

inline bool same_view(const Tensor& out, const Own& own) {
  return own.present && address(out) == own.ptr &&
         (out.size(0) <= 1 || (out.stride(0) == own.stride0 && out.stride(1) == own.stride1));
}

// own(i): the view output i may exactly alias.
template <typename OwnOf>
void outputs(const std::vector<Entry>& outs, const std::vector<Entry>& inputs, const OwnOf& own_of) {
  for (const Entry& src : inputs) {
    for (const Entry& out : outs) {
      if (!meet(out, src)) continue;
      const Own own = own_of(out.name);
      if (std::string(src.name) == own.name && same_view(*out.t, own)) continue;
      fail(Kind::Value, out.name, std::string("memory shared with ") + src.name,
           std::string("no element shared with an input other than exactly aliasing its own slice of ") + own.name);
    }
  }
  for (size_t k = 0; k < outs.size(); ++k) {
    for (size_t j = k + 1; j < outs.size(); ++j) {
      if (meet(outs[k], outs[j])) {
        fail(Kind::Value, outs[k].name, std::string("memory shared with ") + outs[j].name,
             "outputs that share no element with each other");
      }
    }
  }
}

inline void targets(const std::vector<Entry>& targets, const std::vector<Entry>& inputs) {
  if (targets.size() == 2 && meet(targets[0], targets[1])) {
    fail(Kind::Value, targets[1].name, std::string("memory shared with ") + targets[0].name,
         std::string("an in-place target that shares no element with ") + targets[0].name);
  }
  for (const Entry& target : targets) {
    for (const Entry& src : inputs) {
      if (meet(target, src)) {
        fail(Kind::Value, target.name, std::string("memory shared with ") + src.name,
             "an in-place target that shares no element with another input");
      }
    }
  }
}


// ------------------------------------------------------------------------------------------------------------
// The cache-writing split's caches (_checks.py: check_cache, strided_share; _library.py: check_cache_values).
// ------------------------------------------------------------------------------------------------------------
inline bool is_fp8(at::ScalarType t) { return t == at::ScalarType::Float8_e4m3fn || t == at::ScalarType::Float8_e5m2; }

// Python's repr(float) of a double: the shortest round-trip digits, positional for exponents in [-4, 16).
inline std::string py_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  const auto end = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific).ptr;
  const std::string sci(buf, end);  // [-]d[.ddd]e[+-]xx
  const size_t e = sci.find('e');
  const bool neg = sci[0] == '-';
  std::string digits;
  for (size_t i = neg ? 1 : 0; i < e; ++i) {
    if (sci[i] != '.') digits += sci[i];
  }
  const int exp = std::stoi(sci.substr(e + 1));
  std::string out = neg ? "-" : "";
  if (exp < -4 || exp >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    const std::string mag = std::to_string(exp < 0 ? -exp : exp);
    return out + "e" + (exp < 0 ? "-" : "+") + (mag.size() < 2 ? "0" : "") + mag;
  }
  if (exp < 0) return out + "0." + std::string(-exp - 1, '0') + digits;
  if (static_cast<int>(digits.size()) <= exp + 1) {
    return out + digits + std::string(exp + 1 - digits.size(), '0') + ".0";
  }
  return out + digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
}

// Byte range [lo, hi) a non-empty strided tensor touches (_checks._span).
inline std::pair<int64_t, int64_t> span(const Tensor& t) {
  const int64_t size_of = static_cast<int64_t>(t.element_size());
  int64_t lo = address(t), hi = address(t);
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t reach = (t.size(d) - 1) * t.stride(d) * size_of;
    (reach < 0 ? lo : hi) += reach;
  }
  return {lo, hi + size_of};
}

// Sizes and strides of the dims longer than 1 (what _checks._nested and strided_share sort).
// sorted by stride, increasing or decreasing, ties in dim order (Python's stable sort); no allocation per call.
using Dims = c10::SmallVector<std::pair<int64_t, int64_t>, 8>;

inline Dims long_dims(const Tensor& t, bool decreasing) {
  Dims dims;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t size = t.size(d), stride = t.stride(d);
    if (size <= 1) continue;
    auto at = dims.end();
    while (at != dims.begin() && (decreasing ? (at - 1)->second < stride : (at - 1)->second > stride)) --at;
    dims.insert(at, {size, stride});
  }
  return dims;
}

// Whether no two indices reach the same element, by the sufficient rule (sorted by stride, each stride exceeds
// the reach of the dims below it).
inline bool nested(const Tensor& t) {
  const Dims dims = long_dims(t, false);
  int64_t reach = 0;
  for (const auto& [size, stride] : dims) {
    if (stride <= reach) return false;
    reach += (size - 1) * stride;
  }
  return true;
}

// Whether d = sum(i_k * stride_k) with |i_k| < size_k, dims[k..] sorted by decreasing stride (nested).
inline bool offset_reachable(int64_t d, const Dims& dims, size_t k) {
  if (k == dims.size()) return d == 0;
  const auto [size, stride] = dims[k];
  int64_t reach = 0;
  for (size_t j = k + 1; j < dims.size(); ++j) reach += (dims[j].first - 1) * dims[j].second;
  const int64_t q = floor_div(d, stride);
  for (const int64_t i : {q, q + 1}) {
    const int64_t rest = d - i * stride;
    if ((i < 0 ? -i : i) < size && (rest < 0 ? -rest : rest) <= reach && offset_reachable(rest, dims, k + 1)) {
      return true;
    }
  }
  return false;
}

// Whether two non-empty strided tensors share a byte: exact for two translates of one nested layout (an
// interleaved KV buffer's halves), otherwise intersecting byte ranges count as sharing.
inline bool strided_share(const Tensor& a, const Tensor& b) {
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  if (!(a0 < b1 && b0 < a1)) return false;
  const int64_t size_of = static_cast<int64_t>(a.element_size());
  const int64_t delta = address(b) - address(a);
  if (a.sizes() != b.sizes() || a.strides() != b.strides() || size_of != static_cast<int64_t>(b.element_size()) ||
      delta % size_of != 0 || !nested(a)) {
    return true;
  }
  return offset_reachable(delta / size_of, long_dims(a, true), 0);
}

constexpr const char* kCacheShapeNHD = "(num_blocks, block_size, num_kv_heads, head_dim)";
constexpr const char* kCacheShapeHND = "(num_blocks, num_kv_heads, block_size, head_dim)";
constexpr const char* kLayoutNames[4] = {"'NHD'", "'HND'", "'vec'", "'amx'"};

inline void scale_arg(const char* name, const std::optional<Tensor>& scale, const c10::Device& dev, bool fp8) {
  if (!fp8) {
    if (scale.has_value()) {
      fail(Kind::Value, name, "a tensor", "None for a cache of qkv's dtype (scales are for FP8 caches)");
    }
    return;
  }
  if (!scale.has_value()) {
    fail(Kind::Value, name, "None", "a 0-d (or one-element) torch.float32 tensor for an FP8 cache");
  }
  device(name, *scale, dev, "qkv");
  if (scale->scalar_type() != at::kFloat) {
    fail(Kind::Type, name, "dtype " + py_dtype(scale->scalar_type()), "torch.float32");
  }
  if (scale->numel() != 1 || scale->dim() > 1) {
    fail(Kind::Value, name, "shape " + py_tuple(scale->sizes()), "shape () or (1,)");
  }
}

// _checks.check_cache, in its order and with its messages: `others` are the split's other tensors, in the order
// of the Python rule (positions, cos_sin_cache, q_weight, k_weight, q_bias, k_bias; the out= form's outputs after
// them, whose names end in "_out").
inline void cache(const Tensor& qkv, const Tensor& key_cache, const Tensor& value_cache, const Tensor& slot_mapping,
                  int64_t cache_mode, const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale,
                  int64_t num_kv_heads, int64_t head_dim, std::initializer_list<Named> others) {
  const int64_t layout = cache_mode & 15;
  if (layout > 3 || cache_mode < 0 || (cache_mode & ~int64_t{31}) != 0) {
    fail(Kind::Value, "cache_mode", std::to_string(cache_mode),
         "a layout code in [0, 1, 2, 3], plus 16 for truncating FP8 rounding (qkvfuse._cache_mode.encode_cache)");
  }
  auto layout_note = [layout] { return std::string(" (layout ") + kLayoutNames[layout] + ")"; };
  const char* shape_text = layout == 0 ? kCacheShapeNHD : kCacheShapeHND;
  const c10::Device dev = qkv.device();
  const at::ScalarType dtype = qkv.scalar_type();
  const std::pair<const char*, const Tensor*> caches[2] = {{"key_cache", &key_cache}, {"value_cache", &value_cache}};
  for (const auto& [name, c] : caches) {
    device(name, *c, dev, "qkv");
    if (c->scalar_type() != dtype && !is_fp8(c->scalar_type())) {
      fail(Kind::Type, name, "dtype " + py_dtype(c->scalar_type()),
           "qkv's dtype " + py_dtype(dtype) + ", torch.float8_e4m3fn or torch.float8_e5m2");
    }
    if (c->dim() != 4) {
      fail(Kind::Value, name, "shape " + py_tuple(c->sizes()),
           std::string("a 4-D cache ") + shape_text + layout_note());
    }
  }
  if (value_cache.scalar_type() != key_cache.scalar_type()) {
    fail(Kind::Type, "value_cache", "dtype " + py_dtype(value_cache.scalar_type()),
         "key_cache's dtype " + py_dtype(key_cache.scalar_type()));
  }
  if (value_cache.sizes() != key_cache.sizes()) {
    fail(Kind::Value, "value_cache", "shape " + py_tuple(value_cache.sizes()),
         "key_cache's shape " + py_tuple(key_cache.sizes()));
  }
  const int64_t blocks = key_cache.size(0), block_size = key_cache.size(layout == 0 ? 1 : 2),
                heads = key_cache.size(layout == 0 ? 2 : 1), dim = key_cache.size(3);
  if (heads != num_kv_heads || dim != head_dim || blocks < 1 || block_size < 1) {
    fail(Kind::Value, "key_cache", "shape " + py_tuple(key_cache.sizes()),
         std::string(shape_text) + " with num_kv_heads=" + std::to_string(num_kv_heads) + ", head_dim=" +
             std::to_string(head_dim) + " and at least one block" + layout_note());
  }
  if (layout == 3 && (key_cache.element_size() != 2 || block_size % 16 != 0 || head_dim % 16 != 0)) {
    fail(Kind::Value, "key_cache",
         "dtype " + py_dtype(key_cache.scalar_type()) + ", block_size " + std::to_string(block_size) +
             " and head_dim " + std::to_string(head_dim),
         "a 16-bit cache with block_size and head_dim multiples of 16 (layout 'amx')");
  }
  for (const auto& [name, c] : caches) {
    if ((layout == 2 || layout == 3) &&
        (c->stride(3) != 1 || c->stride(2) != head_dim || c->stride(1) < block_size * head_dim)) {
      fail(Kind::Value, name, "strides " + py_tuple(c->strides()),
           "a contiguous (block_size, head_dim) region per block and head" + layout_note());
    }
    if (!nested(*c) || *std::min_element(c->strides().begin(), c->strides().end()) < 0) {
      fail(Kind::Value, name, "strides " + py_tuple(c->strides()),
           "non-negative strides with no element reached twice");
    }
  }
  device("slot_mapping", slot_mapping, dev, "qkv");
  if (slot_mapping.scalar_type() != at::kInt && slot_mapping.scalar_type() != at::kLong) {
    fail(Kind::Type, "slot_mapping", "dtype " + py_dtype(slot_mapping.scalar_type()), "torch.int32 or torch.int64");
  }
  if (slot_mapping.dim() != 1) {
    fail(Kind::Value, "slot_mapping", "shape " + py_tuple(slot_mapping.sizes()),
         "shape (num_slots,) (tokens past its end are not written)");
  }
  const bool fp8 = is_fp8(key_cache.scalar_type());
  scale_arg("k_scale", k_scale, dev, fp8);
  scale_arg("v_scale", v_scale, dev, fp8);
  no_grad({{"key_cache", &key_cache}, {"value_cache", &value_cache}});
  if (strided_share(key_cache, value_cache)) {
    fail(Kind::Value, "value_cache", "memory shared with key_cache",
         "a cache that shares no element with key_cache (K and V may interleave in one buffer)");
  }
  c10::SmallVector<Named, 16> inputs{{"qkv", &qkv}};
  inputs.append(others.begin(), others.end());
  inputs.push_back({"slot_mapping", &slot_mapping});
  inputs.push_back({"k_scale", k_scale.has_value() ? &*k_scale : nullptr});
  inputs.push_back({"v_scale", v_scale.has_value() ? &*v_scale : nullptr});
  // The byte ranges first (each once): strided_share's finer test only for ranges that meet.
  c10::SmallVector<std::pair<int64_t, int64_t>, 16> spans;
  for (const Named& other : inputs) {
    spans.push_back(other.t != nullptr && other.t->numel() != 0 ? span(*other.t) : std::pair<int64_t, int64_t>{0, 0});
  }
  for (const auto& [name, c] : caches) {
    const auto [c0, c1] = span(*c);
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Named& other = inputs[i];
      if (other.t != nullptr && spans[i].first < c1 && c0 < spans[i].second && strided_share(*c, *other.t)) {
        const size_t len = std::strlen(other.name);
        const bool output = len > 4 && std::strcmp(other.name + len - 4, "_out") == 0;
        fail(Kind::Value, name, std::string("memory shared with ") + other.name,
             output ? "a cache that shares no element with an output" : "a cache that shares no element with an input");
      }
    }
  }
}

}  // namespace checks
}  // namespace qkvfuse_cpu
