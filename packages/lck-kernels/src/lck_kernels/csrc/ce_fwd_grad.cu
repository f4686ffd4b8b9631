// Cross-entropy loss and gradient in one read of the logits: each row is split over a thread-block
// cluster, every block keeps its slice of the row in shared memory between the statistics pass and the
// gradient pass, and the blocks merge their partial statistics through distributed shared memory.
//
// Why: a single block per row must re-read its 256 KiB row (128256 bf16 logits) for the gradient pass, and
// with one such row per SM in flight the re-read misses L2 (three passes of HBM traffic). A cluster's
// blocks are scheduled together by the hardware, so waiting for partners is a cluster barrier (no polling
// of global memory, no deadlock when the GPU is busy), and a slice of 1/CLUSTER of the row fits shared
// memory twice over: the next row's slice streams in (cp.async) while the current one is reduced and
// written. HBM traffic is one read and one write per logit.
//
// Compile-time: LCK_CE_DTYPE (0 bf16, 1 fp16, 2 fp32), LCK_CE_SOFTCAP (0/1). Everything else is a
// parameter. The math follows the Triton kernels of _cross_entropy_kernels.py (same coefficients, base 2):
//   z = softcap·tanh(scale·x/softcap) (or scale·x), lse = log Σ exp z,
//   ∂L/∂z_c = A·p_c − B·[c = t] − C,  p_c = exp(z_c − lse),  then × (1 − (z_c/softcap)²) and × scale,
//   A = cw·((1−ε)·w_t + ε) + 2·cz·ζ·lse,  B = cw·(1−ε)·w_t,  C = cw·ε/V  (no class weights on this path).
// Rows: loss = (1−ε)·w_t·(lse − z_t) + ε/V·(V·lse − Σ z), z-loss ζ·lse², both 0 for an ignored target and
// NaN for a target outside [0, V).

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace cg = cooperative_groups;

#if LCK_CE_DTYPE == 0
typedef __nv_bfloat16 elem_t;
__device__ __forceinline__ float to_f32(elem_t v) { return __bfloat162float(v); }
__device__ __forceinline__ elem_t from_f32(float v) { return __float2bfloat16_rn(v); }
#elif LCK_CE_DTYPE == 1
typedef __half elem_t;
__device__ __forceinline__ float to_f32(elem_t v) { return __half2float(v); }
__device__ __forceinline__ elem_t from_f32(float v) { return __float2half_rn(v); }
#elif LCK_CE_DTYPE == 2
typedef float elem_t;
__device__ __forceinline__ float to_f32(elem_t v) { return v; }
__device__ __forceinline__ elem_t from_f32(float v) { return v; }
#else
#error "LCK_CE_DTYPE must be 0 (bf16), 1 (fp16) or 2 (fp32)"
#endif

constexpr int VEC = 16 / sizeof(elem_t);  // elements per 16-byte vector
constexpr int MAX_WARPS = 32;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr float NEG_START = -3.0e38f;  // finite: a slice of -inf logits never computes (-inf) - (-inf)

union Vec {
  uint4 raw;
  elem_t e[VEC];
};

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The logit in base 2 (z·log2 e): with a cap, the exp-based tanh of the Triton kernels.
__device__ __forceinline__ float logit2(float x, float scale, float softcap) {
#if LCK_CE_SOFTCAP
  const float u = x * scale / softcap;
  const float t = 1.0f - 2.0f / (fast_exp2(2.0f * LOG2E * u) + 1.0f);
  return softcap * t * LOG2E;
#else
  return x * (scale * LOG2E);
#endif
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// (m, s) pairs merge as max-rescaled sums: s·2^(m − M) + s'·2^(m' − M).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  s = s * fast_exp2(m - mx) + s2 * fast_exp2(m2 - mx);
  m = mx;
}

struct Record {  // one block's partial statistics of one row, read by its cluster partners
  float m, s, sw;
};

struct RowCoef {  // broadcast to every thread of a block after the cluster merge
  float lse2, a, b, c;
  long long t_local;  // target column relative to this block's slice start; -1 when not in it
};

// Issue the cp.async copies of this block's slice of `row` into `buf` (thread-owned vectors only).
__device__ __forceinline__ void load_slice(uint4* buf, const elem_t* x, long long x_stride, long long row,
                                           long long c0, long long c1, int vpt) {
  const elem_t* src = x + row * x_stride;
  for (int j = 0; j < vpt; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    const long long col = c0 + static_cast<long long>(v) * VEC;
    long long left = c1 - col;
    const int bytes = left <= 0 ? 0 : (left >= VEC ? 16 : static_cast<int>(left) * static_cast<int>(sizeof(elem_t)));
    // A zero-byte copy reads nothing and zero-fills; point it at the row start, a valid address.
    cp_async_16(&buf[v], bytes ? static_cast<const void*>(src + col) : static_cast<const void*>(src), bytes);
  }
}

extern "C" __global__ void __launch_bounds__(1024, 1) lck_ce_fwd_grad(
    const elem_t* __restrict__ x, long long x_stride, elem_t* grad, long long grad_stride,
    const long long* __restrict__ target, const float* __restrict__ red, float* __restrict__ loss,
    float* __restrict__ zloss, float* __restrict__ lse_out, float* __restrict__ applied, int n_rows,
    long long n_cols, long long chunk, int vpt, long long ignore_index, float eps, float z_scale, float scale,
    float softcap, int smooth, int has_z) {
  // `grad` may be `x` itself: a block reads its whole slice (into shared memory, and the target logit) before
  // the cluster barrier of that row and writes the slice only after it, and no two blocks share columns.
  extern __shared__ uint4 smem[];  // two slices of blockDim.x · vpt vectors
  __shared__ Record records[2];
  __shared__ RowCoef coef[2];
  __shared__ float warp_m[MAX_WARPS], warp_s[MAX_WARPS], warp_sw[MAX_WARPS];

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int csize = static_cast<int>(cluster.num_blocks());
  const int cid = blockIdx.x / csize;
  const int n_clusters = gridDim.x / csize;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int n_warps = (blockDim.x + 31) >> 5;
  const long long c0 = rank * chunk;
  const long long c1 = c0 + chunk < n_cols ? c0 + chunk : n_cols;
  const int slice_vecs = blockDim.x * vpt;
  const float wsum = red[4];
  const float cw = red[2];
  const float cz = red[3];

  if (cid < n_rows) {
    load_slice(smem, x, x_stride, cid, c0, c1, vpt);
  }
  cp_async_commit();

  int it = 0;
  for (int row = cid; row < n_rows; row += n_clusters, ++it) {
    const int b = it & 1;
    uint4* cur = smem + b * slice_vecs;
    const int next = row + n_clusters;
    if (next < n_rows) {
      // The other buffer held the previous row; this thread's last reads of its own vectors there are done.
      load_slice(smem + (b ^ 1) * slice_vecs, x, x_stride, next, c0, c1, vpt);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this row's copies (own vectors: visible to this thread without a block barrier)

    // The lead block's thread 0 reads the target and its logit now, before this row's cluster barrier.
    long long t = 0;
    float zt = 0.0f;
    if (threadIdx.x == 0) {
      t = target[row];
      if (rank == 0 && t != ignore_index && t >= 0 && t < n_cols) {
        zt = logit2(to_f32(x[static_cast<long long>(row) * x_stride + t]), scale, softcap) * LN2;
      }
    }

    // Statistics of the slice: per-thread online max / sum of 2^(z2 − m), one extra exp2 per vector.
    float m = NEG_START, s = 0.0f, sw = 0.0f;
    for (int j = 0; j < vpt; ++j) {
      const int v = threadIdx.x + j * blockDim.x;
      const long long col = c0 + static_cast<long long>(v) * VEC;
      if (col >= c1) break;
      Vec u;
      u.raw = cur[v];
      const int nv = c1 - col >= VEC ? VEC : static_cast<int>(c1 - col);
      float z[VEC];
      float vmax = NEG_START;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        z[k] = logit2(to_f32(u.e[k]), scale, softcap);
        if (k < nv) vmax = fmaxf(vmax, z[k]);
      }
      const float mn = fmaxf(m, vmax);
      float acc = 0.0f, zs = 0.0f;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (k < nv) {
          acc += fast_exp2(z[k] - mn);
          zs += z[k];
        }
      }
      s = s * fast_exp2(m - mn) + acc;
      sw += zs;
      m = mn;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
      const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
      merge(m, s, m2, s2);
      sw += __shfl_xor_sync(0xffffffffu, sw, off);
    }
    if (lane == 0) {
      warp_m[warp] = m;
      warp_s[warp] = s;
      warp_sw[warp] = sw;
    }
    __syncthreads();
    if (warp == 0) {
      m = lane < n_warps ? warp_m[lane] : NEG_START;
      s = lane < n_warps ? warp_s[lane] : 0.0f;
      sw = lane < n_warps ? warp_sw[lane] : 0.0f;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        merge(m, s, m2, s2);
        sw += __shfl_xor_sync(0xffffffffu, sw, off);
      }
      if (lane == 0) records[b] = Record{m, s, sw};
    }
    // Publishes records[b] to the partners; the record is rewritten two rows later, after the next barrier,
    // which every partner reaches only once done reading it.
    cluster.sync();

    if (warp == 0) {
      float rm = NEG_START, rs = 0.0f, rsw = 0.0f;
      if (lane < csize) {
        const Record* r = cluster.map_shared_rank(&records[b], lane);
        rm = r->m;
        rs = r->s;
        rsw = r->sw;
      }
      // The same butterfly over the same values in every block: every block gets the same lse, bit for bit.
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, rm, off);
        const float s2 = __shfl_xor_sync(0xffffffffu, rs, off);
        merge(rm, rs, m2, s2);
        rsw += __shfl_xor_sync(0xffffffffu, rsw, off);
      }
      if (lane == 0) {
        const float lse2 = rm + __log2f(rs);
        const float lse = lse2 * LN2;
        const bool valid = t != ignore_index;
        const bool in_range = t >= 0 && t < n_cols;
        const float w_t = valid && in_range ? 1.0f : 0.0f;
        const float ct = valid ? cw * (1.0f - eps) * w_t : 0.0f;
        const float cc = valid ? cw * eps / static_cast<float>(n_cols) : 0.0f;
        float ca = ct + cc * wsum;
        if (has_z && valid) ca += cz * 2.0f * z_scale * lse;
        if (valid && !in_range) ca = __int_as_float(0x7fc00000);  // NaN gradient for a bad target
        coef[b] = RowCoef{lse2, ca, ct, cc, (valid && in_range && t >= c0 && t < c1) ? t - c0 : -1};
        if (rank == 0) {
          float ce = (1.0f - eps) * w_t * (lse - zt);
          if (smooth) ce += eps / static_cast<float>(n_cols) * (wsum * lse - rsw * LN2);
          ce = valid ? (in_range ? ce : __int_as_float(0x7fc00000)) : 0.0f;
          loss[row] = ce;
          lse_out[row] = lse;
          if (has_z) zloss[row] = valid ? z_scale * lse * lse : 0.0f;
          applied[row] = 1.0f;
        }
      }
    }
    __syncthreads();

    // Gradient of the slice from shared memory.
    const RowCoef rc = coef[b];
    elem_t* g = grad + static_cast<long long>(row) * grad_stride + c0;
    for (int j = 0; j < vpt; ++j) {
      const int v = threadIdx.x + j * blockDim.x;
      const long long off = static_cast<long long>(v) * VEC;
      if (c0 + off >= c1) break;
      Vec u, o;
      u.raw = cur[v];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float z2 = logit2(to_f32(u.e[k]), scale, softcap);
        float d = fast_exp2(z2 - rc.lse2) * rc.a - rc.c;
        if (off + k == rc.t_local) d -= rc.b;
#if LCK_CE_SOFTCAP
        const float r = z2 * LN2 / softcap;
        d *= 1.0f - r * r;
#endif
        o.e[k] = from_f32(d * scale);
      }
      if (c1 - (c0 + off) >= VEC) {
        __stcs(reinterpret_cast<uint4*>(g + off), o.raw);  // streamed: the gradient's next reader is a GEMM
      } else {
        const int nv = static_cast<int>(c1 - (c0 + off));
        for (int k = 0; k < nv; ++k) g[off + k] = o.e[k];
      }
    }
  }
  cp_async_wait<0>();
  // No block may exit while a partner can still read its records.
  cluster.sync();
}
