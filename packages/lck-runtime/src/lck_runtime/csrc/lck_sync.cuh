// System-scope synchronisation helpers shared by the runtime's CUDA sources (team_signal.cu,
// p2p_all_reduce.cu), compiled by lck_runtime.jit with this folder on the include path.
//
// status[] (int64[5]) is the diagnostic a bounded wait leaves instead of hanging:
//   status[0]  0 = ok, 1 = timed out, 2 = epochs out of step
//   status[1]  the team index the diagnostic is about
//   status[2]  the value its slot held
//   status[3]  the epoch being waited for
//   status[4]  nanoseconds waited
#pragma once

namespace lck_sync {

__device__ __forceinline__ unsigned long long load_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// A release at system scope that never lowers the slot (epochs only move forward).
__device__ __forceinline__ void max_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.sys.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The first reporter wins; the others keep their diagnostics to themselves.
__device__ inline void record(long long* status, long long code, long long who, unsigned long long seen,
                              unsigned long long epoch, unsigned long long waited) {
  if (atomicCAS(reinterpret_cast<unsigned long long*>(status), 0ull, static_cast<unsigned long long>(code)) == 0ull) {
    status[1] = who;
    status[2] = static_cast<long long>(seen);
    status[3] = static_cast<long long>(epoch);
    status[4] = static_cast<long long>(waited);
    __threadfence_system();
  }
}

}  // namespace lck_sync
