// Cross entropy with C++ backward nodes (node.h): the same Triton kernels, launch plans and loss arithmetic as
// the Python ops (ops.py, launch.py), with no Python on the per-call path.
//
// - reduction "sum"/"mean" with grad: CrossEntropyFunction's twin. The forward writes the loss terms and the
//   gradient (into a new buffer, or over the logits with in_place); CrossEntropyBackward rescales that gradient
//   in place by the incoming one.
// - reduction "none" with grad: CrossEntropyRowsFunction's twin (each row's lse saved; CrossEntropyRowsBackward
//   writes the gradient, over the logits with in_place).
// - no grad: the forward alone, as cross_entropy_fwd(..., compute_grad=False).
// finalize_loss is the same finalize kernel (or, for reduction "none", the same ATen ops), so the losses are bit
// for bit the same.
// Plans come from launch.py's host_plans once per shape and are cached here. The entry checks its arguments
// itself (everything cross_entropy's Python checks refuse) and answers None for anything it does not take
// (empty logits, overlapping rows to be overwritten, the split-row or CUDA cluster forward), so that
// cross_entropy() then raises its own errors or runs its Python path.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "../../_host/checks.h"
#include "../../_host/launcher.h"
#include "../../_host/node.h"

namespace lck_host {

// One kernel launch of a plan: its registry slot and 1-D grid; slot -1 means "the Python path only".
struct CeLaunch {
  int slot = -1;
  unsigned grid = 0;
  static CeLaunch from(py::handle h) {
    if (h.is_none()) return {};
    auto t = h.cast<py::tuple>();
    return {t[0].cast<int>(), t[1].cast<unsigned>()};
  }
};

// The reduction kernel's slot.
struct CeSlot {
  int slot;
  static CeSlot from(py::handle h) { return {h.cast<int>()}; }
};

// (rows, columns, element size / device / flags packed by ce_key)
using CeKey = std::tuple<int64_t, int64_t, int64_t>;

struct CePlans {
  PlanCache<int, CeSlot> red;  // key: mean * 2 + has_weight
  PlanCache<int, CeSlot> fin;  // the finalize kernel's; key: mean * 2 + has_z
  PlanCache<CeKey, CeLaunch> fwd, bwd, rescale;
};

inline CePlans& ce_plans() {
  static CePlans* p = new CePlans();  // never destroyed: py::objects must not die after the interpreter
  return *p;
}

// The per-call constants of CEOptions and the reduction, as the kernels take them.
struct CeCall {
  int64_t ignore_index = -100;
  double eps = 0.0, z_scale = 0.0;
  double softcap = 1.0;  // 1 without a cap (CEOptions.scalars: unused then, and no 0 divide)
  bool has_weight = false, smooth = false, has_z = false, has_softcap = false, in_place = false;
  int reduction = 2;  // 0 none, 1 sum, 2 mean
  CeLaunch fwd;       // the forward kernel's plan, looked up by the entry (it may refuse the call)

  // HAS_WEIGHT, SMOOTH, HAS_Z, HAS_SOFTCAP as bits, the order of CEOptions.flags.
  int64_t flags() const { return has_weight | (smooth << 1) | (has_z << 2) | (has_softcap << 3); }
};

inline int64_t ce_key(int64_t esize, int device, int64_t flags) {
  return flags | (esize << 8) | (int64_t(device) << 16);
}

// launch_fwd's kernel: the loss+gradient kernel with `grad`, else the loss-only one (None: Python path).
inline CeLaunch ce_fwd_plan(int64_t rows, int64_t cols, int64_t esize, int device, const CeCall& c, bool grad) {
  const int64_t flags = c.flags() | (int64_t(grad) << 4);
  return ce_plans().fwd.get(CeKey{rows, cols, ce_key(esize, device, flags)}, rows, cols, esize, device,
                            c.has_weight, c.smooth, c.has_z, c.has_softcap, grad);
}

// launch_bwd's kernel with a per-row loss gradient (reduction "none").
inline CeLaunch ce_bwd_plan(int64_t rows, int64_t cols, int64_t esize, int device, const CeCall& c) {
  return ce_plans().bwd.get(CeKey{rows, cols, ce_key(esize, device, c.flags())}, rows, cols, esize, device,
                            c.has_weight, c.smooth, c.has_z, c.has_softcap);
}

// launch_rescale_rows' kernel.
inline CeLaunch ce_rescale_plan(int64_t rows, int64_t cols, int device) {
  return ce_plans().rescale.get(CeKey{rows, cols, ce_key(0, device, 0)}, rows, cols, device);
}

inline int ce_red_slot(bool mean, bool has_weight) {
  return ce_plans().red.get(int(mean) * 2 + int(has_weight), mean, has_weight).slot;
}

// launch_reduction: [Σ w_t, n_valid, cw, cz, Σ w_c] over the non-ignored targets.
inline at::Tensor ce_reduction(const at::Tensor& target, const at::Tensor& weight, int64_t cols, const CeCall& c,
                               bool mean, int device) {
  at::Tensor red = at::empty({5}, target.options().dtype(at::kFloat));
  const at::Tensor& w = c.has_weight ? weight : red;
  launch(ce_red_slot(mean, c.has_weight), {1, 1, 1}, device, ptr(target), ptr(w), ptr(red), i(target.numel()),
         i(cols), i(c.ignore_index));
  return red;
}

struct CeOut {
  at::Tensor loss, z, lse, applied;
};

// finalize_loss: (loss, z-loss) in float32 from the per-row terms `ce` and `zl` (nullptr without a z-loss) and
// the reduction kernel's denominators `red`; reduction 0 none, 1 sum, 2 mean (one finalize kernel launch).
inline std::pair<at::Tensor, at::Tensor> ce_finalize(const at::Tensor& ce, const at::Tensor* zl,
                                                     const at::Tensor& red, int reduction, int device) {
  if (reduction == 0) {
    if (zl == nullptr) return {ce, at::zeros_like(ce)};
    return {ce + *zl, *zl};
  }
  at::Tensor loss = at::empty({}, ce.options());
  at::Tensor z = at::empty({}, ce.options());
  const bool mean = reduction == 2, has_z = zl != nullptr;
  const int slot = ce_plans().fin.get(int(mean) * 2 + int(has_z), mean, has_z).slot;
  launch(slot, {1, 1, 1}, device, ptr(ce), ptr(zl != nullptr ? *zl : ce), ptr(red), ptr(loss), ptr(z),
         i(ce.size(0)));
  return {loss, z};
}

// ops._forward: the reduction's denominators, the per-row terms (and, with `grad`, the gradient and
// `applied` = 1), then finalize_loss.
inline CeOut ce_forward(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& weight,
                        const CeCall& c, const at::Tensor* grad, int device) {
  const int64_t n = logits.size(0), v = logits.size(1);
  at::Tensor red = ce_reduction(target, weight, v, c, c.reduction == 2, device);
  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor ce = at::empty({n}, f32);
  at::Tensor lse = at::empty({n}, f32);
  at::Tensor zl = c.has_z ? at::empty({n}, f32) : at::Tensor();
  at::Tensor applied = at::empty({grad != nullptr ? n : 0}, f32);
  // Absent outputs and inputs point at lse, as launch_fwd passes them.
  const at::Tensor& g = grad != nullptr ? *grad : lse;
  const at::Tensor& w = c.has_weight ? weight : lse;
  const at::Tensor& z_rows = c.has_z ? zl : lse;
  const at::Tensor& applied_arg = grad != nullptr ? applied : lse;
  launch(c.fwd.slot, {c.fwd.grid, 1, 1}, device, ptr(logits), i(logits.stride(0)), ptr(g),
         i(grad != nullptr ? grad->stride(0) : 0), ptr(target), ptr(w), ptr(red), ptr(ce), ptr(z_rows), ptr(lse),
         ptr(lse), ptr(applied_arg), i(n), i(v), i(c.ignore_index), f(c.eps), f(c.z_scale), f(1.0), f(c.softcap));
  auto [loss, z] = ce_finalize(ce, c.has_z ? &zl : nullptr, red, c.reduction, device);
  return CeOut{loss, z, lse, applied};
}

// A saved tensor of `op`'s backward node (`saved_for`: the node, for a saved output), with unpack_saved_gradient's
// message, naming `op`, when it was overwritten since the forward. The fused linear ops' nodes use it too.
inline at::Tensor ce_unpack(const torch::autograd::SavedVariable& saved, const char* op = "cross_entropy",
                            NodePtr saved_for = nullptr) {
  try {
    return saved.unpack(std::move(saved_for));
  } catch (const c10::Error& e) {
    if (std::string(e.what()).find("modified by an inplace operation") == std::string::npos) throw;
  }
  TORCH_CHECK(false, op,
              ": a buffer saved by the forward was modified before this backward. Either backward ran a second "
              "time over the same graph (retain_graph=True), which ",
              op,
              " does not support where its backward updates a saved buffer in place (the gradient computed in the "
              "forward for reduction='sum'/'mean', or the logits with in_place=True): run the forward again; or an "
              "in-place op wrote into the inputs ",
              op, " saved after its forward.");
  return {};
}

// reduction "sum"/"mean": CrossEntropyFunction's backward as a node (node.h): the gradient the forward wrote,
// rescaled in place by the incoming one.
struct CrossEntropyBackward : torch::autograd::Node {
  torch::autograd::SavedVariable grad_, applied_;

  std::string name() const override { return "lck_host::CrossEntropyBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    grad_.reset_data();
    applied_.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor grad = ce_unpack(grad_);
    const at::Tensor applied = ce_unpack(applied_);
    const at::Tensor& g = grads[0];
    if (!g.defined() || !task_should_compute_output(0)) return {at::Tensor()};
    c10::cuda::CUDAGuard guard(grad.device());
    const int device = grad.get_device();
    const int64_t n = grad.size(0), v = grad.size(1);
    const CeLaunch plan = ce_rescale_plan(n, v, device);
    launch(plan.slot, {plan.grid, 1, 1}, device, ptr(grad), i(grad.stride(0)), ptr(applied), ptr(g),
           i(g.dim() == 1 ? g.stride(0) : 0), i(n), i(v));
    // cross_entropy_rescale_ mutates both: a second backward over a retained graph then refuses them.
    grad.unsafeGetTensorImpl()->bump_version();
    applied.unsafeGetTensorImpl()->bump_version();
    return {grad};
  }
};

// reduction "none": CrossEntropyRowsFunction's backward as a node (each row's lse saved; the backward writes
// the gradient, over the logits with in_place).
struct CrossEntropyRowsBackward : torch::autograd::Node {
  torch::autograd::SavedVariable logits_, target_, weight_, lse_;
  CeCall c;  // reduction 0

  std::string name() const override { return "lck_host::CrossEntropyRowsBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    logits_.reset_data();
    target_.reset_data();
    weight_.reset_data();
    lse_.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor logits = ce_unpack(logits_);
    const at::Tensor target = ce_unpack(target_);
    const at::Tensor weight = ce_unpack(weight_);
    const at::Tensor lse = ce_unpack(lse_);
    const at::Tensor& g = grads[0];
    if (!g.defined() || !task_should_compute_output(0)) return {at::Tensor()};
    c10::cuda::CUDAGuard guard(logits.device());
    const int device = logits.get_device();
    const int64_t n = logits.size(0), v = logits.size(1);
    at::Tensor grad = c.in_place ? logits : at::empty(logits.sizes(), logits.options());
    at::Tensor red = ce_reduction(target, weight, v, c, false, device);
    const CeLaunch plan = ce_bwd_plan(n, v, logits.element_size(), device, c);
    const at::Tensor& w = c.has_weight ? weight : lse;
    launch(plan.slot, {plan.grid, 1, 1}, device, ptr(logits), i(logits.stride(0)), ptr(grad), i(grad.stride(0)),
           ptr(target), ptr(w), ptr(red), ptr(lse), ptr(lse), ptr(g), i(g.dim() == 1 ? g.stride(0) : 0), ptr(lse),
           i(0), ptr(lse), i(0), i(n), i(v), i(c.ignore_index), f(c.eps), f(c.z_scale), f(1.0), f(c.softcap));
    if (c.in_place) logits.unsafeGetTensorImpl()->bump_version();  // cross_entropy_bwd_ mutates the logits
    return {grad};
  }
};

// The forward with a gradient: the loss terms (and for sum/mean the gradient, into a new buffer or over the
// logits with in_place) and the backward node recorded on the loss. The z-loss carries no history (not
// differentiable, as torch's mark_non_differentiable leaves it).
inline std::pair<at::Tensor, at::Tensor> ce_forward_with_grad(const at::Tensor& logits, const at::Tensor& target,
                                                               const at::Tensor& weight, const CeCall& c) {
  c10::cuda::CUDAGuard guard(logits.device());
  const int device = logits.get_device();
  NodePtr node;
  if (c.reduction == 0) {
    CeOut out = ce_forward(logits, target, weight, c, nullptr, device);
    node = make_node<CrossEntropyRowsBackward>();
    CrossEntropyRowsBackward* b = node_as<CrossEntropyRowsBackward>(node);
    b->logits_ = torch::autograd::SavedVariable(logits, false);
    b->target_ = torch::autograd::SavedVariable(target, false);
    b->weight_ = torch::autograd::SavedVariable(weight, false);
    b->lse_ = torch::autograd::SavedVariable(out.lse, false);
    b->c = c;
    node->set_next_edges(torch::autograd::collect_next_edges(logits));
    torch::autograd::set_history(out.loss, node);
    return {out.loss, out.z};
  }
  at::Tensor grad = c.in_place ? logits : at::empty(logits.sizes(), logits.options());
  CeOut out = ce_forward(logits, target, weight, c, &grad, device);
  // cross_entropy_fwd_ mutates the logits: bump their version (before saving them as the gradient buffer), so
  // that autograd refuses them where another op saved them.
  if (c.in_place) logits.unsafeGetTensorImpl()->bump_version();
  node = make_node<CrossEntropyBackward>();
  CrossEntropyBackward* b = node_as<CrossEntropyBackward>(node);
  b->grad_ = torch::autograd::SavedVariable(grad, false);
  b->applied_ = torch::autograd::SavedVariable(out.applied, false);
  node->set_next_edges(torch::autograd::collect_next_edges(logits));
  torch::autograd::set_history(out.loss, node);
  return {out.loss, out.z};
}

// A Python int (not a bool) that fits int64, as check_loss_options accepts for ignore_index.
inline bool ce_int(py::handle h, int64_t* out) {
  PyObject* o = h.ptr();
  if (PyBool_Check(o) || !PyLong_Check(o)) return false;
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || (*out == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// check_class_weight: None, or a float [v] contiguous tensor on `like`'s device that needs no gradient (stored in
// *out, and c->has_weight set); false for anything else.
inline bool ce_class_weight(py::handle h, const at::Tensor& like, int64_t v, std::optional<at::Tensor>* out,
                            CeCall* c) {
  if (h.is_none()) return true;
  if (!THPVariable_Check(h.ptr())) return false;
  const at::Tensor& w = THPVariable_Unpack(h.ptr());
  if (!float_dtype(w.scalar_type()) || w.dim() != 1 || !w.is_contiguous() || w.device() != like.device())
    return false;
  if (w.size(0) != v || (w.requires_grad() && at::GradMode::is_enabled())) return false;
  *out = w;
  c->has_weight = true;
  return true;
}

// check_loss_options minus the reduction: ignore_index, label smoothing, z-loss scale and soft cap into *c with
// the flags they imply; false for anything check_loss_options refuses.
inline bool ce_loss_options(py::handle ignore_h, py::handle smoothing_h, py::handle z_scale_h,
                            py::handle softcap_h, CeCall* c) {
  if (!ce_int(ignore_h, &c->ignore_index) || !number(smoothing_h, &c->eps) || !number(z_scale_h, &c->z_scale))
    return false;
  if (!(c->eps >= 0.0 && c->eps <= 1.0) || c->z_scale < 0.0) return false;
  if (!softcap_h.is_none()) {
    if (!number(softcap_h, &c->softcap) || !(c->softcap > 0.0)) return false;
    c->has_softcap = true;
  }
  c->smooth = c->eps > 0.0;
  c->has_z = c->z_scale > 0.0;
  return true;
}

// check_loss_dtype: a torch.dtype that is float32 or the input's; false otherwise.
inline bool ce_loss_dtype(py::handle h, at::ScalarType input, at::ScalarType* out) {
  if (!THPDtype_Check(h.ptr())) return false;
  *out = reinterpret_cast<THPDtype*>(h.ptr())->scalar_type;
  return *out == at::kFloat || *out == input;
}

// The float32 loss (and z-loss) as the public function returns them: in loss_dtype, the z-loss only when asked.
// Tensor::to returns the tensor itself at its own dtype; the check skips a dispatcher round trip.
inline py::object ce_result(at::Tensor loss, const at::Tensor& z, at::ScalarType loss_dtype, bool return_z) {
  if (loss_dtype != at::kFloat) loss = loss.to(loss_dtype);
  if (!return_z) return wrap(loss);
  return py::make_tuple(wrap(loss), wrap(loss_dtype != at::kFloat ? z.to(loss_dtype) : z));
}

// cross_entropy(logits, target, weight, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
// return_z_loss, in_place, loss_dtype) -> what cross_entropy returns, or None (see the file comment).
inline py::object cross_entropy_entry(py::handle logits_h, py::handle target_h, py::handle weight_h,
                                      py::handle ignore_h, py::handle smoothing_h, py::handle z_scale_h,
                                      py::handle softcap_h, py::handle reduction_h, py::handle return_z_h,
                                      py::handle in_place_h, py::handle loss_dtype_h) {
  if (!THPVariable_Check(logits_h.ptr()) || !THPVariable_Check(target_h.ptr())) return py::none();
  const at::Tensor& logits = THPVariable_Unpack(logits_h.ptr());
  const at::Tensor& target = THPVariable_Unpack(target_h.ptr());
  // check_cross_entropy_inputs, minus the empty case (the Python path handles it).
  if (!logits.is_cuda() || !float_dtype(logits.scalar_type()) || logits.dim() != 2) return py::none();
  const int64_t n = logits.size(0), v = logits.size(1);
  if (n == 0 || v == 0 || (v > 1 && logits.stride(1) != 1)) return py::none();
  if (target.scalar_type() != at::kLong && target.scalar_type() != at::kInt) return py::none();
  if (target.dim() != 1 || target.size(0) != n || (n > 1 && target.stride(0) != 1)) return py::none();
  if (target.device() != logits.device()) return py::none();
  CeCall c;
  std::optional<at::Tensor> weight;
  if (!ce_class_weight(weight_h, logits, v, &weight, &c)) return py::none();
  // check_loss_options, the flags and check_loss_dtype.
  bool return_z, in_place;
  at::ScalarType loss_dtype;
  if (!ce_loss_options(ignore_h, smoothing_h, z_scale_h, softcap_h, &c)) return py::none();
  c.reduction = choice(reduction_h, {"none", "sum", "mean"});
  if (c.reduction < 0 || !boolean(return_z_h, &return_z) || !boolean(in_place_h, &in_place)) return py::none();
  if (!ce_loss_dtype(loss_dtype_h, logits.scalar_type(), &loss_dtype)) return py::none();
  const bool with_grad = at::GradMode::is_enabled() && logits.requires_grad();
  c.in_place = with_grad && in_place;  // without grad nothing is written into the logits
  // The gradient written over the logits needs rows that do not overlap (the ops raise otherwise).
  if (c.in_place && n > 1 && logits.stride(0) < v) return py::none();
  const int device = logits.get_device();
  c.fwd = ce_fwd_plan(n, v, logits.element_size(), device, c, with_grad && c.reduction != 0);
  if (c.fwd.slot < 0) return py::none();  // the split or cluster forward: launch.py's own path
  at::Tensor loss, z;
  if (!with_grad) {
    c10::cuda::CUDAGuard guard(logits.device());
    const at::Tensor w = weight.has_value() ? *weight : at::Tensor();
    CeOut out = ce_forward(logits, target, w, c, nullptr, device);
    loss = out.loss, z = out.z;
  } else {
    std::tie(loss, z) = ce_forward_with_grad(logits, target, weight.has_value() ? *weight : at::Tensor(), c);
  }
  return ce_result(loss, z, loss_dtype, return_z);
}

inline void bind_cross_entropy(py::module& m) {
  m.def("cross_entropy_set_plans", [](py::object red, py::object fwd, py::object bwd, py::object rescale,
                                      py::object fin) {
    CePlans& p = ce_plans();
    p.fin.reset(std::move(fin));
    p.red.reset(std::move(red));
    p.fwd.reset(std::move(fwd));
    p.bwd.reset(std::move(bwd));
    p.rescale.reset(std::move(rescale));
  });
  m.def("cross_entropy", &cross_entropy_entry, "cross entropy with C++ backward nodes, or None");
}

}  // namespace lck_host
