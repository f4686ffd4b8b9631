// lck-ep: the argument agreement of a synced native call, exchanged through the members' workspaces.
//
// A synced dispatch or combine first agrees on its arguments (lck_ep.agreement): every member contributes
// one int64 vector (its local status, the call's digest, a dispatch's counts) and every member reads all of
// them. On the native scale-up backend the vectors travel through a mailbox at the end of each member's
// workspace (lck_runtime.symmetric.moe_agreement_offset) instead of a process-group all-gather: two sets of
// W slots, used by alternate agreements, slot s of set p holding member s's vector of the last agreement of
// parity p, after a sequence word. Agreement q (numbered alike on every member by the host: every member
// makes the same synced calls) writes member me's vector into slot me of set q & 1 of every member, then
// releases q into the slot's sequence word; each member waits until every slot of its own set carries q and
// copies the set out for the host. A member cannot start agreement q + 2, which reuses the set, before
// every member has written agreement q + 1, which each does only after reading agreement q.
//
// The vector's words come from a head the host passes as kernel arguments (status and digest: no copy to
// the device before the exchange) and, for a fresh dispatch, from the routing itself (a flag for out-of-range
// expert indices, the layout's counts): see AgreeArgs. The table goes out followed by the context's status
// words as they stand at the end of the kernel, so that one copy brings both to the host.
//
// One block (one waiting thread per member). A member that does not arrive within timeout_ns leaves the
// context's diagnostic (code 1, or 2 for a member at another agreement: it made different calls), as the
// dispatch and combine waits do.
//
// The verdict. With check_words > 0 the kernel also decides what the host will decide on the same table
// (lck_ep.agreement._verdict): the call is refused when a member's status word (word 0) is set, when words
// [1, check_words) differ between members, or when word flag_word (if >= 0) is set on any member. A refusal
// records code 5 in status, so that the dispatch or combine launched after this kernel returns at once on
// every member alike (the members all read the same table), before the host has read anything; the host
// raises the error and clears the code.
#pragma once

#include "ep_native.cuh"

namespace lck_ep {

constexpr long long kPhaseAgree = 9;  // a synced call, waiting for a member's arguments
constexpr int kAgreeHead = 16;        // most head words (lck_ep.native.AGREE_HEAD)
constexpr int kAgreeStatusWords = 6;  // the context's status words (lck_ep.native: status[6])

struct AgreeArgs {
  long long head[kAgreeHead];  // the start of this member's vector (status and digest words), by value
  long long head_n;            // at most kAgreeHead
  long long n;               // the vector's length: at most slot_words - 1
  // A fresh dispatch's routing words, read here rather than assembled by launches of their own (none when
  // idx is null: words [head_n, n) are then 0): word head_n is 1 when an entry of idx lies outside
  // [-1, idx_hi), then the layout's int32 counts per rank and per expert, widened; 0 after them.
  const long long* idx;
  long long idx_n, idx_hi;
  const int* per_rank;
  long long rank_words;
  const int* per_expert;
  long long expert_words;
  const long long* peer_ws;  // [W] every member's workspace as mapped here
  long long mailbox_offset;  // bytes from a workspace's start to its mailbox
  long long slot_words;      // int64 words per slot: the sequence word, then the vector
  int num_ranks, me;
  unsigned long long seq;    // this agreement's number, from 1
  long long* out;            // [W, n] the members' vectors, by member, then the status words
  long long* status;
  unsigned long long timeout_ns;
  int check_words;  // the status and digest words the verdict compares (0: no verdict)
  int flag_word;    // a word no member may set (-1: none)
};

constexpr long long kAgreeRefused = 5;

__device__ __forceinline__ long long* agree_slot(const AgreeArgs& a, int member, int owner) {
  long long* box = reinterpret_cast<long long*>(reinterpret_cast<uint8_t*>(a.peer_ws[owner]) + a.mailbox_offset);
  const long long set = static_cast<long long>(a.seq & 1ull);
  return box + (set * a.num_ranks + member) * a.slot_words;
}

// Word j of this member's vector (flag: the block's verdict on idx).
__device__ __forceinline__ long long agree_word(const AgreeArgs& a, long long j, long long flag) {
  if (j < a.head_n) return a.head[j];
  if (a.idx == nullptr) return 0;
  j -= a.head_n;
  if (j == 0) return flag;
  j -= 1;
  if (j < a.rank_words) return a.per_rank[j];
  j -= a.rank_words;
  return j < a.expert_words ? a.per_expert[j] : 0;
}

__device__ inline void agree_body(const AgreeArgs& a) {
  if (failed(a.status)) return;  // the same word for every thread: no thread leaves the block's barriers
  int outside = 0;
  if (a.idx != nullptr) {
    for (long long i = threadIdx.x; i < a.idx_n; i += blockDim.x) {
      const long long v = a.idx[i];
      outside |= v < -1 || v >= a.idx_hi;
    }
  }
  const long long flag = __syncthreads_or(outside) ? 1 : 0;
  // this member's vector into its slot at every member (itself included), then the sequence words
  const long long total = a.n * a.num_ranks;
  for (long long i = threadIdx.x; i < total; i += blockDim.x) {
    const int owner = static_cast<int>(i / a.n);
    const long long j = i - owner * a.n;
    agree_slot(a, a.me, owner)[1 + j] = agree_word(a, j, flag);
  }
  __threadfence_system();
  __syncthreads();
  for (int d = threadIdx.x; d < a.num_ranks; d += blockDim.x)
    lck_sync::max_release_sys(reinterpret_cast<unsigned long long*>(agree_slot(a, a.me, d)), a.seq);
  const bool ok = wait_each_member(a.num_ranks, a.status, [&](int s) {
    const unsigned long long* w = reinterpret_cast<const unsigned long long*>(agree_slot(a, s, a.me));
    return wait_for(w, 0, a.seq, true, a.status, kPhaseAgree, s, a.timeout_ns) != ~0ull;
  });
  if (!ok) return;
  for (long long i = threadIdx.x; i < total; i += blockDim.x) {
    const int s = static_cast<int>(i / a.n);
    const long long j = i - s * a.n;
    a.out[i] = *reinterpret_cast<const volatile long long*>(agree_slot(a, s, a.me) + 1 + j);
  }
  if (a.check_words <= 0) return;
  __syncthreads();  // the block's copies of the table are visible to thread 0
  if (threadIdx.x == 0) {
    long long refuse = -1;  // the first member whose words refuse the call
    for (int s = 0; s < a.num_ranks && refuse < 0; ++s) {
      const long long* row = a.out + s * a.n;
      bool bad = row[0] != 0 || (a.flag_word >= 0 && row[a.flag_word] != 0);
      for (int j = 1; j < a.check_words && !bad; ++j) bad = row[j] != a.out[j];
      if (bad) refuse = s;
    }
    if (refuse >= 0) report(a.status, kAgreeRefused, kPhaseAgree, refuse, 0, 0, 0);
  }
}

// The exchange, then the status words after the table (every path of agree_body returns alike on every
// thread, so all of them reach the barrier).
__device__ inline void agree_exchange(const AgreeArgs& a) {
  agree_body(a);
  __syncthreads();
  if (threadIdx.x < kAgreeStatusWords) {
    a.out[a.n * a.num_ranks + threadIdx.x] = *reinterpret_cast<const volatile long long*>(a.status + threadIdx.x);
  }
}

}  // namespace lck_ep
