#!/usr/bin/env bash
# The GPU test tier in parts that each fit one device call (the whole tier no longer fits 600 s:
# the Hadamard-32 parity cases are compile-bound). Each part has its own time limit and log
# under $OUT, so a stopped part leaves the others' results; pytest -v names every case.
# PART_LIMIT (default 480 s) bounds each part: "distributed" took 348 s on 4x H200 with
# tests/train and the no-host-wait test's staleness and HSDP cases (2026-11-27), before the
# stream-pool tests joined it.
#   OUT=out bash benchmarks/run_gpu_tier.sh [distributed integrations quant-plain quant-hadamard]
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/run_env.sh  # PYTHONPATH, GPU safety variables, gpu, day
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1
declare -A PART=(
  [distributed]="tests/comm tests/ddp tests/fsdp tests/train tests/runtime"
  [integrations]="tests/integrations"
  [quant-plain]="tests/quant -k not(h16 or h32)"
  [quant-hadamard]="tests/quant -k h16 or h32"
)
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(distributed integrations quant-plain quant-hadamard)
for part in "${parts[@]}"; do
  [ -n "${PART[$part]:-}" ] || { echo "unknown part $part; known: ${!PART[*]}"; exit 2; }
  read -r -a where <<< "${PART[$part]%% -k *}"
  keyword=""
  [[ "${PART[$part]}" == *" -k "* ]] && keyword="${PART[$part]#* -k }"
  start=$(date +%s)
  timeout "${PART_LIMIT:-480}" python -m pytest -m gpu "${where[@]}" ${keyword:+-k "$keyword"} \
    -v --no-header -p no:cacheprovider -rfE --durations=15 > "$OUT/gpu_tier_${part}_${gpu}_${day}.log" 2>&1
  rc=$?
  log="$OUT/gpu_tier_${part}_${gpu}_${day}.log"
  echo "$part: rc $rc, $(( $(date +%s) - start )) s, $(grep -c PASSED "$log") passed," \
    "$(grep -c -E 'FAILED|ERROR' "$log") failed or errors"
done
