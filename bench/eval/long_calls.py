"""Sorts the long timed calls a `dice eval` log names (RUST_LOG=dice_eval::long_calls=info:
job.rs `log_long_calls`, one line per call over 5x its round's median) by what held them up,
from what the timing thread's host side did while it enqueued the call (protocol.py HostSide):
  host     the enqueue itself took most of the call (the device waited for the host), split by
           whether the thread was preempted (off its core), faulted pages, or neither (blocked
           or spinning in a call: the driver, a lock);
  device   the host had enqueued the call in under half its time: the device was held up.

    python3 bench/eval/long_calls.py RUN.log [RUN.log ...]
"""

import re
import statistics
import sys

LINE = re.compile(
    r": (?P<side>candidate|baseline) call \d+: (?P<ms>[\d.]+) ms, round median (?P<median>[\d.]+) ms; "
    r"host enqueued it in (?P<wall>[\d.NaN]+) ms \((?P<cpu>[\d.NaN]+) ms on the cpu, "
    r"(?P<preempted>[\d.NaN]+) preemptions, (?P<faults>[\d.NaN]+) page faults\)")


def kind(c):
    if not c["wall"] == c["wall"] or c["wall"] < 0.5 * c["ms"]:
        return "device"
    if c["preempted"] > 0:
        return "host, preempted"
    if c["faults"] > 0:
        return "host, page faults"
    if c["cpu"] > 0.5 * c["wall"]:
        return "host, on the cpu"
    return "host, blocked"


def main(paths):
    for path in paths:
        calls = []
        for line in open(path, errors="replace"):
            m = LINE.search(line)
            if m:
                calls.append({k: (v if k == "side" else float(v)) for k, v in m.groupdict().items()})
        if not calls:
            print(f"{path}: no long timed call logged")
            continue
        kinds = {}
        for c in calls:
            kinds.setdefault(kind(c), []).append(c)
        cells = "; ".join(
            f"{k} {len(v)} ({sum(c['side'] == 'candidate' for c in v)} candidate), median {statistics.median(c['ms'] for c in v):.1f} ms"
            for k, v in sorted(kinds.items(), key=lambda kv: -len(kv[1])))
        print(f"{path}: {len(calls)} long calls: {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])
