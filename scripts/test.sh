#!/usr/bin/env bash
# Runs the whole test suite on CPU: sets up the pinned Python environment the evaluator's
# workers use (first time only), checks formatting and the workspace's lints, then runs every
# Rust test of the workspace through scripts/run-tests.py (test binaries side by side: --jobs N,
# default half the cores, or $DICE_TEST_JOBS). Other arguments go to cargo's build, those after
# `--` to every test binary (a name filter, --ignored, --test-threads N).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# A clone must stand alone: outside the documentation, no tracked file may name the shared data
# folder beside the development checkout (tests read tests/data; DICE_SHARED points a few
# optional ones at more). Skipped outside a git checkout, where there is nothing tracked.
if named=$(git grep -n -I -E -e '(\.\.|/work)/shared' -- ':!*.md' 2>/dev/null); then
  echo "error: these tracked files name the shared folder beside the repository; read tests/data instead (DICE_SHARED for optional data):" >&2
  echo "$named" >&2
  exit 1
fi
scripts/setup-python.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
export DICE_CACHE=${DICE_CACHE:-$root/.dice/cache}
python3 scripts/run-tests.py "$@"
