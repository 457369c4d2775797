#!/usr/bin/env python3
"""PTX instructions of each kernel entry of a PTX file, as a Markdown table: a proxy, on a machine
without a GPU or a disassembler, for the instructions a kernel issues (ptxas keeps PTX's integer
and conversion work; what it removes is mostly moves). Session 31 used it on the training
attention (bench/notes/train-h200.md):

    nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -ptx -DHEAD_DIM=128 \
        -o /tmp/ta.ptx crates/dice-model/src/kernels/train_attention.cu
    python3 bench/ptx_counts.py /tmp/ta.ptx [NAME_SUBSTRING]

(nvcc from scripts/build-cuda.sh's environment: `eval "$(scripts/build-cuda.sh --print-env)"`.)
Counts every instruction line of an entry's body (inline asm's too), not directives, labels or
comments; with NAME_SUBSTRING only the entries whose name holds it.
"""
import collections
import re
import sys

ENTRY = re.compile(r"^(?:\.visible\s+)?\.entry\s+(\w+)\(", re.M)
INSTRUCTION = re.compile(r"^\s+(?:@!?%p\d+\s+)?([a-z][\w.]*)")


def counts(text):
    starts = [(m.start(), m.group(1)) for m in ENTRY.finditer(text)]
    for i, (start, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        ops = collections.Counter()
        for line in text[start:end].splitlines()[1:]:
            m = INSTRUCTION.match(line)
            if m:
                ops[m.group(1).split(".")[0]] += 1
        yield name, ops


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    wanted = sys.argv[2] if len(sys.argv) == 3 else ""
    print("| kernel | instructions | setp | selp | cvt | ex2 | wgmma | cp.async |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, ops in counts(open(sys.argv[1]).read()):
        if wanted in name:
            print(f"| `{name}` | {sum(ops.values())} | {ops['setp']} | {ops['selp']} | "
                  f"{ops['cvt']} | {ops['ex2']} | {ops['wgmma']} | {ops['cp']} |")


if __name__ == "__main__":
    main()
