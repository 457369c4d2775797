"""Cold builds beside timing windows on the CPU, for quiet timing's share (crates/dice-eval
TIMING.md, "Builds beside timing").

`quiet_share.py candidates OUT.jsonl [BUILDS] [IDENTITIES]` writes IDENTITIES identity
candidates of problem 2 (its reference renamed `ModelNew`), ready to be timed at once, then BUILDS
C++ ReLU candidates (examples/candidates.jsonl, problem 1 sample 0) whose builds run beside that
timing; each source is made distinct, so that each is built or judged on its own.
`quiet_share.py summary RUN_DIR` prints the builds' wall time, the identity candidates'
|speedup - 1| (median, 90th percentile, max) and how long builds were stopped or ran beside
timing.
"""

import json
import sqlite3
import statistics
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def candidates(out, builds=6, identities=8):
    lines = [json.loads(line) for line in (EXAMPLES / "candidates.jsonl").open()]
    relu = next(c["code"] for c in lines if (c["problem_id"], c["sample_id"]) == (1, 0))
    identity = next(c["code"] for c in lines if (c["problem_id"], c["sample_id"]) == (2, 2))
    with open(out, "w") as f:
        for k in range(identities):
            code = f"# identity {k}\n{identity}"
            f.write(json.dumps({"level": 1, "problem_id": 2, "sample_id": k, "code": code}) + "\n")
        for k in range(builds):
            code = relu.replace("#include <cmath>", f"#include <cmath>\n// build {k}", 1)
            assert code != relu
            f.write(json.dumps({"level": 1, "problem_id": 1, "sample_id": k, "code": code}) + "\n")


def summary(run_dir):
    db = sqlite3.connect(f"file:{Path(run_dir) / 'dice.db'}?mode=ro", uri=True)
    rows = db.execute("SELECT problem_id, verdict, speedup, wall_s, stages FROM samples").fetchall()
    builds = sorted(w for (w,) in db.execute("SELECT wall_s FROM builds WHERE cached = 0 AND ok = 1"))
    off = sorted(abs(s - 1) for p, v, s, _, _ in rows if p == 2 and s is not None)
    beside = {}
    for *_, stages in rows:
        for name, secs in json.loads(stages or "[]"):
            if name.startswith("timing"):
                beside[name] = beside.get(name, 0.0) + secs
    verdicts = {}
    for _, v, *_ in rows:
        verdicts[v] = verdicts.get(v, 0) + 1
    print("verdicts", verdicts)
    if builds:
        print(f"builds: n={len(builds)} wall s median {statistics.median(builds):.1f} max {builds[-1]:.1f}")
    if off:
        p90 = off[min(len(off) - 1, int(0.9 * len(off)))]
        print(f"identity |speedup-1|: n={len(off)} median {statistics.median(off):.3f} p90 {p90:.3f} max {off[-1]:.3f}")
    print("seconds summed:", {k: round(v, 2) for k, v in sorted(beside.items())})


if __name__ == "__main__":
    {"candidates": candidates, "summary": summary}[sys.argv[1]](*sys.argv[2:3], *map(int, sys.argv[3:]))
