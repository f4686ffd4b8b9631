// lck's C++ host module: autograd Functions whose forward and backward launch lck's Triton kernels from
// C++ (launcher.h). Built once per (torch, Python, compiler, sources) into the LCK JIT cache by build.py.
// Each op family contributes csrc/host.h with a bind_<family>(m) that adds its entry points and its
// <family>_set_plans (the plan callbacks from its launch.py's host_plans).
#include "../cross_entropy/csrc/host.h"
#include "../linear_cross_entropy/csrc/host.h"
#include "../rms_norm/csrc/host.h"
#include "../swiglu/csrc/host.h"
#include "launcher.h"

namespace py = pybind11;
using namespace lck_host;

PYBIND11_MODULE(_lck_kernels_host, m) {
  m.doc() = "lck-kernels: Triton kernels launched from C++ autograd Functions";
  m.def("add_slot", &add_slot, "register a Python Launch; returns its slot id");
  m.def("set_compile_callback", [](py::object cb) { registry().compile_cb = std::move(cb); });
  m.def("launch_counts", [] {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    return py::make_tuple(r.direct_launches.load(), r.python_launches.load());
  });
  bind_rms_norm(m);
  bind_swiglu(m);
  bind_cross_entropy(m);
  bind_linear_cross_entropy(m);
}
