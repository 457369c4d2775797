#!/usr/bin/env bash
# A/B: call-7 binary (I, before the review refactor) against the working tree after 4904fbd (J: merge loops of constant trip counts, lane passed in), alternating, batch 128.
set -uo pipefail
DATA=$(realpath "$DATA")
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))')
for v in I J; do python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' $DATA/dice-$v.xz /tmp/dice-$v && chmod +x /tmp/dice-$v; done
for round in 1 2 3; do for v in I J; do
  /tmp/dice-$v bench generate --config $DATA/configs/sdar-4b.json --device cuda --dtype bf16 --batch 128 > $OUT/$v-$round.txt 2>&1
  echo "$v round $round: $(grep -E '^\| 4B' $OUT/$v-$round.txt | cut -d'|' -f4,6)"
done; done
