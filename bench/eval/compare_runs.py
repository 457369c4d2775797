"""Compares the speedups of two `dice report --format json` outputs of the same programs (issue
#15's acceptance): per program the ratio A / B of speedups, the median and 90th percentile of
|ratio - 1|, Spearman's rank correlation, how many land on different sides of 1x; and, for the
identity candidates of A (ids >= 1,000,000, see pairs_with_identity.py), |speedup - 1|. A or B may
also be the JSONL that kernelbench_timing.py writes.

    python3 bench/eval/compare_runs.py A.json B.json [--field speedup|median_speedup] [--json OUT]
"""

import argparse
import json
import statistics

IDENTITY = 1_000_000


def speedups(path, field):
    """Speedups by program id: a `dice report --format json`, or the JSONL of kernelbench_timing.py."""
    out = {}
    if path.endswith(".jsonl"):
        for line in open(path):
            row = json.loads(line)
            if row.get("speedup"):
                out[row["id"]] = row["speedup"]
        return out
    for s in json.load(open(path))["samples"]:
        if s.get("correct") and s.get(field):
            out[s["problem_id"]] = s[field]
    return out


def ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(a, b):
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--field", default="speedup")
    ap.add_argument("--json")
    args = ap.parse_args()
    a, b = speedups(args.a, args.field), speedups(args.b, args.field)
    common = sorted(k for k in a if k in b and k < IDENTITY)
    ratios = [a[k] / b[k] for k in common]
    dev = [abs(r - 1) for r in ratios]
    sides = sum((a[k] > 1) != (b[k] > 1) for k in common)
    ident = [abs(v - 1) for k, v in a.items() if k >= IDENTITY]
    result = {
        "field": args.field,
        "programs": len(common),
        "median_ratio": statistics.median(ratios) if ratios else None,
        "median_abs_ratio_dev": statistics.median(dev) if dev else None,
        "p90_abs_ratio_dev": quantile(dev, 0.9),
        "spearman": spearman([a[k] for k in common], [b[k] for k in common]),
        "other_side_of_1x": sides,
        "identity_count": len(ident),
        "identity_median_abs_dev": statistics.median(ident) if ident else None,
        "identity_p95_abs_dev": quantile(ident, 0.95) if ident else None,
    }
    for k, v in result.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    if args.json:
        json.dump(result, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
