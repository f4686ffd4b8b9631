// lck-ep: the hybrid (scale-out) dispatch and combine send kernels, shared by the unordered and ordered pairs.
//
// Two-level routing. Ranks are split into hosts of g consecutive ranks (host(r) = r / g, local(r) = r % g).
// A token of source m goes once to each other host H that hosts one of its experts, as one row put to the
// forwarder b = H * g + local(m) (the rank of H with m's local index), and b forwards it over the scale-up
// path to its final ranks on H. Rows for m's own host are stored straight into their destinations (the
// native scale-up path). Either way a row ends where the native dispatch puts it (destination d's region
// for source m, at m's send slot for d, with the same routing words), so the native receive, expanded
// layout and combine reduction kernels run unchanged: same receive order, same reduction order.
//
// Scale-out channels. The rows of m for host H (in token order: the host stream, n <= cap rows) are cut into
// C channels (channel c: stream positions [n c / C, n (c + 1) / C)); each channel into P parts (the first one
// smaller, so the forwarder starts early), each part into up to EP_NUM_SUB_PARTS sub-parts of at least
// EP_MIN_SUB_TOKENS rows (EP_SM100_MIN_SUB_TOKENS on Blackwell). The geometry is a template over the
// channel's capacity Q = ceil(cap / C), so every sub-part has a fixed place in the forwarder's staging area:
// [16-byte-aligned header][its rows], contiguous, and is sent as one batched put. lck_ep/hybrid.py mirrors
// this arithmetic in Python (and its tests check it).
//
// Header (kHeaderBytes + 4 g bytes, 16-aligned): the operation, the channel's row count, this sub-part's
// rows with its part and sub-part index and a continuation flag, a check word, then for each rank l of H the
// number of m's rows for l before this sub-part (its first send slot): the forwarder ranks the rows itself.
//
// Unordered pair: each sub-part's put adds 1 to the part's counting signal. The forwarder waits for one
// arrival, reads the channel's row count from any valid header, computes how many sub-parts the part has,
// waits for that many and validates every header (operation, counts, indices, check word): arrival order
// does not matter. One signal per (channel, part) from each source: C * P signal words per peer.
// Ordered pair: sub-parts are put in order and each put is followed (after a fence) by a tail signal set to
// (op << 32) | (rows delivered << 1) | final; the forwarder processes whole parts as the tail covers them.
//
// Combine, in reverse: the host of a received row returns its partial to the source's own host directly
// (scale-up) or, for a source on another host, into the relay area of the forwarder b of the source's
// local index on its own host; b then puts each returning rank's rows, cut into C channels, straight into
// the source's region for that rank (they are contiguous there: the source's send-slot order). Unordered:
// every put adds (1 << 32) | rows to the source's per-channel counter, g adds per channel (empty ones too),
// so the source knows a channel is complete when the high half reaches g. Ordered: a tail per channel.
// The source then marks the combine arrival words the native reduction waits for.
//
// Signal words of a peer slot (lck_runtime.symmetric: SIGNAL_WORDS_PER_PEER per member): [0, 3) belong to
// the scale-up protocol (ep_native.cuh); [3, 32) are the hybrid budget: from a peer on another host, the
// dispatch counting signals (c * P + j) or tails (c), then the combine counters or tails (c); from a peer on
// this host, relay flags (one per other host). Counting signals are reset by their receiver once consumed,
// before the operation is published (no sender touches them again before that).
//
// Transport. A put is a warp copy into the peer's symmetric memory through its NVSHMEM peer mapping, then a
// system fence, then the signal as a system-scope release atomic: the data is visible before the signal.
// This is what NVSHMEM's P2P transport does for nvshmemx_putmem_signal_nbi_warp between PEs of one machine
// (virtual hosts); across real hosts these three calls become that NVSHMEM call over IB (see the README).
#pragma once

#include <stdint.h>

#include "ep_config.cuh"
#include "ep_native.cuh"

namespace lck_ep {
namespace hybrid {

constexpr int kFirstWord = 3;                       // hybrid signal words: [kFirstWord, kSignalWords)
constexpr int kWords = kSignalWords - kFirstWord;    // lck_ep.hybrid.SIGNAL_BUDGET
constexpr int kHeaderBytes = 16;
constexpr int kRing = 64;          // sub-parts handed from the data warps to the put warp at once
constexpr int kDebugPending = 256;  // sub-parts the put warp holds back and reverses in debug mode

enum : long long {
  kPhaseSubPart = 5,     // dispatch forwarder, waiting for a sub-part's put
  kPhaseHeader = 6,      // dispatch forwarder, a sub-part header did not validate
  kPhaseRelay = 7,       // combine forwarder, waiting for a rank of its host to relay partials
  kPhaseReturn = 8,      // combine source, waiting for a forwarder's partial rows
};

__device__ __forceinline__ int min_sub_tokens() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
  return kSm100MinSubTokens;
#else
  return kMinSubTokens;
#endif
}

// Template geometry of a channel of capacity q_cap rows in `parts` parts (lck_ep.hybrid.part_begin ...).
__device__ __forceinline__ int parts_used(int q_cap, int parts) { return q_cap < parts ? q_cap : parts; }
__device__ __forceinline__ int part_begin(int q_cap, int parts, int j) {
  if (j <= 0) return 0;
  if (j >= parts) return q_cap;
  return j + static_cast<int>(static_cast<long long>(q_cap - parts) * (2 * j - 1) / (2 * parts - 1));
}
__device__ __forceinline__ int sub_count(int q, int min_sub) {
  int s = q / min_sub;
  s = s < kNumSubParts ? s : kNumSubParts;
  return s < 1 ? 1 : s;
}
__device__ __forceinline__ int sub_begin(int q, int n, int k) {
  return static_cast<int>(static_cast<long long>(q) * k / n);
}
__device__ __forceinline__ long long channel_bytes(int q_cap, int parts, long long row, int hb) {
  return static_cast<long long>(q_cap) * row + static_cast<long long>(parts) * kNumSubParts * hb;
}
// Byte offset of sub-part (j, k) (template rows from u) inside its channel.
__device__ __forceinline__ long long sub_offset(int u, int j, int k, long long row, int hb) {
  return static_cast<long long>(u) * row + static_cast<long long>(j * kNumSubParts + k) * hb;
}

__device__ __forceinline__ unsigned int header_check(unsigned int w0, unsigned int w1, unsigned int w2,
                                                     const int* base, int g) {
  unsigned int h = 0x9E3779B9u ^ w0;
  h = (h ^ w1) * 0x85EBCA6Bu;
  h = ((h << 13) | (h >> 19)) ^ w2;
  for (int l = 0; l < g; ++l) h = (h ^ static_cast<unsigned int>(base[l])) * 0xC2B2AE35u;
  return h ^ (h >> 16);
}
__device__ __forceinline__ unsigned int pack_w2(int cnt, int j, int k, bool more) {
  return static_cast<unsigned int>(cnt) | (static_cast<unsigned int>(j) << 20) |
         (static_cast<unsigned int>(k) << 26) | (more ? 0x80000000u : 0u);
}

// Plain (coherent) 16-byte copies: the sources were written during this kernel (by other warps or by other
// PEs), so the read-only cache path (__ldg) must not be used for them. `idx` of `stride` threads (a warp: lane
// of 32; a block: threadIdx.x of blockDim.x). Like warp_copy, U independent loads per thread are issued before
// their stores: a copy is bound by the bytes in flight, and one load at a time (512 bytes per warp per memory
// round trip) made every put and forward a serial chain of round trips.
template <int U>
__device__ __forceinline__ long long copy_plain_batches(int4* d, const int4* s, long long i, long long m, int stride) {
  const long long st = stride;
  for (; i + st * (U - 1) < m; i += st * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                   : "l"(s + i + st * u));
#pragma unroll
    for (int u = 0; u < U; ++u) d[i + st * u] = v[u];
  }
  return i;
}
template <int U = 8>
__device__ __forceinline__ void copy_plain(uint8_t* dst, const uint8_t* src, long long n, int idx, int stride = 32) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(n)) & 15u) == 0) {
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    const long long m = n >> 4;
    long long i = copy_plain_batches<U>(d, s, idx, m, stride);
    if (U > 4) i = copy_plain_batches<4>(d, s, i, m, stride);
    copy_plain_batches<1>(d, s, i, m, stride);
  } else {
    const volatile unsigned short* s = reinterpret_cast<const volatile unsigned short*>(src);
    unsigned short* d = reinterpret_cast<unsigned short*>(dst);
    for (long long i = idx; i < (n >> 1); i += stride) d[i] = s[i];
  }
}

// The put: data into the peer's memory, fence, then the signal (a release at system scope). One warp.
__device__ __forceinline__ void put_signal_add(uint8_t* dst, const uint8_t* src, long long bytes,
                                               unsigned long long* sig, unsigned long long add, int lane) {
  copy_plain(dst, src, bytes, lane);
  __threadfence_system();
  __syncwarp();
  if (lane == 0) asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(sig), "l"(add) : "memory");
}
__device__ __forceinline__ void put_signal_set(uint8_t* dst, const uint8_t* src, long long bytes,
                                               unsigned long long* sig, unsigned long long value, int lane) {
  copy_plain(dst, src, bytes, lane);
  __threadfence_system();
  __syncwarp();
  if (lane == 0) lck_sync::max_release_sys(sig, value);
}
// The same put by a whole block (every thread copies and fences, then one signals): block-uniform call.
template <bool kSet>
__device__ __forceinline__ void block_put_signal(uint8_t* dst, const uint8_t* src, long long bytes,
                                                 unsigned long long* sig, unsigned long long v) {
  copy_plain(dst, src, bytes, threadIdx.x, blockDim.x);
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    if (kSet) lck_sync::max_release_sys(sig, v);
    else asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(sig), "l"(v) : "memory");
  }
}

__device__ __forceinline__ void spin_ns(unsigned long long ns) {
  const unsigned long long t0 = lck_sync::globaltimer_ns();
  while (lck_sync::globaltimer_ns() - t0 < ns) {
  }
}

// Bounded wait until *word >= want (counting signals); exact: a larger value is an error.
__device__ inline bool wait_count(const unsigned long long* word, unsigned long long want, bool exact,
                                  long long* status, long long phase, long long who,
                                  unsigned long long timeout_ns, unsigned long long* seen) {
  const unsigned long long t0 = lck_sync::globaltimer_ns();
  unsigned spins = 0;
  while (true) {
    const unsigned long long v = lck_sync::load_acquire_sys(word);
    if (v >= want) {
      *seen = v;
      if (exact && v > want) {
        report(status, 2, phase, who, v, want, lck_sync::globaltimer_ns() - t0);
        return false;
      }
      return true;
    }
    if ((++spins & 63u) == 0u) {
      const unsigned long long waited = lck_sync::globaltimer_ns() - t0;
      if (waited > timeout_ns || failed(status)) {
        report(status, 1, phase, who, v, want, waited);
        return false;
      }
    }
  }
}

// Bounded wait for a tail (op << 32 | payload): the tag equal to op and the payload accepted by `done`.
template <typename Done>
__device__ inline bool wait_tail(const unsigned long long* word, unsigned long long op, Done done, long long* status,
                                 long long phase, long long who, unsigned long long timeout_ns,
                                 unsigned long long* seen) {
  const unsigned long long t0 = lck_sync::globaltimer_ns();
  unsigned spins = 0;
  while (true) {
    const unsigned long long v = lck_sync::load_acquire_sys(word);
    const unsigned long long tag = v >> 32;
    if (tag > op) {
      report(status, 2, phase, who, tag, op, lck_sync::globaltimer_ns() - t0);
      return false;
    }
    if (tag == op && done(v & 0xffffffffull)) {
      *seen = v;
      return true;
    }
    if ((++spins & 63u) == 0u) {
      const unsigned long long waited = lck_sync::globaltimer_ns() - t0;
      if (waited > timeout_ns || failed(status)) {
        report(status, 1, phase, who, tag, op, waited);
        return false;
      }
    }
  }
}

// Everything before this point in every block (fenced at system scope) is ordered before `last()`, run by
// the last block to arrive; the ticket is reset for the next launch. Unlike finish_grid's callers, blocks
// go on after it, so `last()`'s writes are fenced at system scope before the ticket is reset.
template <typename Last>
__device__ __forceinline__ void grid_step(unsigned int* ticket, Last last) {
  finish_grid(ticket, [&] {
    last();
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
  });
}

struct DispatchArgs {
  const uint8_t* x;
  long long x_bytes;
  const long long* topk_idx;     // [T, K] or nullptr (replay)
  const float* topk_weights;     // [T, K] or nullptr
  const bool* mask;              // [T, W]
  const long long* send_slot;    // [T, W]
  const int* excl;               // [T, W] rows sent to each rank before token t (send slot of any token)
  const int* host_tokens;        // [NH, T] tokens of each host stream, in token order
  const int* host_rows;          // [NH] rows of each host stream
  const int* rows_to;            // [W]
  const long long* peer_ws;
  const long long* peer_sig;
  uint8_t* pack;                 // local: (NH - 1) staging areas as they will be put
  long long region_bytes, row_stride, meta_offset, hybrid_base, area_bytes;
  int num_tokens, num_topk, num_ranks, me, num_local_experts;
  int g, num_hosts, channels, parts, q_cap, hb, cap;
  int debug_reorder;
  unsigned long long debug_delay_ns;
  int* fwd_rows;                 // [(NH - 1) * g + NH] zero between launches: rows forwarded to each rank of this
                                 // host from each other host's source, then per other host the blocks that
                                 // forwarded its channel, then the blocks that stored this source's own rows
  unsigned int* tickets;         // [2]
  long long* status;
  unsigned long long timeout_ns;
};

__device__ __forceinline__ int other_host(int area, int my_host) { return area < my_host ? area : area + 1; }
__device__ __forceinline__ int area_of(int host, int my_host) { return host < my_host ? host : host - 1; }

struct Desc {
  long long off;       // byte offset inside the staging area (the same in the pack buffer)
  long long bytes;
  int area;            // which staging area (the destination host, relative to this one)
  int word;            // signal word index inside the hybrid budget
  unsigned int tail;   // ordered: (rows delivered << 1) | final
  int pad;
};

// The routing words of a row as the native receiver reads them, for destination d (ep_native.cuh layout).
__device__ __forceinline__ void write_meta_for(uint8_t* meta, int src, const float* w_in, const short* eh,
                                               int K, int l, int L, int lane) {
  if (lane == 0) *reinterpret_cast<int*>(meta) = src;
  float* w = reinterpret_cast<float*>(meta + 4);
  short* li = reinterpret_cast<short*>(meta + 4 + 4 * K);
  for (int k = lane; k < K; k += 32) {
    const int e = eh[k];
    const bool local = e >= l * L && e < (l + 1) * L;
    w[k] = local ? w_in[k] : 0.0f;
    li[k] = local ? static_cast<short>(e - l * L) : static_cast<short>(-1);
  }
}

template <bool kOrdered>
__device__ inline void dispatch(const DispatchArgs& a) {
  __shared__ Desc ring[kRing];
  __shared__ Desc pending[kDebugPending];
  __shared__ volatile int ring_head;
  __shared__ volatile int ring_tail;
  __shared__ int s_m, s_ok, s_nsub;
  const long long* const* peer_sig = reinterpret_cast<const long long* const*>(a.peer_sig);
  const long long* my_sig = peer_sig[a.me];
  const unsigned long long op = current_op(my_sig, a.me);
  const bool ok0 = wait_peers_free(peer_sig, a.num_ranks, op, a.status, kPhaseDispatchFree, a.timeout_ns);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int K = a.num_topk, g = a.g, L = a.num_local_experts, W = a.num_ranks;
  // A dispatch (routing words in the rows) or a replay (num_topk 0: a bit per rank of the host instead).
  // Never from the topk_idx pointer: a rank with no tokens passes an empty topk_idx, whose address is null,
  // and as a forwarder it must still read other sources' staged rows as routed ones.
  const bool routed = K > 0;
  const int my_host = a.me / g, my_local = a.me % g;
  int* const blocks_done = a.fwd_rows + (a.num_hosts - 1) * g;  // [NH - 1] per other host, then own rows
  const int c = blockIdx.x;
  const long long row = a.row_stride;
  const int min_sub = min_sub_tokens();
  const int P = parts_used(a.q_cap, a.parts);
  const long long chan_off = c * channel_bytes(a.q_cap, a.parts, row, a.hb);
  if (threadIdx.x == 0) {
    ring_head = 0;
    ring_tail = 0;
  }
  __syncthreads();

  if (ok0) {
    // 1. Scale-up: rows for this host's ranks, as the native sender stores them. Warps 1.. of every block.
    const long long dwarp = static_cast<long long>(blockIdx.x) * (nwarps - 1) + (warp - 1);
    const long long dwarps = static_cast<long long>(gridDim.x) * (nwarps - 1);
    if (warp > 0) {
      for (long long t = dwarp; t < a.num_tokens; t += dwarps) {
        const uint8_t* src = a.x + t * a.x_bytes;
        for (int l = 0; l < g; ++l) {
          const int d = my_host * g + l;
          if (!a.mask[t * W + d]) continue;
          uint8_t* r = reinterpret_cast<uint8_t*>(a.peer_ws[d]) + a.me * a.region_bytes + a.send_slot[t * W + d] * row;
          uint8_t* meta = r + a.meta_offset;
          if (d != a.me) warp_copy(r, src, a.x_bytes, lane);
          if (lane == 0) *reinterpret_cast<int*>(meta) = static_cast<int>(t);
          if (routed) {
            float* w = reinterpret_cast<float*>(meta + 4);
            short* li = reinterpret_cast<short*>(meta + 4 + 4 * K);
            const long long lo = static_cast<long long>(d) * L;
            for (int k = lane; k < K; k += 32) {
              const long long e = a.topk_idx[t * K + k];
              const bool local = e >= lo && e < lo + L;
              w[k] = local && a.topk_weights != nullptr ? a.topk_weights[t * K + k] : 0.0f;
              li[k] = local ? static_cast<short>(e - lo) : static_cast<short>(-1);
            }
          }
        }
      }
    }

    // 2. Scale-out: channel c of every other host's stream, packed by warps 1.. and put by warp 0.
    if (warp > 0) {
      const int data_threads = blockDim.x - 32;
      for (int area = 0; area < a.num_hosts - 1; ++area) {
        const int H = other_host(area, my_host);
        const int n = a.host_rows[H];
        const int lo = static_cast<int>(static_cast<long long>(n) * c / a.channels);
        const int m = static_cast<int>(static_cast<long long>(n) * (c + 1) / a.channels) - lo;
        uint8_t* pack = a.pack + area * a.area_bytes + chan_off;
        const long long host_lo = static_cast<long long>(H) * g * L;
        for (int j = 0; j < P; ++j) {
          const int pb = part_begin(a.q_cap, P, j), pe = part_begin(a.q_cap, P, j + 1);
          if (j > 0 && m <= pb) break;
          const int nsub = sub_count(pe - pb, min_sub);
          for (int k = 0; k < nsub; ++k) {
            const int u = pb + sub_begin(pe - pb, nsub, k), v = pb + sub_begin(pe - pb, nsub, k + 1);
            if (m > 0 && u >= m) break;
            if (m == 0 && (j > 0 || k > 0)) break;
            const int cnt = (m < v ? m : v) - u > 0 ? (m < v ? m : v) - u : 0;
            uint8_t* hdr = pack + sub_offset(u, j, k, row, a.hb);
            uint8_t* rows = hdr + a.hb;
            for (int r = warp - 1; r < cnt; r += nwarps - 1) {
              const int t = a.host_tokens[static_cast<long long>(H) * a.num_tokens + lo + u + r];
              uint8_t* dst = rows + static_cast<long long>(r) * row;
              warp_copy(dst, a.x + static_cast<long long>(t) * a.x_bytes, a.x_bytes, lane);
              uint8_t* meta = dst + a.meta_offset;
              if (lane == 0) *reinterpret_cast<int*>(meta) = t;
              if (routed) {
                float* w = reinterpret_cast<float*>(meta + 4);
                short* eh = reinterpret_cast<short*>(meta + 4 + 4 * K);
                for (int kk = lane; kk < K; kk += 32) {
                  const long long e = a.topk_idx[static_cast<long long>(t) * K + kk];
                  const bool here = e >= host_lo && e < host_lo + static_cast<long long>(g) * L;
                  w[kk] = here && a.topk_weights != nullptr ? a.topk_weights[static_cast<long long>(t) * K + kk] : 0.0f;
                  eh[kk] = here ? static_cast<short>(e - host_lo) : static_cast<short>(-1);
                }
              } else {
                const unsigned bit = lane < g && a.mask[static_cast<long long>(t) * W + H * g + lane] ? 1u : 0u;
                const unsigned bits = __ballot_sync(0xffffffffu, bit);
                if (lane == 0) *reinterpret_cast<unsigned*>(meta + 4) = bits;
              }
            }
            if (warp == 1) {  // the header: first send slots of this sub-part, then the words and check
              int* base = reinterpret_cast<int*>(hdr + kHeaderBytes);
              const int t0 = cnt > 0 ? a.host_tokens[static_cast<long long>(H) * a.num_tokens + lo + u] : -1;
              if (lane < g) base[lane] = t0 >= 0 ? a.excl[static_cast<long long>(t0) * W + H * g + lane] : 0;
              __syncwarp();
              if (lane == 0) {
                unsigned int* w = reinterpret_cast<unsigned int*>(hdr);
                const unsigned int w0 = static_cast<unsigned int>(op), w1 = static_cast<unsigned int>(m);
                const unsigned int w2 = pack_w2(cnt, j, k, m > pe);
                w[0] = w0;
                w[1] = w1;
                w[2] = w2;
                w[3] = header_check(w0, w1, w2, base, g);
              }
            }
            asm volatile("bar.sync 1, %0;" ::"r"(data_threads) : "memory");
            if (threadIdx.x == 32) {
              while (ring_head - ring_tail >= kRing) {
              }
              Desc dsc;
              dsc.off = chan_off + sub_offset(u, j, k, row, a.hb);
              dsc.bytes = a.hb + static_cast<long long>(cnt) * row;
              dsc.area = area;
              dsc.word = kOrdered ? c : c * a.parts + j;
              dsc.tail = (static_cast<unsigned int>(u + cnt) << 1) | ((u + cnt >= m) ? 1u : 0u);
              ring[ring_head % kRing] = dsc;
              __threadfence_block();
              ring_head = ring_head + 1;
            }
          }
        }
      }
      if (threadIdx.x == 32) {
        __threadfence_block();
        ring_head = ring_head | (1 << 30);  // the producer is done
      }
    } else {
      // The put warp: issue each packed sub-part as one put with its signal, in hand-off order (debug:
      // held back, then issued newest first with a delay before each).
      int issued = 0, held = 0;
      auto issue = [&](const Desc& dsc) {
        if (a.debug_delay_ns) spin_ns(a.debug_delay_ns);
        const int H = other_host(dsc.area, my_host);
        const int b = H * g + my_local;
        uint8_t* dst = reinterpret_cast<uint8_t*>(a.peer_ws[b]) + a.hybrid_base +
                       area_of(my_host, H) * a.area_bytes + dsc.off;
        unsigned long long* sig = reinterpret_cast<unsigned long long*>(const_cast<long long*>(peer_sig[b]) +
                                                                       a.me * kSignalWords + kFirstWord + dsc.word);
        if (kOrdered) put_signal_set(dst, a.pack + dsc.area * a.area_bytes + dsc.off, dsc.bytes, sig,
                                     (op << 32) | dsc.tail, lane);
        else put_signal_add(dst, a.pack + dsc.area * a.area_bytes + dsc.off, dsc.bytes, sig, 1ull, lane);
      };
      auto flush = [&]() {
        for (int i = held - 1; i >= 0; --i) issue(pending[i]);
        held = 0;
      };
      while (true) {
        // One lane reads the hand-off word for the warp: the branch below must be warp-uniform (puts and
        // their signals are warp-collective).
        int head = 0;
        if (lane == 0) {
          head = ring_head;
          __threadfence_block();
        }
        head = __shfl_sync(0xffffffffu, head, 0);
        __syncwarp();  // orders lane 0's observation before the other lanes' reads of the ring and the pack
        const bool finished = (head >> 30) & 1;
        const int avail = head & ((1 << 30) - 1);
        if (issued < avail) {
          const Desc dsc = ring[issued % kRing];
          __syncwarp();
          if (a.debug_reorder && !kOrdered) {
            if (lane == 0) pending[held] = dsc;
            __syncwarp();
            ++held;
            if (held == kDebugPending) flush();
          } else {
            issue(dsc);
          }
          ++issued;
          if (lane == 0) ring_tail = issued;
          __syncwarp();
        } else if (finished) {
          break;
        }
      }
      flush();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && ok0) atomicAdd(blocks_done + (a.num_hosts - 1), 1);  // this block's own rows are stored
  // Publish this source's own row counts to the ranks of its host as soon as every block stored them, not
  // after forwarding: a forwarding wait may take a whole bound on a stopped source of another host, and the
  // receivers of this host would otherwise wait that long for this (live) rank. The last block to arrive
  // publishes (grid_step: every block's stores and its count above are fenced before its ticket).
  grid_step(a.tickets + 1, [&] {
    const bool own = static_cast<unsigned>(*reinterpret_cast<volatile int*>(blocks_done + (a.num_hosts - 1))) ==
                     gridDim.x;
    for (int l = threadIdx.x; own && l < g; l += blockDim.x) {
      const int d = my_host * g + l;
      long long* word = const_cast<long long*>(peer_sig[d]) + a.me * kSignalWords + kDispatchArrived;
      lck_sync::max_release_sys(reinterpret_cast<unsigned long long*>(word),
                                (op << 32) | static_cast<unsigned long long>(a.rows_to[d]));
    }
  });

  // 3. Forward: as the forwarder of every other host's source with this rank's local index, channel c.
  if (__syncthreads_and(ok0 && !failed(a.status))) {  // block-uniform: the loop below has barriers
    for (int area = 0; area < a.num_hosts - 1; ++area) {
      const int G = other_host(area, my_host);
      const int src = G * g + my_local;
      const uint8_t* stage = reinterpret_cast<const uint8_t*>(a.peer_ws[a.me]) + a.hybrid_base + area * a.area_bytes + chan_off;
      unsigned long long* words = reinterpret_cast<unsigned long long*>(const_cast<long long*>(my_sig) +
                                                                         src * kSignalWords + kFirstWord);
      if (threadIdx.x == 0) s_m = -1;
      for (int j = 0; j < P; ++j) {
        const int pb = part_begin(a.q_cap, P, j), pe = part_begin(a.q_cap, P, j + 1);
        const int nsub_t = sub_count(pe - pb, min_sub);
        __syncthreads();
        if (threadIdx.x == 0) {
          s_ok = 1;
          s_nsub = 0;
          unsigned long long seen = 0;
          int m = s_m;
          if (j > 0 && m <= pb) {
            s_ok = 2;  // the channel ended before this part
          } else if (!kOrdered) {
            bool good = wait_count(words + c * a.parts + j, 1ull, false, a.status, kPhaseSubPart, src, a.timeout_ns, &seen);
            if (good && m < 0) {  // learn the channel's row count from any complete, valid header
              for (int k = 0; k < nsub_t && m < 0; ++k) {
                const int u = pb + sub_begin(pe - pb, nsub_t, k);
                const volatile unsigned int* h = reinterpret_cast<const volatile unsigned int*>(stage + sub_offset(u, j, k, row, a.hb));
                int base[32];
                for (int l = 0; l < g; ++l) base[l] = reinterpret_cast<const volatile int*>(h + 4)[l];
                if (h[0] == static_cast<unsigned int>(op) && h[3] == header_check(h[0], h[1], h[2], base, g)) m = static_cast<int>(h[1]);
              }
              if (m < 0) {
                report(a.status, 3, kPhaseHeader, src, seen, op, 0);
                good = false;
              }
            }
            int n = 0;
            if (good) {
              if (m == 0) n = 1;
              else for (int k = 0; k < nsub_t; ++k) n += pb + sub_begin(pe - pb, nsub_t, k) < m ? 1 : 0;
              good = wait_count(words + c * a.parts + j, static_cast<unsigned long long>(n), true, a.status, kPhaseSubPart, src,
                                a.timeout_ns, &seen);
            }
            if (good) *reinterpret_cast<volatile unsigned long long*>(words + c * a.parts + j) = 0ull;  // consumed
            s_ok = good ? 1 : 0;
            s_m = m;
            s_nsub = n;
          } else {
            const int want_end = pe;
            const bool good = wait_tail(words + c, op, [&](unsigned long long p) {
              return (p & 1ull) || static_cast<int>(p >> 1) >= want_end;
            }, a.status, kPhaseSubPart, src, a.timeout_ns, &seen);
            if (good && (seen & 1ull)) m = static_cast<int>((seen & 0xffffffffull) >> 1);
            int n = 0;
            if (good) {
              const int mm = m >= 0 ? m : pe;  // not final yet: this part is full
              if (mm == 0) n = 1;
              else for (int k = 0; k < nsub_t; ++k) n += pb + sub_begin(pe - pb, nsub_t, k) < mm ? 1 : 0;
            }
            s_ok = good ? 1 : 0;
            s_m = m >= 0 ? m : 0x7fffffff;
            s_nsub = n;
          }
        }
        __syncthreads();
        if (s_ok == 2) break;
        if (s_ok == 0) break;
        const int m = s_m;
        // Validate every header of the part, then forward its rows: S = nwarps / sub-parts warps per sub-part
        // (one warp per sub-part left most of the block idle). Each warp of a sub-part ranks all of its rows,
        // 32 at a time (lane i reads row r0 + i's routing, ballots give each rank's running count: the send
        // slots), and copies the rows r with r % S == its share.
        const int S = s_nsub > 0 && s_nsub < nwarps ? nwarps / s_nsub : 1;
        for (int item = warp; item < s_nsub * S; item += nwarps) {
          const int k = item / S, share = item % S;
          const int u = pb + sub_begin(pe - pb, nsub_t, k), v = pb + sub_begin(pe - pb, nsub_t, k + 1);
          const int mm = m == 0x7fffffff ? v : m;
          const int cnt = (mm < v ? mm : v) - u > 0 ? (mm < v ? mm : v) - u : 0;
          const uint8_t* hdr = stage + sub_offset(u, j, k, row, a.hb);
          const volatile unsigned int* h = reinterpret_cast<const volatile unsigned int*>(hdr);
          const volatile int* vbase = reinterpret_cast<const volatile int*>(hdr + kHeaderBytes);
          int slot_l = lane < g ? vbase[lane] : 0;  // lane l < g: the send slot of l's next row
          if (lane == 0) {
            int base[32];
            for (int l = 0; l < g; ++l) base[l] = vbase[l];
            const unsigned int w0 = h[0], w1 = h[1], w2 = h[2], w3 = h[3];
            const bool hdr_ok = w0 == static_cast<unsigned int>(op) && w3 == header_check(w0, w1, w2, base, g) &&
                                (kOrdered || static_cast<int>(w1) == m) &&
                                w2 == pack_w2(cnt, j, k, static_cast<int>(w1) > pe);
            if (!hdr_ok) report(a.status, 3, kPhaseHeader, src, w2, pack_w2(cnt, j, k, static_cast<int>(w1) > pe), 0);
          }
          if (__any_sync(0xffffffffu, failed(a.status))) continue;  // warp-uniform: ballots follow
          const unsigned host_mask = g >= 32 ? 0xffffffffu : (1u << g) - 1u;
          int run = 0;  // lane l < g: rows this warp forwarded to l
          for (int r0 = 0; r0 < cnt; r0 += 32) {
            const int nr = cnt - r0 < 32 ? cnt - r0 : 32;
            unsigned dest = 0;  // lane i: the ranks of this host row r0 + i goes to
            if (lane < nr) {
              const uint8_t* meta = hdr + a.hb + static_cast<long long>(r0 + lane) * row + a.meta_offset;
              if (routed) {
                const int hl = g * L;
                for (int kk = 0; kk < K; ++kk) {
                  const int e = reinterpret_cast<const volatile short*>(meta + 4 + 4 * K)[kk];
                  if (e >= 0 && e < hl) dest |= 1u << (e / L);
                }
              } else {
                dest = *reinterpret_cast<const volatile unsigned*>(meta + 4) & host_mask;
              }
            }
            for (int i = share - (r0 % S); i < nr; i += S) {
              if (i < 0) continue;
              const uint8_t* srow = hdr + a.hb + static_cast<long long>(r0 + i) * row;
              const uint8_t* meta = srow + a.meta_offset;
              const int t = *reinterpret_cast<const volatile int*>(meta);
              const float* w_in = reinterpret_cast<const float*>(meta + 4);
              const short* eh = reinterpret_cast<const short*>(meta + 4 + 4 * K);
              unsigned bits = __shfl_sync(0xffffffffu, dest, i);
              while (bits) {
                const int l = __ffs(bits) - 1;
                bits &= bits - 1;
                const unsigned before = __ballot_sync(0xffffffffu, (dest >> l) & 1u) & ((1u << i) - 1u);
                const int slot = __shfl_sync(0xffffffffu, slot_l, l) + __popc(before);
                const int d = my_host * g + l;
                uint8_t* drow = reinterpret_cast<uint8_t*>(a.peer_ws[d]) + src * a.region_bytes + static_cast<long long>(slot) * row;
                copy_plain<4>(drow, srow, a.x_bytes, lane);  // 4 in flight: up to 16 warps forward
                if (routed) write_meta_for(drow + a.meta_offset, t, w_in, eh, K, l, L, lane);
                else if (lane == 0) *reinterpret_cast<int*>(drow + a.meta_offset) = t;
                run += lane == l ? 1 : 0;
              }
            }
            for (int l = 0; l < g; ++l) {  // past this chunk: each rank's running count
              const int c_l = __popc(__ballot_sync(0xffffffffu, (dest >> l) & 1u));
              if (lane == l) slot_l += c_l;
            }
          }
          if (lane < g && run) atomicAdd(a.fwd_rows + area * g + lane, run);
        }
      }
      __syncthreads();
      if (threadIdx.x == 0 && !failed(a.status)) atomicAdd(blocks_done + area, 1);  // channel c forwarded
    }
  }

  // 4. Publish: every rank of this host gets the row counts forwarded to it from each other host's source
  // (this source's own counts went out after step 2). Each publication stands alone, like the native
  // senders' (one per source): another host's source's once every block forwarded its channel, even when
  // another wait of this kernel failed.
  finish_grid(a.tickets, [&] {
    const int nfwd = (a.num_hosts - 1) * g;
    const unsigned blocks = gridDim.x;
    for (int i = threadIdx.x; i < nfwd; i += blockDim.x) {
      const int area = i / g, l = i % g;
      if (static_cast<unsigned>(*reinterpret_cast<volatile int*>(blocks_done + area)) != blocks) continue;
      const int src = other_host(area, my_host) * g + my_local;
      const int d = my_host * g + l;
      long long* word = const_cast<long long*>(peer_sig[d]) + src * kSignalWords + kDispatchArrived;
      lck_sync::max_release_sys(reinterpret_cast<unsigned long long*>(word),
                                (op << 32) | static_cast<unsigned long long>(*reinterpret_cast<volatile int*>(a.fwd_rows + i)));
    }
    __syncthreads();  // every count read before any is reset
    for (int i = threadIdx.x; i < nfwd + a.num_hosts; i += blockDim.x) a.fwd_rows[i] = 0;
  });
}

struct CombineArgs {
  const uint8_t* partial;
  long long row_bytes, valid_rows;
  const long long* recv_counts;  // [W]
  const long long* recv_starts;  // [W + 1]
  const long long* peer_ws;
  const long long* peer_sig;
  long long region_bytes, row_stride, hybrid_base;
  int num_ranks, me, g, num_hosts, channels, cap;
  int debug_reorder;
  unsigned long long debug_delay_ns;
  unsigned int* tickets;  // [2]
  long long* status;
  unsigned long long timeout_ns;
};

template <bool kOrdered>
__device__ inline void combine(const CombineArgs& a) {
  __shared__ long long starts[kMaxRanks + 1];
  __shared__ long long relay_rows[32];
  __shared__ int s_ok;
  const long long* const* peer_sig = reinterpret_cast<const long long* const*>(a.peer_sig);
  const long long* my_sig = peer_sig[a.me];
  const unsigned long long op = current_op(my_sig, a.me);
  for (int s = threadIdx.x; s <= a.num_ranks; s += blockDim.x) starts[s] = a.recv_starts[s];
  const bool ok0 = wait_peers_free(peer_sig, a.num_ranks, op, a.status, kPhaseCombineFree, a.timeout_ns);
  const int lane = threadIdx.x & 31;
  const int g = a.g, my_host = a.me / g, my_local = a.me % g, c = blockIdx.x;
  const long long row = a.row_stride;
  const long long relay_rows_per = static_cast<long long>(a.cap);
  // A. Partials home: straight to a source of this host, or into the relay area of this host's forwarder.
  if (ok0) {
    const long long gw = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const long long gws = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
    const long long total = starts[a.num_ranks];
    for (long long p = gw; p < total; p += gws) {
      const int s = source_of(starts, a.num_ranks, p);
      if (s == a.me) continue;
      uint8_t* dst;
      if (s / g == my_host) {
        dst = reinterpret_cast<uint8_t*>(a.peer_ws[s]) + a.me * a.region_bytes + (p - starts[s]) * row;
      } else {
        const int b = my_host * g + s % g;
        dst = reinterpret_cast<uint8_t*>(a.peer_ws[b]) + a.hybrid_base +
              ((static_cast<long long>(area_of(s / g, my_host)) * g + my_local) * relay_rows_per + (p - starts[s])) * row;
      }
      if (p < a.valid_rows) warp_copy(dst, a.partial + p * a.row_bytes, a.row_bytes, lane);
      else warp_zero(dst, a.row_bytes, lane);
    }
  }
  grid_step(a.tickets, [&] {
    if (failed(a.status) || !ok0) return;
    for (int s = threadIdx.x; s < a.num_ranks; s += blockDim.x) {
      if (s / g == my_host) {
        arrive_combine(peer_sig[s], a.me, op, false);
      } else {
        const int b = my_host * g + s % g;
        long long* word = const_cast<long long*>(peer_sig[b]) + a.me * kSignalWords + kFirstWord + area_of(s / g, my_host);
        lck_sync::max_release_sys(reinterpret_cast<unsigned long long*>(word),
                                  (op << 32) | static_cast<unsigned long long>(a.recv_counts[s]));
      }
    }
  });
  // B. Forward: for each other host's source with this rank's local index, channel c of every rank's rows.
  if (__syncthreads_and(ok0 && !failed(a.status))) {  // block-uniform: the loop below has barriers
    for (int area = 0; area < a.num_hosts - 1; ++area) {
      const int src = other_host(area, my_host) * g + my_local;
      __syncthreads();
      if (threadIdx.x == 0) s_ok = 1;
      __syncthreads();
      if (threadIdx.x < g) {
        const int d = my_host * g + threadIdx.x;
        const unsigned long long* word = reinterpret_cast<const unsigned long long*>(my_sig + d * kSignalWords + kFirstWord + area);
        const unsigned long long v = wait_for(word, 32, op, true, a.status, kPhaseRelay, d, a.timeout_ns);
        if (v == ~0ull) s_ok = 0;
        relay_rows[threadIdx.x] = static_cast<long long>(v & 0xffffffffull);
      }
      __syncthreads();
      if (!s_ok) break;
      unsigned long long* sig = reinterpret_cast<unsigned long long*>(const_cast<long long*>(peer_sig[src]) +
                                                                       a.me * kSignalWords + kFirstWord + c);
      // Every warp of the block copies each put (one warp alone was a serial chain of memory round trips).
      for (int i = 0; i < g; ++i) {
        const int l = a.debug_reorder && !kOrdered ? g - 1 - i : i;
        const long long n = relay_rows[l];
        const long long lo = n * c / a.channels, hi = n * (c + 1) / a.channels;
        if (a.debug_delay_ns) {
          if (threadIdx.x == 0) spin_ns(a.debug_delay_ns);
          __syncthreads();
        }
        const uint8_t* from = reinterpret_cast<const uint8_t*>(a.peer_ws[a.me]) + a.hybrid_base +
                              ((static_cast<long long>(area) * g + l) * relay_rows_per + lo) * row;
        uint8_t* to = reinterpret_cast<uint8_t*>(a.peer_ws[src]) + static_cast<long long>(my_host * g + l) * a.region_bytes + lo * row;
        if (kOrdered) block_put_signal<true>(to, from, (hi - lo) * row, sig, (op << 32) | static_cast<unsigned long long>(i + 1));
        else block_put_signal<false>(to, from, (hi - lo) * row, sig, (1ull << 32) | static_cast<unsigned long long>(hi - lo));
      }
    }
  }
  __syncthreads();
  // C. As a source: wait for channel c of every other host's forwarder, then (last block) mark the arrivals.
  if (ok0 && !failed(a.status) && threadIdx.x == 0) {
    for (int area = 0; area < a.num_hosts - 1; ++area) {
      const int H = other_host(area, my_host);
      const int f = H * g + my_local;
      unsigned long long* word = reinterpret_cast<unsigned long long*>(const_cast<long long*>(my_sig) + f * kSignalWords + kFirstWord + c);
      unsigned long long seen = 0;
      if (!kOrdered) {
        // g puts per channel, each adding (1 << 32) | rows: complete when the high half reaches g.
        if (!wait_count(word, static_cast<unsigned long long>(g) << 32, false, a.status, kPhaseReturn, f, a.timeout_ns, &seen)) break;
        if ((seen >> 32) != static_cast<unsigned long long>(g)) {
          report(a.status, 2, kPhaseReturn, f, seen >> 32, g, 0);
          break;
        }
        *reinterpret_cast<volatile unsigned long long*>(word) = 0ull;  // consumed
      } else {
        // The tail counts the forwarder's puts to this source, issued in order: the g-th covers them all.
        if (!wait_tail(word, op, [&](unsigned long long p) { return p >= static_cast<unsigned long long>(g); }, a.status,
                       kPhaseReturn, f, a.timeout_ns, &seen)) break;
      }
    }
  }
  finish_grid(a.tickets + 1, [&] {
    if (failed(a.status) || !ok0) return;
    for (int d = threadIdx.x; d < a.num_ranks; d += blockDim.x) {
      if (d / g == my_host) continue;
      arrive_combine(my_sig, d, op, false);
    }
  });
}

}  // namespace hybrid
}  // namespace lck_ep
