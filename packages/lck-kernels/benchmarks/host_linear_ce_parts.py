"""The parts of the fused linear cross entropy's host time, on one CUDA GPU (under a minute).

    python packages/lck-kernels/benchmarks/host_linear_ce_parts.py [--out DIR]   (default: $OUT, else here)

At 8192x4096->128256 bf16 (host ms, ``lck_runtime.benchmarking.host_ms``: the GPU kept busy):

- forward+backward of ``fused_linear_cross_entropy`` (mean) by the number of chunks (``max_chunk_tokens``
  8192 to 1024): the slope is what one more chunk costs the host (three GEMMs, a row kernel, the side
  stream's events);
- the GEMMs of one 2048-token chunk one at a time through torch (``torch.mm(out=)``, ``addmm_``), and the same
  GEMMs as one ``cublasGemmEx`` each on torch's own cuBLAS handle through ctypes (cuBLAS's own host cost, with
  the operands torch's column-major mapping gives), with a bit-for-bit comparison of their outputs;
- the same GEMMs as one ``cublasLtMatmul`` each with an algorithm chosen once (what a cached plan costs the
  host), and which of cublasLt's heuristic candidates, under four workspace limits, give torch's bits, there and
  at two smaller shapes;
- for scale, one elementwise op (``x * 2``) and one ``torch.empty``.

Prints all and writes ``host-linear-ce-parts-<gpu>-<date>.json`` with provenance.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import os
from pathlib import Path

import torch

from lck_runtime.benchmarking import gpu_slug, host_ms, provenance

_OP = {"n": 0, "t": 1}
# cudaDataType CUDA_R_16BF, cublasComputeType CUBLAS_COMPUTE_32F, cublasGemmAlgo CUBLAS_GEMM_DEFAULT_TENSOR_OP
_BF16, _COMPUTE_32F, _DEFAULT_TENSOR_OP = 14, 68, 99


def _loaded(name: str) -> ctypes.CDLL:
    """The ``name`` library (``libcublas.so``, ``libcublasLt.so``) this process already loaded (torch's): a second
    copy must not touch torch's handle."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if f"/{name}" in line}
    if len(paths) != 1:
        raise RuntimeError(f"expected one loaded {name}, found {sorted(paths)}")
    return ctypes.CDLL(paths.pop())


def _ld_op(t: torch.Tensor) -> tuple[int, int]:
    """A row-major [r, c] operand as cuBLAS sees it: stride (c', 1) is column-major [c, r] with ld c', no
    transpose; stride (1, r') is column-major [r, c] with ld r', transposed."""
    return (t.stride(0), _OP["n"]) if t.stride(1) == 1 else (t.stride(1), _OP["t"])


class _HeuristicResult(ctypes.Structure):
    # cublasLtMatmulHeuristicResult_t: the algo (8 words), its workspace, state, waves, 4 reserved ints.
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # fmt: skip


class _LtGemm:
    """torch's column-major mapping of ``out = a @ b (+ out)`` as one ``cublasLtMatmul`` with an algorithm chosen
    once (heuristic candidate ``index`` under a ``workspace``-byte limit): what a cached plan would cost the host
    per GEMM, and whether any candidate gives cublasGemmEx's bits."""

    handle: ctypes.c_void_p | None = None  # one cublasLt handle for the process

    def __init__(self, lib: ctypes.CDLL, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float,
                 workspace: int, index: int) -> None:  # fmt: skip
        vp = ctypes.c_void_p
        self.lib, self.out, self.a, self.b = lib, out, a, b
        if _LtGemm.handle is None:
            _LtGemm.handle = vp()
            self._ok(lib.cublasLtCreate(ctypes.byref(_LtGemm.handle)), "cublasLtCreate")
        self.desc = vp()
        self._ok(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, 0), "DescCreate")
        m, k = a.shape
        n = b.shape[1]
        ldb, opb = _ld_op(b)
        lda, opa = _ld_op(a)
        for attr, op in ((3, opb), (4, opa)):  # CUBLASLT_MATMUL_DESC_TRANSA / TRANSB
            val = ctypes.c_int32(op)
            self._ok(
                lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(val), 4), "SetAttribute"
            )

        def layout(rows: int, cols: int, ld: int) -> ctypes.c_void_p:
            h = vp()
            self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(h), _BF16, ctypes.c_uint64(rows),
                                                    ctypes.c_uint64(cols), ctypes.c_int64(ld)), "LayoutCreate")  # fmt: skip
            return h

        # cuBLAS's A is b^T (n x k before op), B is a^T (k x m), C is out^T (n x m); stored shapes before op.
        self.la = layout(n, k, ldb) if opb == 0 else layout(k, n, ldb)
        self.lb = layout(k, m, lda) if opa == 0 else layout(m, k, lda)
        self.lc = layout(n, m, out.stride(0))
        pref = vp()
        self._ok(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(workspace)
        self._ok(lib.cublasLtMatmulPreferenceSetAttribute(pref, 1, ctypes.byref(ws), 8), "PreferenceSet")
        results = (_HeuristicResult * 8)()
        count = ctypes.c_int(0)
        self._ok(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.la, self.lb, self.lc, self.lc,
                                                    pref, 8, results, ctypes.byref(count)), "GetHeuristic")  # fmt: skip
        self.candidates = count.value
        self.algo = results[min(index, count.value - 1)]
        self.ws = torch.empty(max(workspace, 1), dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(beta)

    @staticmethod
    def _ok(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"cublasLt {what} returned {rc}")

    def __call__(self) -> None:
        c = ctypes.c_void_p(self.out.data_ptr())
        self._ok(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(self.b.data_ptr()), self.la,
            ctypes.c_void_p(self.a.data_ptr()), self.lb, ctypes.byref(self.beta), c, self.lc, c, self.lc,
            ctypes.byref(self.algo.algo), ctypes.c_void_p(self.ws.data_ptr()), ctypes.c_size_t(self.ws.numel()),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "Matmul")  # fmt: skip


def _gemm_ex(lib: ctypes.CDLL) -> object:
    """out[m, n] = a[m, k] @ b[k, n] (row-major views with unit column stride or unit row stride) as torch maps
    it onto column-major cuBLAS: out^T = b^T a^T, with beta 0 or 1."""
    fn = lib.cublasGemmEx
    fn.restype = ctypes.c_int
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def call(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 0.0) -> None:
        m, k = a.shape
        n = b.shape[1]
        ldb, opb = _ld_op(b)
        lda, opa = _ld_op(a)
        handle = ctypes.c_void_p(torch.cuda.current_blas_handle())
        rc = fn(
            handle,
            opb,
            opa,
            n,
            m,
            k,
            ctypes.byref(one),
            ctypes.c_void_p(b.data_ptr()),
            _BF16,
            ldb,
            ctypes.c_void_p(a.data_ptr()),
            _BF16,
            lda,
            ctypes.byref(one if beta else zero),
            ctypes.c_void_p(out.data_ptr()),
            _BF16,
            out.stride(0),
            _COMPUTE_32F,
            _DEFAULT_TENSOR_OP,
        )
        if rc != 0:
            raise RuntimeError(f"cublasGemmEx returned {rc}")

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    from lck_kernels import fused_linear_cross_entropy

    n, h, v, m = 8192, 4096, 128256, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    out: dict[str, object] = {"blas_backend": str(torch.backends.cuda.preferred_blas_library())}
    by_chunks: dict[int, float | None] = {}
    for tokens in (8192, 4096, 2048, 1024):

        def step(tokens: int = tokens) -> object:
            loss = fused_linear_cross_entropy(x, w, t, chunk_bytes=1 << 40, max_chunk_tokens=tokens)
            return torch.autograd.grad(loss, (x, w))

        by_chunks[n // tokens] = host_ms(step, iters=10)
        print(f"flce fwd+bwd, {n // tokens} chunks: {by_chunks[n // tokens]}", flush=True)
    out["flce_fwd_bwd_by_chunks"] = by_chunks
    import torch.nn.functional as F

    for name, fwd, wrt in (
        ("lck default chunking", lambda: fused_linear_cross_entropy(x, w, t), (x, w)),
        ("torch F.cross_entropy(x @ w.T)", lambda: F.cross_entropy(x @ w.T, t), (x, w)),
        ("floor x * 2", lambda: (x * 2).sum(), (x,)),
    ):
        out[f"fwd+bwd {name}"] = host_ms(lambda f=fwd, r=wrt: torch.autograd.grad(f(), r), iters=10)
        print(f"fwd+bwd {name}: {out[f'fwd+bwd {name}']}", flush=True)

    xc, wd = x.detach()[:m], w.detach()
    logits = torch.randn(m, v, device="cuda", dtype=torch.bfloat16, generator=g)
    gw = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g)
    gx = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
    torch_calls = {
        "mm logits [m,H]@[H,V]": lambda: torch.mm(xc, wd.T, out=logits),
        "mm grad_x [m,V]@[V,H]": lambda: torch.mm(logits, wd, out=gx),
        "mm grad_w [V,m]@[m,H]": lambda: torch.mm(logits.T, xc, out=gw),
        "addmm_ grad_w": lambda: gw.addmm_(logits.T, xc),
        "x * 2": lambda: xc * 2,
        "torch.empty": lambda: torch.empty(m, h, device="cuda", dtype=torch.bfloat16),
    }
    out["torch_host_ms"] = {k: host_ms(fn, iters=30) for k, fn in torch_calls.items()}
    gemm = _gemm_ex(_loaded("libcublas.so"))
    direct = {
        "mm logits [m,H]@[H,V]": lambda: gemm(logits, xc, wd.T),
        "mm grad_x [m,V]@[V,H]": lambda: gemm(gx, logits, wd),
        "mm grad_w [V,m]@[m,H]": lambda: gemm(gw, logits.T, xc),
        "addmm_ grad_w": lambda: gemm(gw, logits.T, xc, beta=1.0),
    }
    out["cublas_gemm_ex_host_ms"] = {k: host_ms(fn, iters=30) for k, fn in direct.items()}
    # Bits: each GEMM through torch and directly, from the same operands (grad_w's accumulate from one start).
    same = {}
    for key, (ref, mine) in {
        "logits": (lambda: torch.mm(xc, wd.T), lambda o: gemm(o, xc, wd.T)),
        "grad_x": (lambda: torch.mm(logits, wd), lambda o: gemm(o, logits, wd)),
        "grad_w": (lambda: torch.mm(logits.T, xc), lambda o: gemm(o, logits.T, xc)),
    }.items():
        expect = ref()
        got = torch.full_like(expect, float("nan"))
        mine(got)
        same[key] = bool(torch.equal(expect, got))
    start = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g)
    a, b = start.clone(), start.clone()
    a.addmm_(logits.T, xc)
    gemm(b, logits.T, xc, beta=1.0)
    same["grad_w accumulate"] = bool(torch.equal(a, b))
    out["direct_equals_torch"] = same
    # cublasLt with an algorithm chosen once: which heuristic candidates (by workspace limit) give torch's bits,
    # at this chunk's GEMMs and at two smaller shapes, and its host cost per call.
    lt = _loaded("libcublasLt.so")
    matches: dict[str, dict[str, object]] = {}
    for mm, hh, vv in ((m, h, v), (1000, 1024, 32000), (13, 256, 1000)):
        xs = torch.randn(mm, hh, device="cuda", dtype=torch.bfloat16, generator=g)
        ws_ = torch.randn(vv, hh, device="cuda", dtype=torch.bfloat16, generator=g)
        ls = torch.randn(mm, vv, device="cuda", dtype=torch.bfloat16, generator=g)
        cases = {
            "logits": (xs, ws_.T, torch.mm(xs, ws_.T)),
            "grad_x": (ls, ws_, torch.mm(ls, ws_)),
            "grad_w": (ls.T, xs, torch.mm(ls.T, xs)),
        }
        for name, (a_, b_, expect) in cases.items():
            for workspace in (0, 1 << 22, 4096 * 1024 * 2 + 16 * 1024 * 8, 1 << 25):
                got = torch.full_like(expect, float("nan"))
                first = _LtGemm(lt, got, a_, b_, 0.0, workspace, 0)
                hits = []
                for index in range(first.candidates):
                    got.fill_(float("nan"))
                    _LtGemm(lt, got, a_, b_, 0.0, workspace, index)()
                    if torch.equal(got, expect):
                        hits.append(index)
                matches[f"{mm}x{hh}x{vv} {name} ws {workspace}"] = {
                    "candidates": first.candidates,
                    "equal": hits,
                }
                print(f"lt {mm}x{hh}x{vv} {name:<7} ws {workspace:>9}: {first.candidates} candidates, "
                      f"torch's bits at {hits}", flush=True)  # fmt: skip
    out["lt_candidates_with_torch_bits"] = matches
    lt_calls = {
        "mm logits [m,H]@[H,V]": _LtGemm(lt, logits, xc, wd.T, 0.0, 1 << 25, 0),
        "mm grad_x [m,V]@[V,H]": _LtGemm(lt, gx, logits, wd, 0.0, 1 << 25, 0),
        "mm grad_w [V,m]@[m,H]": _LtGemm(lt, gw, logits.T, xc, 0.0, 1 << 25, 0),
        "addmm_ grad_w": _LtGemm(lt, gw, logits.T, xc, 1.0, 1 << 25, 0),
    }
    out["cublaslt_host_ms"] = {k: host_ms(fn, iters=30) for k, fn in lt_calls.items()}
    for section in ("torch_host_ms", "cublas_gemm_ex_host_ms", "cublaslt_host_ms", "direct_equals_torch"):
        for k, val in out[section].items():  # type: ignore[union-attr]
            print(f"{section:<24} {k:<26} {val}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host-linear-ce-parts-{gpu_slug()}-{_dt.date.today().isoformat()}.json"
    path.write_text(json.dumps({"provenance": provenance(), **out}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
