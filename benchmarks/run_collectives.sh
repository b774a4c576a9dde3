#!/usr/bin/env bash
# On a 4-GPU host: qsdp's compressed collectives beside NCCL in the three regimes of docs/gpu.md.
#   bash benchmarks/run_collectives.sh [extra bench_collectives.py args, e.g. --sizes-mib 16 256]
# Writes $RESULTS_DIR/collectives_<regime>_<gpu>_<date>.json (default
# benchmarks/results/collectives_<date>), one file per regime.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/run_env.sh  # PYTHONPATH, GPU safety variables, gpu, day, RESULTS_DIR
run() {  # run <regime>: its NCCL variables are set in every process by benchmarks/regimes.py
  local regime=$1
  echo "== regime $regime"
  torchrun --standalone --nproc-per-node 4 benchmarks/bench_collectives.py \
    --regime "$regime" --out "${RESULTS_DIR}/collectives_${regime}_${gpu}_${day}.json" \
    ${ARGS[@]+"${ARGS[@]}"}
}
ARGS=("$@")

run nvlink
run socket
run 2x2
