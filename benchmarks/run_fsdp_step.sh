#!/usr/bin/env bash
# On a 4-GPU host: plain FSDP2 beside qsdp's recipes, one training step of the 1.42 B GPT of
# docs/gpu.md, in the network regimes given as arguments (default: socket nvlink 2x2).
#   RESULTS_DIR=out bash benchmarks/run_fsdp_step.sh socket nvlink
# NPROC=2 runs on 2 GPUs (scaling; the JSON name gets _ws2); FSDP_ARGS adds bench arguments.
# HSDP=1: the HSDP rows (native HSDP vs compressed, 2 nodes; JSON name fsdp_step_hsdp_...):
#   HSDP=1 bash benchmarks/run_fsdp_step.sh 2x2
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
# NVLink multicast off in every multi-GPU command: it can take the shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Each regime's NCCL variables are set in every process by benchmarks/regimes.py.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr -c 'A-Za-z0-9\n' '_')
day=$(date -u +%Y-%m-%d)
RESULTS_DIR=${RESULTS_DIR:-benchmarks/results}
regimes=("$@")
[ ${#regimes[@]} -gt 0 ] || regimes=(socket nvlink 2x2)
for regime in "${regimes[@]}"; do
  echo "== regime $regime"
  torchrun --standalone --nproc-per-node "${NPROC:-4}" \
    benchmarks/bench_fsdp_step.py --regime "$regime" ${HSDP:+--hsdp} \
    --out "${RESULTS_DIR}/fsdp_step_${HSDP:+hsdp_}${regime}${NPROC:+_ws$NPROC}_${gpu}_${day}.json" ${FSDP_ARGS:-}
done
