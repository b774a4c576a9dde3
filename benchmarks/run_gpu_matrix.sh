#!/usr/bin/env bash
# One 4-GPU session: the FSDP step matrix (NVLink with a profile, sockets, 2x2), the scaling
# points at 2 GPUs and 1 GPU, then the FSDP GPU tests. Logs and JSON go to $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
export PYTHONPATH=src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
quiet() { grep -v -E " step [0-9]+:|^W[0-9]{4}|\*{5}|OMP_NUM_THREADS|_warn_once|UserWarning"; }
RESULTS_DIR=$OUT FSDP_ARGS="--profile $OUT/prof" bash benchmarks/run_fsdp_step.sh nvlink 2>&1 | quiet
RESULTS_DIR=$OUT bash benchmarks/run_fsdp_step.sh socket 2x2 2>&1 | quiet
RESULTS_DIR=$OUT NPROC=2 bash benchmarks/run_fsdp_step.sh socket 2x2 2>&1 | quiet
RESULTS_DIR=$OUT NPROC=1 bash benchmarks/run_fsdp_step.sh nvlink 2>&1 | quiet
timeout 200 python3 -m pytest -m gpu tests/fsdp -q -x -p no:cacheprovider 2>&1 | tail -15
