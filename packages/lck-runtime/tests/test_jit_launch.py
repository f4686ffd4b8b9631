"""Launching JIT kernels on a GPU: typed arguments, streams, cooperative and cluster launches, large
dynamic shared memory, CUDA graphs, and driver errors surfacing with the CUDA error name."""

from __future__ import annotations

import pytest
import torch
from _kernels import TYPED

from lck_runtime.jit import F32, I32, I64, U64, CudaError, Jit, JitConfigError, Ptr, detect_arch

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]

COOPERATIVE = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
extern "C" __global__ void grid_exchange(int* slots, int* out) {
  cg::grid_group grid = cg::this_grid();
  if (threadIdx.x == 0) slots[blockIdx.x] = 3 * blockIdx.x + 1;
  grid.sync();
  if (threadIdx.x == 0) out[blockIdx.x] = slots[(blockIdx.x + 1) % gridDim.x] + (grid.is_valid() ? 1000000 : 0);
}
extern "C" __global__ void noop(int* out) {
  if (out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) out[0] = 1;
}
"""

SMEM = r"""
extern "C" __global__ void smem_reverse(const float* x, float* out, int per_block) {
  extern __shared__ float buf[];
  const float* src = x + (long long)blockIdx.x * per_block;
  for (int i = threadIdx.x; i < per_block; i += blockDim.x) buf[i] = src[i];
  __syncthreads();
  for (int i = threadIdx.x; i < per_block; i += blockDim.x)
    out[(long long)blockIdx.x * per_block + i] = buf[per_block - 1 - i];
}
"""

CLUSTER = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
extern "C" __global__ void cluster_ids(int* out) {
  cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = (int)cluster.block_rank();
    out[2 * blockIdx.x + 1] = (int)cluster.num_blocks();
  }
}
"""

COPY = r"""
extern "C" __global__ void copy_f32(const float* src, float* dst, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i];
}
"""


@pytest.fixture(scope="module")
def jit(tmp_path_factory):
    return Jit(cache_dir=tmp_path_factory.mktemp("jit-gpu"))


def _sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def test_typed_arguments(jit):
    k = jit.build("typed_args", TYPED, "typed_args")
    assert k.arch == detect_arch()
    n = 3000
    x = torch.rand(n, device="cuda", dtype=torch.float32) + 0.5
    out = torch.full((n,), float("nan"), device="cuda")
    scalars = torch.full((5,), -7, dtype=torch.int64, device="cuda")
    a, b, c, d = -1_234_567, -(2**40) + 7, 2**63 + 12_345, 1.7
    k.launch((n + 255) // 256, 256, [out, scalars, I32(a), I64(b), U64(c), F32(d), x, I32(n)])
    torch.cuda.synchronize()
    assert scalars.tolist() == [a, b, c - 2**64, c >> 32, n]
    ref = x.double() * torch.tensor(d, dtype=torch.float32).double()
    torch.testing.assert_close(out.double(), ref, rtol=1.2e-7, atol=0)

    # A raw pointer in place of a tensor, another scale, and a grid given as a tuple.
    out2 = torch.full((n,), float("nan"), device="cuda")
    k.launch(
        ((n + 127) // 128, 1, 1),
        (128,),
        [out2, scalars, I32(1), I64(2), U64(3), F32(-0.25), Ptr(x.data_ptr()), I32(n)],
    )
    torch.cuda.synchronize()
    torch.testing.assert_close(out2.double(), x.double() * -0.25, rtol=1.2e-7, atol=0)
    assert scalars.tolist() == [1, 2, 3, 0, n]
    attrs = k.attributes()
    assert attrs["num_regs"] > 0 and attrs["max_threads_per_block"] >= 256


def test_argument_checks(jit):
    k = jit.build("typed_args", TYPED, "typed_args")
    x = torch.rand(16, device="cuda")
    out = torch.empty(16, device="cuda")
    s = torch.empty(5, dtype=torch.int64, device="cuda")
    good = [out, s, I32(1), I64(2), U64(3), F32(1.0), x, I32(16)]
    wrong_size = [*good[:2], I64(1), *good[3:]]
    with pytest.raises(
        TypeError, match=r"args\[2\] is I64 \(8 bytes\) but parameter 2 of typed_args is 4 bytes"
    ):
        k.launch(1, 32, wrong_size)
    with pytest.raises(ValueError, match=r"typed_args takes 8 parameters .* but 7 args were given"):
        k.launch(1, 32, good[:-1])
    with pytest.raises(TypeError, match=r"args\[7\] is a plain int"):
        k.launch(1, 32, [*good[:-1], 16])
    with pytest.raises(ValueError, match=r"args\[6\] is a tensor on cpu"):
        k.launch(1, 32, [*good[:6], x.cpu(), I32(16)])
    with pytest.raises(ValueError, match=r"block \(1025, 1, 1\) exceeds 1024 threads"):
        k.launch(1, 1025, good)
    with pytest.raises(ValueError, match="grid entries must be positive"):
        k.launch(0, 32, good)
    with pytest.raises(ValueError, match="shared_mem must be a non-negative int"):
        k.launch(1, 32, good, shared_mem=-1)
    with pytest.raises(TypeError, match=r"stream must be a torch\.cuda\.Stream"):
        k.launch(1, 32, good, stream=0)
    with pytest.raises(ValueError, match=r"cluster \(3, 1, 1\) must divide grid \(4, 1, 1\)"):
        k.launch(4, 32, good, cluster=3)
    torch.cuda.synchronize()


def test_launch_uses_the_given_stream(jit):
    k = jit.build("copy_f32", COPY, "copy_f32")
    n = 1 << 16
    src = torch.full((n,), float("nan"), device="cuda")
    dst = torch.full((n,), -1.0, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of ms: the copy must wait for the fill behind it
        src.fill_(2.5)
    k.launch(n // 256, 256, [src, dst, I32(n)], stream=side)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(dst, torch.full_like(dst, 2.5)), "the kernel did not run in order on the given stream"


def test_cooperative_launch(jit):
    k = jit.build("grid_exchange", COOPERATIVE, "grid_exchange")
    blocks = _sms()
    slots = torch.full((blocks,), -7, dtype=torch.int32, device="cuda")
    out = torch.full((blocks,), -7, dtype=torch.int32, device="cuda")
    k.launch(blocks, 128, [slots, out], cooperative=True)
    torch.cuda.synchronize()
    expect = (3 * ((torch.arange(blocks, device="cuda") + 1) % blocks) + 1 + 1_000_000).to(torch.int32)
    assert torch.equal(out, expect)
    # Far more blocks than can be co-resident: only a cooperative launch is refused, by the driver.
    noop = jit.build("grid_exchange", COOPERATIVE, "noop")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(
        CudaError, match="cuLaunchKernelEx failed: CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"
    ) as err:
        noop.launch(blocks * 64, 1024, [flag], cooperative=True)
    assert (
        err.value.call == "cuLaunchKernelEx"
        and err.value.code_name == "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"
    )
    noop.launch(blocks * 64, 1024, [flag])
    torch.cuda.synchronize()
    assert flag.item() == 1


def test_large_dynamic_shared_memory(jit):
    k = jit.build("smem_reverse", SMEM, "smem_reverse")
    per_block = 100 * 1024 // 4  # 100 KiB of floats: above the 48 KiB default limit
    blocks = 6
    x = torch.randn(blocks * per_block, device="cuda")
    out = torch.full_like(x, float("nan"))
    k.launch(blocks, 512, [x, out, I32(per_block)], shared_mem=per_block * 4)
    torch.cuda.synchronize()
    assert torch.equal(out, x.view(blocks, per_block).flip(1).reshape(-1))
    with pytest.raises(CudaError, match=r"cuFuncSetAttribute failed: CUDA_ERROR_INVALID_VALUE"):
        k.launch(1, 512, [x, out, I32(per_block)], shared_mem=400 * 1024)


@pytest.mark.parametrize("cluster", [None, 2, 4])
def test_cluster_launch(jit, cluster):
    k = jit.build("cluster_ids", CLUSTER, "cluster_ids")
    blocks = 16
    out = torch.full((blocks, 2), -1, dtype=torch.int32, device="cuda")
    k.launch(blocks, 64, [out], cluster=cluster)
    torch.cuda.synchronize()
    size = cluster or 1
    b = torch.arange(blocks, device="cuda", dtype=torch.int32)
    assert torch.equal(out[:, 0], b % size) and torch.equal(out[:, 1], torch.full_like(b, size))


def test_max_active_clusters(jit):
    """How many clusters fit the GPU at once: with 150 KiB of shared memory a block has an SM to itself, so
    at most SMs/2 clusters of two (fewer where a GPU processing cluster has an odd SM left over)."""
    k = jit.build("cluster_ids", CLUSTER, "cluster_ids")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    two = k.max_active_clusters(256, 2, shared_mem=150 * 1024)
    assert two is not None and sms // 4 <= two <= sms // 2, (two, sms)
    assert k.max_active_clusters(64, 1) >= sms, "small blocks: several per SM"
    with pytest.raises(ValueError, match="shared_mem"):
        k.max_active_clusters(64, 2, shared_mem=-1)
    with pytest.raises(ValueError, match="cluster entries must be positive"):
        k.max_active_clusters(64, 0)


def test_cuda_graph_capture_and_replay(jit):
    k = jit.build("copy_f32", COPY, "copy_f32")
    k.load()  # module loading stays outside the captured region
    n = 4096
    src = torch.randn(n, device="cuda")
    dst = torch.full_like(src, float("nan"))
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        k.launch(n // 128, 128, [src, dst, I32(n)])
    for _ in range(3):
        src.copy_(torch.randn(n, device="cuda"))
        dst.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dst, src)


def test_wrong_architecture_refused(jit):
    other = "sm_100a" if detect_arch() == "sm_90a" else "sm_90a"
    k = jit.build("copy_f32", COPY, "copy_f32", arch=other)
    x = torch.zeros(4, device="cuda")
    with pytest.raises(JitConfigError, match=f"built for {other} but cuda:"):
        k.launch(1, 32, [x, x, I32(4)])


@pytest.mark.multigpu(2)
def test_launch_on_a_second_device(jit):
    k = jit.build("copy_f32", COPY, "copy_f32")
    with torch.cuda.device(1):
        src = torch.randn(1000, device="cuda:1")
        dst = torch.full_like(src, float("nan"))
        k.launch(4, 256, [src, dst, I32(1000)])
        torch.cuda.synchronize(1)
    assert torch.equal(dst, src)
    with pytest.raises(
        ValueError, match=r"args\[0\] is a tensor on cuda:1, expected a CUDA tensor on cuda:0"
    ):
        k.launch(4, 256, [src, dst, I32(1000)])
