// The lck JIT host module: loads cubins and launches their kernels through the CUDA driver API.
//
// Built once per (nvcc, Python, pybind11, this file) and cached like any JIT entry (see host.py).
// The driver is opened with dlopen at first use instead of linking -lcuda, so the module also builds
// (and imports) on CPU-only CI machines that have nvcc but no libcuda.so.1. Every driver call is
// checked; a failure raises CudaDriverError("<call> failed: <CUDA_ERROR_NAME> (<driver text>)").
//
// Contexts: every call runs in the primary context of the requested device, the one torch's
// runtime uses, pushed only when it is not already current (and popped afterwards), so the caller's
// thread state is left as it was.

#include <cuda.h>
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// Keep in sync with args.py (KIND_*).
enum ArgKind : int { kI32 = 0, kI64 = 1, kU64 = 2, kF32 = 3, kPtr = 4 };

struct CudaDriverError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Driver entry points, resolved by their exported (versioned) symbol names.
struct Driver {
  void* lib = nullptr;
  decltype(&::cuInit) init = nullptr;
  decltype(&::cuDriverGetVersion) driverGetVersion = nullptr;
  decltype(&::cuDeviceGet) deviceGet = nullptr;
  decltype(&::cuDeviceGetCount) deviceGetCount = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) primaryCtxRetain = nullptr;
  decltype(&::cuCtxGetCurrent) ctxGetCurrent = nullptr;
  decltype(&::cuCtxPushCurrent) ctxPush = nullptr;
  decltype(&::cuCtxPopCurrent) ctxPop = nullptr;
  decltype(&::cuModuleLoadData) moduleLoadData = nullptr;
  decltype(&::cuModuleGetFunction) moduleGetFunction = nullptr;
  decltype(&::cuFuncSetAttribute) funcSetAttribute = nullptr;
  decltype(&::cuFuncGetAttribute) funcGetAttribute = nullptr;
  decltype(&::cuLaunchKernelEx) launchKernelEx = nullptr;
  decltype(&::cuGetErrorName) getErrorName = nullptr;
  decltype(&::cuGetErrorString) getErrorString = nullptr;
  // Optional: CUDA >= 12.4 drivers. Used to check argument count and sizes before a launch.
  decltype(&::cuFuncGetParamInfo) funcGetParamInfo = nullptr;
  // Optional: CUDA >= 12.0 drivers. How many thread-block clusters of a launch fit the GPU at once.
  decltype(&::cuOccupancyMaxActiveClusters) occupancyMaxActiveClusters = nullptr;
};

Driver g_driver;
std::once_flag g_driver_once;
std::string g_driver_error;  // set when loading failed; reported on every later call
std::mutex g_ctx_mutex;
std::unordered_map<int, CUcontext> g_primary;  // device ordinal -> retained primary context

template <class F>
bool resolve(F& fn, const char* symbol, bool required) {
  fn = reinterpret_cast<F>(dlsym(g_driver.lib, symbol));
  if (fn == nullptr && required) {
    g_driver_error = std::string("libcuda.so.1 has no symbol ") + symbol + " (driver too old?)";
    return false;
  }
  return true;
}

void load_driver_once() {
  g_driver.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (g_driver.lib == nullptr) {
    const char* why = dlerror();
    g_driver_error = std::string("cannot load the CUDA driver (libcuda.so.1): ") + (why ? why : "unknown error") +
                     "; launching JIT kernels needs an NVIDIA driver";
    return;
  }
  bool ok = resolve(g_driver.init, "cuInit", true) && resolve(g_driver.driverGetVersion, "cuDriverGetVersion", true) &&
            resolve(g_driver.deviceGet, "cuDeviceGet", true) &&
            resolve(g_driver.deviceGetCount, "cuDeviceGetCount", true) &&
            resolve(g_driver.primaryCtxRetain, "cuDevicePrimaryCtxRetain", true) &&
            resolve(g_driver.ctxGetCurrent, "cuCtxGetCurrent", true) &&
            resolve(g_driver.ctxPush, "cuCtxPushCurrent_v2", true) &&
            resolve(g_driver.ctxPop, "cuCtxPopCurrent_v2", true) &&
            resolve(g_driver.moduleLoadData, "cuModuleLoadData", true) &&
            resolve(g_driver.moduleGetFunction, "cuModuleGetFunction", true) &&
            resolve(g_driver.funcSetAttribute, "cuFuncSetAttribute", true) &&
            resolve(g_driver.funcGetAttribute, "cuFuncGetAttribute", true) &&
            resolve(g_driver.launchKernelEx, "cuLaunchKernelEx", true) &&
            resolve(g_driver.getErrorName, "cuGetErrorName", true) &&
            resolve(g_driver.getErrorString, "cuGetErrorString", true) &&
            resolve(g_driver.funcGetParamInfo, "cuFuncGetParamInfo", false) &&
            resolve(g_driver.occupancyMaxActiveClusters, "cuOccupancyMaxActiveClusters", false);
  if (!ok) return;
  CUresult r = g_driver.init(0);
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    const char* text = nullptr;
    g_driver.getErrorName(r, &name);
    g_driver.getErrorString(r, &text);
    g_driver_error = std::string("cuInit failed: ") + (name ? name : "CUDA_ERROR_UNKNOWN") + " (" +
                     (text ? text : "no description") + ")";
  }
}

const Driver& driver() {
  std::call_once(g_driver_once, load_driver_once);
  if (!g_driver_error.empty()) throw CudaDriverError(g_driver_error);
  return g_driver;
}

void check(CUresult r, const char* call) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* text = nullptr;
  if (g_driver.getErrorName == nullptr || g_driver.getErrorName(r, &name) != CUDA_SUCCESS) name = nullptr;
  if (g_driver.getErrorString == nullptr || g_driver.getErrorString(r, &text) != CUDA_SUCCESS) text = nullptr;
  throw CudaDriverError(std::string(call) + " failed: " + (name ? name : "CUDA_ERROR_UNKNOWN") + " (" +
                        (text ? text : "no description") + ") [code " + std::to_string(static_cast<int>(r)) +
                        "]");
}

CUcontext primary_context(int device) {
  const Driver& d = driver();
  std::lock_guard<std::mutex> lock(g_ctx_mutex);
  auto it = g_primary.find(device);
  if (it != g_primary.end()) return it->second;
  int count = 0;
  check(d.deviceGetCount(&count), "cuDeviceGetCount");
  if (device < 0 || device >= count) {
    throw CudaDriverError("device " + std::to_string(device) + " is out of range: the driver sees " +
                          std::to_string(count) + " device(s)");
  }
  CUdevice dev;
  check(d.deviceGet(&dev, device), "cuDeviceGet");
  CUcontext ctx = nullptr;
  // Retained for the life of the process: modules loaded into it must stay valid.
  check(d.primaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  g_primary.emplace(device, ctx);
  return ctx;
}

// Makes the device's primary context current for this scope, restoring the previous one after.
class ContextScope {
 public:
  explicit ContextScope(int device) {
    const Driver& d = driver();
    CUcontext ctx = primary_context(device);
    CUcontext cur = nullptr;
    check(d.ctxGetCurrent(&cur), "cuCtxGetCurrent");
    if (cur != ctx) {
      check(d.ctxPush(ctx), "cuCtxPushCurrent");
      pushed_ = true;
    }
  }
  ~ContextScope() {
    if (pushed_) {
      CUcontext popped = nullptr;
      g_driver.ctxPop(&popped);
    }
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  bool pushed_ = false;
};

int driver_version() {
  const Driver& d = driver();
  int v = 0;
  check(d.driverGetVersion(&v), "cuDriverGetVersion");
  return v;
}

std::uintptr_t load_module(int device, const py::bytes& image) {
  std::string data = image;  // owns a copy for the duration of the load
  CUmodule module = nullptr;
  {
    py::gil_scoped_release nogil;
    ContextScope scope(device);
    check(driver().moduleLoadData(&module, data.data()), "cuModuleLoadData");
  }
  return reinterpret_cast<std::uintptr_t>(module);
}

std::uintptr_t get_function(int device, std::uintptr_t module, const std::string& name) {
  CUfunction fn = nullptr;
  ContextScope scope(device);
  check(driver().moduleGetFunction(&fn, reinterpret_cast<CUmodule>(module), name.c_str()), "cuModuleGetFunction");
  return reinterpret_cast<std::uintptr_t>(fn);
}

// Byte size of every kernel parameter, or None when the driver cannot tell (before CUDA 12.4).
py::object param_sizes(int device, std::uintptr_t func) {
  const Driver& d = driver();
  if (d.funcGetParamInfo == nullptr) return py::none();
  ContextScope scope(device);
  py::list sizes;
  for (size_t i = 0; i < 65536; ++i) {
    size_t offset = 0, size = 0;
    CUresult r = d.funcGetParamInfo(reinterpret_cast<CUfunction>(func), i, &offset, &size);
    if (r == CUDA_ERROR_INVALID_VALUE) break;  // past the last parameter
    check(r, "cuFuncGetParamInfo");
    sizes.append(size);
  }
  return std::move(sizes);
}

int get_attribute(int device, std::uintptr_t func, int attribute) {
  int value = 0;
  ContextScope scope(device);
  check(driver().funcGetAttribute(&value, static_cast<CUfunction_attribute>(attribute), reinterpret_cast<CUfunction>(func)),
        "cuFuncGetAttribute");
  return value;
}

void set_attribute(int device, std::uintptr_t func, int attribute, int value) {
  ContextScope scope(device);
  check(driver().funcSetAttribute(reinterpret_cast<CUfunction>(func), static_cast<CUfunction_attribute>(attribute), value),
        "cuFuncSetAttribute");
}

using Dim3 = std::tuple<unsigned, unsigned, unsigned>;

CUlaunchConfig make_config(const Dim3& grid, const Dim3& block, unsigned shared_mem) {
  CUlaunchConfig config;
  std::memset(&config, 0, sizeof config);
  config.gridDimX = std::get<0>(grid);
  config.gridDimY = std::get<1>(grid);
  config.gridDimZ = std::get<2>(grid);
  config.blockDimX = std::get<0>(block);
  config.blockDimY = std::get<1>(block);
  config.blockDimZ = std::get<2>(block);
  config.sharedMemBytes = shared_mem;
  return config;
}

void set_cluster(CUlaunchAttribute& attr, const Dim3& cluster) {
  std::memset(&attr, 0, sizeof attr);
  attr.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  attr.value.clusterDim.x = std::get<0>(cluster);
  attr.value.clusterDim.y = std::get<1>(cluster);
  attr.value.clusterDim.z = std::get<2>(cluster);
}

void launch(int device, std::uintptr_t func, const Dim3& grid, const Dim3& block, unsigned shared_mem,
            std::uintptr_t stream, const std::vector<int>& kinds, const py::sequence& values, bool cooperative,
            const Dim3& cluster) {
  const size_t n = kinds.size();
  if (static_cast<size_t>(py::len(values)) != n) {
    throw std::invalid_argument("launch: kinds and values differ in length");
  }
  // One 8-byte slot per parameter; the driver copies each parameter's size from the front of its slot
  // (little-endian, so a 4-byte value stored at the front is the value itself).
  std::vector<std::uint64_t> storage(n, 0);
  std::vector<void*> params(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    py::object v = values[i];
    switch (kinds[i]) {
      case kI32: {
        std::int32_t x = v.cast<std::int32_t>();
        std::memcpy(&storage[i], &x, sizeof x);
        break;
      }
      case kI64: {
        std::int64_t x = v.cast<std::int64_t>();
        std::memcpy(&storage[i], &x, sizeof x);
        break;
      }
      case kU64:
      case kPtr: {
        std::uint64_t x = v.cast<std::uint64_t>();
        std::memcpy(&storage[i], &x, sizeof x);
        break;
      }
      case kF32: {
        float x = static_cast<float>(v.cast<double>());
        std::memcpy(&storage[i], &x, sizeof x);
        break;
      }
      default:
        throw std::invalid_argument("launch: unknown argument kind " + std::to_string(kinds[i]));
    }
    params[i] = &storage[i];
  }

  CUlaunchConfig config = make_config(grid, block, shared_mem);
  config.hStream = reinterpret_cast<CUstream>(stream);
  CUlaunchAttribute attrs[2];
  std::memset(attrs, 0, sizeof attrs);
  unsigned num_attrs = 0;
  if (cooperative) {
    attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attrs[num_attrs].value.cooperative = 1;
    ++num_attrs;
  }
  if (std::get<0>(cluster) != 0) set_cluster(attrs[num_attrs++], cluster);
  config.attrs = num_attrs ? attrs : nullptr;
  config.numAttrs = num_attrs;

  py::gil_scoped_release nogil;  // a full launch queue blocks here; let other Python threads run
  ContextScope scope(device);
  check(driver().launchKernelEx(&config, reinterpret_cast<CUfunction>(func), params.data(), nullptr),
        "cuLaunchKernelEx");
}

// Clusters of `cluster` blocks of `block` threads (and `shared_mem` dynamic bytes) that can be resident at
// once: a persistent grid of at most this many clusters never waits for an SM. -1 when the driver lacks the
// query.
int max_active_clusters(int device, std::uintptr_t func, const Dim3& block, unsigned shared_mem,
                        const Dim3& cluster) {
  const Driver& d = driver();
  if (d.occupancyMaxActiveClusters == nullptr) return -1;
  CUlaunchConfig config = make_config(cluster, block, shared_mem);  // one cluster's worth of grid
  CUlaunchAttribute attr;
  set_cluster(attr, cluster);
  config.attrs = &attr;
  config.numAttrs = 1;
  ContextScope scope(device);
  int count = 0;
  check(d.occupancyMaxActiveClusters(&count, reinterpret_cast<CUfunction>(func), &config),
        "cuOccupancyMaxActiveClusters");
  return count;
}

}  // namespace

PYBIND11_MODULE(_lck_jit_host, m) {
  m.doc() = "lck JIT host module: load cubins and launch kernels through the CUDA driver API";
  py::register_exception<CudaDriverError>(m, "CudaDriverError", PyExc_RuntimeError);
  m.attr("ABI") = 1;
  m.def("driver_version", &driver_version, "CUDA driver version (e.g. 13000)");
  m.def("load_module", &load_module, py::arg("device"), py::arg("image"),
        "cuModuleLoadData in the device's primary context; returns the CUmodule handle");
  m.def("get_function", &get_function, py::arg("device"), py::arg("module"), py::arg("name"));
  m.def("param_sizes", &param_sizes, py::arg("device"), py::arg("func"));
  m.def("get_attribute", &get_attribute, py::arg("device"), py::arg("func"), py::arg("attribute"));
  m.def("set_attribute", &set_attribute, py::arg("device"), py::arg("func"), py::arg("attribute"),
        py::arg("value"));
  m.def("launch", &launch, py::arg("device"), py::arg("func"), py::arg("grid"), py::arg("block"),
        py::arg("shared_mem"), py::arg("stream"), py::arg("kinds"), py::arg("values"), py::arg("cooperative"),
        py::arg("cluster"));
  m.def("max_active_clusters", &max_active_clusters, py::arg("device"), py::arg("func"), py::arg("block"),
        py::arg("shared_mem"), py::arg("cluster"));
}
