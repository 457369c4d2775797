#!/usr/bin/env bash
# The generation issue's GPU evidence, run on the H200 machine from the repository root:
#   DATA=DIR [BUDGET_S=SECONDS] bash bench/model/run-generate-h200.sh [STEP...]
# (STEP: golden-f32, cuda-tests, kernel-tests, golden-bf16, gen-4b, gen-8b, gen-4b-again,
# kernel-times, gen-4b-no-graphs, gen-4b-candle; all by default)
# reading the formula golden and the model configs from tests/data, and under $DATA (an ignored
# folder carried to the machine; nothing of it is committed):
#   dice.xz     scripts/build-cuda.sh's target/cuda/release/dice, stripped and xz-compressed
#   cuda_tests.xz (optional)  the dice-model CUDA test binary (random weights, nothing else)
#   kernel_tests.xz (optional)  the dice-model library test binary built with --features cuda
#               (its GPU tests are #[ignore]d elsewhere: the kernels against candle's ops, bit for bit)
# Writes steps.txt, golden-*.txt, gen-*.txt (tables, profiles), gen-*.json, cuda-tests.txt and
# kernel-times.{csv,txt} to OUT, by default the run's folder bench/runs/<date>-<commit>-<machine>
# (bench/run-folder.sh). PACK=1 puts everything but steps.txt in OUT/generate.tgz instead, for a
# transport that brings back only a few files.
set -uo pipefail
DATA=$(realpath "${DATA:?}")
OUT=${OUT:-$(bash bench/run-folder.sh)} || exit 1
mkdir -p "$OUT" && OUT=$(realpath "$OUT")
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))')
bin=/tmp/dice-cuda golden=tests/data/sdar/golden/formula configs=tests/data/sdar/configs
unxz() { python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"; }
unxz "$DATA/dice.xz" "$bin" && chmod +x "$bin"
start=$(date +%s) budget=${BUDGET_S:-3600}
left() { echo $(( budget - ($(date +%s) - start) )); }
steps=" $* "   # step names to run (all when none is given)
wanted() { [[ $steps == "  " || $steps == *" $1 "* ]]; }
run() { # name, dice args...   (skipped, or cut, when BUDGET_S seconds are spent)
  local name=$1; shift
  wanted "$name" || return 0
  (( $(left) > 5 )) || { echo "$name skipped: no time left" | tee -a "$OUT/steps.txt"; return; }
  local t0=$(date +%s)
  timeout "$(left)" "$bin" "$@" >"$OUT/$name.txt" 2>&1
  echo "$name rc=$? wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/steps.txt"
  tail -25 "$OUT/$name.txt"
}
tests() { # name, carried binary, test arguments...   (skipped when the binary is not carried)
  local name=$1 binary=$DATA/$2; shift 2
  [[ -f $binary ]] && wanted "$name" || return 0
  unxz "$binary" "/tmp/dice-$name" && chmod +x "/tmp/dice-$name"
  (cd crates/dice-model && timeout "$(left)" "/tmp/dice-$name" --test-threads 1 --nocapture "$@") \
    >"$OUT/$name.txt" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/steps.txt"
  tail -5 "$OUT/$name.txt"
}
# The formula golden in f32 (logits, the four greedy generations token for token, SFT loss and
# gradients; bench golden writes the checkpoint), through the device-side greedy selection, the
# fused kernels and the engine's CUDA graph (the defaults); bf16 through the same path (within
# --low-precision-tol of the reference's magnitude; tokens may differ).
run golden-f32 bench golden --golden "$golden" --device cuda --dtype f32
# The model's CUDA tests (CPU against GPU: every forward path, the fused kernels over a long
# cache, graph replays), when their binary is carried:
# `cargo test -p dice-model --release --features cuda --test cuda --no-run`.
tests cuda-tests cuda_tests.xz
# The kernels against candle's ops, bit for bit (the library's #[ignore]d GPU tests).
tests kernel-tests kernel_tests.xz --ignored
run golden-bf16 bench golden --golden "$golden" --device cuda --dtype bf16
# The benchmark's settings are dice bench generate's defaults: 512-token prompts, 512 new tokens,
# block 4, 4 steps, static greedy, no stop.
run gen-4b bench generate --config "$configs/sdar-4b.json" --device cuda --dtype bf16 \
  --batch 1,128 --profile --json "$OUT/gen-4b.json"
run gen-8b bench generate --config "$configs/sdar-8b.json" --device cuda --dtype bf16 \
  --batch 1 --profile --json "$OUT/gen-8b.json"
# Batch 128 once more, without the profile: the spread from run to run.
run gen-4b-again bench generate --config "$configs/sdar-4b.json" --device cuda --dtype bf16 \
  --batch 128 --json "$OUT/gen-4b-again.json"
# What each of dice's own kernels takes on its own (Nsight Compute, one metric, no clock or cache
# control), over about five forwards of a batch-128 decoding run past its prefill: launches are
# counted among the kernels the filter selects only.
if wanted kernel-times && (( $(left) > 30 )); then
  DICE_CUDA_GRAPHS=0 timeout "$(left)" ncu --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv \
    -k 'regex:^(qk_norm|silu_mul|add_rms|greedy|block_attention)' -s 2500 -c 900 \
    "$bin" bench generate --config "$configs/sdar-4b.json" --device cuda --dtype bf16 \
    --batch 128 --new-tokens 16 >"$OUT/kernel-times.csv" 2>"$OUT/kernel-times.err"
  echo "kernel-times rc=$?" | tee -a "$OUT/steps.txt"
  python3 bench/ncu_kernels.py "$OUT/kernel-times.csv" --by-launch | tee "$OUT/kernel-times.txt"
fi
# What the graph and the fused kernels each bring: the same runs with graphs off (the fused
# forward op by op), then with candle's ops only (DICE_FUSED_ATTENTION=0 turns the fused decoding
# forward off).
DICE_CUDA_GRAPHS=0 run gen-4b-no-graphs bench generate --config "$configs/sdar-4b.json" \
  --device cuda --dtype bf16 --batch 1,128 --json "$OUT/gen-4b-no-graphs.json"
DICE_FUSED_ATTENTION=0 run gen-4b-candle bench generate --config "$configs/sdar-4b.json" \
  --device cuda --dtype bf16 --batch 1,128 --json "$OUT/gen-4b-candle.json"
if [[ ${PACK:-} == 1 ]]; then
  tar -C "$OUT" -czf /tmp/generate.tgz --exclude=steps.txt . && find "$OUT" -mindepth 1 ! -name steps.txt -delete \
    && mv /tmp/generate.tgz "$OUT/generate.tgz"
fi
