// lck-ep: the unordered hybrid pair (the default; EP_HYBRID_KERNEL=unordered or unset).
//
// Every sub-part is one put that adds 1 to its part's counting signal; the forwarder treats the signal as a
// completion count and validates each sub-part by its in-band header, so puts may land in any order (the
// debug option of lck_ep.hybrid holds them back and issues them newest first to prove it). Combine puts add
// (1 << 32) | rows to a per-channel counter. The protocol is in hybrid_common.cuh.
#pragma once

#include "hybrid_common.cuh"

namespace lck_ep {
namespace hybrid {
constexpr bool kOrderedPair = false;
__device__ inline void dispatch_pair(const DispatchArgs& a) { dispatch<kOrderedPair>(a); }
__device__ inline void combine_pair(const CombineArgs& a) { combine<kOrderedPair>(a); }
}  // namespace hybrid
}  // namespace lck_ep
