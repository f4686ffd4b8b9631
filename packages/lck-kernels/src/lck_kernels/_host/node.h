// Backward nodes written the way torch's generated ones are (a Node subclass holding SavedVariables), for
// ops whose host cost per call matters most. torch::autograd::Function's CppNode does more per call than an
// op needs: an IValue map for non-tensor state, VariableInfo copies of every input, generic output wrapping
// (views, dirty and non-differentiable outputs) in the forward, and grad materialisation and input bookkeeping
// in the backward.
//
// torch has held nodes by std::shared_ptr (with deleteNode, which frees long graphs without recursing) and,
// since 2.12, by c10::intrusive_ptr; make_node builds whichever this torch uses.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace lck_host {

using NodePtr =
    std::remove_cv_t<std::remove_reference_t<decltype(std::declval<torch::autograd::Edge>().function)>>;

// deleteNode found by argument-dependent lookup at instantiation (only torches holding shared_ptr have it).
template <class N>
void delete_node(N* n) {
  deleteNode(n);  // N* converts to Node*; N (a Node) makes torch::autograd an associated namespace
}

template <class N>
NodePtr make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<N>(new N(), &delete_node<N>);
  } else {
    return c10::make_intrusive<N>();
  }
}

// The node a make_node result points at, typed.
template <class N>
N* node_as(const NodePtr& p) {
  return static_cast<N*>(p.get());
}

// The node's own pointer, for SavedVariable::unpack of a saved output (which needs the node it was saved for).
template <class N>
NodePtr self_ptr(N* n) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return n->shared_from_this();
  } else {
    return n->getptr();
  }
}

// Whether a forward-mode gradient rides on `t` (the C++ nodes have no forward-mode formula: such calls go
// to the Python Functions, which raise torch's own error).
inline bool has_fw_grad(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }

}  // namespace lck_host
