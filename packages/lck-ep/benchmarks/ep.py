"""Benchmark script for lck-ep; the same module backs ``lck bench ep``.

python packages/lck-ep/benchmarks/ep.py [--quick] [--gpus N] [--out DIR] [--cpu]
"""

from lck_ep.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
