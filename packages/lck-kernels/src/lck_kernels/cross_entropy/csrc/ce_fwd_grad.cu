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

// Eight (or four) floats rounded into one 16-byte vector, in registers (indexing a union's elements with
// a runtime index would put it in local memory).
__device__ __forceinline__ uint4 pack(const float (&d)[VEC]) {
  uint4 o;
#if LCK_CE_DTYPE == 2
  o.x = __float_as_uint(d[0]);
  o.y = __float_as_uint(d[1]);
  o.z = __float_as_uint(d[2]);
  o.w = __float_as_uint(d[3]);
#else
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#if LCK_CE_DTYPE == 0
    __nv_bfloat162 h = __floats2bfloat162_rn(d[2 * i], d[2 * i + 1]);
#else
    __half2 h = __floats2half2_rn(d[2 * i], d[2 * i + 1]);
#endif
    w[i] = *reinterpret_cast<unsigned*>(&h);
  }
  o = make_uint4(w[0], w[1], w[2], w[3]);
#endif
  return o;
}

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

// A butterfly over the warp: every lane ends with the warp's merged (m, s) and Σ sw.
__device__ __forceinline__ void warp_merge(float& m, float& s, float& sw, int smooth) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
    merge(m, s, m2, s2);
    if (smooth) sw += __shfl_xor_sync(0xffffffffu, sw, off);
  }
}

struct Record {  // one block's partial statistics of one row, pushed into every partner's inbox
  float m, s, sw;
};

struct RowCoef {  // what the gradient pass of one row needs, the same in every thread of the cluster
  float lse2, a, b, c;
  long long t_local;  // target column relative to this block's slice start; -1 when not in it
  long long row;
};

// .aligned: every thread of a warp executes the barrier together; the loops before it may exit per thread.
__device__ __forceinline__ void cluster_arrive() {
  __syncwarp();
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  __syncwarp();
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Issue the cp.async copies of this block's slice of `row` into `buf`: the vectors this thread will read.
__device__ __forceinline__ void load_slice(uint4* buf, const elem_t* x, long long x_stride, long long row,
                                           long long c0, long long c1, int vpt) {
  const elem_t* src = x + row * x_stride;
  for (int j = 0; j < vpt; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    const long long col = c0 + static_cast<long long>(v) * VEC;
    if (col >= c1) break;
    const long long left = c1 - col;
    cp_async_16(&buf[v], src + col, left >= VEC ? 16 : static_cast<int>(left * sizeof(elem_t)));
  }
}

// The gradient of one vector: d = (p·a − c − b·[lane = kt]) (× the cap's derivative), with `scale` already
// folded into a, b, c. TARGET: this vector holds the row's target (one vector per row: the per-lane
// select stays out of the common path).
template <bool TARGET>
__device__ __forceinline__ uint4 grad_vec(const Vec& u, const RowCoef& rc, int kt, float scale, float s2,
                                          float softcap, float (&d)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
#if LCK_CE_SOFTCAP
    const float z2 = logit2(to_f32(u.e[k]), scale, softcap);
    float dk = fmaf(fast_exp2(z2 - rc.lse2), rc.a, -rc.c);
    if (TARGET && k == kt) dk -= rc.b;
    const float r = z2 * LN2 / softcap;
    d[k] = dk * (1.0f - r * r);
#else
    float dk = fmaf(fast_exp2(fmaf(to_f32(u.e[k]), s2, -rc.lse2)), rc.a, -rc.c);
    if (TARGET && k == kt) dk -= rc.b;
    d[k] = dk;
#endif
  }
  return pack(d);
}

// ∂L/∂x of this block's slice of one row, from the slice in shared memory; streamed to global memory.
__device__ __forceinline__ void grad_slice(const uint4* buf, elem_t* grad, long long grad_stride, const RowCoef& rc,
                                           long long c0, long long c1, int vpt, float scale, float softcap) {
  elem_t* g = grad + rc.row * grad_stride + c0;
  const float s2 = scale * LOG2E;
  const int len = static_cast<int>(c1 - c0);  // a slice is at most 72 KiB
  for (int j = 0; j < vpt; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    const int off = v * VEC;
    if (off >= len) break;
    Vec u;
    u.raw = buf[v];
    const int kt = static_cast<int>(rc.t_local) - off;  // the target's lane in this vector, if in [0, VEC)
    float d[VEC];
    const uint4 o = (kt >= 0 && kt < VEC) ? grad_vec<true>(u, rc, kt, scale, s2, softcap, d)
                                          : grad_vec<false>(u, rc, kt, scale, s2, softcap, d);
    if (len - off >= VEC) {
      __stcs(reinterpret_cast<uint4*>(g + off), o);  // streamed: the gradient's next reader is a GEMM
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (k < len - off) g[off + k] = from_f32(d[k]);
      }
    }
  }
}

constexpr int NBUF = 3;  // slices in shared memory: gradient pending, statistics now, loading next

extern "C" __global__ void __launch_bounds__(1024, 1) lck_ce_fwd_grad(
    const elem_t* __restrict__ x, long long x_stride, elem_t* grad, long long grad_stride,
    const long long* __restrict__ target, const float* __restrict__ red, float* __restrict__ loss,
    float* __restrict__ zloss, float* __restrict__ lse_out, float* __restrict__ applied, int n_rows,
    long long n_cols, long long chunk, int vpt, long long ignore_index, float eps, float z_scale, float scale,
    float softcap, int smooth, int has_z) {
  // Software pipeline over this cluster's rows i = 0, 1, ...: while row i+1 streams into shared memory,
  // the block reduces row i, arrives at the cluster barrier of row i (split phase), writes the gradient of
  // row i-1, and only then waits for its partners' statistics of row i, so the barrier's latency hides
  // behind a pass over the slice. `grad` may be `x` itself: a block has read its whole slice of a row
  // (and the target logit) before arriving at that row's barrier, and a block writes a row's slice only
  // after waiting at it; no two blocks share columns.
  extern __shared__ uint4 smem[];  // NBUF slices of chunk / VEC vectors
  // inbox[b][r]: block r's record of the current (b = row parity) row, written by block r itself through
  // distributed shared memory, so the merge reads only local shared memory.
  __shared__ Record inbox[2][8];
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
  const int slice_vecs = static_cast<int>(chunk / VEC);
  const int n_iter = cid < n_rows ? (n_rows - 1 - cid) / n_clusters + 1 : 0;
  const float wsum = red[4];
  const float cw = red[2];
  const float cz = red[3];

  if (n_iter > 0) load_slice(smem, x, x_stride, cid, c0, c1, vpt);
  cp_async_commit();

  RowCoef prev{0.0f, 0.0f, 0.0f, 0.0f, -1, 0};
  for (int i = 0; i < n_iter; ++i) {
    const long long row = cid + static_cast<long long>(i) * n_clusters;
    const int b = i & 1;
    const uint4* cur = smem + (i % NBUF) * slice_vecs;
    if (i + 1 < n_iter) load_slice(smem + ((i + 1) % NBUF) * slice_vecs, x, x_stride, row + n_clusters, c0, c1, vpt);
    cp_async_commit();
    cp_async_wait<1>();  // row i's copies (this thread's own vectors: no block barrier needed to read them)

    const long long t = target[row];  // one address for the whole block
    const bool valid = t != ignore_index;
    const bool in_range = t >= 0 && t < n_cols;
    float zt = 0.0f;
    if (rank == 0 && threadIdx.x == 0 && valid && in_range) {
      zt = logit2(to_f32(x[row * x_stride + t]), scale, softcap) * LN2;
    }

    // Statistics of the slice: per-thread online max / sum of 2^(z2 - m), one extra exp2 per vector.
    float m = NEG_START, s = 0.0f, sw = 0.0f;
    const int len = static_cast<int>(c1 - c0);
    for (int j = 0; j < vpt; ++j) {
      const int off = (threadIdx.x + j * blockDim.x) * VEC;
      if (off >= len) break;
      Vec u;
      u.raw = cur[off / VEC];
      float z[VEC];
      float vmax = NEG_START;
      if (len - off >= VEC) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          z[k] = logit2(to_f32(u.e[k]), scale, softcap);
          vmax = fmaxf(vmax, z[k]);
        }
      } else {  // the slice's last, partial vector: lanes past the row end count as -inf
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          z[k] = k < len - off ? logit2(to_f32(u.e[k]), scale, softcap) : -INFINITY;
          vmax = fmaxf(vmax, z[k]);
        }
      }
      const float mn = fmaxf(m, vmax);
      float acc = 0.0f;
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc += fast_exp2(z[k] - mn);
      s = s * fast_exp2(m - mn) + acc;
      m = mn;
      if (smooth) {
        float zs = 0.0f;
#pragma unroll
        for (int k = 0; k < VEC; ++k) zs += k < len - off ? z[k] : 0.0f;
        sw += zs;
      }
    }
    warp_merge(m, s, sw, smooth);
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
      warp_merge(m, s, sw, smooth);
      if (lane < csize) *cluster.map_shared_rank(&inbox[b][rank], lane) = Record{m, s, sw};
    }
    // Split-phase barrier: arrive publishes the records pushed to the partners (and ends this block's reads
    // of row i's logits); an inbox slot is rewritten two rows later, after the next wait, which needs its
    // owner to have arrived at row i+1, after reading it.
    cluster_arrive();
    if (i > 0) grad_slice(smem + ((i - 1) % NBUF) * slice_vecs, grad, grad_stride, prev, c0, c1, vpt, scale, softcap);
    cluster_wait();

    // Every thread merges the cluster's records in rank order: the same lse, bit for bit, everywhere.
    float rm = NEG_START, rs = 0.0f, rsw = 0.0f;
#pragma unroll 1
    for (int r = 0; r < csize; ++r) {
      const Record rec = inbox[b][r];
      rsw += rec.sw;
      merge(rm, rs, rec.m, rec.s);
    }
    const float lse2 = rm + __log2f(rs);
    const float lse = lse2 * LN2;
    const float w_t = valid && in_range ? 1.0f : 0.0f;
    const float ct = valid ? cw * (1.0f - eps) * w_t : 0.0f;
    const float cc = valid ? cw * eps / static_cast<float>(n_cols) : 0.0f;
    float ca = ct + cc * wsum;
    if (has_z && valid) ca += cz * 2.0f * z_scale * lse;
    if (valid && !in_range) ca = __int_as_float(0x7fc00000);  // NaN gradient for a bad target
    // The logits' scale multiplies the whole gradient: folded into the three coefficients.
    prev = RowCoef{lse2, ca * scale, ct * scale, cc * scale, (valid && in_range && t >= c0 && t < c1) ? t - c0 : -1, row};
    if (rank == 0 && threadIdx.x == 0) {
      float ce = (1.0f - eps) * w_t * (lse - zt);
      if (smooth) ce += eps / static_cast<float>(n_cols) * (wsum * lse - rsw * LN2);
      loss[row] = valid ? (in_range ? ce : __int_as_float(0x7fc00000)) : 0.0f;
      lse_out[row] = lse;
      if (has_z) zloss[row] = valid ? z_scale * lse * lse : 0.0f;
      applied[row] = 1.0f;
    }
  }
  if (n_iter > 0) grad_slice(smem + ((n_iter - 1) % NBUF) * slice_vecs, grad, grad_stride, prev, c0, c1, vpt, scale, softcap);
  cp_async_wait<0>();
  // Partners write into a block's inbox only before arriving at a barrier this block has waited at; one last
  // barrier all the same, so no block exits while its cluster is still running.
  cluster_arrive();
  cluster_wait();
}
