# The step runner of the GPU machine's benchmark scripts (bench/train/run-h200.sh,
# bench/rl/run-h200.sh), sourced after DATA is set: unpacks DATA/dice.xz to $bin, sets the CUDA
# libraries' path and the kernel cache (DATA/kernels copied in, where it is), the run folder
# OUT and a time budget (BUDGET_S, default an hour), and defines
#   run NAME CAP_SECONDS DICE_ARGS...   one step (skipped unless named in the script's arguments,
#                                       or none is), its output in OUT/NAME.txt, its wall time
#                                       and mean SM utilisation in OUT/steps.txt
#   wanted NAME, left, unxz FILE.xz DEST, archive (after a step the scripts run themselves)
# ARCHIVE=FILE (outside OUT) puts every file of OUT in one archive after every step and when the
# script ends, also when it is stopped (for a transport that brings back only a few files from the
# GPU machine): a call killed at its limit mid-step still brings back the steps that ended. A stop
# takes effect once the running step ends, which BUDGET_S bounds: keep it inside the call's limit.
DATA=$(realpath "${DATA:?}")
OUT=${OUT:-$(bash bench/run-folder.sh)} || exit 1
mkdir -p "$OUT" && OUT=$(realpath "$OUT")
# Written beside and renamed: a kill mid-write leaves the last whole archive.
archive() {
  [[ -z ${ARCHIVE:-} ]] || { tar -czf "$ARCHIVE.part" -C "$OUT" . && mv "$ARCHIVE.part" "$ARCHIVE"; }
}
if [[ -n ${ARCHIVE:-} ]]; then
  trap archive EXIT
  trap 'exit 143' TERM INT
fi
# The binary links libnccl.so.2 and CUDA 13's libraries: torch's wheels carry both.
nvidia=$(python3 -c 'import nvidia, os; print(nvidia.__path__[0])')
export LD_LIBRARY_PATH=$nvidia/cu13/lib:$nvidia/nccl/lib
bin=/tmp/dice-cuda configs=tests/data/sdar/configs
unxz() { python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"; }
unxz "$DATA/dice.xz" "$bin" && chmod +x "$bin"
# Kernels compiled ahead where DATA has them (`DICE_KERNEL_CACHE=DATA/kernels dice model kernels
# --config ...` on the build machine): the steps read them instead of compiling at each start.
if [[ -d $DATA/kernels ]]; then
  export DICE_KERNEL_CACHE=/tmp/dice-kernels
  mkdir -p "$DICE_KERNEL_CACHE" && cp -n "$DATA"/kernels/*.cubin "$DICE_KERNEL_CACHE"/ 2>/dev/null
fi
start=$(date +%s) budget=${BUDGET_S:-3600}
left() { echo $(( budget - ($(date +%s) - start) )); }
steps=" $* "
wanted() { [[ $steps == "  " || $steps == *" $1 "* ]]; }
run() { # name, cap seconds, dice args...   (GPU utilisation sampled each second beside it)
  local name=$1 cap=$2; shift 2
  wanted "$name" || return 0
  local limit=$(( $(left) < cap ? $(left) : cap ))
  (( limit > 10 )) || { echo "$name skipped: no time left" | tee -a "$OUT/steps.txt"; return; }
  # Power, clocks, utilisation and memory each second: a step slower than its kernels' sum may
  # be the SM clock dropping under sustained load (the power limit), not the device waiting.
  nvidia-smi dmon -s pucm -d 1 >"$OUT/$name.dmon" 2>&1 &
  local dmon=$! t0=$(date +%s)
  timeout "$limit" "$bin" "$@" >"$OUT/$name.txt" 2>&1
  echo "$name rc=$? wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/steps.txt"
  kill $dmon 2>/dev/null
  tail -15 "$OUT/$name.txt"
  # Mean SM utilisation, SM clock and power over the samples that saw any (the model's build and
  # the start excluded); columns found by the header's names.
  awk '$1 == "#" && $2 == "gpu" {for (i = 3; i <= NF; i++) col[$i] = i - 1}
       $1 ~ /^[0-9]+$/ && $(col["sm"]) > 0 {n++; s += $(col["sm"]); c += $(col["pclk"]); w += $(col["pwr"])}
       END {if (n) printf "  sm%% mean over %d busy samples: %.0f, SM clock %.0f MHz, power %.0f W\n", n, s / n, c / n, w / n}' \
    "$OUT/$name.dmon" | tee -a "$OUT/steps.txt"
  archive
}
