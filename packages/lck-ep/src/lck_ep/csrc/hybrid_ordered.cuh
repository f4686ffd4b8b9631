// lck-ep: the ordered hybrid pair (EP_HYBRID_KERNEL=ordered).
//
// Sub-parts are put in order, each followed (after a fence) by a tail signal set to (op << 32) | (rows
// delivered << 1) | final; the forwarder processes a part once the tail covers it. Combine sets a tail
// counting the forwarder's in-order puts. Same staging layout, headers and reduce epilogue as the unordered
// pair (hybrid_common.cuh); the debug option only delays puts here, it cannot reorder them.
#pragma once

#include "hybrid_common.cuh"

namespace lck_ep {
namespace hybrid {
constexpr bool kOrderedPair = true;
__device__ inline void dispatch_pair(const DispatchArgs& a) { dispatch<kOrderedPair>(a); }
__device__ inline void combine_pair(const CombineArgs& a) { combine<kOrderedPair>(a); }
}  // namespace hybrid
}  // namespace lck_ep
