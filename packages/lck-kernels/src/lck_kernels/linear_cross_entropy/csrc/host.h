// Fused linear cross entropy (plain and scaled) with C++ autograd, for the schedule that finishes every
// gradient in the forward (reduction "sum"/"mean" with an input needing a gradient): the twins of ops.py's
// FusedLinearCrossEntropyFunction and FusedLinearScaledCrossEntropyFunction over launch.py's forward_chunked,
// with no Python on the per-call path.
//
// - forward: the reduction kernel (cross entropy's), then per chunk of tokens the logits GEMM into one reused
//   buffer, the loss+gradient row kernel over it, and the gradient GEMMs and bias sum. These are the ATen calls
//   of launch.py's _logits and _accumulate_grads, in the same order with the same operands, so cuBLAS gives the
//   same bits; the row kernel runs at the plan launch_fwd would use for that chunk; the loss is finished by
//   ce_finalize, finalize_loss's twin.
// - autograd: each op records a backward node (node.h) whose edge goes to x itself (no view node).
// - backward: launch_rescale_flat (the factor kernel, then the rescale kernel over each gradient buffer), and
//   for the scaled op's lse/entropy outputs, when they receive a gradient, the recompute backward, which stays
//   in Python (launch.py's host_plans hands it over; the backward takes the GIL for it).
// Plans (the tokens per chunk and the row kernel of a whole and of the last chunk; the rescale launches) come
// from launch.py's host_plans once per shape. The entries check their arguments themselves and answer None for
// anything else (reduction "none", no input needing a gradient, no tokens, the split-row or cluster forward, and
// whatever the Python checks refuse), so that the public functions run their checks and Python path.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#if LCK_HOST_ATEN_CUDA
#include <ATen/ops/addmm_cuda_dispatch.h>
#include <ATen/ops/mm_cuda_dispatch.h>
#endif
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../../_host/alias.h"
#include "../../_host/checks.h"
#include "../../_host/launcher.h"
#include "../../_host/node.h"
#include "../../cross_entropy/csrc/host.h"

namespace lck_host {

// One forward's chunking: tokens per chunk, and the row kernel of a whole chunk and of the last one (the same
// launch when the chunk divides the tokens). chunk 0: the Python path.
struct LceChunks {
  int64_t chunk = 0;
  CeLaunch full, tail;
  static LceChunks from(py::handle h) {
    if (h.is_none()) return {};
    auto t = h.cast<py::tuple>();
    return {t[0].cast<int64_t>(), {t[1].cast<int>(), t[2].cast<unsigned>()}, {t[3].cast<int>(), t[4].cast<unsigned>()}};
  }
};

// launch_rescale_flat's launches for a buffer of some length: the factor kernel's slot, the rescale kernel's
// slot, its grid and its block count.
struct LceRescale {
  int factor = -1, slot = -1;
  unsigned grid = 0;
  int64_t blocks = 0;
  static LceRescale from(py::handle h) {
    auto t = h.cast<py::tuple>();
    return {t[0].cast<int>(), t[1].cast<int>(), t[2].cast<unsigned>(), t[3].cast<int64_t>()};
  }
};

// (tokens, vocab, element size / device / flags packed by ce_key, chunk_bytes, max_chunk_tokens; 0 for None)
using LceKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;

struct LcePlans {
  PlanCache<LceKey, LceChunks> chunks;
  PlanCache<std::pair<int64_t, int>, LceRescale> rescale;  // key: (elements, device)
  py::object recompute;                                     // the recompute backward; read and called with the GIL
};

inline LcePlans& lce_plans() {
  static LcePlans* p = new LcePlans();  // never destroyed: py::objects must not die after the interpreter
  return *p;
}

// One call's constants: the loss options as cross entropy's kernels take them (ce.reduction 1 sum, 2 mean), the
// scaled op's inverse temperature and entropy output, the gradients wanted and the chunk plan.
struct LceCall {
  CeCall ce;
  double scale = 1.0;
  bool entropy = false;
  bool need_x = false, need_w = false, need_b = false;
  LceChunks plan;

  int64_t needs() const { return need_x | (need_w << 1) | (need_b << 2); }
};

inline LceChunks lce_chunks(int64_t n, int64_t v, int64_t esize, int device, int64_t chunk_bytes,
                            int64_t max_chunk, const LceCall& c) {
  const int64_t flags = c.ce.flags() | (int64_t(c.entropy) << 4);
  return lce_plans().chunks.get(LceKey{n, v, ce_key(esize, device, flags), chunk_bytes, max_chunk}, n, v, esize,
                                device, chunk_bytes, max_chunk, c.ce.has_weight, c.ce.smooth, c.ce.has_z,
                                c.ce.has_softcap, c.entropy);
}

struct LceOut {
  at::Tensor loss, z, lse, entropy, gx, gw, gb;
};

// The GEMMs of _logits and _accumulate_grads. CUDA tensors take ATen's CUDA kernels directly (at::cuda::, the
// function the dispatcher would reach: the same cuBLAS call and bits, without the dispatcher's layers) where the
// build links them (LCK_HOST_ATEN_CUDA); the interpreted CPU harness takes the dispatcher. (The device is tested
// by type: the harness redefines is_cuda.)
inline bool lce_on_cuda(const at::Tensor& t) {
#if LCK_HOST_ATEN_CUDA
  return t.device().type() == c10::DeviceType::CUDA;
#else
  return false;
#endif
}

// (A torch without libtorch_cuda has no at::cuda entry points: those builds compile the dispatcher calls only.)
inline void lce_mm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
#if LCK_HOST_ATEN_CUDA
  if (lce_on_cuda(out)) {
    at::cuda::mm_out(out, a, b);
    return;
  }
#endif
  at::mm_out(out, a, b);
}

inline void lce_addmm_out(at::Tensor& out, const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b) {
#if LCK_HOST_ATEN_CUDA
  if (lce_on_cuda(out)) {
    at::cuda::addmm_out(out, bias, a, b);
    return;
  }
#endif
  at::addmm_out(out, bias, a, b);
}

inline void lce_addmm_(at::Tensor& self, const at::Tensor& a, const at::Tensor& b) {
#if LCK_HOST_ATEN_CUDA
  if (lce_on_cuda(self)) {
    at::cuda::addmm_(self, a, b);
    return;
  }
#endif
  self.addmm_(a, b);
}

// _run_with_grads' side stream: each chunk's grad_W update runs on it beside the chunk's grad_x GEMM on the
// caller's stream (see launch.py's _run_with_grads for why and what it gains). One stream and one pair of events
// per thread and device (a wait takes an event's latest record, so the pair serves every chunk).
struct LceSide {
  c10::cuda::CUDAStream stream;
  CUevent ready = nullptr, done = nullptr;
};

inline void lce_check(CUresult rc, const char* what) { driver_check(rc, "fused_linear_cross_entropy", what); }

inline LceSide& lce_side(int device) {
  thread_local std::map<int, LceSide> sides;
  auto it = sides.find(device);
  if (it == sides.end()) {
    const Driver& d = driver();
    if (d.event_create == nullptr || d.event_record == nullptr || d.stream_wait_event == nullptr)
      throw std::runtime_error("fused_linear_cross_entropy: libcuda.so.1 lacks cuEventCreate/Record/StreamWaitEvent");
    LceSide side{c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device))};
    lce_check(d.event_create(&side.ready, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    lce_check(d.event_create(&side.done, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    it = sides.emplace(device, side).first;
  }
  return it->second;
}

// forward_chunked with needs (through _run_with_grads and run_chunks without overlap): the loss, z-loss, per-row
// lse and entropy (empty unless asked for) and the gradients of the reduced loss (unneeded ones empty). Runs with
// autograd off (the caller's guard). The GEMM operands are aliases (alias.h) and the row kernel's per-row vectors
// offsets into them (ptr_at): the same operands as the Python loop's narrow views, with no dispatcher call each.
inline LceOut lce_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target,
                          const at::Tensor& bias, const at::Tensor& class_weight, const LceCall& c, int device) {
  const CeCall& ce = c.ce;
  const int64_t n = x.size(0), v = weight.size(0), chunk = c.plan.chunk;
  at::Tensor red = ce_reduction(target, class_weight, v, ce, ce.reduction == 2, device);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor rows = at::empty({n}, f32);
  at::Tensor lse = at::empty({n}, f32);
  at::Tensor zl = ce.has_z ? at::empty({n}, f32) : at::Tensor();
  at::Tensor ent = at::empty({c.entropy ? n : 0}, f32);
  at::Tensor applied = at::empty({n}, f32);  // the row kernel's marks; the backward rescales whole buffers
  at::Tensor gx = c.need_x ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  at::Tensor gw = c.need_w ? at::empty(weight.sizes(), weight.options()) : at::empty({0}, weight.options());
  at::Tensor gb32 = c.need_b ? at::zeros({v}, f32) : at::empty({0}, f32);  // no fill call when unused
  at::Tensor buf = at::empty({std::min(chunk, n), v}, x.options());
  const at::Tensor wt = t_alias(weight);
  // Absent per-row vectors point at the chunk's lse rows, as launch_fwd passes them.
  const at::Tensor& zl_v = ce.has_z ? zl : lse;
  const at::Tensor& ent_v = c.entropy ? ent : lse;
  const bool cw = ce.has_weight;
  LceSide* side = c.need_w && lce_on_cuda(x) ? &lce_side(device) : nullptr;
  const CUstream main_stream = side != nullptr ? c10::cuda::getCurrentCUDAStream(device).stream() : nullptr;
  for (int64_t s = 0; s < n; s += chunk) {
    const int64_t e = std::min(n, s + chunk), m = e - s;
    at::Tensor logits = rows_alias(buf, 0, m);
    const at::Tensor x_c = rows_alias(x, s, m);
    // _logits
    if (bias.defined())
      lce_addmm_out(logits, bias, x_c, wt);
    else
      lce_mm_out(logits, x_c, wt);
    // launch_fwd with grad = logits: the loss+gradient row kernel over the chunk's rows.
    const CeLaunch& k = m == chunk ? c.plan.full : c.plan.tail;
    launch(k.slot, {k.grid, 1, 1}, device, ptr(logits), i(logits.stride(0)), ptr(logits), i(logits.stride(0)),
           ptr_at(target, s), cw ? ptr(class_weight) : ptr_at(lse, s), ptr(red), ptr_at(rows, s), ptr_at(zl_v, s),
           ptr_at(lse, s), ptr_at(ent_v, s), ptr_at(applied, s), i(m), i(v), i(ce.ignore_index), f(ce.eps),
           f(ce.z_scale), f(c.scale), f(ce.softcap));
    // _accumulate_grads (the logits buffer now holds their gradient)
    auto grad_w_update = [&] {
      const at::Tensor lt = t_alias(logits);
      if (s == 0)  // no zero fill of a V×H buffer: the first chunk writes it
        lce_mm_out(gw, lt, x_c);
      else
        lce_addmm_(gw, lt, x_c);
    };
    if (side != nullptr) {
      const Driver& d = driver();
      lce_check(d.event_record(side->ready, main_stream), "cuEventRecord");
      lce_check(d.stream_wait_event(side->stream.stream(), side->ready, 0), "cuStreamWaitEvent");
      {
        c10::cuda::CUDAStreamGuard on_side(side->stream);
        grad_w_update();
      }
      lce_check(d.event_record(side->done, side->stream.stream()), "cuEventRecord");
    }
    if (c.need_x) {
      at::Tensor gx_c = rows_alias(gx, s, m);
      lce_mm_out(gx_c, logits, weight);
    }
    if (c.need_w && side == nullptr) grad_w_update();
    if (c.need_b) gb32.add_(at::sum(logits, at::IntArrayRef{0}, false, at::kFloat));
    // The next chunk's logits GEMM rewrites the buffer grad_W read; every later use of memory the side stream
    // touched is ordered after it.
    if (side != nullptr) lce_check(driver().stream_wait_event(main_stream, side->done, 0), "cuStreamWaitEvent");
  }
  at::Tensor gb = c.need_b ? gb32.to(bias.scalar_type())
                           : at::empty({0}, f32.dtype(bias.defined() ? bias.scalar_type() : at::kFloat));
  auto [loss, z] = ce_finalize(rows, ce.has_z ? &zl : nullptr, red, ce.reduction, device);
  return LceOut{loss, z, lse, ent, gx, gw, gb};
}

// launch_rescale_flat: each buffer ← buffer × g / applied (one value each), then applied ← g; no pass over the
// buffers when the factor is 1. Bumps the versions of what it rewrote, as the mutating op's dispatch does, so
// that a second backward over a retained graph is refused.
inline void lce_rescale(const std::array<at::Tensor, 3>& buffers, const at::Tensor& applied, const at::Tensor& g,
                        int device) {
  at::Tensor factor = at::empty({1}, applied.options());
  bool first = true;
  for (const at::Tensor& t : buffers) {
    const int64_t n = t.numel();
    const LceRescale plan = lce_plans().rescale.get({n, device}, n, device);
    if (first) launch(plan.factor, {1, 1, 1}, device, ptr(g), ptr(applied), ptr(factor));
    first = false;
    if (n > 0) launch(plan.slot, {plan.grid, 1, 1}, device, ptr(t), i(n), i(plan.blocks), ptr(factor));
  }
  for (const at::Tensor& t : buffers) t.unsafeGetTensorImpl()->bump_version();
  applied.unsafeGetTensorImpl()->bump_version();
}

// FusedLinearCrossEntropyFunction's backward as a node (node.h): the gradients the forward finished, rescaled in
// place by the loss's incoming gradient. Its edges are x (in its own shape: no view node), weight and bias.
struct FusedLinearCrossEntropyBackward : torch::autograd::Node {
  torch::autograd::SavedVariable gx_, gw_, gb_, applied_;
  std::vector<int64_t> x_sizes;  // x's shape when it is not [N, H]; the gradient buffer is [N, H]
  int64_t needs = 0;

  std::string name() const override { return "lck_host::FusedLinearCrossEntropyBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    gx_.reset_data();
    gw_.reset_data();
    gb_.reset_data();
    applied_.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    constexpr const char* op = "fused_linear_cross_entropy";
    at::Tensor gx = ce_unpack(gx_, op), gw = ce_unpack(gw_, op), gb = ce_unpack(gb_, op);
    const at::Tensor applied = ce_unpack(applied_, op);
    const at::Tensor none;
    if (!grads[0].defined()) return {none, none, none};
    c10::cuda::CUDAGuard guard(applied.device());
    lce_rescale({gx, gw, gb}, applied, grads[0], applied.get_device());
    if ((needs & 1) && !x_sizes.empty()) gx = gx.view(x_sizes);
    return {needs & 1 ? gx : none, needs & 2 ? gw : none, needs & 4 ? gb : none};
  }
};

// FusedLinearScaledCrossEntropyFunction's backward as a node: outputs nll, lse (and entropy), all differentiable.
// It rescales the gradients of the reduced nll the forward finished and adds the recompute backward's for lse and
// entropy when they get one. Its edges are x (in its own shape), weight and bias.
struct FusedLinearScaledCrossEntropyBackward : torch::autograd::Node {
  torch::autograd::SavedVariable x_, weight_, target_, bias_, lse_, entropy_, gx_, gw_, gb_, applied_;
  std::vector<int64_t> x_sizes;  // x's shape when it is not [N, H]
  int64_t ignore_index = -100, reduction = 2, needs = 0, chunk = 0;
  double scale = 1.0;
  bool entropy = false;

  std::string name() const override { return "lck_host::FusedLinearScaledCrossEntropyBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* v : {&x_, &weight_, &target_, &bias_, &lse_, &entropy_, &gx_, &gw_, &gb_, &applied_}) v->reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    constexpr const char* op = "fused_linear_scaled_cross_entropy";
    const at::Tensor none;
    std::array<at::Tensor, 3> out;
    const at::Tensor applied = ce_unpack(applied_, op);
    c10::cuda::CUDAGuard guard(applied.device());
    if (grads[0].defined()) {
      out = {ce_unpack(gx_, op), ce_unpack(gw_, op), ce_unpack(gb_, op)};
      lce_rescale(out, applied, grads[0], applied.get_device());
    }
    const at::Tensor& g_lse = grads[1];
    const at::Tensor g_ent = entropy ? grads[2] : none;
    if (g_lse.defined() || g_ent.defined()) {
      const at::Tensor x = ce_unpack(x_, op), weight = ce_unpack(weight_, op);
      const at::Tensor target = ce_unpack(target_, op), bias = ce_unpack(bias_, op);
      // lse and entropy are this node's outputs: unpacking them names the node.
      const at::Tensor lse = ce_unpack(lse_, op, self_ptr(this));
      const at::Tensor ent = entropy ? ce_unpack(entropy_, op, self_ptr(this)) : none;
      std::array<at::Tensor, 3> extra;
      {
        py::gil_scoped_acquire gil;
        auto opt = [](const at::Tensor& t) -> py::object { return t.defined() ? wrap(t) : py::none(); };
        py::object result = lce_plans().recompute(
            wrap(x), wrap(weight), wrap(target), opt(bias), wrap(lse), opt(ent), opt(g_lse), opt(g_ent),
            ignore_index, scale, reduction == 1 ? "sum" : "mean", bool(needs & 1), bool(needs & 2),
            bool(needs & 4), chunk);
        auto t = result.cast<py::tuple>();
        for (size_t k = 0; k < 3; ++k) extra[k] = THPVariable_Unpack(t[k].ptr());
      }
      for (size_t k = 0; k < 3; ++k) out[k] = out[k].defined() ? out[k] + extra[k] : extra[k];
    }
    if ((needs & 1) && out[0].defined() && !x_sizes.empty()) out[0] = out[0].view(x_sizes);
    return {needs & 1 ? out[0] : none, needs & 2 ? out[1] : none, needs & 4 ? out[2] : none};
  }
};

// ---------------------------------------------------------------------------------------------------------
// Entries
// ---------------------------------------------------------------------------------------------------------

struct LceInputs {
  at::Tensor x, weight, target;  // x as [N, H] rows and target as [N], as flatten_tokens gives them
  at::Tensor x_in;               // x as given
  std::optional<at::Tensor> bias;
  int64_t esize = 0;
};

// flatten_tokens and check_linear_inputs (minus the class weight and the empty case): false for anything they
// would refuse. The [N, H] view of x records no autograd view node: the backward nodes' edge is x itself.
inline bool lce_inputs(py::handle x_h, py::handle weight_h, py::handle target_h, py::handle bias_h,
                       LceInputs* in) {
  if (!THPVariable_Check(x_h.ptr()) || !THPVariable_Check(weight_h.ptr()) || !THPVariable_Check(target_h.ptr()))
    return false;
  const at::Tensor& x = THPVariable_Unpack(x_h.ptr());
  const at::Tensor& weight = THPVariable_Unpack(weight_h.ptr());
  const at::Tensor& target = THPVariable_Unpack(target_h.ptr());
  if (!x.is_cuda() || !float_dtype(x.scalar_type()) || !rows_ok(x)) return false;
  const int64_t h = x.size(-1);
  if (weight.dim() != 2 || weight.scalar_type() != x.scalar_type() || weight.size(0) == 0 || weight.size(1) != h)
    return false;
  if (weight.device() != x.device()) return false;
  if (target.scalar_type() != at::kLong && target.scalar_type() != at::kInt) return false;
  if (target.sizes() != x.sizes().slice(0, x.dim() - 1) || !target.is_contiguous()) return false;
  if (target.device() != x.device()) return false;
  if (!bias_h.is_none()) {
    if (!THPVariable_Check(bias_h.ptr())) return false;
    const at::Tensor& b = THPVariable_Unpack(bias_h.ptr());
    if (b.dim() != 1 || b.scalar_type() != x.scalar_type() || b.size(0) != weight.size(0)) return false;
    if (b.device() != x.device()) return false;
    in->bias = b;
  }
  {
    at::AutoGradMode no_grad(false);
    in->x = x.view({-1, h});
  }
  in->x_in = x;
  in->weight = weight;
  in->target = target.view({-1});
  in->esize = x.element_size();
  return true;
}

// chunk_bytes / max_chunk_tokens: None (0 here) or an int >= 1, as check_chunking accepts.
inline bool lce_chunk_option(py::handle h, int64_t* out) {
  *out = 0;
  if (h.is_none()) return true;
  return ce_int(h, out) && *out >= 1;
}

// The gradients wanted (needs_grads), or false when none is: the Python path's no-grad forward.
inline bool lce_needs(const LceInputs& in, LceCall* c) {
  const bool on = at::GradMode::is_enabled();
  c->need_x = on && in.x_in.requires_grad();
  c->need_w = on && in.weight.requires_grad();
  c->need_b = on && in.bias.has_value() && in.bias->requires_grad();
  return c->need_x || c->need_w || c->need_b;
}

// Either entry's forward: lce_forward with autograd off (ATen's out= GEMMs refuse operands that record a graph),
// and in *applied the scale the gradients carry (1: those of the loss itself) for the backward's rescale.
inline LceOut lce_run(const LceInputs& in, const at::Tensor& class_weight, const LceCall& c, at::Tensor* applied) {
  at::AutoGradMode no_grad(false);
  c10::cuda::CUDAGuard guard(in.x.device());
  LceOut out = lce_forward(in.x, in.weight, in.target, in.bias.value_or(at::Tensor()), class_weight, c,
                           in.x.get_device());
  *applied = at::ones({1}, in.x.options().dtype(at::kFloat));
  return out;
}

// fused_linear_cross_entropy(x, weight, target, bias, class_weight, ignore_index, label_smoothing,
// lse_square_scale, softcap, reduction, return_z_loss, chunk_bytes, max_chunk_tokens, loss_dtype) -> what it
// returns, or None (see the file comment).
inline py::object fused_linear_cross_entropy_entry(py::handle x_h, py::handle weight_h, py::handle target_h,
                                                   py::handle bias_h, py::handle cw_h, py::handle ignore_h,
                                                   py::handle smoothing_h, py::handle z_scale_h,
                                                   py::handle softcap_h, py::handle reduction_h,
                                                   py::handle return_z_h, py::handle chunk_bytes_h,
                                                   py::handle max_chunk_h, py::handle loss_dtype_h) {
  LceCall c;
  c.ce.reduction = choice(reduction_h, {"none", "sum", "mean"});
  if (c.ce.reduction < 1) return py::none();  // "none" takes the recompute schedule
  LceInputs in;
  if (!lce_inputs(x_h, weight_h, target_h, bias_h, &in)) return py::none();
  const at::Tensor& x = in.x;
  const int64_t n = x.size(0), v = in.weight.size(0);
  std::optional<at::Tensor> class_weight;
  if (!ce_class_weight(cw_h, x, v, &class_weight, &c.ce)) return py::none();
  // check_loss_options, check_chunking, check_flag and check_loss_dtype.
  bool return_z;
  int64_t chunk_bytes, max_chunk;
  at::ScalarType loss_dtype;
  if (!ce_loss_options(ignore_h, smoothing_h, z_scale_h, softcap_h, &c.ce)) return py::none();
  if (!boolean(return_z_h, &return_z)) return py::none();
  if (!lce_chunk_option(chunk_bytes_h, &chunk_bytes) || !lce_chunk_option(max_chunk_h, &max_chunk))
    return py::none();
  if (!ce_loss_dtype(loss_dtype_h, x.scalar_type(), &loss_dtype)) return py::none();
  if (!lce_needs(in, &c)) return py::none();
  c.plan = lce_chunks(n, v, in.esize, x.get_device(), chunk_bytes, max_chunk, c);
  if (c.plan.chunk <= 0) return py::none();  // the split-row or cluster forward: launch.py's own path
  const at::Tensor& x_in = in.x_in;
  const at::Tensor bias = in.bias.value_or(at::Tensor());
  at::Tensor applied;
  LceOut out = lce_run(in, class_weight.value_or(at::Tensor()), c, &applied);
  NodePtr node = make_node<FusedLinearCrossEntropyBackward>();
  FusedLinearCrossEntropyBackward* b = node_as<FusedLinearCrossEntropyBackward>(node);
  b->gx_ = torch::autograd::SavedVariable(out.gx, false);
  b->gw_ = torch::autograd::SavedVariable(out.gw, false);
  b->gb_ = torch::autograd::SavedVariable(out.gb, false);
  b->applied_ = torch::autograd::SavedVariable(applied, false);
  if (x_in.dim() != 2) b->x_sizes = x_in.sizes().vec();
  b->needs = c.needs();
  node->set_next_edges(torch::autograd::collect_next_edges(x_in, in.weight, bias));
  torch::autograd::set_history(out.loss, node);
  return ce_result(out.loss, out.z, loss_dtype, return_z);
}

// fused_linear_scaled_cross_entropy(x, weight, target, bias, inverse_temperature, return_entropy, ignore_index,
// reduction, chunk_bytes, max_chunk_tokens) -> (nll, lse[, entropy]), or None (see the file comment).
inline py::object fused_linear_scaled_cross_entropy_entry(py::handle x_h, py::handle weight_h,
                                                          py::handle target_h, py::handle bias_h,
                                                          py::handle inv_t_h, py::handle return_entropy_h,
                                                          py::handle ignore_h, py::handle reduction_h,
                                                          py::handle chunk_bytes_h, py::handle max_chunk_h) {
  LceCall c;
  c.ce.reduction = choice(reduction_h, {"none", "sum", "mean"});
  if (c.ce.reduction < 1) return py::none();  // "none" takes the recompute schedule
  LceInputs in;
  if (!lce_inputs(x_h, weight_h, target_h, bias_h, &in)) return py::none();
  int64_t chunk_bytes, max_chunk;
  if (!number(inv_t_h, &c.scale) || !(c.scale > 0.0) || !boolean(return_entropy_h, &c.entropy)) return py::none();
  if (!ce_int(ignore_h, &c.ce.ignore_index)) return py::none();
  if (!lce_chunk_option(chunk_bytes_h, &chunk_bytes) || !lce_chunk_option(max_chunk_h, &max_chunk))
    return py::none();
  if (!lce_needs(in, &c)) return py::none();
  const int64_t n = in.x.size(0), v = in.weight.size(0);
  c.plan = lce_chunks(n, v, in.esize, in.x.get_device(), chunk_bytes, max_chunk, c);
  if (c.plan.chunk <= 0) return py::none();
  const at::Tensor& x_in = in.x_in;
  const at::Tensor bias = in.bias.value_or(at::Tensor());
  at::Tensor applied;
  LceOut out = lce_run(in, at::Tensor(), c, &applied);
  NodePtr node = make_node<FusedLinearScaledCrossEntropyBackward>();
  auto* b = node_as<FusedLinearScaledCrossEntropyBackward>(node);
  node->set_next_edges(torch::autograd::collect_next_edges(x_in, in.weight, bias));
  if (c.entropy)
    torch::autograd::set_history(std::vector<at::Tensor>{out.loss, out.lse, out.entropy}, node);
  else
    torch::autograd::set_history(std::vector<at::Tensor>{out.loss, out.lse}, node);
  using torch::autograd::SavedVariable;
  b->x_ = SavedVariable(in.x, false);  // the [N, H] rows, as the recompute backward takes them
  b->weight_ = SavedVariable(in.weight, false);
  b->target_ = SavedVariable(in.target, false);
  b->bias_ = SavedVariable(bias, false);
  b->lse_ = SavedVariable(out.lse, true);
  if (c.entropy) b->entropy_ = SavedVariable(out.entropy, true);
  b->gx_ = SavedVariable(out.gx, false);
  b->gw_ = SavedVariable(out.gw, false);
  b->gb_ = SavedVariable(out.gb, false);
  b->applied_ = SavedVariable(applied, false);
  if (x_in.dim() != 2) b->x_sizes = x_in.sizes().vec();
  b->ignore_index = c.ce.ignore_index;
  b->reduction = c.ce.reduction;
  b->needs = c.needs();
  b->chunk = c.plan.chunk;
  b->scale = c.scale;
  b->entropy = c.entropy;
  // lse and entropy of ignored tokens are zeroed (and so are their gradients), as the public function does.
  const at::Tensor& target = THPVariable_Unpack(target_h.ptr());
  at::Tensor valid = in.target.ne(c.ce.ignore_index);
  at::Tensor lse = at::where(valid, out.lse, 0.0).view(target.sizes());
  if (!c.entropy) return py::make_tuple(wrap(out.loss), wrap(lse));
  at::Tensor entropy = at::where(valid, out.entropy, 0.0).view(target.sizes());
  return py::make_tuple(wrap(out.loss), wrap(lse), wrap(entropy));
}

inline void bind_linear_cross_entropy(py::module& m) {
  m.def("linear_cross_entropy_set_plans", [](py::object chunks, py::object rescale, py::object recompute) {
    LcePlans& p = lce_plans();
    p.chunks.reset(std::move(chunks));
    p.rescale.reset(std::move(rescale));
    p.recompute = std::move(recompute);
  });
  m.def("fused_linear_cross_entropy", &fused_linear_cross_entropy_entry,
        "fused linear cross entropy with a C++ backward node, or None");
  m.def("fused_linear_scaled_cross_entropy", &fused_linear_scaled_cross_entropy_entry,
        "fused linear scaled cross entropy with a C++ backward node, or None");
}

}  // namespace lck_host
