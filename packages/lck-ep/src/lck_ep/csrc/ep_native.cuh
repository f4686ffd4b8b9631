// lck-ep: what the native (NVSHMEM peer-view) dispatch and combine kernels share.
//
// Memory. Every member of an EP group owns one symmetric workspace (lck_runtime's MoE context) cut into
// W regions of `cap` rows, one region per source member: region s of member d receives what s sends to d
// (dispatch: token rows and their routing; combine: partial rows). Row j of region s holds the j-th row
// s sends to d, in s's token order, so the receiver knows where every row of every source lands. A pulled
// dispatch leaves the rows' bytes with their source: member s stages token t at row t of its own region s
// (the bytes before meta_offset; the routing of s's rows to itself sits after it), where d reads it.
//
// Signals (int64 words, kSignalWords per member, in each member's symmetric signal array):
//   [s * kSignalWords + kDispatchArrived]  (epoch << 32) | rows: source s finished its dispatch rows here;
//   [s * kSignalWords + kCombineArrived]   (epoch << 1) | pulled: member s finished its combine rows for
//                                          this member: pushed into its region s here (pulled 0), or left
//                                          in place in s's own workspace (pulled 1: a zero-copy combine,
//                                          where s's table says where this member's rows start);
//   [me * kSignalWords + kOpsDone]         the last operation this member finished reading (its epoch).
// Every dispatch, replay and combine of a context is one operation; all members run the same sequence,
// so a device-side counter (kOpsDone) numbers them alike on every member without any host state, also
// across CUDA-graph replays. Before writing into member d's workspace, operation e waits until d has
// finished reading operation e - 1 (d's kOpsDone >= e - 1): a region is never overwritten while read,
// and a source's staged rows are not either (it waits for every member before staging).
//
// A zero-copy combine: the hosts of the experts wrote their partial rows straight into their own workspaces
// (Buffer.combine_input: [rows, hidden] from byte 0), after waiting for every member to finish reading the
// last operation. Each then writes, in the last W int64 of its regions, entry s = (first row of s's rows
// << 32) | rows of s present, and releases its arrival with pulled = 1; the sources read the rows from
// there. Every member of one combine takes its input the same way (a mismatch is reported, code 4).
//
// Waits are bounded: a wait that outlasts timeout_ns records a diagnostic in status[] and the kernel
// stops; later kernels of the context see the diagnostic and return at once, and the host raises it.
//   status[0] 0 ok, 1 timed out, 2 out of step (a peer is an operation ahead or behind), 4 a combine whose
//            members took their input differently (zero-copy on some, pushed on others), 5 a synced call's
//            agreement refused its arguments (agree.cuh; the host clears it once it has raised why)
//   status[1] phase (kPhase*), status[2] the member waited for, status[3] the value seen,
//   status[4] the value expected, status[5] nanoseconds waited
#pragma once

#include <stdint.h>

#include "lck_sync.cuh"

namespace lck_ep {

constexpr int kSignalWords = 32;  // lck_runtime.symmetric.SIGNAL_WORDS_PER_PEER
constexpr int kDispatchArrived = 0;
constexpr int kCombineArrived = 1;
constexpr int kOpsDone = 2;
constexpr int kThreads = 512;
constexpr int kMaxRanks = kThreads;  // one waiting thread per member

enum Phase : long long {
  kPhaseDispatchFree = 1,     // dispatch: waiting for a destination to finish reading the last operation
  kPhaseDispatchArrive = 2,   // dispatch: waiting for a source's rows
  kPhaseCombineFree = 3,      // combine: waiting for a source to finish reading the last operation
  kPhaseCombineArrive = 4,    // combine: waiting for a destination's partial rows
};

__device__ __forceinline__ bool failed(const long long* status) {
  return *reinterpret_cast<const volatile long long*>(status) != 0;
}

__device__ inline void report(long long* status, long long code, long long phase, long long who,
                              unsigned long long seen, unsigned long long want, unsigned long long waited) {
  if (atomicCAS(reinterpret_cast<unsigned long long*>(status), 0ull, static_cast<unsigned long long>(code)) == 0ull) {
    status[1] = phase;
    status[2] = who;
    status[3] = static_cast<long long>(seen);
    status[4] = static_cast<long long>(want);
    status[5] = static_cast<long long>(waited);
    __threadfence_system();
  }
}

// Spin until (*word >> shift) reaches `want`; with `exact`, a larger value is an error (a peer ran ahead
// of this operation, which the protocol rules out unless members called different sequences). Returns
// the word, or ~0 after recording a diagnostic.
__device__ inline unsigned long long wait_for(const unsigned long long* word, int shift, unsigned long long want,
                                              bool exact, long long* status, long long phase, long long who,
                                              unsigned long long timeout_ns) {
  const unsigned long long t0 = lck_sync::globaltimer_ns();
  unsigned spins = 0;
  while (true) {
    const unsigned long long v = lck_sync::load_acquire_sys(word);
    const unsigned long long tag = v >> shift;
    if (tag == want || (!exact && tag > want)) return v;
    if (exact && tag > want) {
      report(status, 2, phase, who, tag, want, lck_sync::globaltimer_ns() - t0);
      return ~0ull;
    }
    if ((++spins & 63u) == 0u) {
      const unsigned long long waited = lck_sync::globaltimer_ns() - t0;
      if (waited > timeout_ns || failed(status)) {
        report(status, 1, phase, who, tag, want, waited);
        return ~0ull;
      }
    }
  }
}

// Release source `source`'s combine arrival word in the signal array `signals` (a member's, as mapped here):
// (op << 1) | pulled, see the signals above.
__device__ __forceinline__ void arrive_combine(const long long* signals, int source, unsigned long long op,
                                               bool pulled) {
  long long* word = const_cast<long long*>(signals) + source * kSignalWords + kCombineArrived;
  lck_sync::max_release_sys(reinterpret_cast<unsigned long long*>(word), (op << 1) | (pulled ? 1ull : 0ull));
}

// The number of the operation a kernel belongs to: one past the last this member finished.
__device__ __forceinline__ unsigned long long current_op(const long long* my_signals, int me) {
  return static_cast<unsigned long long>(
             *reinterpret_cast<const volatile long long*>(my_signals + me * kSignalWords + kOpsDone)) + 1ull;
}

// Warp-strided 16-byte moves in batches of U per lane (all U loads issued before the stores), from int4
// index i while a whole batch fits below m; returns where it stopped.
template <int U>
__device__ __forceinline__ long long copy_batches(int4* __restrict__ d, const int4* __restrict__ s, long long i,
                                                  long long m) {
  for (; i + 32 * (U - 1) < m; i += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldg(s + i + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u) d[i + 32 * u] = v[u];
  }
  return i;
}

// Copy n bytes (a multiple of 2) with one warp: 16-byte moves when both ends and n allow it.
__device__ __forceinline__ void warp_copy(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, long long n,
                                          int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(n)) & 15u) == 0) {
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    const long long m = n >> 4;
    // Eight independent 16-byte loads in flight per lane (4 KiB per warp), then four, then one: a copy
    // between PEs is bound by the bytes in flight, and a channel is one block, so each warp keeps many
    // requests open.
    long long i = copy_batches<8>(d, s, lane, m);
    i = copy_batches<4>(d, s, i, m);
    for (; i < m; i += 32) d[i] = __ldg(s + i);
  } else if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(n)) & 3u) == 0) {
    const int* s = reinterpret_cast<const int*>(src);
    int* d = reinterpret_cast<int*>(dst);
    for (long long i = lane; i < (n >> 2); i += 32) d[i] = __ldg(s + i);
  } else {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(src);
    unsigned short* d = reinterpret_cast<unsigned short*>(dst);
    for (long long i = lane; i < (n >> 1); i += 32) d[i] = __ldg(s + i);
  }
}

__device__ __forceinline__ void warp_zero(uint8_t* __restrict__ dst, long long n, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(n)) & 15u) == 0) {
    int4* d = reinterpret_cast<int4*>(dst);
    for (long long i = lane; i < (n >> 4); i += 32) d[i] = make_int4(0, 0, 0, 0);
  } else {
    unsigned short* d = reinterpret_cast<unsigned short*>(dst);
    for (long long i = lane; i < (n >> 1); i += 32) d[i] = 0;
  }
}

// End of a kernel's work: the last block to finish runs `last(...)` (publishing a signal) after every
// block's writes are ordered before it (each thread fences at system scope, then one ticket per block).
template <typename Last>
__device__ __forceinline__ void finish_grid(unsigned int* done, Last last) {
  __threadfence_system();
  __syncthreads();
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    __threadfence_system();
    is_last = atomicAdd(done, 1u) == gridDim.x - 1;
    if (is_last) __threadfence_system();
  }
  __syncthreads();
  if (is_last) {
    last();
    __syncthreads();
    if (threadIdx.x == 0) *done = 0u;  // ready for the next launch (stream-ordered)
  }
}

// End of a receiving kernel: once every block is done reading, publish that this member finished `op`.
__device__ __forceinline__ void finish_receive(unsigned int* done, long long* my_signals, int me,
                                               unsigned long long op, const long long* status) {
  finish_grid(done, [&] {
    if (threadIdx.x == 0 && !failed(status))
      lck_sync::max_release_sys(reinterpret_cast<unsigned long long*>(my_signals + me * kSignalWords + kOpsDone), op);
  });
}

// Thread m < num_ranks runs wait(m) (false: the wait failed) unless an earlier kernel of the context failed;
// true on every thread of the block when every wait succeeded.
template <typename Wait>
__device__ __forceinline__ bool wait_each_member(int num_ranks, const long long* status, Wait wait) {
  __shared__ bool ok;
  if (threadIdx.x == 0) ok = !failed(status);
  __syncthreads();
  if (ok && threadIdx.x < num_ranks) {
    if (!wait(static_cast<int>(threadIdx.x))) ok = false;
  }
  __syncthreads();
  return ok;
}

// Token-row counts of the W sources, read from the arrival words once they carry this operation, and
// their exclusive prefix sums; shared by every warp of the block. False when a wait failed.
__device__ inline bool gather_arrivals(const long long* my_signals, int num_ranks, int word, int shift,
                                       unsigned long long op, long long* counts, long long* starts,
                                       long long* status, long long phase, unsigned long long timeout_ns) {
  const bool ok = wait_each_member(num_ranks, status, [&](int s) {
    const unsigned long long* w = reinterpret_cast<const unsigned long long*>(my_signals + s * kSignalWords + word);
    const unsigned long long v = wait_for(w, shift, op, true, status, phase, s, timeout_ns);
    counts[s] = shift ? static_cast<long long>(v & 0xffffffffull) : 0;
    return v != ~0ull;
  });
  if (threadIdx.x == 0 && ok) {
    long long acc = 0;
    for (int s = 0; s < num_ranks; ++s) {
      starts[s] = acc;
      acc += counts[s];
    }
    starts[num_ranks] = acc;
  }
  __syncthreads();
  return ok;
}

// Wait until every member has finished reading operation op - 1 (its kOpsDone >= op - 1).
__device__ inline bool wait_peers_free(const long long* const* peer_signals, int num_ranks, unsigned long long op,
                                       long long* status, long long phase, unsigned long long timeout_ns) {
  return wait_each_member(num_ranks, status, [&](int d) {
    const unsigned long long* w =
        reinterpret_cast<const unsigned long long*>(peer_signals[d] + d * kSignalWords + kOpsDone);
    return wait_for(w, 0, op - 1ull, false, status, phase, d, timeout_ns) != ~0ull;
  });
}

// The source member of compacted row p: the last s with starts[s] <= p (starts has W + 1 entries).
__device__ __forceinline__ int source_of(const long long* starts, int num_ranks, long long p) {
  int lo = 0, hi = num_ranks - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (starts[mid] <= p) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace lck_ep
