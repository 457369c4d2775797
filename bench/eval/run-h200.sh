#!/usr/bin/env bash
# The evaluator's GPU evidence (issue: evaluator), run on the H200 machine from the repository
# root with the CUDA build of dice and the inputs under $DATA:
#   $DATA/dice                   scripts/build-cuda.sh's binary
#   $DATA/kb/level{1,2,3}        KernelBench problems (shared/kernelbench)
#   $DATA/pairs.json             shared/dice/kernel_infilling_evaluation.json (99 pairs)
#   $DATA/pairs32.json           its first 32 pairs: the fixed throughput subset
#   $DATA/identity.jsonl         identity candidates (Model renamed ModelNew, word-bounded) for
#                                the first 20 problems of levels 1-3 whose inputs fit in 8 GB
# Each step is timed; runs resume, so the script can be re-run to finish what a time limit cut.
set -uo pipefail
DATA=${DATA:?} OUT=${OUT:?}
export DICE_PYTHON=$(command -v python3)
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))')
# Runs live outside $OUT (emptied by the next call) and are packed into $OUT after every step,
# so a step cut by a time limit still brings back what it finished.
runs=/tmp/dice-runs cache=/tmp/dice-build-cache
mkdir -p "$runs"
step() { # name, seconds, dice args...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s%N)
  timeout "$limit" "$DATA/dice" eval "$@" --run "$runs/$name" --device cuda --build-cache "$cache" --jobs 16 \
    >"$runs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc wall_ms=$(( ($(date +%s%N) - t0) / 1000000 ))" | tee -a "$OUT/steps.txt"
  tail -2 "$runs/$name.log"
  tar -C /tmp -czf "$OUT/eval-runs.tgz" dice-runs
}
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' | tee "$OUT/steps.txt"
step c-cold 200 --pairs "$DATA/pairs32.json"
step c-warm 120 --pairs "$DATA/pairs32.json"
step b-identity 200 "$DATA/identity.jsonl" --kernelbench "$DATA/kb"
step a-pairs "${A_LIMIT:-150}" --pairs "$DATA/pairs.json"
for r in c-cold c-warm b-identity a-pairs; do
  "$DATA/dice" report "$runs/$r" --format json >"$runs/$r.json" 2>>"$OUT/steps.txt"
  "$DATA/dice" report "$runs/$r" --format md >"$runs/$r.md" 2>>"$OUT/steps.txt"
done
tar -C /tmp -czf "$OUT/eval-runs.tgz" dice-runs
