#!/usr/bin/env bash
# The generation issue's GPU evidence, run on the H200 machine from the repository root:
#   DATA=DIR bash bench/model/run-generate-h200.sh
# with, under $DATA (an ignored folder carried to the machine; nothing of it is committed):
#   dice.xz     scripts/build-cuda.sh's target/cuda/release/dice, stripped and xz-compressed
#   golden/     shared/sdar/golden/tiny (the reference's greedy generations, f32)
#   configs/    shared/sdar/configs/sdar-{4b,8b}.json
#   cuda_tests.xz (optional)  the dice-model CUDA test binary (random weights, nothing else)
# Writes $OUT/steps.txt and $OUT/generate.tgz: golden-*.txt, gen-*.txt (tables, profiles),
# gen-*.json, cuda-tests.txt.
set -uo pipefail
DATA=$(realpath "${DATA:?}") OUT=${OUT:?}
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))')
bin=/tmp/dice-cuda
python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
  "$DATA/dice.xz" "$bin" && chmod +x "$bin"
run() { # name, dice args...
  local name=$1; shift
  local t0=$(date +%s)
  "$bin" "$@" >"$OUT/$name.txt" 2>&1
  echo "$name rc=$? wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/steps.txt"
  tail -25 "$OUT/$name.txt"
}
# The four greedy generations token for token in f32 (issue: generation), through the
# device-side greedy selection.
run golden-f32 bench golden --golden "$DATA/golden" --device cuda --dtype f32
# The benchmark's settings are dice bench generate's defaults: 512-token prompts, 512 new tokens,
# block 4, 4 steps, static greedy, no stop.
run gen-4b bench generate --config "$DATA/configs/sdar-4b.json" --device cuda --dtype bf16 \
  --batch 1,128 --profile --json "$OUT/gen-4b.json"
run gen-8b bench generate --config "$DATA/configs/sdar-8b.json" --device cuda --dtype bf16 \
  --batch 1 --profile --json "$OUT/gen-8b.json"
# What cudarc's event tracking costs per forward (dice turns it off): the same short run with and
# without.
for tracking in "" --cuda-event-tracking; do
  run "gen-4b-128${tracking:+-tracking}" bench generate --config "$DATA/configs/sdar-4b.json" \
    --device cuda --dtype bf16 --batch 1 --new-tokens 128 $tracking \
    --json "$OUT/gen-4b-128${tracking:+-tracking}.json"
done
# The fused block attention over the KV cache (off unless DICE_FUSED_ATTENTION is set, until these
# pass): golden checks through it, then the same throughput runs with the tensor-core kernel.
export DICE_FUSED_ATTENTION=1
run golden-f32-fused bench golden --golden "$DATA/golden" --device cuda --dtype f32
run golden-bf16-fused bench golden --golden "$DATA/golden" --device cuda --dtype bf16
run gen-4b-fused bench generate --config "$DATA/configs/sdar-4b.json" --device cuda --dtype bf16 \
  --batch 1,128 --profile --json "$OUT/gen-4b-fused.json"
# The model's CUDA tests (CPU against GPU, the fused kernel's key splits over a long cache), when
# their binary is carried: `cargo test -p dice-model --release --features cuda --test cuda --no-run`.
if [[ -f $DATA/cuda_tests.xz ]]; then
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$DATA/cuda_tests.xz" /tmp/dice-cuda-tests && chmod +x /tmp/dice-cuda-tests
  (cd crates/dice-model && /tmp/dice-cuda-tests --test-threads 1) \
    >"$OUT/cuda-tests.txt" 2>&1
  echo "cuda-tests rc=$?" | tee -a "$OUT/steps.txt"
  tail -5 "$OUT/cuda-tests.txt"
fi
unset DICE_FUSED_ATTENTION
# Only a few files come back from the machine: everything but steps.txt goes in one archive.
tar -C "$OUT" -czf /tmp/generate.tgz --exclude=steps.txt . && find "$OUT" -mindepth 1 ! -name steps.txt -delete \
  && mv /tmp/generate.tgz "$OUT/generate.tgz"
