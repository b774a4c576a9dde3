#!/usr/bin/env bash
# One 4-GPU session for the all-reduce integrations: the DDP step (sockets, NVLink), then the
# HSDP rows of the FSDP step (2 nodes of 2 GPUs). Logs and JSON go to $OUT (or ./out); each
# run has its own time limit so that one stuck run leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
quiet() { grep -v -E " step [0-9]+:|^W[0-9]{4}|\*{5}|OMP_NUM_THREADS|_warn_once|UserWarning"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1
RESULTS_DIR=$OUT timeout "${DDP_LIMIT:-240}" bash benchmarks/run_ddp_step.sh socket nvlink 2>&1 \
  | tee "$OUT/ddp_step.log" | quiet
RESULTS_DIR=$OUT HSDP=1 timeout "${HSDP_LIMIT:-300}" bash benchmarks/run_fsdp_step.sh 2x2 2>&1 \
  | tee "$OUT/hsdp_step.log" | quiet
