"""Writes a pairs file that holds every pair of PAIRS, each followed by its identity candidate
(its own PyTorch program with `Model` renamed `ModelNew`, id + OFFSET): timed in the same cold
batch as the real kernels, the identity candidates show how far the batch's load moves a
speedup that must be 1. Interleaved, they are judged while the pairs' builds run (the load the
measure is about), and a batch cut short holds both kinds.

    python3 bench/eval/pairs_with_identity.py PAIRS.json OUT.json [--only-identity]

--only-identity writes the identity candidates alone: a batch with no build, whose dispersion is
the batch's own processes' doing (run-h200.sh steps id-look, id-nolook, id-quiet).
"""

import json
import re
import sys

OFFSET = 1_000_000


def identity(pair):
    code = re.sub(r"\bModel\b", "ModelNew", pair["pytorch_code"])
    return {"id": pair["id"] + OFFSET, "pytorch_code": pair["pytorch_code"], "cuda_code": code}


def main(src, dst, only_identity=False):
    pairs = json.load(open(src))
    out = []
    for p in pairs:
        if not only_identity:
            out.append({"id": p["id"], "pytorch_code": p["pytorch_code"], "cuda_code": p["cuda_code"]})
        out.append(identity(p))
    json.dump(out, open(dst, "w"))
    kept = "" if only_identity else f"{len(pairs)} pairs + "
    print(f"{kept}{len(pairs)} identity candidates -> {dst}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--only-identity" in sys.argv[3:])
