// lck-ep: native dispatch over peer views of the symmetric workspace (scale-up: one host).
//
// dispatch_send (every member, as a source): every member that hosts one of a token's experts gets the
// token's routing in its region for this source, at the row's send slot (its rank among this source's
// tokens for that member): the source token index, then per slot the weight (0 where the slot is not the
// member's) and the local expert index (-1 there). The row itself is pulled (pull = 1, the native state):
// stored once, at row t of this source's own region, for every member to read from there; or pushed (the
// hybrid pair's receivers, and the benchmark's comparison): stored into each member's region beside its
// routing. Then the last block publishes (op << 32 | rows) to every member; a source overwrites its staged
// rows only after every member finished reading the operation (the same wait as for pushed rows).
// dispatch_recv (every member, as a destination): waits for every source's word, lays the routing of the
// rows out in the documented order (source ascending, then token ascending: region by region, row by
// row) into the caller's tensors, pads the rest of a capacity-sized output, and counts entries per local
// expert. It runs on num_sms blocks (it spins on peers) and leaves the rows where they are.
// dispatch_rows (every member): copies the rows out of the sources' regions (pulled), its own workspace
// (pushed) or x (this member's own rows) into the output, compact or expert-major (each received row read
// once and stored at each of its expanded rows), zeroing alignment padding, and then publishes that this
// member finished reading the operation. It waits for nothing, so it runs on every SM.
// Expanded dispatch (expand=True): between the two, expand_chunks (expand_maps for more local experts than
// its shared memory holds) ranks every (row, slot) entry inside its local expert (expert, then row, then
// slot: lck_ep.expanded's order).
//
// Row layout in a region (row_stride bytes, 16-byte aligned): [x: x_bytes][pad to 4][src: int32]
// [weights: float32 x K][local expert: int16 x K]; meta_offset is where src starts.
#pragma once

#include "ep_native.cuh"

namespace lck_ep {

// One count per warp in warp_base[0, nwarps) becomes its exclusive prefix sum over the warps, and
// warp_base[nwarps] the block's total: between two barriers, so every warp's count is in before thread 0
// scans and every warp reads the result after.
__device__ __forceinline__ void scan_warp_counts(int* warp_base, int nwarps) {
  __syncthreads();
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int w = 0; w < nwarps; ++w) {
      const int n = warp_base[w];
      warp_base[w] = acc;
      acc += n;
    }
    warp_base[nwarps] = acc;
  }
  __syncthreads();
}

// Exclusive rank of each (token, destination) pair among the destination's tokens, in token order:
// send_slot[t, d] = #{t' < t : mask[t', d]} where mask[t, d], else -1 (lck_ep.reference.send_slots).
// One block per destination (grid-strided), a ballot scan over the tokens in chunks of the block.
__device__ inline void send_slots(const bool* mask, int num_tokens, int num_ranks, long long* slot) {
  __shared__ int warp_base[kThreads / 32 + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int d = blockIdx.x; d < num_ranks; d += gridDim.x) {
    long long found = 0;
    for (int c0 = 0; c0 < num_tokens; c0 += blockDim.x) {
      const int t = c0 + threadIdx.x;
      const bool hit = t < num_tokens && mask[static_cast<long long>(t) * num_ranks + d];
      const unsigned ballot = __ballot_sync(0xffffffffu, hit);
      if (lane == 0) warp_base[warp] = __popc(ballot);
      scan_warp_counts(warp_base, nwarps);
      if (t < num_tokens)
        slot[static_cast<long long>(t) * num_ranks + d] =
            hit ? found + warp_base[warp] + __popc(ballot & ((1u << lane) - 1u)) : -1;
      found += warp_base[nwarps];
      __syncthreads();  // warp_base is rewritten by the next chunk
    }
  }
}

// One token row (n bytes, a multiple of 16, 16-byte aligned) into the region row of every other member it
// goes to: each batch of 16-byte loads is issued once and stored to each destination, so a row is read
// once however many members receive it.
template <int U>
__device__ __forceinline__ long long fan_out_batches(const int4* __restrict__ s, long long i, long long m,
                                                     const bool* mask, const long long* slot,
                                                     const long long* peer_ws, int num_ranks, int me,
                                                     long long region_off, long long row_stride) {
  for (; i + 32 * (U - 1) < m; i += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldg(s + i + 32 * u);
    for (int d = 0; d < num_ranks; ++d) {
      if (d == me || !mask[d]) continue;
      int4* row = reinterpret_cast<int4*>(reinterpret_cast<uint8_t*>(peer_ws[d]) + region_off + slot[d] * row_stride);
#pragma unroll
      for (int u = 0; u < U; ++u) row[i + 32 * u] = v[u];
    }
  }
  return i;
}

__device__ __forceinline__ void fan_out_row(const uint8_t* src, long long n, const bool* mask, const long long* slot,
                                            const long long* peer_ws, int num_ranks, int me, long long region_off,
                                            long long row_stride, int lane) {
  const int4* s = reinterpret_cast<const int4*>(src);
  const long long m = n >> 4;
  long long i = fan_out_batches<8>(s, lane, m, mask, slot, peer_ws, num_ranks, me, region_off, row_stride);
  i = fan_out_batches<4>(s, i, m, mask, slot, peer_ws, num_ranks, me, region_off, row_stride);
  fan_out_batches<1>(s, i, m, mask, slot, peer_ws, num_ranks, me, region_off, row_stride);
}

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
  int pull;  // 1: rows are staged once in this member's own region and each destination reads them from there
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
    // Rows are read once and stored to every destination when they are 16-byte movable (regions and rows
    // are 16-byte aligned, so only x and the row length decide).
    const bool fan = !a.pull && ((reinterpret_cast<uintptr_t>(a.x) | static_cast<uintptr_t>(a.x_bytes)) & 15u) == 0;
    // Pulled rows: row t of this member's own region (its x bytes; the routing of this member's own rows
    // sits at meta_offset of other rows there, so the two never overlap; t < cap as num_tokens <= cap).
    uint8_t* stage = reinterpret_cast<uint8_t*>(a.peer_ws[a.me]) + a.me * a.region_bytes;
    for (long long t = warp; t < a.num_tokens; t += warps) {
      const uint8_t* src = a.x + t * a.x_bytes;
      const bool* mask = a.mask + t * a.num_ranks;
      const long long* slot = a.send_slot + t * a.num_ranks;
      if (fan) fan_out_row(src, a.x_bytes, mask, slot, a.peer_ws, a.num_ranks, a.me, a.me * a.region_bytes,
                           a.row_stride, lane);
      if (a.pull) {  // one store of the row however many other members read it
        bool elsewhere = false;
        for (int d = 0; d < a.num_ranks && !elsewhere; ++d) elsewhere = d != a.me && mask[d];
        if (elsewhere) warp_copy(stage + t * a.row_stride, src, a.x_bytes, lane);
      }
      for (int d = 0; d < a.num_ranks; ++d) {
        if (!mask[d]) continue;
        uint8_t* row = reinterpret_cast<uint8_t*>(a.peer_ws[d]) + a.me * a.region_bytes + slot[d] * a.row_stride;
        uint8_t* meta = row + a.meta_offset;
        // Rows for this member itself stay in x: only their token index goes to the region, and the
        // receiver copies them from x (one pass over those bytes instead of three).
        if (d != a.me) {
          if (!fan && !a.pull) warp_copy(row, src, a.x_bytes, lane);
        } else if (lane == 0) {
          *reinterpret_cast<int*>(meta) = static_cast<int>(t);
        }
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
  const uint8_t* ws;        // this member's workspace
  long long* my_sig;        // this member's signal words
  long long region_bytes, row_stride, meta_offset;
  long long cap;            // rows per region
  long long out_rows;       // rows of the outputs (exact count, or the sync-free capacity)
  int num_ranks, me, num_topk, has_meta, num_local_experts;
  long long* recv_src_idx;         // [out_rows] or nullptr (replay)
  long long* recv_topk_idx;        // [out_rows, K]
  float* recv_topk_weights;        // [out_rows, K] or nullptr
  long long* recv_src_rank;        // [out_rows]
  long long* recv_counts;          // [W] rows from each source
  long long* recv_starts;          // [W + 1] their prefix sums
  long long* slot_pos;             // [W * cap] compacted row of each region row (out_rows: none) or nullptr
  long long* num_recv;             // [1] rows received (may exceed out_rows: the excess is dropped)
  int* per_expert;                 // [L] entries per local expert (dropped rows too), or nullptr
  int* kept_per_expert;            // [L] entries per local expert of the kept rows, or nullptr
  int stage;                       // 0: wait for every source (one block); 1: lay out (every SM)
  long long* status;
  unsigned long long timeout_ns;
};

// Entries per local expert are counted in shared memory first (one global atomic per expert and block
// instead of one per entry) when the experts fit; else straight into global memory.
constexpr int kSharedExperts = 1024;

__device__ __forceinline__ void count_expert(int* shared_hist, int* global_hist, bool in_shared, int j) {
  if (in_shared) atomicAdd(shared_hist + j, 1);
  else atomicAdd(global_hist + j, 1);
}

// Two launches of one kernel: stage 0 (a single block) waits for every source's arrival word; stage 1, on
// every SM and stream-ordered after it, reads the same words again (they hold this operation until this
// member publishes that it finished reading it, in dispatch_rows, so the reads return at once) and lays
// the routing out. The spin holds one block instead of num_sms.
__device__ inline void dispatch_recv(const DispatchRecvArgs& a) {
  __shared__ long long counts[kMaxRanks];
  __shared__ long long starts[kMaxRanks + 1];
  __shared__ int hist[2][kSharedExperts];
  const unsigned long long op = current_op(a.my_sig, a.me);
  if (a.stage == 0) {
    // The counters stage 1 adds into start at zero here (stage 1 is the next launch on the stream), so the
    // caller allocates them without a fill.
    for (int j = threadIdx.x; j < a.num_local_experts; j += blockDim.x) {
      if (a.per_expert != nullptr) a.per_expert[j] = 0;
      if (a.kept_per_expert != nullptr) a.kept_per_expert[j] = 0;
    }
    gather_arrivals(a.my_sig, a.num_ranks, kDispatchArrived, 32, op, counts, starts, a.status,
                    kPhaseDispatchArrive, a.timeout_ns);
    return;
  }
  const bool in_shared = a.num_local_experts <= kSharedExperts;
  if (in_shared) {
    for (int j = threadIdx.x; j < a.num_local_experts; j += blockDim.x) hist[0][j] = hist[1][j] = 0;
  }
  // After stage 0 this waits for nothing; it returns false at once if stage 0 failed (status is set).
  const bool ok = gather_arrivals(a.my_sig, a.num_ranks, kDispatchArrived, 32, op, counts, starts, a.status,
                                  kPhaseDispatchArrive, a.timeout_ns);  // its __syncthreads order the zeros
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
          if (a.has_meta) {
            if (lane == 0) {
              a.recv_src_idx[p] = *reinterpret_cast<const int*>(meta);
              a.recv_src_rank[p] = s;
            }
            for (int k = lane; k < K; k += 32) {
              const int j = li[k];
              a.recv_topk_idx[p * K + k] = j;
              if (a.recv_topk_weights != nullptr) a.recv_topk_weights[p * K + k] = w[k];
              if (j >= 0 && a.kept_per_expert != nullptr) count_expert(hist[1], a.kept_per_expert, in_shared, j);
            }
          }
        }
        if (a.has_meta && a.per_expert != nullptr) {  // dropped rows count too, as their senders did
          for (int k = lane; k < K; k += 32)
            if (li[k] >= 0) count_expert(hist[0], a.per_expert, in_shared, li[k]);
        }
      } else {  // padding of a capacity-sized output: inert rows
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
  if (in_shared && (a.per_expert != nullptr || a.kept_per_expert != nullptr)) {
    __syncthreads();
    for (int j = threadIdx.x; j < a.num_local_experts; j += blockDim.x) {
      if (a.per_expert != nullptr && hist[0][j] != 0) atomicAdd(a.per_expert + j, hist[0][j]);
      if (a.kept_per_expert != nullptr && hist[1][j] != 0) atomicAdd(a.kept_per_expert + j, hist[1][j]);
    }
  }
  // dispatch_rows still reads the workspace: it publishes that this member finished the operation.
}

// The expanded maps from the kept rows' routing (one block per local expert j, grid-strided):
// offsets [L + 1], src_row / slot [M] (-1 on padding), index [N, K] (-1 where the slot is not local).
// kept_counts are dispatch_recv's kept_per_expert. Entries of expert j are ranked in flat (row, slot)
// order by a block-wide scan over every entry (16 consecutive entries a thread); the entries of other
// experts are skipped.
struct ExpandMapsArgs {
  const long long* recv_topk_idx;  // [N, K] local expert or -1
  const int* kept_counts;          // [L]
  long long num_entries;           // N * K
  long long out_rows;              // M
  int num_topk, num_local_experts, alignment;
  long long* offsets;              // [L + 1]
  long long* src_row;              // [M]
  long long* slot;                 // [M]
  long long* index;                // [N * K]
  const long long* status;
  int* counts;                     // expand_chunks: [C * L] entries per chunk and local expert
  long long chunk;                 // expand_chunks: entries per chunk (a multiple of the block)
  int stage;                       // expand_chunks: 0 count, 1 rank (expand_maps ignores it)
};

__device__ __forceinline__ long long round_up(long long v, int a) { return (v + a - 1) / a * a; }

// Sum over a block of one value per thread (every thread gets the result).
__device__ inline long long block_sum(long long v, long long* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[warp] = v;
  __syncthreads();
  long long total = 0;
  for (int w = 0; w < nwarps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

__device__ inline void expand_maps(const ExpandMapsArgs& a) {
  __shared__ long long scratch[kThreads / 32];
  __shared__ int warp_base[kThreads / 32 + 1];
  __shared__ bool ok;
  if (threadIdx.x == 0) ok = !failed(a.status);
  __syncthreads();
  if (!ok) return;
  const int L = a.num_local_experts, K = a.num_topk, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  // The end of every padded segment (the padding past it runs to M).
  long long all = 0;
  for (int j = threadIdx.x; j < L; j += blockDim.x) all += round_up(a.kept_counts[j], a.alignment);
  const long long end = block_sum(all, scratch);
  for (long long m = end + static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; m < a.out_rows;
       m += static_cast<long long>(gridDim.x) * blockDim.x) {
    a.src_row[m] = -1;
    a.slot[m] = -1;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) a.offsets[0] = 0;
  for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < a.num_entries;
       e += static_cast<long long>(gridDim.x) * blockDim.x)
    if (a.recv_topk_idx[e] < 0) a.index[e] = -1;
  constexpr int kPer = 16;
  const long long chunk = static_cast<long long>(blockDim.x) * kPer;
  for (int j = blockIdx.x; j < L; j += gridDim.x) {
    long long before = 0;
    for (int i = threadIdx.x; i < j; i += blockDim.x) before += round_up(a.kept_counts[i], a.alignment);
    const long long base = block_sum(before, scratch);
    const long long count = a.kept_counts[j];
    const long long seg_end = base + round_up(count, a.alignment);
    if (threadIdx.x == 0) a.offsets[j + 1] = seg_end;
    for (long long m = base + count + threadIdx.x; m < seg_end; m += blockDim.x) {
      a.src_row[m] = -1;
      a.slot[m] = -1;
    }
    long long found = 0;
    for (long long c0 = 0; c0 < a.num_entries && found < count; c0 += chunk) {
      // kPer consecutive entries per thread (threads in entry order), their hits scanned over the block
      const long long e0 = c0 + static_cast<long long>(threadIdx.x) * kPer;
      long long v[kPer];
      int mine = 0;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        v[i] = e0 + i < a.num_entries ? a.recv_topk_idx[e0 + i] : -2;
        mine += v[i] == j;
      }
      int incl = mine;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      if (lane == 31) warp_base[warp] = incl;
      scan_warp_counts(warp_base, nwarps);
      long long r = base + found + warp_base[warp] + incl - mine;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        if (v[i] != j) continue;
        const long long e = e0 + i;
        a.index[e] = r;
        a.src_row[r] = e / K;
        a.slot[r] = e % K;
        ++r;
      }
      found += warp_base[nwarps];
      __syncthreads();  // warp_base is rewritten by the next chunk
    }
  }
}

// Exclusive prefix sum over a block of one value per thread; *total gets the block's sum (every thread).
__device__ inline long long block_exclusive_scan(long long v, long long* scratch, long long* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  long long incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const long long y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (threadIdx.x == 0) {
    long long acc = 0;
    for (int w = 0; w < nwarps; ++w) {
      const long long n = scratch[w];
      scratch[w] = acc;
      acc += n;
    }
    scratch[nwarps] = acc;
  }
  __syncthreads();
  const long long ex = scratch[warp] + incl - v;
  *total = scratch[nwarps];
  __syncthreads();  // scratch is rewritten by the next call
  return ex;
}

// The expanded maps (expand_maps' result) in two launches over C chunks of `chunk` consecutive entries, one
// block each, for up to kSharedExperts local experts: expand_maps scanned every entry once per expert. Stage 0
// counts each chunk's entries per local expert into counts[c * L + j] and marks the entries that are not local
// (index -1). Stage 1 (stream-ordered after it) starts expert j's ranks in chunk c where its segment starts
// plus its entries in chunks before c, and ranks the chunk's entries in entry order: the warps of a
// block-wide step one after another, the lanes of a warp holding the same expert by __match_any_sync, so the
// ranks are expand_maps' (expert, then row, then slot). Stage 1 also writes the offsets, the alignment
// padding (expert j by block j mod C) and the capacity padding past the last segment (every block).
__device__ inline void expand_chunks(const ExpandMapsArgs& a) {
  __shared__ int hist[kSharedExperts];  // stage 0: the chunk's entries per expert; stage 1: ranks given so far
  __shared__ int prior[kSharedExperts];  // stage 1: a lane group's rank before it, from its leader
  __shared__ long long base[kSharedExperts];
  __shared__ long long scratch[kThreads / 32 + 1];
  __shared__ bool ok;
  if (threadIdx.x == 0) ok = !failed(a.status);
  const int L = a.num_local_experts, K = a.num_topk;
  for (int j = threadIdx.x; j < L; j += blockDim.x) hist[j] = 0;
  __syncthreads();
  if (!ok) return;
  const long long c = blockIdx.x;
  const long long e_begin = c * a.chunk, e_end = min(a.num_entries, e_begin + a.chunk);
  if (a.stage == 0) {
    for (long long e = e_begin + threadIdx.x; e < e_end; e += blockDim.x) {
      const long long v = a.recv_topk_idx[e];
      if (v < 0) a.index[e] = -1;
      else atomicAdd(hist + v, 1);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < L; j += blockDim.x) a.counts[c * L + j] = hist[j];
    return;
  }
  // Where every expert's segment starts: the aligned counts of the experts before it (`per` each thread).
  const int per = (L + blockDim.x - 1) / blockDim.x;
  const int j0 = threadIdx.x * per, j1 = min(L, j0 + per);
  long long mine = 0;
  for (int j = j0; j < j1; ++j) mine += round_up(a.kept_counts[j], a.alignment);
  long long end;
  long long at = block_exclusive_scan(mine, scratch, &end);
  for (int j = j0; j < j1; ++j) {
    base[j] = at;
    at += round_up(a.kept_counts[j], a.alignment);
  }
  __syncthreads();
  if (c == 0) {
    if (threadIdx.x == 0) a.offsets[0] = 0;
    for (int j = threadIdx.x; j < L; j += blockDim.x)
      a.offsets[j + 1] = base[j] + round_up(a.kept_counts[j], a.alignment);
  }
  for (long long j = c; j < L; j += gridDim.x) {
    const long long from = base[j] + a.kept_counts[j], to = base[j] + round_up(a.kept_counts[j], a.alignment);
    for (long long m = from + threadIdx.x; m < to; m += blockDim.x) {
      a.src_row[m] = -1;
      a.slot[m] = -1;
    }
  }
  for (long long m = end + c * blockDim.x + threadIdx.x; m < a.out_rows;
       m += static_cast<long long>(gridDim.x) * blockDim.x) {
    a.src_row[m] = -1;
    a.slot[m] = -1;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < L; j += blockDim.x) {
    long long before = 0;
    for (long long q = 0; q < c; ++q) before += a.counts[q * L + j];
    base[j] += before;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const unsigned below = (1u << lane) - 1u;
  for (long long s0 = e_begin; s0 < e_end; s0 += blockDim.x) {
    const long long e = s0 + threadIdx.x;
    const int v = e < e_end ? static_cast<int>(a.recv_topk_idx[e]) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, v);
    for (int w = 0; w < nwarps; ++w) {
      if (warp == w && v >= 0) {
        if (lane == __ffs(peers) - 1) {
          prior[v] = hist[v];
          hist[v] += __popc(peers);
        }
        __syncwarp(peers);
        const long long r = base[v] + prior[v] + __popc(peers & below);
        a.index[e] = r;
        a.src_row[r] = e / K;
        a.slot[r] = e % K;
      }
      __syncthreads();  // the next warp reads the ranks this one gave
    }
  }
}

// The rows out of the workspace: out[m] = received row n (read from the workspace, or from x for this
// member's own rows); n = src_row[m] for the expanded layout (-1: an alignment padding row, zeroed), else
// n = m (compact, source-major). Rows past the last one in use (the rows received, or *rows_end of the
// expanded layout) are capacity padding of a sync-free output and are not written: zeroing them moved
// most of the bytes (a sync-free expanded output holds num_worst_tokens * K rows). Then publish that this
// member finished reading the operation.
struct DispatchRowsArgs {
  const uint8_t* x;
  const uint8_t* ws;
  long long* my_sig;
  long long region_bytes, row_stride, meta_offset, x_bytes;
  const long long* recv_starts;  // [W + 1] of dispatch_recv
  const long long* src_row;      // [M], or nullptr for the compact layout
  const long long* rows_end;     // expanded: [1] rows in use (expert_offsets[L]); nullptr: all M
  long long out_rows;            // M
  int num_ranks, me;
  uint8_t* out;                  // [M, x_bytes]
  unsigned int* done;
  long long* status;
  const long long* index;  // expanded: [N, K] expanded row of each (received row, slot) or -1; else nullptr
  long long index_rows;    // N
  int num_topk;            // K
  const long long* peer_ws;  // [W] every member's workspace (pulled rows)
  const long long* src_idx;  // [N] source token index of each received row (pulled rows)
  int pull;                  // 1: other members' rows are read from their own regions (dispatch_send's pull)
};

// The batches of 16-byte loads of one row (n16 of them, from lane's index i), each issued once and stored at
// offset i of every expanded row index[k] below used: a row routed to several local experts is read once.
template <int U>
__device__ __forceinline__ long long store_each_batches(const int4* __restrict__ s, long long i, long long n16,
                                                        uint8_t* out, long long x_bytes, const long long* index,
                                                        int num_topk, long long used) {
  for (; i + 32 * (U - 1) < n16; i += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldg(s + i + 32 * u);
    for (int k = 0; k < num_topk; ++k) {
      const long long e = index[k];
      if (e < 0 || e >= used) continue;
      int4* d = reinterpret_cast<int4*>(out + e * x_bytes);
#pragma unroll
      for (int u = 0; u < U; ++u) d[i + 32 * u] = v[u];
    }
  }
  return i;
}

// One received row (src) into each of its expanded rows (index[0, K), those below used) with one warp.
__device__ __forceinline__ void copy_to_expanded(const uint8_t* src, uint8_t* out, long long x_bytes,
                                                 const long long* index, int num_topk, long long used, int lane) {
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(out) | static_cast<uintptr_t>(x_bytes)) &
       15u) != 0) {
    for (int k = 0; k < num_topk; ++k) {
      const long long e = index[k];
      if (e >= 0 && e < used) warp_copy(out + e * x_bytes, src, x_bytes, lane);
    }
    return;
  }
  const int4* s = reinterpret_cast<const int4*>(src);
  const long long n16 = x_bytes >> 4;
  long long i = store_each_batches<8>(s, lane, n16, out, x_bytes, index, num_topk, used);
  i = store_each_batches<4>(s, i, n16, out, x_bytes, index, num_topk, used);
  store_each_batches<1>(s, i, n16, out, x_bytes, index, num_topk, used);
}

// Where received row n's bytes are: its source's region row (pushed), the row its source staged in its own
// region (pulled), or, for this member's own tokens (whose region row holds only the routing), that token's
// row of x.
__device__ __forceinline__ const uint8_t* received_row(const DispatchRowsArgs& a, const long long* starts, long long n) {
  const int s = source_of(starts, a.num_ranks, n);
  if (a.pull && s != a.me)
    return reinterpret_cast<const uint8_t*>(a.peer_ws[s]) + s * a.region_bytes + a.src_idx[n] * a.row_stride;
  const uint8_t* row = a.ws + s * a.region_bytes + (n - starts[s]) * a.row_stride;
  return s != a.me ? row : a.x + static_cast<long long>(*reinterpret_cast<const int*>(row + a.meta_offset)) * a.x_bytes;
}

__device__ inline void dispatch_rows(const DispatchRowsArgs& a) {
  __shared__ long long starts[kMaxRanks + 1];
  const unsigned long long op = current_op(a.my_sig, a.me);
  __shared__ bool ok;
  if (threadIdx.x == 0) ok = !failed(a.status);  // dispatch_recv failed: nothing arrived to copy
  for (int s = threadIdx.x; s <= a.num_ranks; s += blockDim.x) starts[s] = a.recv_starts[s];
  __syncthreads();
  if (ok) {
    const int lane = threadIdx.x & 31;
    const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const long long warps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
    const long long total = starts[a.num_ranks];
    const long long used = a.src_row == nullptr ? min(total, a.out_rows)
                           : a.rows_end != nullptr ? min(*a.rows_end, a.out_rows) : a.out_rows;
    if (a.index != nullptr) {
      // Expanded with the row -> expanded rows map: each received row is read once (a row routed to k local
      // experts was read k times through src_row), then the alignment padding rows are zeroed.
      const long long kept = min(total, a.index_rows);
      for (long long n = warp; n < kept; n += warps)
        copy_to_expanded(received_row(a, starts, n), a.out, a.x_bytes, a.index + n * a.num_topk, a.num_topk, used,
                         lane);
      for (long long m = warp; m < used; m += warps)
        if (a.src_row[m] < 0) warp_zero(a.out + m * a.x_bytes, a.x_bytes, lane);
    } else {
      for (long long m = warp; m < used; m += warps) {
        const long long n = a.src_row != nullptr ? a.src_row[m] : m;
        uint8_t* dst = a.out + m * a.x_bytes;
        if (n < 0) warp_zero(dst, a.x_bytes, lane);
        else warp_copy(dst, received_row(a, starts, n), a.x_bytes, lane);
      }
    }
  }
  finish_receive(a.done, a.my_sig, a.me, op, a.status);
}

}  // namespace lck_ep
