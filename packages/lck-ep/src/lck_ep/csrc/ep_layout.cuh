// lck-ep: the dispatch layout of one rank's routing.
//
// From topk_idx [num_tokens, num_topk] (expert indices, -1 = no expert) it counts, per destination
// rank, the tokens that must travel there (a token goes once to each rank hosting any of its experts),
// per expert the (token, slot) entries that select it, and marks is_token_in_rank [num_tokens,
// num_ranks]. Experts are placed contiguously: rank r hosts [r * E / R, (r + 1) * E / R).
//
// Contract with the launcher (lck_ep/layout.py):
//   - num_tokens_per_rank [R] and num_tokens_per_expert [E] (int32) are zero on entry: blocks add their
//     partial counts with integer atomics, so the result is exact and the same on every run;
//   - every element of is_token_in_rank is written (no pre-fill needed);
//   - entries outside [0, E) are ignored like -1 (the host validates values where it can afford to);
//   - dynamic shared memory holds (E + R) ints.
#pragma once

#include "ep_config.cuh"

namespace lck_ep {

__device__ __forceinline__ void dispatch_layout(const ep_topk_idx_t* __restrict__ topk_idx,
                                                int num_tokens, int num_topk, int num_experts, int num_ranks,
                                                int* __restrict__ num_tokens_per_rank,
                                                int* __restrict__ num_tokens_per_expert,
                                                bool* __restrict__ is_token_in_rank) {
    extern __shared__ int smem[];
    int* expert_count = smem;              // [num_experts]
    int* rank_count = smem + num_experts;  // [num_ranks]
    for (int i = threadIdx.x; i < num_experts + num_ranks; i += blockDim.x) smem[i] = 0;
    __syncthreads();

    const int experts_per_rank = num_experts / num_ranks;
    const int stride = gridDim.x * blockDim.x;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += stride) {
        const ep_topk_idx_t* row = topk_idx + static_cast<int64_t>(t) * num_topk;
        bool* mask = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
        for (int k = 0; k < num_topk; ++k) {
            const long long e = static_cast<long long>(row[k]);
            if (e >= 0 && e < num_experts) atomicAdd(&expert_count[e], 1);
        }
        // Ranks in chunks of 64: one bit per rank, so a rank selected by several slots of the token is
        // counted once, and each mask byte is written exactly once.
        for (int base = 0; base < num_ranks; base += 64) {
            unsigned long long bits = 0ull;
            for (int k = 0; k < num_topk; ++k) {
                const long long e = static_cast<long long>(row[k]);
                if (e < 0 || e >= num_experts) continue;
                const int r = static_cast<int>(e / experts_per_rank) - base;
                if (r < 0 || r >= 64) continue;
                const unsigned long long bit = 1ull << r;
                if (!(bits & bit)) {
                    bits |= bit;
                    atomicAdd(&rank_count[base + r], 1);
                }
            }
            const int n = min(64, num_ranks - base);
            for (int r = 0; r < n; ++r) mask[base + r] = (bits >> r) & 1ull;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
        if (expert_count[i] != 0) atomicAdd(&num_tokens_per_expert[i], expert_count[i]);
    for (int i = threadIdx.x; i < num_ranks; i += blockDim.x)
        if (rank_count[i] != 0) atomicAdd(&num_tokens_per_rank[i], rank_count[i]);
}

}  // namespace lck_ep
