"""Benchmark script for lck-megatron; the same module backs ``lck bench megatron``.

python packages/lck-megatron/benchmarks/megatron.py [--quick] [--ffn 4096 32768] [--out DIR]
"""

from lck_megatron.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
