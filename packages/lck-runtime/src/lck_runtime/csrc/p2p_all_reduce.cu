// One-shot all-reduce over NVLink peer views, compiled by lck_runtime.jit (see lck_runtime/p2p.py).
//
// Every member of a team of n owns, in symmetric memory, a receive area of 2 parities x n slots of
// `slot` floats and a flag array of n x MAX_BLOCKS uint64 words (both zeroed before first use). One call
// (epoch e, parity e % 2) is one launch of B blocks; block b owns the element range R_b of t (the same
// ranges on every member, since B and the ranges depend on n only) and:
//   1. stores t[R_b] into slot `me` of parity e % 2 of every other member's receive area (NVLink stores);
//   2. fences system-wide, then raises flags_m[me][b] to e on every member m (release), so block b of
//      every member learns that its range has arrived;
//   3. waits until flags_me[r][b] >= e for every member r (acquire), bounded by a wall-clock timeout;
//   4. writes t[i] = x_0[i] op x_1[i] op ... op x_{n-1}[i] over R_b, in member order (x_me is its own t),
//      so every member computes the same bits.
// Two parities suffice: a member stores epoch e + 1 into parity (e + 1) % 2 only after every block of
// every member signalled epoch e, i.e. after each of them finished reading parity (e - 1) % 2 (the
// previous launch on its stream).
//
// A member that waits too long records a diagnostic in status[] (the layout of team_signal.cu: code,
// member, seen, epoch, waited ns) and fills its range with NaN instead of summing partial data; once
// status[0] is non-zero every later call skips the exchange and writes NaN at once (a broken team fails
// fast). The host reads status when asked (P2PAllReduce.check).

#include <cstdint>

#include "lck_sync.cuh"

using lck_sync::globaltimer_ns;
using lck_sync::load_acquire_sys;
using lck_sync::max_release_sys;
using lck_sync::record;

namespace {

constexpr int MAX_BLOCKS = 128;

__device__ __forceinline__ float combine(float a, float b, int op_max) { return op_max ? fmaxf(a, b) : a + b; }

}  // namespace

// peers[m]: member m's receive area (parity 0, slot 0) in this process's address space; flags[m]: member
// m's flag array likewise. t holds n floats; vec4 (set only when t is 16-byte aligned and n % 4 == 0)
// picks 16-byte loads and stores, which may differ between members: it never changes the ranges.
extern "C" __global__ void lck_p2p_all_reduce(float* t, long long n, const unsigned long long* peers,
                                              const unsigned long long* flags, int team_size, int me,
                                              long long slot, unsigned long long epoch, int op_max, int vec4,
                                              unsigned long long timeout_ns, long long* status) {
  const int b = blockIdx.x;
  // Ranges in whole groups of 4 floats, from n and the grid alone: every member's block b covers the same
  // elements whatever its tensor's alignment (block b's flag vouches for exactly that range), and the
  // range starts stay 16-byte aligned for the vectorised copies.
  const long long per4 = ((n + 3) / 4 + gridDim.x - 1) / gridDim.x;
  const long long lo = min(n, b * per4 * 4);
  const long long hi = min(n, (b + 1) * per4 * 4);
  const long long parity_off = static_cast<long long>(epoch & 1ull) * team_size * slot;

  __shared__ int failed;
  if (threadIdx.x == 0) failed = (*reinterpret_cast<volatile long long*>(status) != 0);
  __syncthreads();

  if (!failed) {
    // 1. Push this block's range to every other member.
    for (int m = 0; m < team_size; ++m) {
      if (m == me) continue;
      float* dst = reinterpret_cast<float*>(peers[m]) + parity_off + static_cast<long long>(me) * slot;
      if (vec4) {
        const float4* s4 = reinterpret_cast<const float4*>(t + lo);
        float4* d4 = reinterpret_cast<float4*>(dst + lo);
        for (long long i = threadIdx.x; i < (hi - lo) / 4; i += blockDim.x) d4[i] = s4[i];
      } else {
        for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) dst[i] = t[i];
      }
    }
    // 2. Every thread's stores are visible system-wide before the flag says so.
    __threadfence_system();
    __syncthreads();
    const int tid = threadIdx.x;
    if (tid < team_size && tid != me) {
      unsigned long long* their = reinterpret_cast<unsigned long long*>(flags[tid]);
      max_release_sys(their + static_cast<long long>(me) * MAX_BLOCKS + b, epoch);
    }
    // 3. Wait for every other member's block b.
    if (tid < team_size && tid != me) {
      const unsigned long long* mine = reinterpret_cast<const unsigned long long*>(flags[me]);
      const unsigned long long* slot_flag = mine + static_cast<long long>(tid) * MAX_BLOCKS + b;
      const unsigned long long start = globaltimer_ns();
      unsigned long long seen = load_acquire_sys(slot_flag);
      while (seen < epoch) {
        const unsigned long long waited = globaltimer_ns() - start;
        if (waited > timeout_ns) {
          record(status, 1, tid, seen, epoch, waited);
          break;
        }
        if (*reinterpret_cast<volatile long long*>(status) != 0) break;
        seen = load_acquire_sys(slot_flag);
      }
      if (seen > epoch + 1) record(status, 2, tid, seen, epoch, globaltimer_ns() - start);
    }
    __syncthreads();
    if (threadIdx.x == 0) failed = (*reinterpret_cast<volatile long long*>(status) != 0);
    __syncthreads();
  }

  // 4. Reduce in member order (or poison the range when the exchange failed).
  const float* recv = reinterpret_cast<const float*>(peers[me]) + parity_off;
  if (failed) {
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) t[i] = __int_as_float(0x7fc00000);
    return;
  }
  if (vec4) {
    for (long long i = lo / 4 + threadIdx.x; i < hi / 4; i += blockDim.x) {
      float4 acc = (me == 0) ? reinterpret_cast<const float4*>(t)[i] : reinterpret_cast<const float4*>(recv)[i];
      for (int r = 1; r < team_size; ++r) {
        const float4 v = (r == me) ? reinterpret_cast<const float4*>(t)[i]
                                   : reinterpret_cast<const float4*>(recv + static_cast<long long>(r) * slot)[i];
        acc.x = combine(acc.x, v.x, op_max);
        acc.y = combine(acc.y, v.y, op_max);
        acc.z = combine(acc.z, v.z, op_max);
        acc.w = combine(acc.w, v.w, op_max);
      }
      reinterpret_cast<float4*>(t)[i] = acc;
    }
  } else {
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      float acc = (me == 0) ? t[i] : recv[i];
      for (int r = 1; r < team_size; ++r) {
        const float v = (r == me) ? t[i] : recv[static_cast<long long>(r) * slot + i];
        acc = combine(acc, v, op_max);
      }
      t[i] = acc;
    }
  }
}

// Low-latency form for small tensors (n <= ll_slot): no fence and no separate flag. Every element travels
// to each other member as one 8-byte store {value bits, epoch}, which lands whole; the receiver polls each
// word until its epoch matches, so one NVLink crossing replaces a store, a system fence and a flag round
// trip. It has its own receive area (2 parities x n_members x ll_slot words of 8 bytes), written only by
// this kernel, so a stale word can only hold an older epoch. Ranges and the two parities as above; a
// member that waits too long records the diagnostic and poisons its output.
extern "C" __global__ void lck_p2p_all_reduce_ll(float* t, long long n, const unsigned long long* peers,
                                                 int team_size, int me, long long ll_slot,
                                                 unsigned long long epoch, int op_max,
                                                 unsigned long long timeout_ns, long long* status) {
  const unsigned int tag = static_cast<unsigned int>(epoch);
  const long long parity_off = static_cast<long long>(epoch & 1ull) * team_size * ll_slot;
  __shared__ int failed;
  if (threadIdx.x == 0) failed = (*reinterpret_cast<volatile long long*>(status) != 0);
  __syncthreads();
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (failed) {
    for (long long i = first; i < n; i += stride) t[i] = __int_as_float(0x7fc00000);
    return;
  }
  for (long long i = first; i < n; i += stride) {
    const unsigned long long word =
        (static_cast<unsigned long long>(tag) << 32) | static_cast<unsigned int>(__float_as_int(t[i]));
    for (int m = 0; m < team_size; ++m) {
      if (m == me) continue;
      volatile unsigned long long* dst = reinterpret_cast<volatile unsigned long long*>(peers[m]) + parity_off +
                                         static_cast<long long>(me) * ll_slot + i;
      *dst = word;
    }
  }
  const volatile unsigned long long* recv = reinterpret_cast<const volatile unsigned long long*>(peers[me]) + parity_off;
  for (long long i = first; i < n; i += stride) {
    const float mine = t[i];
    float acc = 0.0f;
    bool ok = true;
    for (int r = 0; r < team_size; ++r) {
      float v = mine;
      if (r != me) {
        const volatile unsigned long long* p = recv + static_cast<long long>(r) * ll_slot + i;
        unsigned long long w = *p;
        if (static_cast<unsigned int>(w >> 32) != tag) {
          const unsigned long long start = globaltimer_ns();
          while (static_cast<unsigned int>(w >> 32) != tag) {
            const unsigned long long waited = globaltimer_ns() - start;
            if (waited > timeout_ns) {
              record(status, 1, r, w >> 32, epoch, waited);
              ok = false;
              break;
            }
            if (*reinterpret_cast<volatile long long*>(status) != 0) {
              ok = false;
              break;
            }
            w = *p;
          }
        }
        v = __int_as_float(static_cast<int>(w & 0xffffffffull));
      }
      acc = (r == 0) ? v : combine(acc, v, op_max);
      if (!ok) break;
    }
    t[i] = ok ? acc : __int_as_float(0x7fc00000);
  }
}
