#!/usr/bin/env bash
# The main job end to end on the built-in examples: sets up Python (first time only), builds
# dice, evaluates the example candidates against the example problems on the CPU, and prints
# the report. Re-running resumes the stored run; pass --force to evaluate everything again.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup-python.sh
export DICE_CACHE=${DICE_CACHE:-$root/.dice/cache}
cargo build --locked -p dice-cli
dice=$root/target/debug/dice
run=$root/.dice/demo-run
"$dice" eval examples/candidates.jsonl --kernelbench examples/kernelbench --run "$run" \
  --device cpu --timeout 20 "$@"
"$dice" report "$run" --format md
