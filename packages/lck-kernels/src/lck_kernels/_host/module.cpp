// lck's C++ host module: autograd Functions whose forward and backward launch lck's Triton kernels from
// C++ (launcher.h). Built once per (torch, Python, compiler, sources) into the LCK JIT cache by build.py.
#include <torch/csrc/autograd/python_variable.h>

#include "../rms_norm/csrc/host.h"
#include "launcher.h"

namespace py = pybind11;
using namespace lck_host;

PYBIND11_MODULE(_lck_kernels_host, m) {
  m.doc() = "lck-kernels: Triton kernels launched from C++ autograd Functions";
  m.def("add_slot", &add_slot, "register a Python Launch; returns its slot id");
  m.def("set_compile_callback", [](py::object cb) { registry().compile_cb = std::move(cb); });
  m.def("set_rms_norm_plans", [](py::object fwd, py::object bwd) {
    RmsPlans& p = rms_plans();
    std::lock_guard<std::mutex> lock(p.mu);
    p.fwd_cb = std::move(fwd);
    p.bwd_cb = std::move(bwd);
    p.fwd.clear();
    p.bwd.clear();
  });
  m.def("launch_counts", [] {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    return py::make_tuple(r.direct_launches, r.python_launches);
  });
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("offset"),
        py::arg("casting"), py::arg("in_place"));
}
