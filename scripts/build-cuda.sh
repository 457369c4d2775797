#!/usr/bin/env bash
# Builds `dice` with CUDA support (candle's CUDA backend and our kernels) on a machine without a
# GPU or a CUDA install. nvcc and the CUDA libraries come from PyPI, pinned to CUDA 13.0 because
# newer PTX does not load on a 13.0 driver (580). candle links -lcuda, which only a driver
# provides, so the link uses a stub libcuda.so (soname libcuda.so.1) carrying the driver API's
# symbol names; at run time the real driver's libcuda.so.1 is loaded instead.
#   usage: scripts/build-cuda.sh [cargo build args...]   (binary: target/cuda/release/dice)
#          eval "$(scripts/build-cuda.sh --print-env)"   (environment for other cargo commands)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tool=$root/.dice/cuda-toolchain
mkdir -p "$tool"
[[ -x $tool/venv/bin/python ]] || python3 -m venv "$tool/venv"
site=$("$tool/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cu=$site/nvidia/cu13
if [[ ! -x $cu/bin/nvcc ]]; then
  "$tool/venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
    "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" \
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-nvrtc==13.0.*" \
    "nvidia-cublas==13.0.*" "nvidia-curand==10.4.0.*"
fi
# NCCL (dice-train's collectives between CUDA ranks) is linked like the other libraries; at run
# time torch's own nvidia/nccl/lib provides libnccl.so.2.
nccl=$site/nvidia/nccl
if [[ ! -f $nccl/lib/libnccl.so.2 ]]; then
  "$tool/venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "nvidia-nccl-cu13==2.*"
fi
link=$tool/link
mkdir -p "$link"
for lib in cublas cublasLt cudart nvrtc; do ln -sf "$cu/lib/lib$lib.so.13" "$link/lib$lib.so"; done
ln -sf "$cu/lib/libcurand.so.10" "$link/libcurand.so"
ln -sf "$nccl/lib/libnccl.so.2" "$link/libnccl.so"
cd "$root"
cargo fetch --locked
if [[ ! -f $link/libcuda.so ]]; then
  registry=${CARGO_HOME:-$HOME/.cargo}/registry/src
  sys=$(ls -d "$registry"/*/cudarc-*/src/driver/sys/mod.rs 2>/dev/null | sort -V | tail -1)
  [[ -n $sys ]] || { echo "cudarc sources not found under $registry" >&2; exit 1; }
  grep -oE "pub (unsafe )?fn cu[A-Za-z0-9_]+" "$sys" | awk '{print $NF}' | sort -u |
    awk '{print "void " $1 "(void) {}"}' >"$link/stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$link/stub.c"
fi
export PATH="$cu/bin:$PATH" CUDA_ROOT="$cu" CUDA_PATH="$cu" CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# Once: a second -L (a shell that ran --print-env's output, then this script) would change
# RUSTFLAGS, and cargo rebuilds everything when RUSTFLAGS change.
case " ${RUSTFLAGS:-} " in
  *" -L $link "*) ;;
  *) export RUSTFLAGS="${RUSTFLAGS:-} -L $link" ;;
esac
if [[ ${1:-} == --print-env ]]; then
  # For other cargo commands with CUDA: eval "$(scripts/build-cuda.sh --print-env)"
  declare -p PATH CUDA_ROOT CUDA_PATH CUDA_COMPUTE_CAP RUSTFLAGS | sed 's/^declare -x/export/'
  exit 0
fi
cargo build --locked --release --features cuda -p dice-cli --target-dir "$root/target/cuda" "$@"
echo "built $root/target/cuda/release/dice" >&2
