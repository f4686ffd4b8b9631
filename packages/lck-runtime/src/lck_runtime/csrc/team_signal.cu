// Team barrier over symmetric flag buffers, compiled by lck_runtime.jit (see lck_runtime/signals.py).
//
// Every member m of a team of n owns a symmetric array flags_m[n] of uint64 (zeroed before first use).
// Slot flags_m[s] holds the latest epoch member s has announced to m. At epoch e, member i:
//   1. writes e into slot i of every member's array (a system-scope release, max so a slot never goes
//      backwards), peers reached through their NVLink-mapped addresses;
//   2. waits until every slot of its own array is >= e (system-scope acquire loads).
// Writes made before the barrier on this stream (earlier kernels, copies into peers' buffers) are
// visible to every member after it.
//
// The wait is bounded by a wall-clock timeout (%globaltimer). Instead of hanging, a member that waits
// too long records a diagnostic in status[] and returns, so the host can raise an error:
//   status[0]  0 = ok, 1 = timed out, 2 = epochs out of step (a peer announced an epoch more than
//              one ahead: some member skipped or repeated an epoch)
//   status[1]  the team index the diagnostic is about
//   status[2]  the value its slot held
//   status[3]  the epoch this member was waiting for
//   status[4]  nanoseconds waited
// Once status[0] is non-zero, later barriers with the same status return at once without signalling
// (a broken team should fail fast, not time out once per barrier).

#include <cstdint>

#include "lck_sync.cuh"

using lck_sync::globaltimer_ns;
using lck_sync::load_acquire_sys;
using lck_sync::max_release_sys;
using lck_sync::record;

// One block of >= team_size threads; thread t signals member t and then waits for member t's slot.
extern "C" __global__ void lck_team_barrier(const unsigned long long* peer_flags, int team_size, int my_index,
                                            unsigned long long epoch, unsigned long long timeout_ns,
                                            long long* status) {
  __shared__ int skip;
  const int t = threadIdx.x;
  if (t == 0) skip = (*reinterpret_cast<volatile long long*>(status) != 0);
  __syncthreads();
  if (skip) return;

  if (t < team_size) {
    // Make everything this GPU wrote before the barrier (earlier kernels on the stream included)
    // visible system-wide before announcing the epoch.
    __threadfence_system();
    unsigned long long* their = reinterpret_cast<unsigned long long*>(peer_flags[t]);
    max_release_sys(their + my_index, epoch);

    const unsigned long long* mine = reinterpret_cast<const unsigned long long*>(peer_flags[my_index]);
    const unsigned long long start = globaltimer_ns();
    unsigned long long seen = load_acquire_sys(mine + t);
    while (seen < epoch) {
      const unsigned long long waited = globaltimer_ns() - start;
      if (waited > timeout_ns) {
        record(status, 1, t, seen, epoch, waited);
        break;
      }
      if (*reinterpret_cast<volatile long long*>(status) != 0) break;  // another thread already failed
      seen = load_acquire_sys(mine + t);
    }
    if (seen > epoch + 1) record(status, 2, t, seen, epoch, globaltimer_ns() - start);
  }
  __syncthreads();
}
