#!/usr/bin/env bash
# On a 4-GPU host: where each recipe starts to pay. For each link setting, the NCCL bf16
# all-gather's bus bandwidth (bench_collectives.py, 256 MiB) and the FSDP2 step of the 1.42 B
# GPT, plain beside the recipes (bench_fsdp_step.py); benchmarks/crossover.py draws the plot.
#   RESULTS_DIR=out bash benchmarks/run_crossover.sh              # default settings
#   SETTINGS="socket:1x1 socket:4x4 nvlink" bash benchmarks/run_crossover.sh
# socket:TxS is the socket regime with NCCL_SOCKET_NTHREADS=T and NCCL_NSOCKS_PERTHREAD=S; a bare
# regime (socket, 2x2, nvlink) keeps NCCL's defaults. On one host's loopback NCCL's default (no
# helper thread) is the slowest setting and more threads or sockets than 1x1 add little (4x H200,
# 2026-11-28: 6.3 GB/s at 1x1, 8.6-8.7 at 2x2 and 4x4); nvlink is the fast end (259 GB/s).
# STEP_ARGS adds bench arguments, RECIPES replaces the recipes.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/run_env.sh  # PYTHONPATH, GPU safety variables, gpu, day, RESULTS_DIR
nproc=${NPROC:-4}
settings=(${SETTINGS:-socket socket:1x1 socket:4x4 2x2 nvlink})
mkdir -p "$RESULTS_DIR"
for s in "${settings[@]}"; do
  regime=${s%%:*}
  tag=${s/:/_}
  env=()
  if [[ $s == *:* ]]; then
    tx=${s#*:}
    env=(NCCL_SOCKET_NTHREADS=${tx%x*} NCCL_NSOCKS_PERTHREAD=${tx#*x})
  fi
  echo "== $s"
  env "${env[@]}" torchrun --standalone --nproc-per-node "$nproc" benchmarks/bench_collectives.py \
    --regime "$regime" --sizes-mib 256 --dtypes bfloat16 --only "all_gather w8" --reps 5 \
    --out "$RESULTS_DIR/link_${tag}.json"
  env "${env[@]}" torchrun --standalone --nproc-per-node "$nproc" benchmarks/bench_fsdp_step.py \
    --regime "$regime" --recipes ${RECIPES:-qsdp-w8g8 sdp4bit cgx} --baselines bf16 --steps 5 \
    --out "$RESULTS_DIR/step_${tag}.json" ${STEP_ARGS:-}
done
python benchmarks/crossover.py "$RESULTS_DIR"
