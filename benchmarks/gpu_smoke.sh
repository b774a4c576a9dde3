#!/usr/bin/env bash
# On the GPU machine: GPU test tier, then a short tuning sweep of the quantizer kernels.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
python3 -m pytest tests/quant -q -x -m gpu 2>&1 | tail -15
for cfg in "1024 4" "2048 4" "4096 8" "8192 8"; do
  set -- $cfg
  echo "== block $1 warps $2"
  python3 benchmarks/bench_quant.py --sizes-mib 256 --bits 8 4 --reps 10 --block "$1" --warps "$2" \
    | grep -E "copy|nearest|stochastic" | grep -v "^$"
done
