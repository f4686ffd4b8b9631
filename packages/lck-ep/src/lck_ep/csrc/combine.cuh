// lck-ep: native combine over peer views of the symmetric workspace (scale-up: one host).
//
// combine_send (every member, as the host of experts): the partial row of each received row goes back to
// its source, into the source's region for this member at the row the source sent it from (received row
// p of source s is row p - starts[s] there). Rows a capacity-sized dispatch dropped go back as zeros, as
// the reference backend sends them. Then the last block publishes the operation to every member.
// combine_recv (every member, as a source): for each token, a float32 sum from +0.0 over the members it
// went to, in ascending order, then the biases, rounded once to the output type: the reference backend's
// order, so the results agree bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ep_native.cuh"

namespace lck_ep {

struct CombineSendArgs {
  const uint8_t* partial;       // [valid_rows, row_bytes]
  long long row_bytes, valid_rows;
  const long long* recv_counts;  // [W] rows received from each source by the dispatch
  const long long* recv_starts;  // [W + 1]
  const long long* peer_ws;
  const long long* peer_sig;
  long long region_bytes, row_stride;
  int num_ranks, me;
  unsigned int* done;
  long long* status;
  unsigned long long timeout_ns;
};

// combine_send's frame, shared with combine_send_expanded: wait until every member freed this member's region,
// hand each received row p (source s) to send_row(p, row) with row its place in s's region for this member
// (nullptr for this member's own rows, which only own_rows includes), then publish the operation.
template <typename SendRow>
__device__ inline void send_partial_rows(const CombineSendArgs& a, bool own_rows, SendRow send_row) {
  __shared__ long long starts[kMaxRanks + 1];
  const long long* const* peer_sig = reinterpret_cast<const long long* const*>(a.peer_sig);
  const unsigned long long op = current_op(peer_sig[a.me], a.me);
  for (int s = threadIdx.x; s <= a.num_ranks; s += blockDim.x) starts[s] = a.recv_starts[s];
  const bool ok = wait_peers_free(peer_sig, a.num_ranks, op, a.status, kPhaseCombineFree, a.timeout_ns);
  if (ok) {
    const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const long long warps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
    const long long total = starts[a.num_ranks];
    for (long long p = warp; p < total; p += warps) {
      const int s = source_of(starts, a.num_ranks, p);
      if (s == a.me) {
        if (own_rows) send_row(p, static_cast<uint8_t*>(nullptr));
        continue;
      }
      send_row(p, reinterpret_cast<uint8_t*>(a.peer_ws[s]) + a.me * a.region_bytes + (p - starts[s]) * a.row_stride);
    }
  }
  finish_grid(a.done, [&] {
    if (failed(a.status)) return;
    for (int s = threadIdx.x; s < a.num_ranks; s += blockDim.x) arrive_combine(peer_sig[s], a.me, op, false);
  });
}

__device__ inline void combine_send(const CombineSendArgs& a) {
  const int lane = threadIdx.x & 31;
  // this member's own partials are read in place by combine_recv
  send_partial_rows(a, false, [&](long long p, uint8_t* row) {
    if (p < a.valid_rows) warp_copy(row, a.partial + p * a.row_bytes, a.row_bytes, lane);
    else warp_zero(row, a.row_bytes, lane);
  });
}

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }

struct CombineRecvArgs {
  const uint8_t* partial;       // this member's own partial rows (those of its tokens it hosts itself)
  long long valid_rows;         // rows of partial (a capacity-sized dispatch may have dropped the rest)
  const long long* recv_starts;  // [W + 1] of the dispatch: where this member's own rows start
  const uint8_t* ws;
  long long* my_sig;
  long long region_bytes, row_stride;
  const bool* mask;            // [T, W]
  const long long* send_slot;  // [T, W]
  const void* bias0;           // [T, H] or nullptr
  const void* bias1;
  void* out;                   // [T, H]
  int num_tokens, hidden, num_ranks, me;
  int stage;                   // 0: wait for every member's partials (one block); 1: sum them and publish
  unsigned int* done;
  long long* status;
  unsigned long long timeout_ns;
  const long long* peer_ws;    // [W] every member's workspace as mapped here
  const long long* peer_sig;   // [W] every member's signal words as mapped here
  long long table_offset;      // where a zero-copy combine's table sits in every workspace
  int pull;                    // 1: a zero-copy combine (read the members' rows where they wrote them);
                               // 2: the same of an expanded handle (expanded rows, read with their maps)
  long long index_offset;      // pull 2: where every member's [N, K] int32 expanded index sits in its workspace
  long long weights_offset;    // pull 2: and its [N, K] float32 routing weights (when weighted)
  int num_topk, weighted;      // pull 2: K, and whether each expanded row is multiplied by its slot's weight
};

// A zero-copy combine's publication, by the receiver's waiting block before it waits: write where each
// source's rows start in this member's partial rows (its workspace) and how many are present (a
// capacity-sized dispatch may have dropped some), then tell every source that they are in place. The
// rows were written by earlier work on the stream, after Buffer.combine_input's wait (ep_combine_zero_copy).
__device__ inline void publish_in_place(const CombineRecvArgs& a, unsigned long long op) {
  if (failed(a.status)) return;
  long long* table = reinterpret_cast<long long*>(const_cast<uint8_t*>(a.ws) + a.table_offset);
  for (int s = threadIdx.x; s < a.num_ranks; s += blockDim.x) {
    const long long start = a.recv_starts[s];
    const long long present = min(max(a.valid_rows - start, 0ll), a.recv_starts[s + 1] - start);
    table[s] = static_cast<long long>((static_cast<unsigned long long>(start) << 32) |
                                      static_cast<unsigned long long>(present));
  }
  __threadfence_system();
  __syncthreads();
  const long long* const* peer_sig = reinterpret_cast<const long long* const*>(a.peer_sig);
  for (int s = threadIdx.x; s < a.num_ranks; s += blockDim.x) arrive_combine(peer_sig[s], a.me, op, true);
}

// kVec consecutive elements of a row: one 16-byte access for 8 two-byte elements (the caller checked the
// alignment), else element by element. Stores of 8 separate 2-byte elements would take 8 store
// instructions, each touching 16 sectors for 64 useful bytes.
template <typename T, int kVec>
__device__ __forceinline__ void load_group(T (&dst)[kVec], const T* src) {
  if (src == nullptr) return;
  if constexpr (kVec == 8 && sizeof(T) == 2) {
    *reinterpret_cast<int4*>(dst) = *reinterpret_cast<const int4*>(src);
  } else {
#pragma unroll
    for (int v = 0; v < kVec; ++v) dst[v] = src[v];
  }
}

template <typename T, int kVec>
__device__ __forceinline__ void store_group(T* dst, const T (&src)[kVec]) {
  if constexpr (kVec == 8 && sizeof(T) == 2) {
    *reinterpret_cast<int4*>(dst) = *reinterpret_cast<const int4*>(src);
  } else {
#pragma unroll
    for (int v = 0; v < kVec; ++v) dst[v] = src[v];
  }
}

// One element pass's float32 sums (kSpan groups of kVec elements, the first at h0, 32 * kVec apart) plus the
// biases in that order, each rounded once to T and stored: how sum_rows and reduce_token_expanded finish.
template <typename T, int kVec, int kSpan>
__device__ __forceinline__ void store_sums(const float (&acc)[kSpan][kVec], const T* b0, const T* b1, T* out,
                                           int h0, int hidden) {
#pragma unroll
  for (int u = 0; u < kSpan; ++u) {
    const int h = h0 + u * 32 * kVec;
    if (h >= hidden) break;
    alignas(16) T bias[2][kVec];
    load_group<T, kVec>(bias[0], b0 != nullptr ? b0 + h : nullptr);
    load_group<T, kVec>(bias[1], b1 != nullptr ? b1 + h : nullptr);
    alignas(16) T res[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      float r = acc[u][v];
      if (b0 != nullptr) r = __fadd_rn(r, to_float(bias[0][v]));
      if (b1 != nullptr) r = __fadd_rn(r, to_float(bias[1][v]));
      res[v] = from_float<T>(r);
    }
    store_group<T, kVec>(out + h, res);
  }
}

// The sum of the rows a warp's lanes hold, in ascending lane order over the lanes whose row is set: out[h] =
// (((+0 + f(r_a[h])) + f(r_b[h])) + ...) [+ b0[h]] [+ b1[h]], in float32 with one rounding per multiply and per
// add (no fused multiply-add), rounded once to T; f(v) = v * w of the row's lane when weighted, else v. Rows
// come from item(i, row, w) for i in [0, count), 32 at a time (lane i % 32 asks for item i; a null row is
// skipped); the first 32 are asked for once for the whole row. kVec consecutive elements per lane (16-byte
// accesses when 8), kSpan such groups per lane at once, and up to kGroup rows loaded for every group before
// any is added: kGroup * kSpan loads in flight per lane, whichever lanes the rows are on (two set slots of
// eight load in one round trip). The grouping only changes when loads are issued, not the order of the sums.
template <typename T, int kVec, int kSpan, int kGroup, bool kWeighted, typename Item>
__device__ inline void sum_rows(int count, Item item, const T* b0, const T* b1, T* out, int hidden, int lane) {
  const T* first_row = nullptr;
  float first_w = 1.0f;
  if (lane < count) item(lane, first_row, first_w);
  const unsigned first_set = __ballot_sync(0xffffffffu, first_row != nullptr);
  // Every lane runs every iteration (the loop bounds are the warp's, the lane's elements are guarded): the
  // shuffles inside need the whole warp.
  for (int base = 0; base < hidden; base += 32 * kVec * kSpan) {
    const int h0 = base + lane * kVec;
    float acc[kSpan][kVec];
#pragma unroll
    for (int u = 0; u < kSpan; ++u)
#pragma unroll
      for (int v = 0; v < kVec; ++v) acc[u][v] = 0.0f;
    for (int c0 = 0; c0 < count; c0 += 32) {
      const T* my_row = first_row;
      float my_w = first_w;
      unsigned rest = first_set;
      if (c0 > 0) {
        my_row = nullptr;
        my_w = 1.0f;
        if (c0 + lane < count) item(c0 + lane, my_row, my_w);
        rest = __ballot_sync(0xffffffffu, my_row != nullptr);
      }
      while (rest != 0u) {  // uniform: a ballot
        const T* rows[kGroup];
        float ws[kGroup];  // the rows' weights (kWeighted)
#pragma unroll
        for (int j = 0; j < kGroup; ++j) {
          const int src = rest != 0u ? __ffs(rest) - 1 : 0;
          const unsigned long long r = __shfl_sync(
              0xffffffffu, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(my_row)), src);
          if constexpr (kWeighted) ws[j] = __shfl_sync(0xffffffffu, my_w, src);
          rows[j] = rest != 0u ? reinterpret_cast<const T*>(static_cast<uintptr_t>(r)) : nullptr;
          rest &= rest - 1u;
        }
        T vals[kGroup][kSpan][kVec];
#pragma unroll
        for (int j = 0; j < kGroup; ++j) {
          if (rows[j] == nullptr) continue;
#pragma unroll
          for (int u = 0; u < kSpan; ++u) {
            const int h = h0 + u * 32 * kVec;
            if (h >= hidden) break;
            if constexpr (kVec == 8) {
              *reinterpret_cast<int4*>(vals[j][u]) = *reinterpret_cast<const int4*>(rows[j] + h);
            } else {
              vals[j][u][0] = rows[j][h];
            }
          }
        }
#pragma unroll
        for (int j = 0; j < kGroup; ++j) {
          if (rows[j] == nullptr) continue;
#pragma unroll
          for (int u = 0; u < kSpan; ++u) {
            if (h0 + u * 32 * kVec >= hidden) break;
#pragma unroll
            for (int v = 0; v < kVec; ++v) {
              float f = to_float(vals[j][u][v]);
              if constexpr (kWeighted) f = __fmul_rn(f, ws[j]);
              acc[u][v] = __fadd_rn(acc[u][v], f);
            }
          }
        }
      }
    }
    store_sums<T, kVec, kSpan>(acc, b0, b1, out, h0, hidden);
  }
}

// Token t's output: its partials summed over the members it went to, in ascending member order, then the
// biases (one warp per token). A member's partial is its row in that member's region, or for this member
// itself its row of partial (a row the dispatch dropped comes back as zeros: it adds nothing).
// pulled (a zero-copy combine, else nullptr): member d's table entry for this member, (first row << 32) | rows
// present; a slot at or past the rows present was dropped by a capacity-sized dispatch and adds nothing,
// as the zeros a pushed combine sends for it (the sum starts from +0.0, which +0.0 leaves alone).
template <typename T, int kVec, int kSpan, int kGroup>
__device__ inline void reduce_token(const CombineRecvArgs& a, long long t, int lane, long long self_start,
                                    const long long* pulled) {
  const bool* mask = a.mask + t * a.num_ranks;
  const long long* slot = a.send_slot + t * a.num_ranks;
  auto member = [&](int d, const T*& row, float&) {
    if (!mask[d]) return;
    if (d != a.me && pulled != nullptr) {
      const unsigned long long e = static_cast<unsigned long long>(pulled[d]);
      if (slot[d] < static_cast<long long>(e & 0xffffffffull))
        row = reinterpret_cast<const T*>(a.peer_ws[d]) + (static_cast<long long>(e >> 32) + slot[d]) * a.hidden;
    } else if (d != a.me) {
      row = reinterpret_cast<const T*>(a.ws + d * a.region_bytes + slot[d] * a.row_stride);
    } else {
      const long long p = self_start + slot[d];
      if (p < a.valid_rows) row = reinterpret_cast<const T*>(a.partial) + p * a.hidden;
    }
  };
  const T* b0 = a.bias0 != nullptr ? static_cast<const T*>(a.bias0) + t * a.hidden : nullptr;
  const T* b1 = a.bias1 != nullptr ? static_cast<const T*>(a.bias1) + t * a.hidden : nullptr;
  sum_rows<T, kVec, kSpan, kGroup, false>(a.num_ranks, member, b0, b1, static_cast<T*>(a.out) + t * a.hidden,
                                          a.hidden, lane);
}

// Token t's output from a zero-copy combine of an expanded handle (pull 2): every member it went to (ascending)
// holds, at the start of its workspace, the expanded rows its experts wrote, and after them its expanded index
// and routing weights per received row (Buffer.combine_input, _native_exchange.combine). Member d's partial is
// the float32 sum from +0.0, over the slots of the token's row there in ascending order whose index is set, of
// [w *] row, rounded once to T (lck_ep.expanded.reduce_expanded's order); the output sums the partials from
// +0.0 in member order, then the biases, rounded once: the bits of the reduce-then-push combine. The token's
// expanded rows (at most K <= 32, one per slot) are listed first, lane j holding the j-th in (member, slot)
// order and bit j of `ends` marking the last of a member's, so that every element pass reads the list by
// shuffles; up to kGroup rows load before any is added.
template <typename T, int kVec, int kSpan, int kGroup>
__device__ inline void reduce_token_expanded(const CombineRecvArgs& a, long long t, int lane,
                                             const long long* pulled) {
  const bool* mask = a.mask + t * a.num_ranks;
  const long long* slot = a.send_slot + t * a.num_ranks;
  const T* item_row = nullptr;
  float item_w = 1.0f;
  int count = 0;
  unsigned ends = 0u;
  for (int d = 0; d < a.num_ranks; ++d) {  // uniform: every lane reads the same words
    if (!mask[d]) continue;
    const unsigned long long e = static_cast<unsigned long long>(pulled[d]);
    if (slot[d] >= static_cast<long long>(e & 0xffffffffull)) continue;  // dropped: adds nothing
    const long long p = static_cast<long long>(e >> 32) + slot[d];
    const uint8_t* base = reinterpret_cast<const uint8_t*>(a.peer_ws[d]);
    long long row = -1;
    float w = 1.0f;
    if (lane < a.num_topk) {
      row = reinterpret_cast<const int*>(base + a.index_offset)[p * a.num_topk + lane];
      if (a.weighted) w = reinterpret_cast<const float*>(base + a.weights_offset)[p * a.num_topk + lane];
    }
    const T* mine = row >= 0 ? reinterpret_cast<const T*>(base) + row * a.hidden : nullptr;
    unsigned rest = __ballot_sync(0xffffffffu, mine != nullptr);
    if (rest == 0u) continue;
    while (rest != 0u) {  // uniform: a ballot
      const int src = __ffs(rest) - 1;
      rest &= rest - 1u;
      const unsigned long long r =
          __shfl_sync(0xffffffffu, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(mine)), src);
      const float ws = __shfl_sync(0xffffffffu, w, src);
      if (lane == count) {
        item_row = reinterpret_cast<const T*>(static_cast<uintptr_t>(r));
        item_w = ws;
      }
      ++count;
    }
    ends |= 1u << (count - 1);
  }
  T* out = static_cast<T*>(a.out) + t * a.hidden;
  const T* b0 = a.bias0 != nullptr ? static_cast<const T*>(a.bias0) + t * a.hidden : nullptr;
  const T* b1 = a.bias1 != nullptr ? static_cast<const T*>(a.bias1) + t * a.hidden : nullptr;
  for (int base = 0; base < a.hidden; base += 32 * kVec * kSpan) {
    const int h0 = base + lane * kVec;
    float acc[kSpan][kVec], part[kSpan][kVec];
#pragma unroll
    for (int u = 0; u < kSpan; ++u)
#pragma unroll
      for (int v = 0; v < kVec; ++v) acc[u][v] = part[u][v] = 0.0f;
    for (int j0 = 0; j0 < count; j0 += kGroup) {  // uniform
      T vals[kGroup][kSpan][kVec];
      float ws[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const int j = j0 + g < count ? j0 + g : 0;  // every lane shuffles; past the list nothing is loaded
        const unsigned long long r =
            __shfl_sync(0xffffffffu, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(item_row)), j);
        ws[g] = __shfl_sync(0xffffffffu, item_w, j);
        if (j0 + g >= count) continue;
        const T* row = reinterpret_cast<const T*>(static_cast<uintptr_t>(r));
#pragma unroll
        for (int u = 0; u < kSpan; ++u) {
          const int h = h0 + u * 32 * kVec;
          if (h >= a.hidden) break;
          if constexpr (kVec == 8) {
            *reinterpret_cast<int4*>(vals[g][u]) = *reinterpret_cast<const int4*>(row + h);
          } else {
            vals[g][u][0] = row[h];
          }
        }
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (j0 + g >= count) break;
        const bool last = (ends >> (j0 + g)) & 1u;
#pragma unroll
        for (int u = 0; u < kSpan; ++u) {
          if (h0 + u * 32 * kVec >= a.hidden) break;
#pragma unroll
          for (int v = 0; v < kVec; ++v) {
            float f = to_float(vals[g][u][v]);
            if (a.weighted) f = __fmul_rn(f, ws[g]);
            part[u][v] = __fadd_rn(part[u][v], f);
            if (last) {
              acc[u][v] = __fadd_rn(acc[u][v], to_float(from_float<T>(part[u][v])));
              part[u][v] = 0.0f;
            }
          }
        }
      }
    }
    store_sums<T, kVec, kSpan>(acc, b0, b1, out, h0, a.hidden);
  }
}

// Two launches of one kernel: stage 0 (a single block) waits for every member's partials; stage 1, on
// every SM (it waits for nothing, the stream orders it after stage 0), sums them and publishes that this
// member finished reading the operation. So the spinning stays on one block and the sum, all local
// reads, takes the whole GPU.
template <typename T>
__device__ inline void combine_recv(const CombineRecvArgs& a) {
  __shared__ long long pulled[kMaxRanks];  // a zero-copy combine's table entries for this member
  __shared__ bool ok;
  const unsigned long long op = current_op(a.my_sig, a.me);
  if (a.stage == 0) {
    if (a.pull) publish_in_place(a, op);
    wait_each_member(a.num_ranks, a.status, [&](int s) {
      const unsigned long long* w =
          reinterpret_cast<const unsigned long long*>(a.my_sig + s * kSignalWords + kCombineArrived);
      const unsigned long long v = wait_for(w, 1, op, true, a.status, kPhaseCombineArrive, s, a.timeout_ns);
      if (v == ~0ull) return false;
      if ((v & 1ull) != static_cast<unsigned long long>(a.pull != 0)) {
        report(a.status, 4, kPhaseCombineArrive, s, v & 1ull, a.pull != 0, 0);
        return false;
      }
      return true;
    });
    return;
  }
  if (threadIdx.x == 0) ok = !failed(a.status);  // stage 0 failed: the partials are not all there
  if (a.pull) {
    for (int s = threadIdx.x; s < a.num_ranks; s += blockDim.x) {
      if (s == a.me && a.pull == 1) continue;  // a compact one reads its own rows from partial
      const uint8_t* table = reinterpret_cast<const uint8_t*>(a.peer_ws[s]) + a.table_offset;
      pulled[s] = *reinterpret_cast<const volatile long long*>(table + a.me * sizeof(long long));
    }
  }
  __syncthreads();
  if (ok) {
    const int lane = threadIdx.x & 31;
    const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const long long warps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
    // 16-byte lanes need a row length that keeps every row (workspace and output) 16-byte aligned.
    // float32 partials (narrow rows, e.g. routing-weight gradients) take the scalar path.
    const bool vec = sizeof(T) == 2 && (a.hidden % 8) == 0 && (a.row_stride % 16) == 0 &&
                     ((reinterpret_cast<uintptr_t>(a.out) | reinterpret_cast<uintptr_t>(a.partial) |
                       reinterpret_cast<uintptr_t>(a.bias0) | reinterpret_cast<uintptr_t>(a.bias1)) % 16) == 0;
    const long long self_start = a.recv_starts[a.me];
    const long long* from = a.pull ? pulled : nullptr;
    for (long long t = warp; t < a.num_tokens; t += warps) {
      if (a.pull == 2) {
        if constexpr (sizeof(T) == 2) {
          if (vec) reduce_token_expanded<T, 8, 2, 4>(a, t, lane, pulled);
          else reduce_token_expanded<T, 1, 4, 4>(a, t, lane, pulled);
        } else {
          reduce_token_expanded<T, 1, 4, 4>(a, t, lane, pulled);
        }
        continue;
      }
      if constexpr (sizeof(T) == 2) {
        if (vec) reduce_token<T, 8, 2, 4>(a, t, lane, self_start, from);
        else reduce_token<T, 1, 4, 4>(a, t, lane, self_start, from);
      } else {
        reduce_token<T, 1, 4, 4>(a, t, lane, self_start, from);
      }
    }
  }
  finish_receive(a.done, a.my_sig, a.me, op, a.status);
}

// Buffer.combine_input's wait, one block: until every member finished reading the last operation (a source's
// staged rows, a destination's routing), so that the expert outputs may overwrite this member's workspace.
__device__ inline void combine_zero_copy_wait(const long long* const* peer_sig, int num_ranks, int me,
                                              long long* status, unsigned long long timeout_ns) {
  const unsigned long long op = current_op(peer_sig[me], me);
  wait_peers_free(peer_sig, num_ranks, op, status, kPhaseCombineFree, timeout_ns);
}

}  // namespace lck_ep

namespace lck_ep {

// combine of an expanded handle, on the host of the experts: partial[n] = sum over k ascending of
// [w[n, k] *] x[index[n, k]] over the local slots, in float32 from +0.0 (one rounding per multiply and per
// add, no fused multiply-add), rounded once to T: lck_ep.expanded.reduce_expanded's order, bit for bit.
struct ReduceExpandedArgs {
  const void* x;           // [M, H]
  const long long* index;  // [N, K] expanded row or -1
  const float* weights;    // [N, K] or nullptr
  void* partial;           // [N, H]
  long long num_rows;      // N
  const long long* rows_used;  // [1] rows received (a sync-free handle's count), or nullptr: all N
  int num_topk, hidden;
};

template <typename T, int kVec, int kSpan, int kGroup>
__device__ inline void reduce_expanded_row(const ReduceExpandedArgs& a, long long n, T* out, int lane) {
  const T* x = static_cast<const T*>(a.x);
  const long long* index = a.index + n * a.num_topk;
  const float* weights = a.weights != nullptr ? a.weights + n * a.num_topk : nullptr;
  auto slot = [&](int k, const T*& row, float& w) {
    const long long e = index[k];
    if (e < 0) return;
    row = x + e * a.hidden;
    if (weights != nullptr) w = weights[k];
  };
  if (weights != nullptr)
    sum_rows<T, kVec, kSpan, kGroup, true>(a.num_topk, slot, nullptr, nullptr, out, a.hidden, lane);
  else
    sum_rows<T, kVec, kSpan, kGroup, false>(a.num_topk, slot, nullptr, nullptr, out, a.hidden, lane);
}

// Row n of reduce_expanded into out: 16-byte lanes where the rows allow them (vec) and out is aligned.
template <typename T>
__device__ __forceinline__ void reduce_expanded_to(const ReduceExpandedArgs& a, long long n, T* out, bool vec,
                                                   int lane) {
  if constexpr (sizeof(T) == 2) {
    if (vec && (reinterpret_cast<uintptr_t>(out) % 16) == 0) reduce_expanded_row<T, 8, 4, 2>(a, n, out, lane);
    else reduce_expanded_row<T, 1, 4, 2>(a, n, out, lane);
  } else {
    reduce_expanded_row<T, 1, 4, 2>(a, n, out, lane);
  }
}

template <typename T>
__device__ __forceinline__ bool reduce_expanded_vec(const ReduceExpandedArgs& a) {
  return sizeof(T) == 2 && (a.hidden % 8) == 0 && (reinterpret_cast<uintptr_t>(a.x) % 16) == 0;
}

template <typename T>
__device__ inline void reduce_expanded(const ReduceExpandedArgs& a) {
  const int lane = threadIdx.x & 31;
  const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const long long warps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
  const bool vec = reduce_expanded_vec<T>(a);
  // A sync-free handle's rows past the received count are capacity padding that combine never reads.
  const long long rows = a.rows_used != nullptr ? min(*a.rows_used, a.num_rows) : a.num_rows;
  for (long long n = warp; n < rows; n += warps)
    reduce_expanded_to<T>(a, n, static_cast<T*>(a.partial) + n * a.hidden, vec, lane);
}

// The combine of an expanded handle in one kernel: combine_send whose rows are reduce_expanded's, each reduced
// straight into its place in the source's region (this member's own rows into r.partial, where combine_recv
// reads them), so the reduced rows are not written out and read back before they are sent. The same sums and
// rounding as the two kernels, bit for bit. Received rows a capacity-sized dispatch dropped (p at or past
// s.valid_rows) go back as zeros.
template <typename T>
__device__ inline void combine_send_expanded(const CombineSendArgs& s, const ReduceExpandedArgs& r) {
  const int lane = threadIdx.x & 31;
  const bool vec = reduce_expanded_vec<T>(r);
  send_partial_rows(s, true, [&](long long p, uint8_t* row) {
    if (p < s.valid_rows) {
      T* out = row != nullptr ? reinterpret_cast<T*>(row) : static_cast<T*>(r.partial) + p * r.hidden;
      reduce_expanded_to<T>(r, p, out, vec, lane);
    } else if (row != nullptr) {
      warp_zero(row, s.row_bytes, lane);
    }
  });
}

}  // namespace lck_ep
