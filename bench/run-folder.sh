#!/usr/bin/env bash
# Prints the folder a benchmark run's results belong in, relative to the repository root:
#   bench/runs/<date>-<commit>-<machine>
# <date> is today in UTC; <commit> the checkout's short commit, with -dirty when tracked files
# differ from it (the binary is taken to be built from this checkout); <machine> the GPU's name
# without "NVIDIA ", lower case (h200), with xN for N GPUs. COMMIT and MACHINE set the last two
# where they cannot be found: a copy of the tree without git history, or a machine without a GPU
# (naming a run fetched from the GPU machine).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
commit=${COMMIT:-}
if [[ -z $commit ]]; then
  commit=$(git rev-parse --short=7 HEAD 2>/dev/null) \
    || { echo "no git history here: set COMMIT to the commit the binary was built from" >&2; exit 1; }
  git diff --quiet HEAD -- || commit+=-dirty
fi
machine=${MACHINE:-}
if [[ -z $machine ]]; then
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) \
    || { echo "no GPU found (nvidia-smi): set MACHINE, e.g. MACHINE=h200" >&2; exit 1; }
  machine=$(head -1 <<<"$gpus" | sed 's/^NVIDIA //' | tr 'A-Z ' 'a-z-')
  count=$(wc -l <<<"$gpus")
  (( count == 1 )) || machine+=x$count
fi
echo "bench/runs/$(date -u +%F)-$commit-$machine"
