// RMSNorm as a C++ autograd Function: the same Triton kernels and launch plans as launch.py, with
// no Python on the per-call path (forward on the caller's thread, backward on autograd's device thread).
// Plans come from Python once per shape (launch.py's host_plans) and are cached here. The entry point
// checks its arguments itself (checks.h) and answers None for anything it does not take, so that
// rms_norm() then runs its Python checks (which raise the error naming the argument) and Python path.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/custom_function.h>

#include <tuple>

#include "../../_host/checks.h"
#include "../../_host/launcher.h"

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

class RMSNormFn : public torch::autograd::Function<RMSNormFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, at::Tensor weight, double eps,
                            double offset, int64_t casting, bool in_place) {
    c10::cuda::CUDAGuard guard(x.device());
    const int device = x.get_device();
    const int64_t n = x.size(-1);
    at::Tensor x2 = x.view({-1, n});
    const int64_t rows = x2.size(0);
    at::Tensor y = at::empty(x.sizes(), x.options());
    at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    if (rows > 0) {
      const int64_t esize = x.element_size();
      const RmsFwdPlan plan = rms_plans().fwd.get({n, esize, casting}, n, esize, casting);
      at::Tensor y2 = y.view({-1, n});
      launch(plan.slot, {cdiv(rows, plan.rows_per_program), 1, 1}, device, ptr(x2), ptr(weight), ptr(y2),
             ptr(rstd), i(rows), i(n), i(x2.stride(0)), i(y2.stride(0)), f(eps), f(offset));
    }
    ctx->save_for_backward({x, weight, rstd});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["casting"] = casting;
    ctx->saved_data["in_place"] = in_place;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& rstd = saved[2];
    const double offset = ctx->saved_data["offset"].toDouble();
    const int64_t casting = ctx->saved_data["casting"].toInt();
    const bool in_place = ctx->saved_data["in_place"].toBool();
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
      dw = at::zeros_like(weight);
    } else {
      const int64_t esize = x.element_size();
      const RmsBwdPlan plan =
          rms_plans().bwd.get({rows, n, esize, casting, device}, rows, n, esize, casting, device);
      at::Tensor dy2 = dy.view({-1, n}), x2 = x.view({-1, n}), dx2 = dx.view({-1, n});
      at::Tensor partial = at::empty({plan.programs, n}, x.options().dtype(at::kFloat));
      const unsigned programs = static_cast<unsigned>(plan.programs);
      if (plan.b < 0) {
        launch(plan.a, {programs, 1, 1}, device, ptr(dy2), ptr(x2), ptr(weight), ptr(rstd), ptr(dx2),
               ptr(partial), i(rows), i(n), i(plan.per_program), i(dy2.stride(0)), i(x2.stride(0)),
               i(dx2.stride(0)), f(offset));
      } else {
        at::Tensor dot = at::empty({rows}, x.options().dtype(at::kFloat));
        launch(plan.a, {static_cast<unsigned>(rows), 1, 1}, device, ptr(dy2), ptr(x2), ptr(weight), ptr(rstd),
               ptr(dot), i(rows), i(n), i(dy2.stride(0)), i(x2.stride(0)), f(offset));
        launch(plan.b, {static_cast<unsigned>(plan.tiles), programs, 1}, device, ptr(dy2), ptr(x2), ptr(weight),
               ptr(rstd), ptr(dot), ptr(dx2), ptr(partial), i(rows), i(n), i(plan.per_program),
               i(dy2.stride(0)), i(x2.stride(0)), i(dx2.stride(0)), f(offset));
      }
      dw = at::empty({n}, weight.options());
      launch(plan.dw, {static_cast<unsigned>(plan.dw_programs), 1, 1}, device, ptr(partial), ptr(dw),
             i(plan.programs), i(n));
    }
    const bool need_w = ctx->needs_input_grad(1);
    return {dx, need_w ? dw : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// rms_norm(x, weight, eps, offset, casting_mode, in_place) -> y, or None (see the file comment).
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
  return wrap(RMSNormFn::apply(x, weight, eps, offset, casting, in_place));
}

inline void bind_rms_norm(py::module& m) {
  m.def("rms_norm_set_plans", [](py::object fwd, py::object bwd) {
    rms_plans().fwd.reset(std::move(fwd));
    rms_plans().bwd.reset(std::move(bwd));
  });
  m.def("rms_norm", &rms_norm_entry, "RMSNorm through the C++ autograd Function, or None");
}

}  // namespace lck_host
