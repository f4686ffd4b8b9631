// SwiGLU (both forms) as C++ autograd Functions: the same Triton kernels, launch plans, outputs and saved
// tensors as ops.py's SwiGLUFunction / SwiGLUPackedFunction, with no Python on the per-call path (forward
// on the caller's thread, backward on autograd's device thread). Plans come from Python once per (kernel,
// row width, element size) (launch.py's host_plans) and are cached here; the grid is computed per call as
// launch.py's _plan computes it. The entry points check their arguments themselves (checks.h) and answer
// None for anything they do not take, so that swiglu() / swiglu_packed() then run their Python checks
// (which raise the error naming the argument) and Python path.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <stdexcept>
#include <utility>

#include "../../_host/checks.h"
#include "../../_host/launcher.h"

namespace lck_host {

struct SwigluPlan {
  int slot;
  int64_t block_m, block_n;  // the launch's tile: grid = cdiv(rows, block_m) * cdiv(n, block_n)
  static SwigluPlan from(py::handle h) {
    auto t = h.cast<py::tuple>();
    return {t[0].cast<int>(), t[1].cast<int64_t>(), t[2].cast<int64_t>()};
  }
};

// Forward and backward plans, each keyed by (n_cols, element size).
inline PlanCache<std::pair<int64_t, int64_t>, SwigluPlan>* swiglu_plans() {
  static auto* p = new PlanCache<std::pair<int64_t, int64_t>, SwigluPlan>[2];  // never destroyed: py::objects
  return p;
}

inline SwigluPlan swiglu_plan(int bwd, int64_t n_cols, int64_t esize) {
  return swiglu_plans()[bwd].get({n_cols, esize}, n_cols, esize);
}

inline std::array<unsigned, 3> swiglu_grid(const SwigluPlan& p, int64_t rows, int64_t n) {
  const int64_t tiles = ((rows + p.block_m - 1) / p.block_m) * ((n + p.block_n - 1) / p.block_n);
  return {static_cast<unsigned>(tiles), 1, 1};
}

// launch.py's launch_fwd: c2 = silu(a2) * b2 on [rows, n] views with unit column stride.
inline void swiglu_launch_fwd(const at::Tensor& a2, const at::Tensor& b2, const at::Tensor& c2, int device) {
  const int64_t rows = a2.size(0), n = a2.size(1);
  if (rows == 0) return;
  const SwigluPlan plan = swiglu_plan(0, n, a2.element_size());
  launch(plan.slot, swiglu_grid(plan, rows, n), device, ptr(a2), ptr(b2), ptr(c2), i(rows), i(n),
                i(a2.stride(0)), i(b2.stride(0)), i(c2.stride(0)));
}

// launch.py's launch_bwd; da2 / db2 may be a2 / b2 (the in-place packed backward).
inline void swiglu_launch_bwd(const at::Tensor& a2, const at::Tensor& b2, const at::Tensor& dc2,
                              const at::Tensor& da2, const at::Tensor& db2, int device) {
  const int64_t rows = a2.size(0), n = a2.size(1);
  if (rows == 0) return;
  const SwigluPlan plan = swiglu_plan(1, n, a2.element_size());
  launch(plan.slot, swiglu_grid(plan, rows, n), device, ptr(a2), ptr(b2), ptr(dc2), ptr(da2), ptr(db2),
                i(rows), i(n), i(a2.stride(0)), i(b2.stride(0)), i(dc2.stride(0)), i(da2.stride(0)),
                i(db2.stride(0)));
}

class SwiGLUFn : public torch::autograd::Function<SwiGLUFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor a, at::Tensor b) {
    c10::cuda::CUDAGuard guard(a.device());
    const int64_t n = a.size(-1);
    at::Tensor c = at::empty(a.sizes(), a.options());
    swiglu_launch_fwd(a.view({-1, n}), b.view({-1, n}), c.view({-1, n}), a.get_device());
    ctx->save_for_backward({a, b});
    return c;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    c10::cuda::CUDAGuard guard(a.device());
    at::Tensor dc = grads[0];
    if (!dc.is_contiguous()) dc = dc.contiguous();  // e.g. an expanded gradient of a sum
    const int64_t n = a.size(-1);
    at::Tensor da = at::empty(a.sizes(), a.options());
    at::Tensor db = at::empty(a.sizes(), a.options());
    swiglu_launch_bwd(a.view({-1, n}), b.view({-1, n}), dc.view({-1, n}), da.view({-1, n}), db.view({-1, n}),
                      a.get_device());
    return {da, db};
  }
};

// ops.py's _SECOND_BACKWARD, word for word.
inline constexpr const char* kSwigluSecondBackward =
    "swiglu_packed(in_place=True): backward already ran through this graph and overwrote the input buffer "
    "with its gradient, so a second backward (retain_graph=True, or autograd.grad twice) would read a gradient "
    "as the activation. Recompute the forward, or use in_place=False where the graph is differentiated twice.";

class SwiGLUPackedFn : public torch::autograd::Function<SwiGLUPackedFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor y, bool in_place) {
    c10::cuda::CUDAGuard guard(y.device());
    const int64_t n2 = y.size(-1), n = n2 / 2;
    std::vector<int64_t> sizes = y.sizes().vec();
    sizes.back() = n;
    at::Tensor out = at::empty(sizes, y.options());
    at::Tensor y2 = y.view({-1, n2});
    swiglu_launch_fwd(y2.slice(1, 0, n), y2.slice(1, n, n2), out.view({-1, n}), y.get_device());
    ctx->save_for_backward({y});
    ctx->saved_data["in_place"] = in_place;
    ctx->saved_data["consumed"] = false;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const bool in_place = ctx->saved_data["in_place"].toBool();
    if (in_place && ctx->saved_data["consumed"].toBool()) throw std::runtime_error(kSwigluSecondBackward);
    const auto saved = ctx->get_saved_variables();
    at::Tensor y = saved[0];
    c10::cuda::CUDAGuard guard(y.device());
    const int device = y.get_device();
    at::Tensor dout = grads[0];
    if (!dout.is_contiguous()) dout = dout.contiguous();
    const int64_t n2 = y.size(-1), n = n2 / 2;
    at::Tensor y2 = y.view({-1, n2});
    at::Tensor gate = y2.slice(1, 0, n), up = y2.slice(1, n, n2);
    at::Tensor dout2 = dout.view({-1, n});
    if (!in_place) {
      at::Tensor dy = at::empty(y.sizes(), y.options());
      at::Tensor dy2 = dy.view({-1, n2});
      swiglu_launch_bwd(gate, up, dout2, dy2.slice(1, 0, n), dy2.slice(1, n, n2), device);
      return {dy, at::Tensor()};
    }
    // The entry refused overlapping rows, which the Python op rejects here (ValueError).
    ctx->saved_data["consumed"] = true;
    swiglu_launch_bwd(gate, up, dout2, gate, up, device);
    y.unsafeGetTensorImpl()->bump_version();  // y now holds its gradient, as the op's mutation of y
    return {y, at::Tensor()};
  }
};

// Stride between rows of t seen as [-1, t.size(-1)] (rows_ok(t) holds): that of its innermost leading
// dimension of size > 1, or 0 for a single row.
inline int64_t swiglu_row_stride(const at::Tensor& t) {
  for (int64_t k = t.dim() - 2; k >= 0; --k)
    if (t.size(k) != 1) return t.stride(k);
  return 0;
}

// swiglu(a, b) -> c, or None (see the file comment).
inline py::object swiglu_entry(py::handle ah, py::handle bh) {
  if (!THPVariable_Check(ah.ptr()) || !THPVariable_Check(bh.ptr())) return py::none();
  const at::Tensor& a = THPVariable_Unpack(ah.ptr());
  const at::Tensor& b = THPVariable_Unpack(bh.ptr());
  if (!a.is_cuda() || !float_dtype(a.scalar_type()) || b.scalar_type() != a.scalar_type()) return py::none();
  if (b.device() != a.device() || !a.sizes().equals(b.sizes()) || !rows_ok(a) || !rows_ok(b))
    return py::none();
  return wrap(SwiGLUFn::apply(a, b));
}

// swiglu_packed(y, in_place) -> out, or None (see the file comment).
inline py::object swiglu_packed_entry(py::handle yh, py::handle in_place_h) {
  bool in_place;
  if (!THPVariable_Check(yh.ptr()) || !boolean(in_place_h, &in_place)) return py::none();
  const at::Tensor& y = THPVariable_Unpack(yh.ptr());
  if (!y.is_cuda() || !float_dtype(y.scalar_type()) || !rows_ok(y)) return py::none();
  const int64_t n2 = y.size(-1);
  if (n2 % 2 != 0) return py::none();
  // Rows that overlap cannot take the gradient in place: the Python op raises that in its backward.
  if (in_place && y.numel() / n2 > 1 && swiglu_row_stride(y) < n2) return py::none();
  return wrap(SwiGLUPackedFn::apply(y, in_place));
}

inline void bind_swiglu(py::module& m) {
  m.def("swiglu_set_plans", [](py::object fwd, py::object bwd) {
    swiglu_plans()[0].reset(std::move(fwd));
    swiglu_plans()[1].reset(std::move(bwd));
  });
  m.def("swiglu", &swiglu_entry, "SwiGLU of two tensors through the C++ autograd Function, or None");
  m.def("swiglu_packed", &swiglu_packed_entry,
        "SwiGLU of a packed gate-up buffer through the C++ autograd Function, or None");
}

}  // namespace lck_host
