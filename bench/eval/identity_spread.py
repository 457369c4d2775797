"""How far identity candidates' speedups (their own reference renamed `ModelNew`, whose speedup
must be 1) land from 1 in a run's store, by the statistic the speedup divides: the mean of the
calls (dice's stored speedup), their median, and their minimum. Identities are the samples with
problem id >= 1,000,000 (pairs_with_identity.py). Also the calls' mode mixture: how many samples
have a median call over 1.5x their fastest; and the calls' tail on each side: how many samples'
candidate (fresh process) and baseline (reference process) have a mean over 1.2x their median, a
few very long calls among short ones (bench/notes/eval-h200.md, session 23).

    python3 bench/eval/identity_spread.py RUN.db [RUN.db ...]
"""

import json
import sqlite3
import statistics
import sys

OFFSET = 1_000_000


def quantile(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def spread(db):
    rows = sqlite3.connect(db).execute(
        "select candidate_timing, baseline_timing from samples where problem_id >= ? and candidate_timing is not null",
        (OFFSET,)).fetchall()
    devs = {"mean": [], "median": [], "min": []}
    mixed = 0
    tails = {"candidate": 0, "baseline": 0}
    for c, b in rows:
        c, b = json.loads(c), json.loads(b)
        for k, v in devs.items():
            v.append(abs(b[f"{k}_ms"] / c[f"{k}_ms"] - 1))
        mixed += max(c["median_ms"] / c["min_ms"], b["median_ms"] / b["min_ms"]) > 1.5
        tails["candidate"] += c["mean_ms"] > 1.2 * c["median_ms"]
        tails["baseline"] += b["mean_ms"] > 1.2 * b["median_ms"]
    return len(rows), devs, mixed, tails


def main(dbs):
    for db in dbs:
        n, devs, mixed, tails = spread(db)
        if n == 0:
            print(f"{db}: no timed identity candidate")
            continue
        cells = " · ".join(
            f"{k} {100 * statistics.median(v):.1f} / {100 * quantile(v, 0.9):.1f} / {100 * quantile(v, 0.95):.1f} %"
            for k, v in devs.items())
        print(f"{db}: {n} identities; |speedup - 1| median / p90 / p95 by {cells}; "
              f"{mixed} with a median call over 1.5x the fastest; mean over 1.2x the median: "
              f"{tails['candidate']} candidates, {tails['baseline']} baselines")


if __name__ == "__main__":
    main(sys.argv[1:])
