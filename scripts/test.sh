#!/usr/bin/env bash
# Runs the whole test suite on CPU: sets up the pinned Python environment the evaluator's
# workers use (first time only), then every Rust test of the workspace.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup-python.sh
export DICE_CACHE=${DICE_CACHE:-$root/.dice/cache}
cargo test --workspace --locked "$@"
