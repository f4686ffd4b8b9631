// lck-ep: native dispatch over peer views of the symmetric workspace (scale-up: one host).
//
// dispatch_send (every member, as a source): each token row goes once to every member that hosts one of
// its experts, stored straight into that member's region for this source at the row's send slot (its
// rank among this source's tokens for that member), with its routing as the member will read it: the
// source token index, then per slot the weight (0 where the slot is not the member's) and the local
// expert index (-1 there). Then the last block publishes (op << 32 | rows) to every member.
// dispatch_recv (every member, as a destination): waits for every source's word, lays the rows out in
// the documented order (source ascending, then token ascending: region by region, row by row) into the
// caller's tensors, pads the rest of a capacity-sized output, and counts entries per local expert.
//
// Row layout in a region (row_stride bytes, 16-byte aligned): [x: x_bytes][pad to 4][src: int32]
// [weights: float32 x K][local expert: int16 x K]; meta_offset is where src starts.
#pragma once

#include "ep_native.cuh"

namespace lck_ep {

struct DispatchSendArgs {
  const uint8_t* x;
  long long x_bytes;           // bytes of one token row
  const long long* topk_idx;   // [T, K] global expert or -1; nullptr on a replay (rows only)
  const float* topk_weights;   // [T, K] or nullptr
  const bool* mask;            // [T, W] is_token_in_rank
  const long long* send_slot;  // [T, W] row inside the destination's region, -1 where not sent
  const int* rows_to;          // [W] rows sent to each member (num_tokens_per_rank)
  const long long* peer_ws;    // [W] addresses of every member's workspace in this process
  const long long* peer_sig;   // [W] addresses of every member's signal words
  long long region_bytes, row_stride, meta_offset;
  int num_tokens, num_topk, num_ranks, me, num_local_experts;
  unsigned int* done;
  long long* status;
  unsigned long long timeout_ns;
};

__device__ inline void dispatch_send(const DispatchSendArgs& a) {
  const long long* const* peer_sig = reinterpret_cast<const long long* const*>(a.peer_sig);
  const long long* my_sig = peer_sig[a.me];
  const unsigned long long op = current_op(my_sig, a.me);
  const bool ok = wait_peers_free(peer_sig, a.num_ranks, op, a.status, kPhaseDispatchFree, a.timeout_ns);
  const int lane = threadIdx.x & 31;
  if (ok) {
    const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const long long warps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
    const int K = a.num_topk;
    for (long long t = warp; t < a.num_tokens; t += warps) {
      const uint8_t* src = a.x + t * a.x_bytes;
      for (int d = 0; d < a.num_ranks; ++d) {
        if (!a.mask[t * a.num_ranks + d]) continue;
        uint8_t* row = reinterpret_cast<uint8_t*>(a.peer_ws[d]) + a.me * a.region_bytes +
                       a.send_slot[t * a.num_ranks + d] * a.row_stride;
        uint8_t* meta = row + a.meta_offset;
        // Rows for this member itself stay in x: only their token index goes to the region, and the
        // receiver copies them from x (one pass over those bytes instead of three).
        if (d != a.me) warp_copy(row, src, a.x_bytes, lane);
        else if (lane == 0) *reinterpret_cast<int*>(meta) = static_cast<int>(t);
        if (a.topk_idx != nullptr) {
          if (lane == 0) *reinterpret_cast<int*>(meta) = static_cast<int>(t);
          float* w = reinterpret_cast<float*>(meta + 4);
          short* li = reinterpret_cast<short*>(meta + 4 + 4 * K);
          const long long lo = static_cast<long long>(d) * a.num_local_experts;
          for (int k = lane; k < K; k += 32) {
            const long long e = a.topk_idx[t * K + k];
            const bool local = e >= lo && e < lo + a.num_local_experts;
            w[k] = local && a.topk_weights != nullptr ? a.topk_weights[t * K + k] : 0.0f;
            li[k] = local ? static_cast<short>(e - lo) : static_cast<short>(-1);
          }
        }
      }
    }
  }
  finish_grid(a.done, [&] {
    if (failed(a.status)) return;  // peers time out and report; this member reports its own wait
    for (int d = threadIdx.x; d < a.num_ranks; d += blockDim.x) {
      long long* word = const_cast<long long*>(peer_sig[d]) + a.me * kSignalWords + kDispatchArrived;
      lck_sync::max_release_sys(reinterpret_cast<unsigned long long*>(word),
                                (op << 32) | static_cast<unsigned long long>(a.rows_to[d]));
    }
  });
}

struct DispatchRecvArgs {
  const uint8_t* x;         // this member's own token rows (its rows to itself are read from here)
  const uint8_t* ws;        // this member's workspace
  long long* my_sig;        // this member's signal words
  long long region_bytes, row_stride, meta_offset, x_bytes;
  long long cap;            // rows per region
  long long out_rows;       // rows of the outputs (exact count, or the sync-free capacity)
  int num_ranks, me, num_topk, has_meta, num_local_experts;
  uint8_t* recv_x;                 // [out_rows, x_bytes]
  long long* recv_src_idx;         // [out_rows] or nullptr (replay)
  long long* recv_topk_idx;        // [out_rows, K]
  float* recv_topk_weights;        // [out_rows, K] or nullptr
  long long* recv_src_rank;        // [out_rows]
  long long* recv_counts;          // [W] rows from each source
  long long* recv_starts;          // [W + 1] their prefix sums
  long long* slot_pos;             // [W * cap] compacted row of each region row (out_rows: none) or nullptr
  long long* num_recv;             // [1] rows received (may exceed out_rows: the excess is dropped)
  long long* per_expert;           // [L] zeroed; entries per local expert, or nullptr
  unsigned int* done;
  long long* status;
  unsigned long long timeout_ns;
};

__device__ inline void dispatch_recv(const DispatchRecvArgs& a) {
  __shared__ long long counts[kMaxRanks];
  __shared__ long long starts[kMaxRanks + 1];
  const unsigned long long op = current_op(a.my_sig, a.me);
  const bool ok = gather_arrivals(a.my_sig, a.num_ranks, kDispatchArrived, 32, op, counts, starts, a.status,
                                  kPhaseDispatchArrive, a.timeout_ns);
  if (ok) {
    const long long total = starts[a.num_ranks];
    const long long kept = min(total, a.out_rows);
    if (blockIdx.x == 0) {
      for (int s = threadIdx.x; s <= a.num_ranks; s += blockDim.x) {
        if (s < a.num_ranks) a.recv_counts[s] = counts[s];
        a.recv_starts[s] = starts[s];
      }
      if (threadIdx.x == 0) *a.num_recv = total;
    }
    const int lane = threadIdx.x & 31;
    const int K = a.num_topk;
    const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const long long warps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
    const long long rows = max(total, a.out_rows);
    for (long long p = warp; p < rows; p += warps) {
      if (p < total) {
        const int s = source_of(starts, a.num_ranks, p);
        const uint8_t* row = a.ws + s * a.region_bytes + (p - starts[s]) * a.row_stride;
        const uint8_t* meta = row + a.meta_offset;
        const float* w = reinterpret_cast<const float*>(meta + 4);
        const short* li = reinterpret_cast<const short*>(meta + 4 + 4 * K);
        if (p < kept) {
          const uint8_t* from = s != a.me ? row : a.x + static_cast<long long>(*reinterpret_cast<const int*>(meta)) * a.x_bytes;
          warp_copy(a.recv_x + p * a.x_bytes, from, a.x_bytes, lane);
          if (a.has_meta) {
            if (lane == 0) {
              a.recv_src_idx[p] = *reinterpret_cast<const int*>(meta);
              a.recv_src_rank[p] = s;
            }
            for (int k = lane; k < K; k += 32) {
              a.recv_topk_idx[p * K + k] = li[k];
              if (a.recv_topk_weights != nullptr) a.recv_topk_weights[p * K + k] = w[k];
            }
          }
        }
        if (a.has_meta && a.per_expert != nullptr) {  // dropped rows count too, as their senders did
          for (int k = lane; k < K; k += 32)
            if (li[k] >= 0) atomicAdd(reinterpret_cast<unsigned long long*>(a.per_expert + li[k]), 1ull);
        }
      } else {  // padding of a capacity-sized output: inert rows
        warp_zero(a.recv_x + p * a.x_bytes, a.x_bytes, lane);
        if (a.has_meta) {
          if (lane == 0) {
            a.recv_src_idx[p] = -1;
            a.recv_src_rank[p] = -1;
          }
          for (int k = lane; k < K; k += 32) {
            a.recv_topk_idx[p * K + k] = -1;
            if (a.recv_topk_weights != nullptr) a.recv_topk_weights[p * K + k] = 0.0f;
          }
        }
      }
    }
    if (a.slot_pos != nullptr) {
      const long long n = static_cast<long long>(a.num_ranks) * a.cap;
      for (long long q = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; q < n;
           q += static_cast<long long>(gridDim.x) * blockDim.x) {
        const int s = static_cast<int>(q / a.cap);
        const long long j = q - s * a.cap;
        a.slot_pos[q] = j < counts[s] ? min(starts[s] + j, a.out_rows) : a.out_rows;
      }
    }
  }
  finish_receive(a.done, a.my_sig, a.me, op, a.status);
}

}  // namespace lck_ep
