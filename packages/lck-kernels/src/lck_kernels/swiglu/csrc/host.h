// SwiGLU (both forms) with C++ backward nodes (node.h): the same Triton kernels, launch plans, outputs and saved
// tensors as ops.py's SwiGLUFunction / SwiGLUPackedFunction, with no Python on the per-call path (forward
// on the caller's thread, backward on autograd's device thread) and no views: the kernels get addresses and
// row strides (a packed buffer's up half is its address n elements on). Plans come from Python once per (kernel,
// row width, element size) (launch.py's host_plans) and are cached here; the grid is computed per call as
// launch.py's _plan computes it. The entry points check their arguments themselves (checks.h) and answer
// None for anything they do not take, so that swiglu() / swiglu_packed() then run their Python checks
// (which raise the error naming the argument) and Python path.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/python_variable.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../../_host/checks.h"
#include "../../_host/launcher.h"
#include "../../_host/node.h"

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

// launch.py's launch_fwd: c = silu(a) * b over `rows` rows of n, a and b with row strides sa and sb, c contiguous.
// Addresses and strides only: no [rows, n] views (a dispatcher call each).
inline void swiglu_launch_fwd(const Arg& a, const Arg& b, const Arg& c, int64_t rows, int64_t n, int64_t sa,
                              int64_t sb, int64_t esize, int device) {
  const SwigluPlan plan = swiglu_plan(0, n, esize);
  launch(plan.slot, swiglu_grid(plan, rows, n), device, a, b, c, i(rows), i(n), i(sa), i(sb), i(n));
}

// launch.py's launch_bwd: da, db (row strides sd) from a, b (row strides sa, sb) and a contiguous dc.
inline void swiglu_launch_bwd(const Arg& a, const Arg& b, const Arg& dc, const Arg& da, const Arg& db, int64_t rows,
                              int64_t n, int64_t sa, int64_t sb, int64_t sd, int64_t esize, int device) {
  const SwigluPlan plan = swiglu_plan(1, n, esize);
  launch(plan.slot, swiglu_grid(plan, rows, n), device, a, b, dc, da, db, i(rows), i(n), i(sa), i(sb), i(n),
         i(sd), i(sd));
}

// SwiGLUFunction's backward as a node (node.h): da and db from the saved a and b.
struct SwiGLUBackward : torch::autograd::Node {
  torch::autograd::SavedVariable a_, b_;

  std::string name() const override { return "lck_host::SwiGLUBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    a_.reset_data();
    b_.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor a = a_.unpack(), b = b_.unpack();
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    c10::cuda::CUDAGuard guard(a.device());
    at::Tensor dc = grads[0];
    if (!dc.is_contiguous()) dc = dc.contiguous();  // e.g. an expanded gradient of a sum
    const int64_t n = a.size(-1), rows = a.numel() / n;
    at::Tensor da = at::empty(a.sizes(), a.options());
    at::Tensor db = at::empty(a.sizes(), a.options());
    swiglu_launch_bwd(ptr(a), ptr(b), ptr(dc), ptr(da), ptr(db), rows, n, row_stride(a), row_stride(b), n,
                      a.element_size(), a.get_device());
    return {task_should_compute_output(0) ? da : at::Tensor(), task_should_compute_output(1) ? db : at::Tensor()};
  }
};

// ops.py's _SECOND_BACKWARD, word for word.
inline constexpr const char* kSwigluSecondBackward =
    "swiglu_packed(in_place=True): backward already ran through this graph and overwrote the input buffer "
    "with its gradient, so a second backward (retain_graph=True, or autograd.grad twice) would read a gradient "
    "as the activation. Recompute the forward, or use in_place=False where the graph is differentiated twice.";

// SwiGLUPackedFunction's backward as a node: dy (gate half, then up half) from the saved y, or over y with
// in_place (once: a second backward would read a gradient as the activation).
struct SwiGLUPackedBackward : torch::autograd::Node {
  torch::autograd::SavedVariable y_;
  bool in_place = false, consumed = false;

  std::string name() const override { return "lck_host::SwiGLUPackedBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    y_.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (in_place && consumed) throw std::runtime_error(kSwigluSecondBackward);
    at::Tensor y = y_.unpack();
    if (!grads[0].defined()) return {at::Tensor()};
    c10::cuda::CUDAGuard guard(y.device());
    const int device = y.get_device();
    at::Tensor dout = grads[0];
    if (!dout.is_contiguous()) dout = dout.contiguous();
    const int64_t n2 = y.size(-1), n = n2 / 2, rows = y.numel() / n2, ys = row_stride(y);
    const int64_t esize = y.element_size();
    if (!in_place) {
      at::Tensor dy = at::empty(y.sizes(), y.options());
      swiglu_launch_bwd(ptr(y), ptr_at(y, n), ptr(dout), ptr(dy), ptr_at(dy, n), rows, n, ys, ys, n2, esize, device);
      return {dy};
    }
    // The entry refused overlapping rows, which the Python op rejects here (ValueError).
    consumed = true;
    swiglu_launch_bwd(ptr(y), ptr_at(y, n), ptr(dout), ptr(y), ptr_at(y, n), rows, n, ys, ys, ys, esize, device);
    y.unsafeGetTensorImpl()->bump_version();  // y now holds its gradient, as the op's mutation of y
    return {y};
  }
};

// swiglu(a, b) -> c, or None (see the file comment).
inline py::object swiglu_entry(py::handle ah, py::handle bh) {
  if (!THPVariable_Check(ah.ptr()) || !THPVariable_Check(bh.ptr())) return py::none();
  const at::Tensor& a = THPVariable_Unpack(ah.ptr());
  const at::Tensor& b = THPVariable_Unpack(bh.ptr());
  if (!a.is_cuda() || !float_dtype(a.scalar_type()) || b.scalar_type() != a.scalar_type()) return py::none();
  if (b.device() != a.device() || !a.sizes().equals(b.sizes()) || !rows_ok(a) || !rows_ok(b))
    return py::none();
  if (has_fw_grad(a) || has_fw_grad(b)) return py::none();
  c10::cuda::CUDAGuard guard(a.device());
  const int64_t n = a.size(-1), rows = a.numel() / n;
  at::Tensor c = at::empty(a.sizes(), a.options());
  swiglu_launch_fwd(ptr(a), ptr(b), ptr(c), rows, n, row_stride(a), row_stride(b), a.element_size(),
                    a.get_device());
  if (torch::autograd::compute_requires_grad(a, b)) {
    NodePtr node = make_node<SwiGLUBackward>();
    SwiGLUBackward* bw = node_as<SwiGLUBackward>(node);
    node->set_next_edges(torch::autograd::collect_next_edges(a, b));
    bw->a_ = torch::autograd::SavedVariable(a, false);
    bw->b_ = torch::autograd::SavedVariable(b, false);
    torch::autograd::set_history(c, node);
  }
  return wrap(c);
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
  if (in_place && y.numel() / n2 > 1 && row_stride(y) < n2) return py::none();
  if (has_fw_grad(y)) return py::none();
  c10::cuda::CUDAGuard guard(y.device());
  const int64_t n = n2 / 2, rows = y.numel() / n2, ys = row_stride(y);
  std::vector<int64_t> sizes = y.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, y.options());
  swiglu_launch_fwd(ptr(y), ptr_at(y, n), ptr(out), rows, n, ys, ys, y.element_size(), y.get_device());
  if (torch::autograd::compute_requires_grad(y)) {
    NodePtr node = make_node<SwiGLUPackedBackward>();
    SwiGLUPackedBackward* bw = node_as<SwiGLUPackedBackward>(node);
    node->set_next_edges(torch::autograd::collect_next_edges(y));
    bw->y_ = torch::autograd::SavedVariable(y, false);
    bw->in_place = in_place;
    torch::autograd::set_history(out, node);
  }
  return wrap(out);
}

inline void bind_swiglu(py::module& m) {
  m.def("swiglu_set_plans", [](py::object fwd, py::object bwd) {
    swiglu_plans()[0].reset(std::move(fwd));
    swiglu_plans()[1].reset(std::move(bwd));
  });
  m.def("swiglu", &swiglu_entry, "SwiGLU of two tensors with a C++ backward node, or None");
  m.def("swiglu_packed", &swiglu_packed_entry,
        "SwiGLU of a packed gate-up buffer with a C++ backward node, or None");
}

}  // namespace lck_host
