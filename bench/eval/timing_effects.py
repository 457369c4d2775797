"""Measures, one at a time, the differences between dice's timing and KernelBench's harness that
crates/dice-eval/TIMING.md discusses, on small PyTorch models in this one process:

* schedule: an identity pair (the same model as candidate and baseline) timed KernelBench's way
  (all candidate calls, then all baseline calls) and dice's way (rounds of calls alternating,
  the order flipped each round); the speedup must be 1, so |speedup - 1| is the method's error;
* autograd: calls with autograd on (how KernelBench times a candidate) against no_grad (its
  baseline, and dice's both sides);
* gc: calls with the garbage collector on (KernelBench) against paused (dice);
* statistics: mean against median of the same calls.

    python3 bench/eval/timing_effects.py [--device cpu|cuda] [--repeats 10] [--calls 100]

Prints one JSON object per measurement.
"""

import argparse
import gc
import json
import statistics
from time import perf_counter

import torch
import torch.nn as nn


def models():
    relu = nn.ReLU()
    linear = nn.Linear(1024, 1024)
    return {
        "relu_64x4096": (relu, [torch.randn(64, 4096)]),
        "linear_64x1024": (linear, [torch.randn(64, 1024)]),
        "relu_16x256": (relu, [torch.randn(16, 256)]),
    }


class Clock:
    def __init__(self, device):
        self.device = device

    def call_ms(self, model, args):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(*args)
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end)
        start = perf_counter()
        model(*args)
        return (perf_counter() - start) * 1e3


def summary(ms):
    mean = statistics.fmean(ms)
    return {"mean": mean, "median": statistics.median(ms), "cv": statistics.pstdev(ms) / mean, "max": max(ms)}


def schedule_error(clock, model, args, calls, rounds, interleaved):
    """|speedup - 1| of an identity pair, by means and by medians."""
    a, b = [], []
    per_round = calls // rounds
    for r in range(rounds):
        order = (a, b) if r % 2 == 0 else (b, a)
        if interleaved:
            for side in order:
                side.extend(clock.call_ms(model, args) for _ in range(per_round))
    if not interleaved:
        for side in (a, b):
            side.extend(clock.call_ms(model, args) for _ in range(calls))
    by_mean = abs(statistics.fmean(b) / statistics.fmean(a) - 1)
    return by_mean, abs(statistics.median(b) / statistics.median(a) - 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    device = torch.device(args.device)
    clock = Clock(device)
    for name, (model, inputs) in models().items():
        model = model.to(device)
        inputs = [x.to(device) for x in inputs]
        for _ in range(3):
            model(*inputs)
        errors = {"sequential": [], "interleaved": []}
        for _ in range(args.repeats):
            with torch.no_grad():
                for kind in errors:
                    errors[kind].append(schedule_error(clock, model, inputs, args.calls, 10, kind == "interleaved"))
        row = {"model": name, "effect": "schedule: identity |speedup-1| over the repeats (median, max)"}
        for kind, e in errors.items():
            for i, statistic in enumerate(("means", "medians")):
                row[f"{kind} by {statistic}"] = [statistics.median(x[i] for x in e), max(x[i] for x in e)]
        print(json.dumps(row), flush=True)

        grad, nograd = [], []
        for _ in range(args.repeats):
            grad.extend(clock.call_ms(model, inputs) for _ in range(args.calls))
            with torch.no_grad():
                nograd.extend(clock.call_ms(model, inputs) for _ in range(args.calls))
        print(json.dumps({"model": name, "effect": "autograd on vs no_grad", "on": summary(grad), "no_grad": summary(nograd)}), flush=True)

        on, off = [], []
        with torch.no_grad():
            for _ in range(args.repeats):
                on.extend(clock.call_ms(model, inputs) for _ in range(args.calls))
                gc.disable()
                off.extend(clock.call_ms(model, inputs) for _ in range(args.calls))
                gc.enable()
        print(json.dumps({"model": name, "effect": "gc on vs paused", "on": summary(on), "paused": summary(off)}), flush=True)


if __name__ == "__main__":
    main()
