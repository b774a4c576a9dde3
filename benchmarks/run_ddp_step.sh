#!/usr/bin/env bash
# On a multi-GPU host: DDP and PyTorch's comm hooks beside qsdp's DDP recipes, one GPT-125M
# training step, in the network regimes given as arguments (default: socket nvlink).
#   RESULTS_DIR=out NPROC=4 bash benchmarks/run_ddp_step.sh socket nvlink
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
# NVLink multicast off in every multi-GPU command: it can take the shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Each regime's NCCL variables are set in every process by benchmarks/regimes.py.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr -c 'A-Za-z0-9\n' '_')
day=$(date -u +%Y-%m-%d)
RESULTS_DIR=${RESULTS_DIR:-benchmarks/results}
nproc=${NPROC:-4}
regimes=("$@")
[ ${#regimes[@]} -gt 0 ] || regimes=(socket nvlink)
for regime in "${regimes[@]}"; do
  echo "== regime $regime"
  torchrun --standalone --nproc-per-node "$nproc" \
    benchmarks/bench_ddp_step.py --regime "$regime" \
    --out "${RESULTS_DIR}/ddp_step_${regime}_ws${nproc}_${gpu}_${day}.json" ${DDP_ARGS:-}
done
