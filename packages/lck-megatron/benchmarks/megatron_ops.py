"""Benchmark script for lck-megatron; the same module backs ``lck bench megatron``. (Not named ``megatron.py``:
run as a script, its folder comes first on ``sys.path`` and such a name would hide the megatron package from
every script beside it.)

python packages/lck-megatron/benchmarks/megatron_ops.py [--quick] [--ffn 4096 32768] [--out DIR]
"""

from lck_megatron.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
