// RMSNorm with a C++ backward node (node.h): the same Triton kernels and launch plans as launch.py, with
// no Python on the per-call path (forward on the caller's thread, backward on autograd's device thread).
// Plans come from Python once per shape (launch.py's host_plans) and are cached here. The entry point
// checks its arguments itself (checks.h) and answers None for anything it does not take, so that
// rms_norm() then runs its Python checks (which raise the error naming the argument) and Python path.
#pragma once

#include <c10/cuda/CUDAGuard.h>

#include <mutex>
#include <string>
#include <tuple>

#include "../../_host/checks.h"
#include "../../_host/launcher.h"
#include "../../_host/node.h"

namespace lck_host {

struct RmsFwdPlan {
  int slot;
  int64_t rows_per_program;
  static RmsFwdPlan from(py::handle h) {
    auto t = h.cast<py::tuple>();
    return {t[0].cast<int>(), t[1].cast<int64_t>()};
  }
};
struct RmsBwdPlan {
  int64_t programs, per_program, tiles, dw_programs;
  int a, b, dw;  // the row kernel (or the tiled path's dot kernel), the tiled kernel or -1, the dweight sum
  static RmsBwdPlan from(py::handle h) {
    auto t = h.cast<py::tuple>();
    return {t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<int64_t>(),
            t[4].cast<int>(),     t[5].cast<int>(),     t[6].cast<int>()};
  }
};

struct RmsPlans {
  PlanCache<std::tuple<int64_t, int64_t, int64_t>, RmsFwdPlan> fwd;  // (n_cols, element size, casting)
  PlanCache<std::tuple<int64_t, int64_t, int64_t, int64_t, int>, RmsBwdPlan> bwd;  // (rows, ..., device)
};

inline RmsPlans& rms_plans() {
  static RmsPlans* p = new RmsPlans();  // never destroyed: holds py::objects
  return *p;
}

// RMSNorm's backward node (RMSNormFunction.backward): dx, and dweight when the weight needs a gradient.
struct RMSNormBackward : torch::autograd::Node {
  torch::autograd::SavedVariable x_, weight_, rstd_;
  double offset = 0.0;
  int64_t casting = 0;
  bool in_place = false;

  std::string name() const override { return "lck_host::RMSNormBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    x_.reset_data();
    weight_.reset_data();
    rstd_.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor x = x_.unpack();
    const at::Tensor weight = weight_.unpack();
    const at::Tensor rstd = rstd_.unpack();
    const bool need_x = task_should_compute_output(0), need_w = task_should_compute_output(1);
    if (!grads[0].defined() || !(need_x || need_w)) return {at::Tensor(), at::Tensor()};
    c10::cuda::CUDAGuard guard(x.device());
    const int device = x.get_device();
    at::Tensor dy = grads[0];
    if (!dy.is_contiguous()) dy = dy.contiguous();  // e.g. an expanded gradient of a sum
    const int64_t n = x.size(-1);
    const int64_t rows = rstd.size(0);
    at::Tensor dx = in_place ? dy : at::empty(x.sizes(), x.options());
    if (in_place) dy.unsafeGetTensorImpl()->bump_version();  // dx overwrites dy, as the op's in-place form
    at::Tensor dw;
    if (rows == 0) {
      if (need_w) dw = at::zeros_like(weight);
    } else {
      const int64_t esize = x.element_size();
      const RmsBwdPlan plan =
          rms_plans().bwd.get({rows, n, esize, casting, device}, rows, n, esize, casting, device);
      // dy and dx are contiguous: rows n apart.
      const int64_t xs = row_stride(x);
      at::Tensor partial = at::empty({plan.programs, n}, x.options().dtype(at::kFloat));
      const unsigned programs = static_cast<unsigned>(plan.programs);
      if (plan.b < 0) {
        launch(plan.a, {programs, 1, 1}, device, ptr(dy), ptr(x), ptr(weight), ptr(rstd), ptr(dx), ptr(partial),
               i(rows), i(n), i(plan.per_program), i(n), i(xs), i(n), f(offset));
      } else {
        at::Tensor dot = at::empty({rows}, x.options().dtype(at::kFloat));
        launch(plan.a, {static_cast<unsigned>(rows), 1, 1}, device, ptr(dy), ptr(x), ptr(weight), ptr(rstd),
               ptr(dot), i(rows), i(n), i(n), i(xs), f(offset));
        launch(plan.b, {static_cast<unsigned>(plan.tiles), programs, 1}, device, ptr(dy), ptr(x), ptr(weight),
               ptr(rstd), ptr(dot), ptr(dx), ptr(partial), i(rows), i(n), i(plan.per_program), i(n), i(xs), i(n),
               f(offset));
      }
      if (need_w) {  // the row kernels write the partial sums either way; only their sum is skipped
        dw = at::empty({n}, weight.options());
        launch(plan.dw, {static_cast<unsigned>(plan.dw_programs), 1, 1}, device, ptr(partial), ptr(dw),
               i(plan.programs), i(n));
      }
    }
    return {need_x ? dx : at::Tensor(), dw};
  }
};

inline py::object rms_norm_entry(py::handle xh, py::handle wh, py::handle eps_h, py::handle offset_h,
                                 py::handle casting_h, py::handle in_place_h) {
  if (!THPVariable_Check(xh.ptr()) || !THPVariable_Check(wh.ptr())) return py::none();
  const at::Tensor& x = THPVariable_Unpack(xh.ptr());
  const at::Tensor& weight = THPVariable_Unpack(wh.ptr());
  double eps, offset;
  bool in_place;
  if (!number(eps_h, &eps) || eps < 0 || !number(offset_h, &offset) || !boolean(in_place_h, &in_place))
    return py::none();
  const int64_t casting = choice(casting_h, {"llama", "gemma", "none"});  // CASTING_MODES' order
  if (casting < 0 || !x.is_cuda() || !float_dtype(x.scalar_type()) || !float_dtype(weight.scalar_type()))
    return py::none();
  if (weight.device() != x.device() || weight.dim() != 1 || !rows_ok(x)) return py::none();
  const int64_t n = x.size(-1);
  if (weight.size(0) != n || (n > 1 && weight.stride(0) != 1)) return py::none();
  if (has_fw_grad(x) || has_fw_grad(weight)) return py::none();
  c10::cuda::CUDAGuard guard(x.device());
  const int device = x.get_device();
  const int64_t rows = n > 0 ? x.numel() / n : 0;
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows > 0) {
    const int64_t esize = x.element_size();
    const RmsFwdPlan plan = rms_plans().fwd.get({n, esize, casting}, n, esize, casting);
    launch(plan.slot, {cdiv(rows, plan.rows_per_program), 1, 1}, device, ptr(x), ptr(weight), ptr(y), ptr(rstd),
           i(rows), i(n), i(row_stride(x)), i(n), f(eps), f(offset));
  }
  if (torch::autograd::compute_requires_grad(x, weight)) {
    NodePtr node = make_node<RMSNormBackward>();
    RMSNormBackward* b = node_as<RMSNormBackward>(node);
    node->set_next_edges(torch::autograd::collect_next_edges(x, weight));
    b->x_ = torch::autograd::SavedVariable(x, false);
    b->weight_ = torch::autograd::SavedVariable(weight, false);
    b->rstd_ = torch::autograd::SavedVariable(rstd, false);
    b->offset = offset;
    b->casting = casting;
    b->in_place = in_place;
    torch::autograd::set_history(y, node);
  }
  return wrap(y);
}

inline void bind_rms_norm(py::module& m) {
  m.def("rms_norm_set_plans", [](py::object fwd, py::object bwd) {
    rms_plans().fwd.reset(std::move(fwd));
    rms_plans().bwd.reset(std::move(bwd));
  });
  m.def("rms_norm", &rms_norm_entry, "RMSNorm through the C++ autograd Function, or None");
}

}  // namespace lck_host
