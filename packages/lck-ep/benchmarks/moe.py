"""Benchmark script of the MoE experts layer; the same module backs ``lck bench moe``.

python packages/lck-ep/benchmarks/moe.py [--out DIR] [--iters N] [--only PROVIDER ...] [--cpu]
"""

from lck_ep.moe.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
