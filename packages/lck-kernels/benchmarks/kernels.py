"""Benchmark script for lck-kernels; the same module backs ``lck bench kernels``.

python packages/lck-kernels/benchmarks/kernels.py [--quick] [--only rms_norm swiglu] [--out DIR]
"""

from lck_kernels.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
