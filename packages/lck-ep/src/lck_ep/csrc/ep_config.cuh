// lck-ep: compile-time configuration shared by every generated EP kernel.
//
// Each knob has its default here, behind #ifndef, so a build with no EP_* variable set passes no -D
// and compiles exactly these values; lck_ep/knobs.py validates a set value before nvcc runs and the
// static_asserts below repeat the ranges for anyone compiling these headers by hand.
#pragma once

#include <stdint.h>

// Sub-part geometry of the scale-out kernels: a channel's token stream is cut into parts, each part
// into EP_NUM_SUB_PARTS sub-parts sent as one batched put apiece; a sub-part carries at least
// EP_MIN_SUB_TOKENS tokens (EP_SM100_MIN_SUB_TOKENS on Blackwell, where a put costs more to issue).
#ifndef EP_NUM_SUB_PARTS
#define EP_NUM_SUB_PARTS 2
#endif
#ifndef EP_MIN_SUB_TOKENS
#define EP_MIN_SUB_TOKENS 1
#endif
#ifndef EP_SM100_MIN_SUB_TOKENS
#define EP_SM100_MIN_SUB_TOKENS 15
#endif
// Width of the signed integer holding a top-k expert index on the device (-1 = no expert).
#ifndef EP_NUM_TOPK_IDX_BITS
#define EP_NUM_TOPK_IDX_BITS 64
#endif

static_assert(EP_NUM_SUB_PARTS >= 1 && EP_NUM_SUB_PARTS <= 16, "EP_NUM_SUB_PARTS must be in [1, 16]");
static_assert(EP_MIN_SUB_TOKENS >= 1 && EP_MIN_SUB_TOKENS <= 65536, "EP_MIN_SUB_TOKENS must be in [1, 65536]");
static_assert(EP_SM100_MIN_SUB_TOKENS >= 1 && EP_SM100_MIN_SUB_TOKENS <= 65536,
              "EP_SM100_MIN_SUB_TOKENS must be in [1, 65536]");

#if EP_NUM_TOPK_IDX_BITS == 64
typedef int64_t ep_topk_idx_t;
#elif EP_NUM_TOPK_IDX_BITS == 32
typedef int32_t ep_topk_idx_t;
#elif EP_NUM_TOPK_IDX_BITS == 16
typedef int16_t ep_topk_idx_t;
#elif EP_NUM_TOPK_IDX_BITS == 8
typedef int8_t ep_topk_idx_t;
#else
#error "EP_NUM_TOPK_IDX_BITS must be 8, 16, 32 or 64"
#endif

namespace lck_ep {
constexpr int kNumSubParts = EP_NUM_SUB_PARTS;
constexpr int kMinSubTokens = EP_MIN_SUB_TOKENS;
constexpr int kSm100MinSubTokens = EP_SM100_MIN_SUB_TOKENS;
}  // namespace lck_ep
