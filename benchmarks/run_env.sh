# Sourced (from the repository root) by the run_*.sh scripts that write results files: the
# environment every multi-GPU command needs, and what names the results.
# NVLink multicast off in every multi-GPU command: it can take the shared host's GPUs out of service.
# Each regime's own NCCL variables are set in every process by benchmarks/regimes.py.
export PYTHONPATH=src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr -c 'A-Za-z0-9\n' '_')
day=$(date -u +%Y-%m-%d)
# Unless RESULTS_DIR says where, a run's files go to a folder of their own under
# benchmarks/results (one folder per study, benchmarks/results/README.md): the script's name
# less run_, and the day.
study=$(basename "$0" .sh)
RESULTS_DIR=${RESULTS_DIR:-benchmarks/results/${study#run_}_$day}
