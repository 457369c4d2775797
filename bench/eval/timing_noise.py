"""Where the dispersion of small programs' timed calls comes from (issue #27), on a CUDA host.

Times identity pairs (one problem's reference model, two instances A and B, the same inputs per
call) with dice's own timer (python/protocol.py `Timer`) in alternating rounds, as the
evaluator does, under disturbances made by other processes on the cores the timed process
does not use, the way a cold batch disturbs it:
  quiet   nothing beside
  idle    8 processes holding a CUDA context, asleep (other run slots waiting for their pass)
  spawn   4 processes starting `python -c "import torch; torch.zeros(1, device='cuda')"` in a
          loop (the evaluator's process churn: imports, contexts made and destroyed)
  ctx     4 processes creating and destroying a bare CUDA context in a loop (libcuda only)
  trickle 1 process launching a tiny kernel every 0.5 ms (another context with sparse work: the
          device time-slices between contexts that both have work)
  teardown 2 processes in a loop: start torch, take 4 GiB of device memory, exit (contexts that
          end while others time, as finished candidates' do)
  profiler 1 process recording a small op's kernels with dice's CUPTI session, again and again
          (python/profiling.py, as the profiled trials of other samples do)
  cpu     one busy Python loop per spare core that shares no physical core with the timed ones
          (compilers' CPU, not their memory traffic)
  smt     one busy Python loop on each hyper-threaded sibling of the timed cores (skipped without
          SMT): what the evaluator's whole-core split (job.rs `timing_cores`) keeps away
  mem     one memory-streaming process per spare core (compilers' memory traffic)
and three ways to time a call:
  dice    protocol.Timer as the evaluator runs it (persisting-L2 reset, flush, events)
  noreset the same without the persisting-L2 reset
  queued  protocol.Timer as `--timing dice-queued` runs it: a spin after the flush as long as
          A's enqueue of a call (1.5x its least warm-up + 20 us; B gets A's, as a candidate gets
          the baseline's): the device's time alone, without launch gaps
Prints one line per (disturbance, timer, problem) and a summary per (disturbance, timer):
per-call coefficient of variation, and |B/A - 1| of the identity's speedup by five statistics of
the calls (mean, median, minimum, 5th and 10th percentile). --out keeps every call's time.

    python3 bench/eval/timing_noise.py PAIRS.json --ids 7498,4537,... [--reps 3] [--out F.jsonl]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.realpath(os.path.join(HERE, "..", "..", "crates", "dice-eval", "python"))
sys.path.insert(0, PYTHON_DIR)

import torch  # noqa: E402

import protocol  # noqa: E402

SPIN = {
    "cpu": "while True: pass",
    "smt": "while True: pass",
    "mem": "import numpy as np\na = np.ones(1 << 24); b = np.empty_like(a)\nwhile True: np.copyto(b, a); np.copyto(a, b)",
    "idle": "import torch, time\ntorch.zeros(1, device='cuda')\ntime.sleep(1e6)",
    "spawn": "import subprocess, sys\nwhile True: subprocess.run([sys.executable, '-c', \"import torch; torch.zeros(1, device='cuda')\"])",
    "trickle": "import torch, time\nx = torch.ones(1, device='cuda')\nwhile True:\n    x.add_(1); time.sleep(5e-4)",
    "teardown": "import subprocess, sys\nwhile True: subprocess.run([sys.executable, '-c', \"import torch; torch.empty(1 << 30, device='cuda').fill_(1); torch.cuda.synchronize()\"])",
    "profiler": (
        f"import sys; sys.path.insert(0, {PYTHON_DIR!r})\n"
        "import torch, profiling\nsession = profiling.Session()\nx = torch.ones(1 << 16, device='cuda')\n"
        "while True: session.launched(lambda: x.mul_(1.0))"
    ),
    "ctx": (
        "import ctypes\ncuda = ctypes.CDLL('libcuda.so.1'); cuda.cuInit(0)\n"
        "dev = ctypes.c_int(); cuda.cuDeviceGet(ctypes.byref(dev), 0)\n"
        "while True:\n"
        "    ctx = ctypes.c_void_p(); cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)\n"
        "    mem = ctypes.c_uint64(); cuda.cuMemAlloc_v2(ctypes.byref(mem), ctypes.c_size_t(64 << 20))\n"
        "    cuda.cuCtxDestroy_v2(ctx)\n"
    ),
}
COUNT = {"idle": 8, "spawn": 4, "ctx": 4, "trickle": 1, "teardown": 2, "profiler": 1}
# Seconds a disturbance gets to start (torch's import) before the timing begins.
SETTLE_S = {"idle": 8, "spawn": 8, "trickle": 6, "teardown": 8, "profiler": 8}


def siblings(core):
    """The logical cores of `core`'s physical core, itself included."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return [core]
    cores = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cores += range(int(first), int(last or first) + 1)
    return cores


def disturb(kind, spare, smt):
    """Starts the processes of disturbance `kind` on the cores `spare` (`smt`: on the timed cores'
    siblings)."""
    if kind == "quiet":
        return []
    if kind == "smt":
        spare = smt
    n = COUNT.get(kind, len(spare))
    procs = []
    for i in range(n):
        core = spare[i % len(spare)]
        procs.append(subprocess.Popen(
            ["taskset", "-c", str(core), sys.executable, "-c", SPIN[kind]],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    time.sleep(SETTLE_S.get(kind, 1))
    return procs


class NoResetTimer(protocol.Timer):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.l2.reset = lambda: None


WHOLE_UP_TO = 1 << 30

def queued_timer(*args):
    return protocol.Timer(*args, queued=True)


TIMERS = {"dice": protocol.Timer, "noreset": NoResetTimer, "queued": queued_timer}


def identity_pair(setup, problem, timer_class, rounds, calls):
    """Alternating rounds of A and B (order flipped each round), as the evaluator times."""
    model_a = setup.build_model(problem, problem.Model)
    model_b = setup.build_model(problem, problem.Model)
    # The evaluator's defaults (config.rs): 3 timed calls checked, outputs up to 1 GiB kept whole.
    a = timer_class(setup, problem, model_a, 3, WHOLE_UP_TO)
    b = timer_class(setup, problem, model_b, 3, WHOLE_UP_TO)
    ta, tb = [], []
    for r in range(rounds):
        key = int.from_bytes(os.urandom(8), "little")
        first = r * calls
        order = [(a, ta), (b, tb)] if r % 2 == 0 else [(b, tb), (a, ta)]
        for timer, times in order:
            # A's first run (round 0 begins with it) sets the queued timer's hold, which B is
            # handed as a candidate is the baseline's; None for the other timers.
            # Both sides' call c on the same inputs, as the evaluator hands out a call's key.
            keys = lambda first, count: [key + c for c in range(first, first + count)]  # noqa: E731
            times += timer.run(calls, first, keys, a.hold_ms if timer is b else None)
    return ta, tb


def quantile(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


STATISTICS = {
    "mean": statistics.fmean,
    "median": statistics.median,
    "min": min,
    "p05": lambda xs: quantile(xs, 0.05),
    "p10": lambda xs: quantile(xs, 0.10),
}


def cv(xs):
    m = statistics.fmean(xs)
    return statistics.pstdev(xs) / m if m else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pairs")
    ap.add_argument("--ids", required=True)
    ap.add_argument("--kinds", default="quiet,trickle,spawn,teardown,profiler,idle,ctx,cpu,smt,mem")
    ap.add_argument("--timers", default="dice,queued")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (timer dice only)")
    args = ap.parse_args()
    pairs = {p["id"]: p for p in json.load(open(args.pairs))}
    ids = [int(i) for i in args.ids.split(",")]
    cores = sorted(os.sched_getaffinity(0))
    timed = cores[:2]
    smt = sorted({s for c in timed for s in siblings(c)} - set(timed))
    spare = [c for c in cores if c not in timed and c not in smt]
    os.sched_setaffinity(0, timed)
    setup = protocol.Setup({"device": args.device, "seed": 1234, "precision": None})
    problems = {}
    for pid in ids:
        path = f"/tmp/timing_noise_{pid}.py"
        with open(path, "w") as f:
            f.write(pairs[pid]["pytorch_code"])
        problems[pid] = protocol.load_module(f"problem_{pid}", path)
    out = open(args.out, "w") if args.out else None
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__} {device} timed cores {timed} (their siblings {smt}), spare {len(spare)}", flush=True)
    for kind in args.kinds.split(","):
        if kind == "smt" and not smt:
            print("== smt      skipped: the timed cores have no hyper-threaded siblings", flush=True)
            continue
        procs = disturb(kind, spare, smt)
        try:
            for timer in args.timers.split(","):
                devs, cvs = {k: [] for k in STATISTICS}, []
                for pid, problem in problems.items():
                    for rep in range(args.reps):
                        t0 = time.perf_counter()
                        ta, tb = identity_pair(setup, problem, TIMERS[timer], args.rounds, args.calls)
                        speedups = {k: f(ta) / f(tb) for k, f in STATISTICS.items()}
                        row = {"kind": kind, "timer": timer, "id": pid, "rep": rep,
                               "median_us": 1e3 * statistics.median(ta + tb), "cv_a": cv(ta), "cv_b": cv(tb),
                               "speedups": speedups,
                               "p10_us": 1e3 * quantile(ta, 0.1), "p90_us": 1e3 * quantile(ta, 0.9),
                               "wall_s": time.perf_counter() - t0,
                               "a_ms": [round(x, 5) for x in ta], "b_ms": [round(x, 5) for x in tb]}
                        for k, v in speedups.items():
                            devs[k].append(abs(v - 1))
                        cvs += [row["cv_a"], row["cv_b"]]
                        if out:
                            out.write(json.dumps(row) + "\n")
                            out.flush()
                        print(f"{kind:8} {timer:7} {pid:5} rep {rep} median {row['median_us']:8.1f} us "
                              f"p10-p90 {row['p10_us']:.1f}-{row['p90_us']:.1f} cv {row['cv_a']:.2f}/{row['cv_b']:.2f} speedup by "
                              + " ".join(f"{k} {v:.3f}" for k, v in speedups.items()), flush=True)
                spread = " ".join(f"{k} {100 * statistics.median(v):.1f}/{100 * quantile(v, 0.9):.1f}" for k, v in devs.items())
                print(f"== {kind:8} {timer:7} |speedup-1| % median/p90 by statistic: {spread}; "
                      f"per-call cv median {statistics.median(cvs):.2f}", flush=True)
        finally:
            for p in procs:
                os.killpg(p.pid, 9)
            for p in procs:
                p.wait()


if __name__ == "__main__":
    main()
