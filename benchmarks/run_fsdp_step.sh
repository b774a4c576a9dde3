#!/usr/bin/env bash
# On a 4-GPU host: plain FSDP2 beside qsdp's recipes, one training step of the 1.42 B GPT of
# docs/gpu.md, in the network regimes given as arguments (default: socket nvlink 2x2).
#   RESULTS_DIR=out bash benchmarks/run_fsdp_step.sh socket nvlink
# NPROC=2 runs on 2 GPUs (scaling; the JSON name gets _ws2); FSDP_ARGS adds bench arguments.
# HSDP=1: the HSDP rows (native HSDP vs compressed, 2 nodes; JSON name fsdp_step_hsdp_...):
#   HSDP=1 bash benchmarks/run_fsdp_step.sh 2x2
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/run_env.sh  # PYTHONPATH, GPU safety variables, gpu, day, RESULTS_DIR
regimes=("$@")
[ ${#regimes[@]} -gt 0 ] || regimes=(socket nvlink 2x2)
for regime in "${regimes[@]}"; do
  echo "== regime $regime"
  torchrun --standalone --nproc-per-node "${NPROC:-4}" \
    benchmarks/bench_fsdp_step.py --regime "$regime" ${HSDP:+--hsdp} \
    --out "${RESULTS_DIR}/fsdp_step_${HSDP:+hsdp_}${regime}${NPROC:+_ws$NPROC}_${gpu}_${day}.json" ${FSDP_ARGS:-}
done
