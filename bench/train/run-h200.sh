#!/usr/bin/env bash
# The training issue's GPU evidence (SFT speed, memory, NCCL at one rank), run on the H200 machine
# from the repository root:
#   DATA=DIR [BUDGET_S=SECONDS] bash bench/train/run-h200.sh [STEP...]
# (STEP: golden, golden-f32, tests, train-tests, bench-1.7b, bench-1.7b-portable,
# bench-1.7b-release-pool, bench-1.7b-recompute, bench-1.7b-unfused-layer, bench-1.7b-composite,
# bench-4b, bench-8b,
# sft-nccl, sft-4b, sft-8b-offload, kernels-sft, kernels-1.7b, kernels-1.7b-step,
# attention-detail-1.7b, elementwise-detail-1.7b, wgmma-probe; all by default;
# golden-dq-recompute, tests-dq-recompute, bench-1.7b-dq-recompute, bench-4b-dq-recompute and
# sft-nccl-dq-recompute run theirs with DICE_ATTENTION_KEEP_DS=0: dQ recomputed, no dS kept)
# reading the model configs, the tokenizer and the 99 DICE pairs from tests/data, and under $DATA
# (an ignored folder carried to the machine; nothing of it is committed):
#   dice.xz     scripts/build-cuda.sh's target/cuda/release/dice, stripped and xz-compressed
#   model-tests.xz, model-lib-tests.xz (optional, for the step `tests`) dice-model's integration
#               and unit test binaries built the same way (`cargo test --release -p dice-model
#               -p dice-cli --features dice-model/cuda,dice-cli/cuda --no-run --target-dir
#               target/cuda` in build-cuda.sh's environment: with dice-cli selected the features
#               resolve as for the binary and no dependency is built again; -p dice-model alone
#               builds candle and its kernels a second time, ~20 min on 2 cores)
#   train-lib-tests.xz (optional, for the step `train-tests`) dice-train's unit tests, built the same
#               way (`-p dice-train --lib`): the optimizer's GPU checks
#   wgmma-probe (optional, for the step `wgmma-probe`) bench/train/wgmma_probe.cu built by nvcc
# Writes steps.txt and each step's output to OUT, by default the run's folder
# bench/runs/<date>-<commit>-<machine> (bench/run-folder.sh).
set -uo pipefail
source bench/h200-steps.sh "$@"
# The formula golden's forwards, SFT step (in bf16 through the fused training attention) and
# generations on the GPU.
run golden 120 bench golden --golden tests/data/sdar/golden/formula --device cuda --dtype bf16
# The same in f32, through the fused path too (its attention kernels without tensor cores), against
# the golden README's f32 tolerances.
run golden-f32 120 bench golden --golden tests/data/sdar/golden/formula --device cuda --dtype f32
DICE_ATTENTION_KEEP_DS=0 run golden-dq-recompute 120 bench golden --golden tests/data/sdar/golden/formula \
  --device cuda --dtype bf16
# dice-model's CUDA tests (fused SFT step against the CPU's composite one), where their binary was
# carried: step NAME, output model-NAME.txt, run with the environment ENV=VALUE... given.
model_tests() {
  local name=$1; shift
  wanted "$name" && [[ -f $DATA/model-tests.xz ]] || return 0
  [[ -x /tmp/model-tests ]] || { unxz "$DATA/model-tests.xz" /tmp/model-tests && chmod +x /tmp/model-tests; }
  (cd crates/dice-model && env "$@" timeout 240 /tmp/model-tests cuda --test-threads 1 --nocapture) \
    >"$OUT/model-$name.txt" 2>&1
  echo "model-$name rc=$?" | tee -a "$OUT/steps.txt"; tail -25 "$OUT/model-$name.txt"
  archive
}
model_tests tests
model_tests tests-dq-recompute DICE_ATTENTION_KEEP_DS=0
# Its unit tests (NVRTC builds every kernel; with --include-ignored their GPU checks run too).
if wanted tests && [[ -f $DATA/model-lib-tests.xz ]]; then
  unxz "$DATA/model-lib-tests.xz" /tmp/model-lib-tests && chmod +x /tmp/model-lib-tests
  (cd crates/dice-model && timeout 120 /tmp/model-lib-tests kernels --include-ignored) >"$OUT/model-lib-tests.txt" 2>&1
  echo "model-lib-tests rc=$?" | tee -a "$OUT/steps.txt"; tail -8 "$OUT/model-lib-tests.txt"
  archive
fi
# Which order of a wgmma descriptor's two strides reads our staged tiles (wgmma.cuh).
if wanted wgmma-probe && [[ -f $DATA/wgmma-probe ]]; then
  timeout 60 "$DATA/wgmma-probe" >"$OUT/wgmma-probe.txt" 2>&1
  echo "wgmma-probe rc=$?" | tee -a "$OUT/steps.txt"; cat "$OUT/wgmma-probe.txt"
  archive
fi
if wanted train-tests && [[ -f $DATA/train-lib-tests.xz ]]; then
  unxz "$DATA/train-lib-tests.xz" /tmp/train-lib-tests && chmod +x /tmp/train-lib-tests
  (cd crates/dice-train && timeout 120 /tmp/train-lib-tests optim --include-ignored) \
    >"$OUT/train-lib-tests.txt" 2>&1
  echo "train-lib-tests rc=$?" | tee -a "$OUT/steps.txt"; tail -8 "$OUT/train-lib-tests.txt"
  archive
fi
# DICE trains on 6,144-token packed rows; the bench packs one synthetic row (p = 0.5 noise). The
# fused training layer and attention (layers keeping their activations as memory allows); the
# same recomputing every layer (DICE_RECOMPUTE=all); the fused attention inside candle's
# composite layer and autograd (DICE_FUSED_LAYER=0, the path before the fused layer); the
# composite attention too (DICE_FUSED_ATTENTION=0); each with the step's phases profiled.
run bench-1.7b 240 bench train --config "$configs/sdar-1.7b.json" --device cuda --dtype bf16 \
  --tokens 6144 --steps 2 --profile --json "$OUT/bench-1.7b.json"
# The attention's portable kernels (mma.sync, ldmatrix) where a Hopper runs its wgmma ones.
DICE_ARCH_SPECIFIC=0 run bench-1.7b-portable 240 bench train --config "$configs/sdar-1.7b.json" \
  --device cuda --dtype bf16 --tokens 6144 --steps 2 --profile --json "$OUT/bench-1.7b-portable.json"
# CUDA's default memory pool, which hands every freed byte back to the driver at each
# synchronization (dice keeps them: dice_model::device::keep_freed_memory).
DICE_KEEP_POOL=0 run bench-1.7b-release-pool 240 bench train --config "$configs/sdar-1.7b.json" \
  --device cuda --dtype bf16 --tokens 6144 --steps 2 --profile --json "$OUT/bench-1.7b-release-pool.json"
DICE_RECOMPUTE=all run bench-1.7b-recompute 240 bench train --config "$configs/sdar-1.7b.json" \
  --device cuda --dtype bf16 --tokens 6144 --steps 2 --profile --json "$OUT/bench-1.7b-recompute.json"
DICE_FUSED_LAYER=0 run bench-1.7b-unfused-layer 240 bench train --config "$configs/sdar-1.7b.json" \
  --device cuda --dtype bf16 --tokens 6144 --steps 2 --profile --json "$OUT/bench-1.7b-unfused-layer.json"
DICE_FUSED_ATTENTION=0 run bench-1.7b-composite 240 bench train --config "$configs/sdar-1.7b.json" \
  --device cuda --dtype bf16 --tokens 6144 --steps 2 --profile --json "$OUT/bench-1.7b-composite.json"
DICE_ATTENTION_KEEP_DS=0 run bench-1.7b-dq-recompute 240 bench train --config "$configs/sdar-1.7b.json" \
  --device cuda --dtype bf16 --tokens 6144 --steps 2 --profile --json "$OUT/bench-1.7b-dq-recompute.json"
DICE_ATTENTION_KEEP_DS=0 run bench-4b-dq-recompute 240 bench train --config "$configs/sdar-4b.json" \
  --device cuda --dtype bf16 --tokens 6144 --steps 2 --profile --json "$OUT/bench-4b-dq-recompute.json"
run bench-4b 240 bench train --config "$configs/sdar-4b.json" --device cuda --dtype bf16 \
  --tokens 6144 --steps 2 --profile --json "$OUT/bench-4b.json"
run bench-8b 240 bench train --config "$configs/sdar-8b.json" --device cuda --dtype bf16 \
  --tokens 6144 --steps 2 --profile --json "$OUT/bench-8b.json"
# The trainer through NCCL at world size one (--nproc-per-node 1): a random model of CONFIG
# trained for STEPS steps on the 99 DICE pairs as {prompt, response} rows (written once).
# NAME CAP CONFIG STEPS [dice train sft args...]
sft_run() {
  local name=$1 cap=$2 config=$3 count=$4
  shift 4
  wanted "$name" || return 0
  [[ -f /tmp/pairs.jsonl ]] || python3 - <<'PY'
import json
pairs = json.load(open("tests/data/dice/kernel_infilling_evaluation.json"))
with open("/tmp/pairs.jsonl", "w") as f:
    for p in pairs:
        f.write(json.dumps({"prompt": "Write a CUDA kernel for this PyTorch program.\n" + p["pytorch_code"],
                            "response": p["cuda_code"]}) + "\n")
PY
  "$bin" model init --config "$configs/$config" --weights random --seed 1 \
    --tokenizer tests/data/sdar --out "/tmp/$name-model" --force >"$OUT/$name-model-init.txt" 2>&1
  local args=(train sft --model "/tmp/$name-model" --data /tmp/pairs.jsonl --out "/tmp/$name"
    --device cuda --nproc-per-node 1 --max-steps "$count" --save-steps 1000 --save-total-limit 1 "$@")
  if [[ $name == kernels-* ]]; then
    # Nsight Compute's time of every kernel of the run (the update's too: gradient norm,
    # clipping, AdamW), clocks and caches left alone.
    local t0=$(date +%s) limit=$(( $(left) < cap ? $(left) : cap ))
    (( limit > 10 )) || { echo "$name skipped: no time left" | tee -a "$OUT/steps.txt"; return; }
    timeout "$limit" ncu --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum --csv "$bin" "${args[@]}" >"$OUT/$name.csv" 2>"$OUT/$name.err"
    echo "$name rc=$? wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/steps.txt"
    python3 bench/ncu_kernels.py "$OUT/$name.csv" | tee "$OUT/$name.txt"
  else
    run "$name" "$cap" "${args[@]}"
  fi
  cp "/tmp/$name/metrics.jsonl" "$OUT/$name-metrics.jsonl" 2>/dev/null
  rm -rf "/tmp/$name" "/tmp/$name-model"
  archive
}
sft_run sft-nccl 240 sdar-1.7b.json 3
DICE_ATTENTION_KEEP_DS=0 sft_run sft-nccl-dq-recompute 240 sdar-1.7b.json 3
# The same at 4B (AdamW's f32 state beside the model: about 80 GB of the device).
sft_run sft-4b 300 sdar-4b.json 4
# 8B on one GPU with AdamW's state in host memory (the state beside the weights needs ~175 GB):
# tokens/s and peak memory of its steps (metrics.jsonl). Its closing resumable checkpoint
# (115 GB) does not fit the machine's disk: the run says so and stops after its steps.
sft_run sft-8b-offload 480 sdar-8b.json 3 --optimizer-offload
# Kernel by kernel, two steps of the 1.7B run: what the update's 0.1 s is made of.
sft_run kernels-sft 300 sdar-1.7b.json 2
# Where one step's GPU time goes, kernel by kernel (Nsight Compute, one metric, clocks and caches
# left alone): the sum of kernel times against the step's wall time is the host's share.
if wanted kernels-1.7b && (( $(left) > 30 )); then
  t0=$(date +%s)
  timeout "$(( $(left) < 300 ? $(left) : 300 ))" ncu --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv "$bin" bench train --config "$configs/sdar-1.7b.json" \
    --device cuda --dtype bf16 --tokens 6144 --steps 1 >"$OUT/kernels-1.7b.csv" 2>"$OUT/kernels-1.7b.err"
  echo "kernels-1.7b rc=$? wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/steps.txt"
  python3 bench/ncu_kernels.py "$OUT/kernels-1.7b.csv" | tee "$OUT/kernels-1.7b.txt"
  archive
fi
# The second step's kernels alone (a run of two steps less the run of one: the model's random
# weights and the warm-up left out), to hold against the step's wall time in bench-1.7b: what
# is left is the device waiting on the host.
if wanted kernels-1.7b-step && [[ -f $OUT/kernels-1.7b.csv ]] && (( $(left) > 40 )); then
  t0=$(date +%s)
  timeout "$(( $(left) < 300 ? $(left) : 300 ))" ncu --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv "$bin" bench train --config "$configs/sdar-1.7b.json" \
    --device cuda --dtype bf16 --tokens 6144 --steps 2 >"$OUT/kernels-1.7b-2.csv" 2>"$OUT/kernels-1.7b-2.err"
  echo "kernels-1.7b-step rc=$? wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/steps.txt"
  python3 bench/ncu_kernels.py "$OUT/kernels-1.7b-2.csv" --minus "$OUT/kernels-1.7b.csv" \
    | tee "$OUT/kernels-1.7b-step.txt"
  archive
fi
# Why a kernel runs at its speed: Nsight Compute's detailed sections (throughput against peak,
# issue slots, occupancy, instruction mix, memory traffic) and its warp stall reasons for the first
# launch of each kernel named, in one 1.7B step. STEP KERNEL... (output STEP-KERNEL.txt)
kernel_detail() {
  local name=$1 kernel; shift
  wanted "$name" || return 0
  for kernel in "$@"; do
    (( $(left) > 40 )) || break
    local t0=$(date +%s)
    timeout 120 ncu --set detailed --section WarpStateStats --section SchedulerStats \
      --kernel-name "regex:${kernel}_bf16" --launch-count 1 \
      "$bin" bench train --config "$configs/sdar-1.7b.json" --device cuda --dtype bf16 --tokens 6144 \
      --steps 1 >"$OUT/$name-$kernel.txt" 2>&1
    echo "$name-$kernel rc=$? wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/steps.txt"
    archive
  done
}
# The attention kernels of the default backward (dK/dV keeping dS, dQ from it): issue-bound in
# session 30.
kernel_detail attention-detail-1.7b train_attention_forward train_attention_dq_from_ds \
  train_attention_dkdv_keep_ds
# The element-wise kernels, at 30-50 % of the memory's rate in session 30's step profile (rms_norm
# 59 launches 4.0 + 6.1 ms, swiglu 4.5 + 7.0 ms, heads 4.7 + 6.0 ms): what holds them.
kernel_detail elementwise-detail-1.7b rms_norm_forward rms_norm_backward swiglu_forward \
  swiglu_backward heads_forward heads_backward
