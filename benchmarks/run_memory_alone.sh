#!/usr/bin/env bash
# On a 4-GPU host: each variant's peak memory in a process of its own (bench_fsdp_step.py with
# one variant per torchrun), so no variant inherits another's leftovers.
#   RESULTS_DIR=out bash benchmarks/run_memory_alone.sh socket fsdp2-bf16 sdp4bit sdp4bit+s1
# fsdp2-bf16 / fsdp2-fp32 are plain FSDP2 with that reduce dtype; anything else is a recipe
# (NAME+s1, NAME+own as in bench_fsdp_step.py). One JSON per variant: fsdp_memory_alone_*.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/run_env.sh  # PYTHONPATH, GPU safety variables, gpu, day, RESULTS_DIR
regime=$1
shift
for variant in "$@"; do
  case "$variant" in
    fsdp2-*) args=(--baselines "${variant#fsdp2-}" --recipes) ;;
    *) args=(--baselines --recipes "$variant") ;;
  esac
  echo "== $variant alone"
  torchrun --standalone --nproc-per-node "${NPROC:-4}" benchmarks/bench_fsdp_step.py \
    --regime "$regime" --steps 3 --warmup 2 "${args[@]}" \
    --out "${RESULTS_DIR}/fsdp_memory_alone_${regime}_${variant//+/_}_${gpu}_${day}.json"
done
