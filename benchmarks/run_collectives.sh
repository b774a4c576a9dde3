#!/usr/bin/env bash
# On a 4-GPU host: qsdp's compressed collectives beside NCCL in the three regimes of docs/gpu.md.
#   bash benchmarks/run_collectives.sh [extra bench_collectives.py args, e.g. --sizes-mib 16 256]
# Writes $RESULTS_DIR/collectives_<regime>_<gpu>_<date>.json (default benchmarks/results), one
# file per regime.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
# NVLink multicast off in every multi-GPU command: it can take the shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr -c 'A-Za-z0-9\n' '_')
day=$(date -u +%Y-%m-%d)
RESULTS_DIR=${RESULTS_DIR:-benchmarks/results}
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
