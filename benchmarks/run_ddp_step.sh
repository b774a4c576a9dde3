#!/usr/bin/env bash
# On a multi-GPU host: DDP and PyTorch's comm hooks beside qsdp's DDP recipes, one GPT-125M
# training step, in the network regimes given as arguments (default: socket nvlink).
#   RESULTS_DIR=out NPROC=4 bash benchmarks/run_ddp_step.sh socket nvlink
#   DDP_ARGS="--rounds 3" ... alternates the variants over 3 rounds (the judged ratios)
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/run_env.sh  # PYTHONPATH, GPU safety variables, gpu, day, RESULTS_DIR
nproc=${NPROC:-4}
regimes=("$@")
[ ${#regimes[@]} -gt 0 ] || regimes=(socket nvlink)
for regime in "${regimes[@]}"; do
  echo "== regime $regime"
  torchrun --standalone --nproc-per-node "$nproc" \
    benchmarks/bench_ddp_step.py --regime "$regime" \
    --out "${RESULTS_DIR}/ddp_step_${regime}_ws${nproc}_${gpu}_${day}.json" ${DDP_ARGS:-}
done
