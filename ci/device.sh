#!/usr/bin/env bash
# One call on a lent H200 machine: run the named stages, each bounded by its own timeout, and pack
# logs and result files under $OUT (at most a few files come back, so everything goes in one tarball
# plus a summary).
#
#   bash ci/device.sh [STAGE[:SECONDS][~KSEL]]...   ("a+b,c": a on GPU 0 while b then c run on GPU 1;
#                                                   "a@b,c": a beside b then c on the same GPUs, for tests)
#   stages: probe, runtime, runtime-bench, kernels, kernels-bench, kernels-bench-x ($BENCH_ARGS), kernels-tune, host,
#           flce-clocks, ep, ep-bench, tp, runtime-g (single-GPU tests selected by KSEL),
#           runtime-k, tp-k (multi-GPU tests selected by KSEL), tp-bench, tp-share, megatron, megatron-k, megatron-bench, demo,
#           demo-moe (lck demo --moe), demo-x (lck demo $DEMO_ARGS), demo-profile (GPU time of its steps by kernel kind), megatron-moe (the MoE patch's gpu tests),
#           mps, mps-restart (with MPS=1: list the daemon's servers and clients; a fresh daemon), script ($SCRIPT),
#           pytest ($PYTEST_ARGS)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/work"
W=$OUT/work
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONUNBUFFERED=1
# The device copy may lack usable git metadata: callers pass LCK_COMMIT; otherwise ask git quietly.
export LCK_COMMIT=${LCK_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}
export LCK_JIT_CACHE_DIR=/tmp/lck-jit EP_JIT_CACHE_DIR=/tmp/lck-ep-jit
# Multi-process test workers still running after LCK_TEST_STACK_AFTER s leave their Python stacks here.
export LCK_TEST_STACK_DIR=${LCK_TEST_STACK_DIR:-$W/stacks}
SITE=/tmp/lck-site
if [ -d .device-wheels ] && [ ! -d "$SITE" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .device-wheels/*.whl \
    > "$W/wheels.log" 2>&1 || echo "wheel install failed (see wheels.log)"
fi
export PYTHONPATH=$PWD/packages/lck-runtime/src:$PWD/packages/lck-kernels/src:$PWD/packages/lck-ep/src:$PWD/packages/lck-megatron/src:$SITE
# MPS=1: a private CUDA MPS control daemon (own pipe and log folders, so only this script's processes
# use it) for the stages' lifetime, stopped on exit. NVSHMEM needs it to run several PEs per GPU with
# teams (the shared-GPU tests); the card's settings are not touched. Tests there load every kernel before a
# one-shot all-reduce spins (see lck-kernels' test_vocab_parallel_tp_scaling.py for why).
if [ -n "${MPS:-}" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/lck-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/lck-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d > "$W/mps.log" 2>&1 || echo "MPS daemon did not start (see mps.log)"
  trap 'echo quit | nvidia-cuda-mps-control > /dev/null 2>&1' EXIT
fi
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
summary=$OUT/summary.txt
: > "$summary"

pytest_pkg() {  # package [pytest args...]: single-GPU tests in parallel workers, then multi-GPU ones alone
  local pkg=$1; shift
  local rc=0
  python3 -m pytest "packages/lck-$pkg/tests" -m "${ONE_GPU_MARK:-gpu and not multigpu}" -n "${XDIST:-6}" -ra -q \
    -p no:cacheprovider --tb=short --durations=15 --junitxml="$W/junit-$pkg-1gpu.xml" "$@" || rc=$?
  [ -n "${SKIP_MULTI:-}" ] && return $rc
  python3 -m pytest "packages/lck-$pkg/tests" -m multigpu -ra -q -p no:cacheprovider --tb=short \
    --durations=10 --junitxml="$W/junit-$pkg-multi.xml" "$@" || rc=$((rc ? rc : $?))
  return $rc
}

run_stage() {  # STAGE[:SECONDS][~KSEL]: "~expr" gives this stage its own test selection
  local spec=${1%%\~*}
  local stage=${spec%%:*} limit=${spec#*:}
  [ "$limit" = "$spec" ] && limit=300
  [ "$spec" != "$1" ] && local KSEL=${1#*\~}
  local t0=$SECONDS rc log=$W/$stage.log
  [ -e "$log" ] && log=$W/$stage.$t0.log  # a stage run twice keeps both logs
  echo "=== $stage (limit ${limit}s, $NGPU GPUs${KSEL:+, KSEL=$KSEL})" | tee -a "$summary"
  case $stage in
    probe) timeout "$limit" bash -c 'nvidia-smi; python3 -c "from lck_runtime.doctor import collect, _render; print(_render(collect()))"' ;;
    runtime) timeout "$limit" bash -c "$(declare -f pytest_pkg); W=$W pytest_pkg runtime" ;;
    # Kernel tests run every non-multi-GPU test on CUDA (their small CUDA variants exercise triton_op
    # and opcheck too); the multi-GPU ones are the tp stage.
    kernels) timeout "$limit" bash -c "$(declare -f pytest_pkg); W=$W ONE_GPU_MARK='not multigpu' SKIP_MULTI=1 pytest_pkg kernels" ;;
    kernels-bench) timeout "$limit" python3 -m lck_kernels.bench --out "$W/results-kernels" ;;
    kernels-bench-a) timeout "$limit" python3 -m lck_kernels.bench --only rms_norm swiglu --out "$W/results-kernels" ;;
    kernels-bench-b) timeout "$limit" python3 -m lck_kernels.bench --only cross_entropy fused_linear_cross_entropy --out "$W/results-kernels" ;;
    kernels-bench-x) timeout "$limit" python3 -m lck_kernels.bench ${BENCH_ARGS:?} --out "$W/results-kernels" ;;
    kernels-k) timeout "$limit" python3 -m pytest packages/lck-kernels/tests -m "not multigpu" -k "${KSEL:?}" -n 4 -ra -q -p no:cacheprovider --tb=short ;;
    runtime-bench) timeout "$limit" python3 -m lck_runtime.bench_all_reduce --out "$W/results-runtime" ;;
    kernels-tune) timeout "$limit" bash -c "python3 packages/lck-kernels/benchmarks/tune_rms_norm_swiglu.py; python3 packages/lck-kernels/benchmarks/tune_cross_entropy.py --budget-s ${TUNE_BUDGET:-200} --out $W/tune-ce" ;;
    ce-tune) timeout "$limit" python3 packages/lck-kernels/benchmarks/tune_cross_entropy.py --grad-only --budget-s ${TUNE_BUDGET:-200} --out "$W/tune-ce" ;;
    host) timeout "$limit" python3 packages/lck-kernels/benchmarks/host_overhead.py --out "$W/host" ;;
    flce-clocks) timeout "$limit" python3 packages/lck-kernels/benchmarks/flce_clocks.py --out "$W/flce-clocks" ;;
    ep) timeout "$limit" bash -c "$(declare -f pytest_pkg); W=$W pytest_pkg ep" ;;
    ep-k) timeout "$limit" python3 -m pytest packages/lck-ep/tests -m gpu -k "${KSEL:?}" -ra -q -p no:cacheprovider --tb=short --durations=10 ;;
    ep-pes) timeout "$limit" bash -c "for n in ${PES:-2}; do python3 -m lck_ep.benchmark --pes \$n ${EP_BENCH_ARGS:-} --out $W/results-ep || exit; done" ;;
    ep-bench) timeout "$limit" python3 -m lck_ep.benchmark --out "$W/results-ep" ;;
    tp) timeout "$limit" python3 -m pytest packages/lck-kernels/tests -m multigpu -ra -q -p no:cacheprovider --tb=short ;;
    runtime-g) timeout "$limit" python3 -m pytest packages/lck-runtime/tests -m "gpu and not multigpu" -k "${KSEL:?}" -ra -q -p no:cacheprovider --tb=short ;;
    runtime-k) timeout "$limit" python3 -m pytest packages/lck-runtime/tests -m multigpu -k "${KSEL:?}" -ra -q -p no:cacheprovider --tb=short ;;
    tp-k) timeout "$limit" python3 -m pytest packages/lck-kernels/tests -m multigpu -k "${KSEL:?}" -ra -q -p no:cacheprovider --tb=short ;;
    tp-bench) timeout "$limit" python3 -m lck_kernels.bench.tp --tp "${TP:-$NGPU}" --out "$W/results-tp" ;;
    # TP=N's per-rank shard on the GPUs at hand (a proxy where N GPUs are not lent), for each N in SHARES.
    tp-share) timeout "$limit" bash -c "for n in ${SHARES:-4 8}; do python3 -m lck_kernels.bench.tp --tp $NGPU --share-of \$n --out $W/results-tp || exit; done" ;;
    megatron) timeout "$limit" bash -c "$(declare -f pytest_pkg); W=$W pytest_pkg megatron" ;;
    megatron-bench) timeout "$limit" python3 -m lck_megatron.benchmark --out "$W/results-megatron" ;;
    demo) timeout "$limit" python3 -m lck_megatron.demo --out "$W/demo" ;;
    demo-moe) timeout "$limit" python3 -m lck_megatron.demo --moe --out "$W/demo-moe" ;;
    demo-x) timeout "$limit" python3 -m lck_megatron.demo ${DEMO_ARGS:?} --out "$W/demo-x" ;;
    demo-profile) timeout "$limit" python3 packages/lck-megatron/benchmarks/demo_step_profile.py --out "$W/demo-profile" ;;
    megatron-moe) timeout "$limit" python3 -m pytest packages/lck-megatron/tests/test_megatron_moe.py -m gpu -ra -q -p no:cacheprovider --tb=short ;;
    megatron-k) timeout "$limit" python3 -m pytest packages/lck-megatron/tests -m "gpu and not multigpu" -k "${KSEL:?}" -ra -q -p no:cacheprovider --tb=short ;;
    # MPS=1 diagnostics: the daemon's servers, each server's clients, and the processes still alive.
    mps) timeout "$limit" bash -c 'for s in $(echo get_server_list | nvidia-cuda-mps-control); do
        echo "server $s, clients: $(echo "get_client_list $s" | nvidia-cuda-mps-control | tr "\n" " ")"; done
        echo get_device_client_list | nvidia-cuda-mps-control; ps -eo pid,ppid,stat,etime,args | grep -E "python|mps" | grep -v grep' ;;
    mps-restart) echo quit | nvidia-cuda-mps-control; sleep 2; nvidia-cuda-mps-control -d; sleep 1; echo get_server_list | nvidia-cuda-mps-control ;;
    # A script carried beside the tree (e.g. a probe in .device-src): python3 $SCRIPT $SCRIPT_ARGS, its OUT = the work folder.
    script) OUT=$W timeout "$limit" python3 "${SCRIPT:?}" ${SCRIPT_ARGS:-} ;;
    # Named tests (node ids or -k/-m options) in $PYTEST_ARGS, in one pytest run.
    pytest) timeout "$limit" python3 -m pytest ${PYTEST_ARGS:?} -ra -q -p no:cacheprovider --tb=short --durations=15 ;;
    megatron-1) timeout "$limit" python3 -m pytest packages/lck-megatron/tests -m "gpu and not multigpu" -n 4 ${KSEL:+-k "$KSEL"} -ra -q -p no:cacheprovider --tb=short ;;
    moe) timeout "$limit" python3 -m pytest packages/lck-ep/tests/test_moe.py -m gpu -ra -q -p no:cacheprovider --tb=short ;;
    moe-bench) timeout "$limit" python3 -m lck_ep.moe.benchmark --out "$W/results-moe" ;;
    *) echo "unknown stage $stage"; return 2 ;;
  esac > "$log" 2>&1
  rc=$?
  echo "--- $stage: rc=$rc in $((SECONDS - t0))s" | tee -a "$summary"
  tail -n 25 "$log" >> "$summary"
}

for s in "$@"; do
  if [[ $s == *@* ]]; then  # "a@b": side by side on the same GPU(s) (tests only: timings would disturb each other)
    IFS=@ read -ra parts <<< "$s"
    for p in "${parts[@]}"; do
      (IFS=, read -ra seq <<< "$p"; for q in "${seq[@]}"; do run_stage "$q"; done) &
    done
    wait
  elif [[ $s == *+* ]]; then  # "a+b": run side by side, one GPU each (CUDA_VISIBLE_DEVICES=0, 1, ...)
    IFS=+ read -ra parts <<< "$s"
    i=0
    for p in "${parts[@]}"; do
      # "b,c" inside a part: those stages one after another on that part's GPU.
      (IFS=, read -ra seq <<< "$p"; for q in "${seq[@]}"; do CUDA_VISIBLE_DEVICES=$i NGPU=1 run_stage "$q"; done) &
      i=$((i + 1))
    done
    wait
  else
    run_stage "$s"
  fi
done
if [ -n "${MPS:-}" ]; then
  echo quit | nvidia-cuda-mps-control >> "$W/mps.log" 2>&1
  sleep 1
  cp -r "$CUDA_MPS_LOG_DIRECTORY" "$W/mps-logs" 2>/dev/null
fi
tar -czf "$OUT/results.tgz" -C "$W" . 2>/dev/null
rm -rf "$W"
cat "$summary"
