#!/usr/bin/env bash
# The convergence study of the trainer issue on one 4-GPU host: GPT-125M on the Shakespeare
# corpus with GPT-2 BPE, every recipe with the same seed and data order, all recipes at once,
# each on 2 GPUs (torchrun, NCCL; one node, so two-level recipes run their 4-bit inter-node
# quantizer between both ranks). Metrics and configs go to $OUT/<recipe>/. RECIPES="a b" runs
# a subset.
#   DATA=path/to/prepared/shakespeare-gpt2 OUT=out bash benchmarks/run_convergence.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
DATA=${DATA:?set DATA to a prepared directory (python -c "from qsdp.train.data import prepare_data; print(prepare_data(None, 'gpt2'))")}
STEPS=${STEPS:-2000}
LIMIT_S=${LIMIT_S:-480}
RUNS=${RUNS:-/tmp/qsdp-study}
export PYTHONPATH=src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
read -r -a recipes <<< "${RECIPES:-bf16 w4-direct qwd-only tlq-no-hadamard tlq-hs-only sdp4bit qsdp-w8g8 global-qsgd}"
pairs=$(( $(nvidia-smi -L | wc -l) / 2 ))
mkdir -p "$OUT" "$RUNS"
pids=()
for i in "${!recipes[@]}"; do
  r=${recipes[$i]}
  first=$(( (i % pairs) * 2 ))
  CUDA_VISIBLE_DEVICES=$first,$((first + 1)) torchrun --nproc-per-node 2 \
    --master-port $((29600 + i)) -m qsdp.train --out "$RUNS/$r" --recipe "$r" \
    --preset gpt-125m --data "$DATA" --steps "$STEPS" --micro-batch 4 --block-size 256 \
    --lr 6e-4 --warmup 100 --dropout 0.1 --eval-every 200 --eval-batches 20 \
    > "$OUT/$r.log" 2>&1 &
  pids+=($!)
done
start=$(date +%s)
while [ $(( $(date +%s) - start )) -lt "$LIMIT_S" ]; do
  alive=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive = 1 ] || break
  sleep 5
done
for p in "${pids[@]}"; do kill -- "$p" 2>/dev/null; done
pkill -f "qsdp.train" 2>/dev/null
echo "finished after $(( $(date +%s) - start )) s"
for r in "${recipes[@]}"; do
  mkdir -p "$OUT/$r"
  cp "$RUNS/$r/metrics.csv" "$RUNS/$r/config.json" "$OUT/$r/" 2>/dev/null
  echo "$r: $(tail -n 1 "$OUT/$r/metrics.csv" 2>/dev/null | cut -d, -f1-4)"
done
