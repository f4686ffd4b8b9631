"""CUDA sources the JIT launch tests share."""

# Every scalar kind the launcher passes (I32, I64, U64, F32) and pointers: the kernel echoes the scalars
# into `scalars` and scales `x` by `d` into `out`, so a test sees each value arrive intact.
TYPED = r"""
extern "C" __global__ void typed_args(float* out, long long* scalars, int a, long long b,
                                      unsigned long long c, float d, const float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i == 0) {
    scalars[0] = a;
    scalars[1] = b;
    scalars[2] = (long long)c;
    scalars[3] = (long long)(c >> 32);
    scalars[4] = n;
  }
  if (i < n) out[i] = x[i] * d;
}
"""
