// Triton kernels launched from C++: the registry of compiled variants and the driver launch.
//
// A "slot" is one Python `Launch` (a Triton kernel at one launch configuration). Each slot keeps the
// compiled variants it has met, keyed as Triton specialises: per pointer its dtype and 16-byte
// alignment, per int whether it is 1, divisible by 16 and inside int32 (plus the device). A known variant is
// launched with cuLaunchKernel straight from C++ (no Python, no GIL); an unknown one goes once through
// Python (`compile_cb`), which launches it Triton's own way and answers how to launch it next time, or
// that it must always go through Python (a kernel needing scratch memory, clusters, ...).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace lck_host {

namespace py = pybind11;

struct Arg {
  enum Kind : uint8_t { kPtr, kInt, kFloat } kind;
  const at::Tensor* tensor = nullptr;  // kPtr
  int64_t i = 0;                       // kInt; kPtr: elements past the tensor's first (ptr_at)
  double f = 0.0;                      // kFloat

  // The address a pointer argument passes.
  uintptr_t address() const {
    return reinterpret_cast<uintptr_t>(tensor->data_ptr()) + static_cast<uintptr_t>(i * tensor->element_size());
  }
};

inline Arg ptr(const at::Tensor& t) { return Arg{Arg::kPtr, &t, 0, 0.0}; }
// The address `offset` elements past t's first, as a view starting there (a narrow, a column slice) would pass
// it, without building that view (a dispatcher call each). Kernels see only the address.
inline Arg ptr_at(const at::Tensor& t, int64_t offset) {
  TORCH_CHECK(offset >= 0 && t.storage_offset() + offset <= int64_t(t.storage().nbytes() / t.element_size()),
              "lck host: ptr_at outside the tensor's storage");
  return Arg{Arg::kPtr, &t, offset, 0.0};
}
inline Arg i(int64_t v) { return Arg{Arg::kInt, nullptr, v, 0.0}; }
inline Arg f(double v) { return Arg{Arg::kFloat, nullptr, 0, v}; }

// How a kept parameter is passed (Triton's signature type, reduced to its size and kind).
enum Param : uint8_t { kDropped = 0, kP64 = 1, kI32 = 2, kI64 = 3, kF32 = 4, kF64 = 5 };

struct Variant {
  CUfunction fn = nullptr;
  unsigned block = 0, shared = 0, scratch = 0;  // threads per block, dynamic shared bytes, hidden scratch ptrs
  std::vector<uint8_t> params;                   // one Param per argument
  bool python_only = false;
};

struct Slot {
  py::object launch;  // the Python Launch
  std::unordered_map<std::string, Variant> variants;
};

struct Registry {
  std::mutex mu;  // guards slots' maps (backward runs on autograd's device threads)
  std::vector<Slot> slots;
  py::object compile_cb;  // (launch, grid, args) -> None | (fn, block, shared, scratch, params bytes)
  std::atomic<uint64_t> direct_launches{0}, python_launches{0};  // launches from C++ / handed to Triton
};

inline Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: py::objects must not die after the interpreter
  return *r;
}

using LaunchKernel = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, CUstream, void**, void**);
using GetErrorName = CUresult (*)(CUresult, const char**);
using EventCreate = CUresult (*)(CUevent*, unsigned);
using EventRecord = CUresult (*)(CUevent, CUstream);
using StreamWaitEvent = CUresult (*)(CUstream, CUevent, unsigned);

struct Driver {
  LaunchKernel launch = nullptr;
  GetErrorName error_name = nullptr;
  EventCreate event_create = nullptr;  // events order a side stream against the caller's (linear_cross_entropy)
  EventRecord event_record = nullptr;
  StreamWaitEvent stream_wait_event = nullptr;
};

inline const Driver& driver() {
  static Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) throw std::runtime_error("lck host: cannot open libcuda.so.1");
    out.launch = reinterpret_cast<LaunchKernel>(dlsym(lib, "cuLaunchKernel"));
    out.error_name = reinterpret_cast<GetErrorName>(dlsym(lib, "cuGetErrorName"));
    out.event_create = reinterpret_cast<EventCreate>(dlsym(lib, "cuEventCreate"));
    out.event_record = reinterpret_cast<EventRecord>(dlsym(lib, "cuEventRecord"));
    out.stream_wait_event = reinterpret_cast<StreamWaitEvent>(dlsym(lib, "cuStreamWaitEvent"));
    if (out.launch == nullptr) throw std::runtime_error("lck host: libcuda.so.1 lacks cuLaunchKernel");
    return out;
  }();
  return d;
}

// Throws "<who>: <what> failed: <the driver's error name>" unless rc is CUDA_SUCCESS.
inline void driver_check(CUresult rc, const char* who, const char* what) {
  if (rc == CUDA_SUCCESS) return;
  const char* name = "?";
  if (driver().error_name != nullptr) driver().error_name(rc, &name);
  throw std::runtime_error(std::string(who) + ": " + what + " failed: " + name);
}

// The variant key of a launch into `key` (reused: no allocation per launch once it has grown).
template <size_t N>
void variant_key(int device, const std::array<Arg, N>& args, std::string& key) {
  key.clear();
  key.push_back(static_cast<char>(device));
  for (const Arg& a : args) {
    switch (a.kind) {
      case Arg::kPtr: {
        const uintptr_t addr = a.address();
        key.push_back(static_cast<char>(a.tensor->scalar_type()));
        key.push_back(static_cast<char>((addr & 15) == 0 ? 'A' : 'u'));
        break;
      }
      case Arg::kInt: {
        const int64_t v = a.i;
        key.push_back(static_cast<char>('i'));
        key.push_back(static_cast<char>((v == 1) | (((v & 15) == 0) << 1) |
                                        ((v >= INT32_MIN && v <= INT32_MAX) << 2)));
        break;
      }
      case Arg::kFloat:
        key.push_back('f');
        key.push_back('f');
        break;
    }
  }
}

template <size_t N>
py::tuple py_args(const std::array<Arg, N>& args) {
  py::tuple out(N);
  for (size_t k = 0; k < N; ++k) {
    const Arg& a = args[k];
    if (a.kind == Arg::kPtr)
      // At an offset: a one-element view there (Triton and its interpreter take the address and the storage).
      out[k] = py::cast(a.i == 0 ? *a.tensor : a.tensor->as_strided({1}, {1}, a.tensor->storage_offset() + a.i));
    else if (a.kind == Arg::kInt)
      out[k] = py::int_(a.i);
    else
      out[k] = py::float_(a.f);
  }
  return out;
}

inline Variant parse_variant(const py::handle& desc) {
  Variant v;
  if (desc.is_none()) {
    v.python_only = true;
    return v;
  }
  auto t = desc.cast<py::tuple>();
  v.fn = reinterpret_cast<CUfunction>(t[0].cast<uintptr_t>());
  v.block = t[1].cast<unsigned>();
  v.shared = t[2].cast<unsigned>();
  v.scratch = t[3].cast<unsigned>();
  const std::string params = t[4].cast<std::string>();
  v.params.assign(params.begin(), params.end());
  return v;
}

template <size_t N>
void launch_args(int slot, std::array<unsigned, 3> grid, int device, const std::array<Arg, N>& args) {
  if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) return;
  Registry& reg = registry();
  thread_local std::string key;
  variant_key(device, args, key);
  const Variant* v = nullptr;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto& variants = reg.slots.at(slot).variants;
    auto it = variants.find(key);
    if (it != variants.end()) v = &it->second;  // unordered_map nodes never move
  }
  if (v == nullptr || v->python_only) {
    // First call of this variant (or one Triton must launch itself): Python launches it now.
    const std::string miss_key = key;  // the thread's buffer is free again while Python runs
    py::gil_scoped_acquire gil;
    py::object launch_obj;
    {
      std::lock_guard<std::mutex> lock(reg.mu);
      launch_obj = reg.slots.at(slot).launch;
    }
    py::tuple g = py::make_tuple(grid[0], grid[1], grid[2]);
    py::object desc = reg.compile_cb(launch_obj, g, py_args(args));
    std::lock_guard<std::mutex> lock(reg.mu);
    ++reg.python_launches;
    if (v == nullptr) reg.slots.at(slot).variants.emplace(miss_key, parse_variant(desc));
    return;
  }
  if (v->params.size() != N) throw std::runtime_error("lck host: variant arity mismatch");
  // Values live here until cuLaunchKernel has copied them.
  std::array<uint64_t, N + 2> storage{};
  std::array<void*, N + 2> params{};
  size_t n = 0;
  for (size_t k = 0; k < N; ++k) {
    const Arg& a = args[k];
    void* slot_ptr = &storage[n];
    switch (v->params[k]) {
      case kDropped:
        continue;
      case kP64: {
        const uint64_t p = a.address();
        std::memcpy(slot_ptr, &p, 8);
        break;
      }
      case kI32: {
        const int32_t x = static_cast<int32_t>(a.i);
        std::memcpy(slot_ptr, &x, 4);
        break;
      }
      case kI64:
        std::memcpy(slot_ptr, &a.i, 8);
        break;
      case kF32: {
        const float x = static_cast<float>(a.f);
        std::memcpy(slot_ptr, &x, 4);
        break;
      }
      case kF64:
        std::memcpy(slot_ptr, &a.f, 8);
        break;
      default:
        throw std::runtime_error("lck host: unknown parameter kind");
    }
    params[n] = slot_ptr;
    ++n;
  }
  for (unsigned s = 0; s < v->scratch; ++s) {  // Triton's hidden scratch pointers: null (none needed)
    storage[n] = 0;
    params[n] = &storage[n];
    ++n;
  }
  CUstream stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const Driver& d = driver();
  driver_check(d.launch(v->fn, grid[0], grid[1], grid[2], v->block, 1, 1, v->shared, stream, params.data(),
                        nullptr),
               "lck host", "cuLaunchKernel");
  reg.direct_launches.fetch_add(1, std::memory_order_relaxed);
}

// Launch slot `slot` over `grid` on the current stream of `device` with the kernel's runtime arguments
// (ptr / i / f, in its order: everything before its constexprs).
template <class... A>
void launch(int slot, std::array<unsigned, 3> grid, int device, const A&... args) {
  launch_args<sizeof...(A)>(slot, grid, device, std::array<Arg, sizeof...(A)>{args...});
}

// Launch plans asked of Python once per key (shape, dtype, device, options) and kept; Plan::from reads the
// callback's answer. Never destroyed with the interpreter: owners allocate it and leak it on purpose.
template <class Key, class Plan>
class PlanCache {
 public:
  void reset(py::object cb) {
    std::lock_guard<std::mutex> lock(mu_);
    cb_ = std::move(cb);
    plans_.clear();
  }

  template <class... A>
  Plan get(const Key& key, const A&... args) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = plans_.find(key);
      if (it != plans_.end()) return it->second;
    }
    py::gil_scoped_acquire gil;  // the backward runs without it
    py::object cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cb = cb_;
    }
    const Plan plan = Plan::from(cb(args...));
    std::lock_guard<std::mutex> lock(mu_);
    plans_.emplace(key, plan);
    return plan;
  }

 private:
  std::mutex mu_;
  py::object cb_;
  std::map<Key, Plan> plans_;
};

inline py::object wrap(const at::Tensor& t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(t)); }

inline int add_slot(py::object launch_obj) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.slots.push_back(Slot{std::move(launch_obj), {}});
  return static_cast<int>(reg.slots.size()) - 1;
}

inline unsigned cdiv(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

}  // namespace lck_host
