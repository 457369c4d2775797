"""Where a cold `load_inline` build spends its time (the evaluation-at-scale issue, item 1).

Builds DICE pair programs one at a time, each in a fresh TORCH_EXTENSIONS_DIR (so nothing is
cached), then replays every command of each extension's build.ninja alone and times it: the host
C++ wrapper (torch/extension.h and pybind11), the device code (nvcc), the link. The first build
runs the commands through ninja in parallel, so its wall time is about the longer compile plus
the link; the replay shows each part. Also times the host wrapper's preprocessing alone (`-E`),
which is the part a precompiled header would save.

usage: python3 bench/eval/build_phases.py PAIRS.json [COUNT] > build-phases.md
(PAIRS.json: tests/data/dice/kernel_infilling_evaluation.json; COUNT programs from the start)
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def kind_of(command):
    program = os.path.basename(command.split()[0])
    if "nvcc" in program:
        return "device (nvcc)"
    if " -shared" in command:
        return "link"
    return "host c++"


def replay(build_dir):
    listed = subprocess.run(["ninja", "-C", build_dir, "-t", "commands"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    times = []
    for command in listed:
        start = time.perf_counter()
        subprocess.run(command, shell=True, cwd=build_dir, check=True, capture_output=True)
        times.append((kind_of(command), time.perf_counter() - start))
        if kind_of(command) == "host c++" and " -c " in command:
            pre = command.replace(" -c ", " -E ", 1).split(" -o ")[0] + " -o /dev/null"
            start = time.perf_counter()
            subprocess.run(pre, shell=True, cwd=build_dir, check=True, capture_output=True)
            times.append(("host preprocess only", time.perf_counter() - start))
    return times


def main():
    pairs = json.load(open(sys.argv[1]))
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    totals = {}
    print("| pair | first build wall s | phase | replay s |\n| --- | ---: | --- | ---: |")
    for pair in pairs[:count]:
        with tempfile.TemporaryDirectory() as ext_dir:
            program = os.path.join(ext_dir, "program.py")
            with open(program, "w") as f:
                f.write(pair["cuda_code"])
            env = dict(os.environ, TORCH_EXTENSIONS_DIR=os.path.join(ext_dir, "ext"))
            # torch's import is timed apart so that the build's wall time is the build alone
            code = ("import time, runpy, torch; t = time.perf_counter(); "
                    f"runpy.run_path({program!r}); print(time.perf_counter() - t)")
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                errors = [l for l in done.stderr.splitlines() if "error" in l.lower()][:3]
                print(f"| {pair['id']} | failed | {' / '.join(errors)} | |")
                continue
            wall = float(done.stdout.strip().splitlines()[-1])
            for root, _, files in os.walk(env["TORCH_EXTENSIONS_DIR"]):
                if "build.ninja" in files:
                    for kind, seconds in replay(root):
                        totals.setdefault(kind, []).append(seconds)
                        print(f"| {pair['id']} | {wall:.1f} | {kind} | {seconds:.2f} |")
    print("\n| phase | runs | mean s | median s |\n| --- | ---: | ---: | ---: |")
    for kind, seconds in totals.items():
        print(f"| {kind} | {len(seconds)} | {statistics.mean(seconds):.2f} | {statistics.median(seconds):.2f} |")


if __name__ == "__main__":
    main()
