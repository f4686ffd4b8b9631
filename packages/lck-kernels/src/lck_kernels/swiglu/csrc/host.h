// swiglu through a C++ autograd Function: not yet written (the Python op runs).
#pragma once

#include <pybind11/pybind11.h>

namespace lck_host {

inline void bind_swiglu(pybind11::module& m) {}

}  // namespace lck_host
