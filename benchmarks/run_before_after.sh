#!/usr/bin/env bash
# One benchmark, an older commit's code beside the working tree's, in one run (one machine, one
# call: timings of different calls are not comparable, docs/results.md). For each of ROUNDS
# rounds (default 1), alternating which goes first: REV's src/ and benchmarks/ (extracted with
# git archive; the benchmark of that commit, so its arguments must exist there) then the tree's.
#   RESULTS_DIR=out bash benchmarks/run_before_after.sh REV bench_fsdp_step.py \
#       --regime nvlink --recipes sdp4bit --baselines bf16 --profile @/prof
# Runs `torchrun --standalone --nproc-per-node NPROC (default: every GPU)`; in the arguments, @
# stands for the side's own output folder (RESULTS_DIR/before_N or after_N); --out defaults to
# @/result.json. Profiler traces (--profile) are summarized by trace_summary.py and deleted
# (kept: KEEP_TRACES=1). A side that fails is reported and the other still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: run_before_after.sh REV SCRIPT [ARGS...]" >&2; exit 2; }
rev=$1 script=$2
shift 2
git rev-parse --verify --quiet "$rev^{commit}" > /dev/null \
  || { echo "run_before_after.sh: $rev is not a commit of this repository" >&2; exit 2; }
[ -f "benchmarks/$script" ] || { echo "run_before_after.sh: no benchmarks/$script" >&2; exit 2; }
if [ -z "${RESULTS_DIR:-}" ]; then
  echo "run_before_after.sh: set RESULTS_DIR (where before_N/ and after_N/ go)" >&2
  exit 2
fi
source benchmarks/run_env.sh 2>/dev/null  # PYTHONPATH, GPU safety variables (no GPU: no name)
nproc=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$nproc" -ge 1 ] || nproc=2
old=$(mktemp -d)
trap 'rm -rf "$old"' EXIT
git archive "$rev" src benchmarks | tar -x -C "$old"
status=0
run_side() {  # side round root
  local dir="$RESULTS_DIR/$1_$2" root=$3 t0=$SECONDS
  mkdir -p "$dir"
  local args=("${@:4}") has_out=0
  for i in "${!args[@]}"; do
    args[$i]=${args[$i]//@/$dir}
    [ "${args[$i]}" = "--out" ] && has_out=1
  done
  [ $has_out = 1 ] || args+=(--out "$dir/result.json")
  PYTHONPATH="$root/src" torchrun --standalone --nproc-per-node "$nproc" \
    "$root/benchmarks/$script" "${args[@]}" > "$dir/run.log" 2>&1
  local rc=$?
  echo "$1 round $2 ($( [ "$1" = before ] && echo "$rev" || echo tree)): rc=$rc, $((SECONDS - t0)) s"
  [ $rc = 0 ] || status=1
  for f in $(find "$dir" -name '*.trace.json.gz'); do
    python benchmarks/trace_summary.py "$f" > "${f%.txt.trace.json.gz}.streams.txt" 2>&1
    [ "${KEEP_TRACES:-0}" = 1 ] || rm -f "$f"
  done
}
for ((round = 1; round <= ${ROUNDS:-1}; round++)); do
  if ((round % 2)); then
    run_side before $round "$old" "$@"; run_side after $round . "$@"
  else
    run_side after $round . "$@"; run_side before $round "$old" "$@"
  fi
done
exit $status
