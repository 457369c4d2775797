#!/usr/bin/env bash
# BiC-RL's GPU evidence (issue #26: rollouts at the engine's speed), run on the H200 machine from
# the repository root:
#   DATA=DIR [BUDGET_S=SECONDS] bash bench/rl/run-h200.sh [STEP...]
# (STEP: golden-f32, golden-bf16, sampled-1.7b, sampled-1.7b-host, greedy-1.7b, sampled-4b,
# sampled-1.7b-rl-shape, rl-rollout, sampled-1.7b-rl128-ragged, sampled-1.7b-rl256-shape, sampled-1.7b-rl256-ragged,
# rl-rollout-256, rl-learn, bench-rl; all by default)
# reading the model configs, the tokenizer and the DICE tasks from tests/data, and under $DATA
# (an ignored folder carried to the machine; nothing of it is committed):
#   dice.xz     scripts/build-cuda.sh's target/cuda/release/dice, stripped and xz-compressed
# Writes steps.txt and each step's output to OUT, by default the run's folder
# bench/runs/<date>-<commit>-<machine> (bench/run-folder.sh).
set -uo pipefail
source bench/h200-steps.sh "$@"
# The engine's draws of sampled tokens on the device against the host's arithmetic (and the
# formula golden's forwards, SFT step and greedy generations).
run golden-f32 120 bench golden --golden tests/data/sdar/golden/formula --device cuda --dtype f32
run golden-bf16 120 bench golden --golden tests/data/sdar/golden/formula --device cuda --dtype bf16
# Rollout sampling (whole distribution, temperature 1, dynamic threshold 0.9, block 4) at the
# engine's batch, drawn on the device; then the same drawn on the host (the rollouts' old path,
# fewer tokens: it is slow); greedy beside it.
rollout=(--device cuda --dtype bf16 --strategy dynamic --top-k 0)
run sampled-1.7b 240 bench generate --config "$configs/sdar-1.7b.json" "${rollout[@]}" \
  --batch 128,256 --json "$OUT/sampled-1.7b.json"
DICE_DEVICE_SAMPLING=0 run sampled-1.7b-host 180 bench generate --config "$configs/sdar-1.7b.json" \
  "${rollout[@]}" --batch 128 --new-tokens 64 --json "$OUT/sampled-1.7b-host.json"
run greedy-1.7b 180 bench generate --config "$configs/sdar-1.7b.json" --device cuda --dtype bf16 \
  --strategy dynamic --batch 128 --json "$OUT/greedy-1.7b.json"
run sampled-4b 240 bench generate --config "$configs/sdar-4b.json" "${rollout[@]}" --batch 128 \
  --json "$OUT/sampled-4b.json"
# The shape of the rollout below (prompts of about 1,000 tokens, 256 new), for the comparison the
# issue asks: rollout tokens/s within 10 % of the engine's at the same batch and lengths.
run sampled-1.7b-rl-shape 180 bench generate --config "$configs/sdar-1.7b.json" "${rollout[@]}" \
  --batch 128 --prompt-tokens 1024 --new-tokens 256 --json "$OUT/sampled-1.7b-rl-shape.json"
# Steps of dice train rl on random 1.7B weights (stage-2 preset, the toy reward: no judging), and
# dice bench generate at the same batch and lengths (the stage-2 tasks' prompts: 811-1,287
# tokens, mean 890, `dice train rl --dry-run`): the rollout's tokens/s against the engine's, the
# checkpoints' size and the seconds the step waited for them.
# NAME CAP TASKS SAMPLES MAX_TOKENS MAX_ACTIVE STEPS [dice train rl args...] (`count`: `steps` is
# the runner's list of wanted steps)
rl_run() {
  local name=$1 cap=$2 tasks=$3 samples=$4 tokens=$5 active=$6 count=$7
  shift 7
  wanted "$name" || return 0
  [[ -d /tmp/m17 ]] || "$bin" model init --config "$configs/sdar-1.7b.json" --weights random \
    --seed 1 --tokenizer tests/data/sdar --out /tmp/m17 --force >"$OUT/model-init.txt" 2>&1
  run "$name" "$cap" train rl --model /tmp/m17 --tasks "${tasks_file:-tests/data/dice/end_to_end_kernel_generation_4000.json}" \
    --stage e2e --preset dice-1.7b-stage2 --tasks-per-step "$tasks" --samples-per-task "$samples" \
    --max-tokens "$tokens" --max-active "$active" --max-steps "$count" --out "/tmp/$name" \
    --device cuda "$@"
  cp "/tmp/$name/metrics.jsonl" "/tmp/$name/metrics.html" "/tmp/$name/reward_token.json" "$OUT/" 2>/dev/null
  [[ -f $OUT/metrics.jsonl ]] && mv "$OUT/metrics.jsonl" "$OUT/$name-metrics.jsonl"
  [[ -f $OUT/metrics.html ]] && mv "$OUT/metrics.html" "$OUT/$name-metrics.html"
  du -sh "/tmp/$name"/* >"$OUT/$name-disk.txt" 2>&1
  rm -rf "/tmp/$name"
  archive
}
rl_run rl-rollout 300 16 8 256 128 1 --reward-token 16
# The engine at the rollout's shape above (128 sequences, 256 new tokens, prompts as ragged as
# the stage-2 tasks'): what rl-rollout's tokens/s is held against where 256 sequences of 512 do
# not fit (an 80 GB card).
run sampled-1.7b-rl128-ragged 180 bench generate --config "$configs/sdar-1.7b.json" "${rollout[@]}" \
  --batch 128 --prompt-tokens 811-1287 --new-tokens 256 --json "$OUT/sampled-1.7b-rl128-ragged.json"
run sampled-1.7b-rl256-shape 180 bench generate --config "$configs/sdar-1.7b.json" "${rollout[@]}" \
  --batch 256 --prompt-tokens 896 --new-tokens 512 --json "$OUT/sampled-1.7b-rl256-shape.json"
# The same with prompts as ragged as the stage-2 tasks' (811-1,287 tokens): the rollout's fair
# comparison, whose sequences' block boundaries fall out of step as the rollout's do.
run sampled-1.7b-rl256-ragged 180 bench generate --config "$configs/sdar-1.7b.json" "${rollout[@]}" \
  --batch 256 --prompt-tokens 811-1287 --new-tokens 512 --json "$OUT/sampled-1.7b-rl256-ragged.json"
# Three steps: the engine, its KV cache and graphs are built for the first and kept for the
# others; the checkpoint's snapshot (on the device when it fits) against the step.
rl_run rl-rollout-256 300 32 8 512 256 3 --reward-token 16
# Learning on the GPU: 20 steps of 1 task x 16 samples of 128 tokens rewarded for the token a
# census of the first step picks; the preset's learning rate moves random weights too slowly to
# show in 20 steps, so 1e-4 (Adam's first step after the preset's moment reset moves every weight
# by about the rate: about 0.2 of a logit per step for the rewarded token). 2 x 8 x 64 (run
# 2026-12-05-6084aae) split a group in 3 of 16 steps only: the census's best token was held by 3
# of 16 completions of 64 tokens; 16 completions of 128 tokens split almost every step, and one
# group keeps the update (prompts of ~900 tokens: 16 x ~1,030 tokens) near 11 s.
# The update replays each completion once per denoising pass of its busiest block (4 at random
# weights): with the stage-2 prompts (~900 tokens) 64 replayed sequences of ~1,150 tokens took 23 s
# an update (run of 2026-12-05, session 16), too long for 20 steps in one call; tasks with prompts
# of a few tokens (as the CPU tests use) keep the same stage, reward and update at ~300 tokens a
# replayed sequence.
tasks_file=/tmp/short-prompt-tasks.json
python3 - "$tasks_file" <<'PY'
import json, sys
asks = ["Write relu.", "Double it.", "Add one.", "Square it."]
tasks = [{"idx": i, "level": "1", "pytorch_code": "x.relu()",
          "prompt": f"<|im_start|>user\n{a}<|im_end|>\n<|im_start|>assistant\n"} for i, a in enumerate(asks)]
json.dump(tasks, open(sys.argv[1], "w"))
PY
# (LEARN_STEPS=N runs the first N of them: the update's seconds with less device time.)
rl_run rl-learn 540 1 16 128 16 "${LEARN_STEPS:-20}" --reward-token census --lr 1e-4
unset tasks_file
rm -rf /tmp/m17
# dice bench rl (issue #26, build 3): one stage-2 step of the 1.7B config with random weights, the
# judge on the GPU scoring recorded programs of the infilling-evaluation tasks (correct, not
# building, wrong, hack: every group kept) and the real update, pipelined and then back to back.
# The preset's 64 tasks x 16 samples build 768 CUDA extensions per run, more than one 10-minute
# command holds twice; 4 tasks x 16 samples (48 builds and 256 replayed samples per run) measure
# the same step's phases at the preset's group size and lengths (BENCH_RL_TASKS=2 halves the
# builds where less of the call is left).
run bench-rl 600 bench rl --config "$configs/sdar-1.7b.json" --device cuda --judge-device cuda \
  --python "$(command -v python3)" --tasks-per-step "${BENCH_RL_TASKS:-4}" --json "$OUT/bench-rl.json" \
  --out /tmp/bench-rl-work
# Where each run's judging went, sample by sample (builds, stages): its judge's store reported
# as an evaluation run (the store copied whole, its write-ahead log folded in).
if wanted bench-rl; then
  for name in pipelined back-to-back; do
    db=/tmp/bench-rl-work/$name/judge.db
    [[ -f $db ]] || continue
    python3 bench/store_copy.py "$db" "$OUT/bench-rl-$name-judge.db"
    "$bin" report "/tmp/bench-rl-work/$name" --db "$OUT/bench-rl-$name-judge.db" --format md \
      >"$OUT/bench-rl-$name-judge.md" 2>&1
  done
  rm -rf /tmp/bench-rl-work
  archive
fi
