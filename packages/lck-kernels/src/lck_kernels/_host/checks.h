// Argument checks of the C++ entry points: cheap predicates, no messages. An entry point whose arguments
// fail one returns None, and the Python op then runs its own checks, which raise the error naming the
// argument (or takes its Python path), so there is one source of error messages.
#pragma once

#include <ATen/ATen.h>
#include <Python.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <initializer_list>

namespace lck_host {

namespace py = pybind11;

inline bool float_dtype(at::ScalarType s) { return s == at::kFloat || s == at::kHalf || s == at::kBFloat16; }

// A finite Python int or float (not a bool), as check_float accepts.
inline bool number(py::handle h, double* out) {
  PyObject* o = h.ptr();
  if (PyBool_Check(o)) return false;
  if (PyFloat_Check(o)) {
    *out = PyFloat_AS_DOUBLE(o);
  } else if (PyLong_Check(o)) {
    *out = PyLong_AsDouble(o);
    if (*out == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  } else {
    return false;
  }
  return std::isfinite(*out);
}

inline bool boolean(py::handle h, bool* out) {
  if (h.ptr() == Py_True || h.ptr() == Py_False) {
    *out = h.ptr() == Py_True;
    return true;
  }
  return false;
}

// The index of the str `h` in `names`, or -1 (not a str, or none of them); no allocation.
inline int choice(py::handle h, std::initializer_list<const char*> names) {
  if (!PyUnicode_Check(h.ptr())) return -1;
  int k = 0;
  for (const char* name : names) {
    if (PyUnicode_CompareWithASCIIString(h.ptr(), name) == 0) return k;
    ++k;
  }
  return -1;
}

// A non-empty CUDA tensor whose leading dimensions collapse into rows of unit column stride without a
// copy (what _common.rows_view accepts, minus the empty case, which the Python path handles).
inline bool rows_ok(const at::Tensor& t) {
  const int64_t d = t.dim();
  if (d == 0 || t.numel() == 0) return false;
  const int64_t n = t.size(d - 1);
  if (n > 1 && t.stride(d - 1) != 1) return false;
  int64_t expect = -1;
  for (int64_t k = d - 2; k >= 0; --k) {
    if (t.size(k) == 1) continue;
    if (expect >= 0 && t.stride(k) != expect) return false;
    expect = t.stride(k) * t.size(k);
  }
  return true;
}

// The row stride of x's [rows, n] view (rows_ok: the leading dimensions collapse into rows), without building
// the view (a dispatcher call, and an autograd view node when x requires grad): the stride of the innermost
// leading dimension longer than 1 (any value serves a single row).
inline int64_t row_stride(const at::Tensor& x) {
  for (int64_t k = x.dim() - 2; k >= 0; --k)
    if (x.size(k) != 1) return x.stride(k);
  return x.size(-1);
}

}  // namespace lck_host
