"""Cold `load_inline` builds, old against new, per phase (the evaluation-at-scale issue, build item 1).

For each program it captures the arguments of its `load_inline`/`load` calls (what the evaluator
receives), lets torch write the build (main.cpp, cuda.cu, build.ninja) without running it, and then
times every compile alone:

- host c++: the generated wrapper main.cpp as torch compiles it (torch/extension.h + pybind11);
- host preprocess: the same with -E (what a precompiled header cannot save is the rest);
- host c++ with pch: the same command plus `-I<pch> -Winvalid-pch`, where <pch> holds
  torch/extension.h (a copy) and its .gch, built once per set of flags without TORCH_EXTENSION_NAME. GCC
  looks for X.gch in each include folder before X; an unusable one (other flags, other macros) is
  skipped with a warning and the real header is read, so a mismatch is a normal compile, never a
  wrong one. The two objects' disassembly and symbols are compared;
- device (nvcc), with --cuda: the .cu as torch compiles it, and the same light (its
  torch/extension.h includes made torch/types.h: the evaluator's first try, buildcache.py's
  light_source); with --nvcc-steps also each step of `nvcc --dryrun` replayed alone
  (preprocessors, cicc, ptxas, fatbinary, cudafe++, host gcc);
- link.

It also counts, over all programs (no compiling), how often the generated wrapper and the .cu
repeat: by text, and by text plus compile command with the build folder left out (what an object
cache keyed on content would reuse).

usage: python3 bench/eval/build_speed.py PROGRAMS [--count N] [--cuda [--nvcc-steps]] > build-speed.md
PROGRAMS: tests/data/dice/kernel_infilling_evaluation.json (cuda_code) or a .jsonl of candidates
(code). On a GPU host: TORCH_CUDA_ARCH_LIST=9.0 python3 bench/eval/build_speed.py
tests/data/dice/kernel_infilling_evaluation.json --count 8 --cuda
"""
import argparse
import collections
import hashlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../crates/dice-eval/python"))
from buildcache import light_source  # noqa: E402

def programs_of(path):
    if path.endswith(".jsonl"):
        rows = [json.loads(line) for line in open(path) if line.strip()]
        return [(f"{r.get('level')}/{r.get('problem_id')}/{r.get('sample_id')}", r.get("code") or "") for r in rows]
    return [(str(p["id"]), p["cuda_code"]) for p in json.load(open(path))]


def captured_calls(code):
    """The arguments of each load_inline/load the program makes at import, as the evaluator gets them."""
    calls = []

    def recorder(kind):
        original = getattr(cpp_extension, kind)

        def record(*args, **kwargs):
            import inspect

            bound = inspect.signature(original).bind(*args, **kwargs)
            bound.apply_defaults()
            calls.append((kind, dict(bound.arguments)))
            raise StopIteration  # the rest of the program needs the module: stop here

        return original, record

    saved = {}
    for kind in ("load_inline", "load"):
        saved[kind], replacement = recorder(kind)
        setattr(cpp_extension, kind, replacement)
    try:
        exec(compile(code, "<program>", "exec"), {"__name__": "program"})
    except BaseException:  # noqa: B036 (the program stops at its first build, or fails on its own)
        pass
    finally:
        for kind, original in saved.items():
            setattr(cpp_extension, kind, original)
    return calls


def write_build(kind, arguments, folder):
    """Lets torch write the build folder of one call without running ninja."""
    run_ninja, import_library = cpp_extension._run_ninja_build, cpp_extension._import_module_from_library
    cpp_extension._run_ninja_build = lambda *a, **k: None
    cpp_extension._import_module_from_library = lambda *a, **k: None
    try:
        getattr(cpp_extension, kind)(**dict(arguments, build_directory=folder, verbose=False))
    finally:
        cpp_extension._run_ninja_build, cpp_extension._import_module_from_library = run_ninja, import_library
    return subprocess.run(["ninja", "-C", folder, "-t", "commands"], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def kind_of(command):
    program = os.path.basename(shlex.split(command)[0])
    if "nvcc" in program:
        return "device"
    if " -shared" in command:
        return "link"
    return "host"


def source_of(command):
    return re.search(r" -c (\S+)", command).group(1)


def content_id(command, folder):
    """The object's identity without the build folder: command and source text."""
    text = open(source_of(command), "rb").read()
    flags = command.replace(folder, "BUILD")
    return hashlib.sha256(text + b"\0" + flags.encode()).hexdigest()


def timed(command, cwd):
    start = time.perf_counter()
    done = subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command}\n{done.stderr[-2000:]}")
    return time.perf_counter() - start, done.stderr


def pch_command(command, pch_dir):
    """The host compile turned into the build of torch/extension.h.gch with the same flags."""
    header = os.path.join(pch_dir, "torch", "extension.h")
    # A copy beside the .gch: a second #include of it (the user's, after torch's) opens the file
    # where the pch was found.
    shutil.copyfile(os.path.join(os.path.dirname(cpp_extension.__file__), "..", "include", "torch",
                                 "extension.h"), header)
    command = re.sub(r"-MMD -MF \S+ ", "", command)
    # Without the extension's name: GCC refuses a pch built with another value of a command-line
    # macro, and accepts one built without a macro that the header never mentions.
    command = re.sub(r"-DTORCH_EXTENSION_NAME=\S+ ", "", command)
    target = os.path.join(pch_dir, "torch", "extension.h.gch")
    return re.sub(r" -c \S+ -o \S+", f" -x c++-header {header} -o {target}", command)


def pch_key(command):
    flags = re.sub(r"-MMD -MF \S+ |-DTORCH_EXTENSION_NAME=\S+| -c \S+ -o \S+", "", command)
    return hashlib.sha256(flags.encode()).hexdigest()[:16]


def code_of(obj, cwd):
    """What the object does: its disassembly and symbols (not its debug sections or paths)."""
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", obj], cwd=cwd, capture_output=True,
                          text=True).stdout.split("\n", 2)[-1]
    symbols = subprocess.run(["nm", obj], cwd=cwd, capture_output=True, text=True).stdout
    return hashlib.sha256((dump + symbols).encode()).hexdigest()


def nvcc_steps(command, cwd):
    """Each step of nvcc's compile of the .cu, replayed alone: (tool, seconds)."""
    keep = os.path.join(cwd, "keep")
    os.makedirs(keep, exist_ok=True)
    dry = subprocess.run(f"{command} --dryrun --keep --keep-dir {keep}", shell=True, cwd=cwd,
                         capture_output=True, text=True)
    lines = [line[3:] for line in dry.stderr.splitlines() if line.startswith("#$ ")]
    script = ["set -e", "TIMEFORMAT=%R"]
    for line in lines:
        if line.startswith("--"):  # nvcc's own steps (dependency filtering), not commands
            continue
        assignment = re.match(r"^(\w+)=(.*)$", line)
        if assignment:  # nvcc prints some as several quoted words (`X="-isystem" "dir"`)
            value = " ".join(shlex.split(assignment.group(2)))
            script.append(f"export {assignment.group(1)}={shlex.quote(value)}")
            continue
        tool = os.path.basename(shlex.split(line)[0])
        script.append(f"echo -n 'STEP {tool} ' >&2; time ( {line} >/dev/null 2>>{keep}/steps.log )")
    done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, capture_output=True, text=True)
    return [(m.group(1), float(m.group(2))) for m in re.finditer(r"STEP (\S+) \n?(\d+\.\d+)", done.stderr)]


def repeats(builds):
    print("## Repeats over all programs (no compiling)\n")
    print("| object | builds | distinct texts | distinct text + command | distinct text + command, name left out |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for kind, label in (("host", "wrapper main.cpp"), ("device", "cuda .cu")):
        texts, ids, nameless = set(), set(), set()
        count = 0
        for folder, commands in builds:
            for command in commands:
                if kind_of(command) != kind:
                    continue
                count += 1
                texts.add(hashlib.sha256(open(source_of(command), "rb").read()).hexdigest())
                ids.add(content_id(command, folder))
                nameless.add(content_id(re.sub(r"-DTORCH_EXTENSION_NAME=\S+", "", command), folder))
        print(f"| {label} | {count} | {len(texts)} | {len(ids)} | {len(nameless)} |")
    flag_sets = {pch_key(c) for _, commands in builds for c in commands if kind_of(c) == "host"}
    print(f"\nDistinct host flag sets (one torch/extension.h pch each): {len(flag_sets)}\n")


def phases(builds, count, cuda, steps):
    print("## Phases, each compile alone (seconds)\n")
    print("| build | phase | seconds | note |\n| --- | --- | ---: | --- |")
    totals = collections.defaultdict(list)
    pch_dirs = {}
    for index, (folder, commands) in enumerate(builds[:count]):
        for command in commands:
            kind = kind_of(command)
            if kind == "device" and not cuda:
                continue
            try:
                seconds, _ = timed(command, folder)
            except RuntimeError as e:  # a link without libcudart on a machine without CUDA
                print(f"| {index} | {kind} | failed | {str(e).splitlines()[-1][:100]} |")
                continue
            totals[kind].append(seconds)
            print(f"| {index} | {kind} | {seconds:.2f} | |")
            if kind == "host":
                obj = re.search(r" -o (\S+)", command).group(1)
                normal = code_of(obj, folder)
                pre = command.replace(" -c ", " -E ", 1).split(" -o ")[0] + " -o /dev/null"
                seconds, _ = timed(pre, folder)
                totals["host preprocess only"].append(seconds)
                print(f"| {index} | host preprocess only | {seconds:.2f} | |")
                key = pch_key(command)
                if key not in pch_dirs:
                    pch_dirs[key] = tempfile.mkdtemp(prefix="pch-", dir=os.path.dirname(folder))
                    os.makedirs(os.path.join(pch_dirs[key], "torch"))
                    seconds, _ = timed(pch_command(command, pch_dirs[key]), folder)
                    totals["pch build (once per flags)"].append(seconds)
                    print(f"| {index} | pch build (once per flags) | {seconds:.2f} | {key} |")
                # -H lists what was read: a used pch shows as "! <file>.gch".
                with_pch = command.replace(" -c ", f" -I{pch_dirs[key]} -Winvalid-pch -H -c ", 1)
                seconds, listing = timed(with_pch, folder)
                totals["host with pch"].append(seconds)
                gch = os.path.join(pch_dirs[key], "torch", "extension.h.gch")
                invalid = [line for line in listing.splitlines() if "Winvalid-pch" in line]
                used = "pch used" if f"! {gch}" in listing else f"pch not used {invalid[:1]}"
                same = "same code" if code_of(obj, folder) == normal else "CODE DIFFERS"
                print(f"| {index} | host with pch | {seconds:.2f} | {used}; {same} |")
            if kind == "device":
                source = source_of(command)
                text = open(source).read()
                with open(source, "w") as f:
                    f.write(light_source(text))
                try:
                    seconds, _ = timed(command, folder)
                    totals["device light"].append(seconds)
                    print(f"| {index} | device light | {seconds:.2f} | |")
                except RuntimeError as e:  # the evaluator then builds the text as written
                    print(f"| {index} | device light | failed | {str(e).splitlines()[-1][:100]} |")
                with open(source, "w") as f:
                    f.write(text)
            if kind == "device" and steps:
                for tool, seconds in nvcc_steps(command, folder):
                    totals[f"nvcc step {tool}"].append(seconds)
                    print(f"| {index} | nvcc step {tool} | {seconds:.2f} | |")
    print("\n| phase | runs | mean s | median s |\n| --- | ---: | ---: | ---: |")
    for kind, seconds in totals.items():
        print(f"| {kind} | {len(seconds)} | {statistics.mean(seconds):.2f} | {statistics.median(seconds):.2f} |")
    mean = {kind: statistics.mean(seconds) for kind, seconds in totals.items()}
    rest = mean.get("device", 0.0) + mean.get("link", 0.0)
    if "host" in mean:
        print(f"\nCompiler seconds per build (what bounds a host's throughput): old "
              f"{mean['host'] + rest:.1f}, with the pch {mean['host with pch'] + rest:.1f} (+ the pch once)")
    if "device light" in mean:
        light = mean["device light"] + mean.get("link", 0.0) + mean.get("host", 0.0)
        print(f"Light device compile: {mean['device']:.1f} s as written, {mean['device light']:.1f} s light "
              f"({mean['device'] / mean['device light']:.2f}x); compiler seconds per build with it: {light:.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("programs")
    parser.add_argument("--count", type=int, default=2, help="builds to time (all are counted for repeats)")
    parser.add_argument("--cuda", action="store_true", help="also time the .cu compiles (nvcc), as written and light")
    parser.add_argument("--nvcc-steps", action="store_true", help="with --cuda, also each step of nvcc alone")
    options = parser.parse_args()
    if not options.cuda:
        # CUDA sources are still written (for the repeat counts), without being compiled.
        os.environ.setdefault("CUDA_HOME", os.environ.get("CUDA_PATH", "/usr/local/cuda"))
    # Removed at the end: each pch is most of a gigabyte.
    with tempfile.TemporaryDirectory(prefix="build-speed-") as root:
        report(options, root)


def report(options, root):
    builds = []
    uncaptured = 0
    for index, (name, code) in enumerate(programs_of(options.programs)):
        calls = captured_calls(code)
        uncaptured += not calls
        for number, (kind, arguments) in enumerate(calls):
            folder = os.path.join(root, f"{index}-{number}")
            os.makedirs(folder)
            try:
                builds.append((folder, write_build(kind, arguments, folder)))
            except Exception as e:  # noqa: BLE001 (a program whose build torch refuses to write)
                print(f"<!-- {name}: {e} -->", file=sys.stderr)
    print(f"# Build speed: {options.programs}\n\ntorch {torch.__version__}; {len(builds)} builds written, "
          f"{uncaptured} programs without a build at import; timings alone, one after another\n")
    repeats(builds)
    phases(builds, options.count, options.cuda, options.nvcc_steps)


if __name__ == "__main__":
    main()
