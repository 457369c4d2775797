"""Reports the Python environment as one JSON line; exits 1 with one line on stderr if unusable."""

import json
import platform
import shutil
import subprocess
import sys


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    # cuda: GPUs and nvcc; cuda-builds: nvcc alone (a CPU host building for GPU workers).
    want_gpus = sys.argv[1] == "cuda"
    want_nvcc = sys.argv[1] in ("cuda", "cuda-builds")
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as e:
        sys.exit(f"cannot import torch: {e}")
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ninja": shutil.which("ninja"),
        "cpu": cpu_model(),
        "gpus": [],
        "nvcc": None,
    }
    if info["ninja"] is None:
        sys.exit("ninja is not installed in this Python environment (pip install ninja)")
    if want_gpus:
        if not torch.cuda.is_available():
            sys.exit("torch reports no usable CUDA device")
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            info["gpus"].append({"name": torch.cuda.get_device_name(i), "arch": f"{major}.{minor}"})
    if want_nvcc:
        nvcc = shutil.os.path.join(cpp_extension.CUDA_HOME or "", "bin", "nvcc")
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            sys.exit(f"nvcc not found (looked for {nvcc}); install the CUDA toolkit or set CUDA_HOME")
        info["nvcc"] = out.strip().splitlines()[-1]
    print(json.dumps(info))


if __name__ == "__main__":
    main()
