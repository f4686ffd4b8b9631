// Views of 2-D tensors built directly as TensorImpls over the same storage: what narrow(0, ...) and t() give a
// GEMM (sizes, strides, storage offset), without a dispatcher call, view bookkeeping or autograd metadata. For
// operands inside a forward that records no graph (the aliases never require grad and share no version
// counter, so nothing may save them for a backward).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>

namespace lck_host {

// rows [start, start + len) of a 2-D tensor.
inline at::Tensor rows_alias(const at::Tensor& t, int64_t start, int64_t len) {
  TORCH_CHECK(t.dim() == 2 && start >= 0 && len >= 0 && start + len <= t.size(0), "lck host: rows_alias outside");
  if (start == 0 && len == t.size(0)) return t;
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
  const int64_t sizes[2] = {len, t.size(1)};
  impl->set_sizes_and_strides(c10::IntArrayRef(sizes), t.strides(), t.storage_offset() + start * t.stride(0));
  return at::Tensor(std::move(impl));
}

// The transpose of a 2-D tensor.
inline at::Tensor t_alias(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 2, "lck host: t_alias of a tensor that is not 2-D");
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
  const int64_t sizes[2] = {t.size(1), t.size(0)}, strides[2] = {t.stride(1), t.stride(0)};
  impl->set_sizes_and_strides(c10::IntArrayRef(sizes), c10::IntArrayRef(strides), t.storage_offset());
  return at::Tensor(std::move(impl));
}

}  // namespace lck_host
