"""Which CUDA kernels a call launches, on which stream, for how long (torch.profiler).

Runs in the candidate's process, so a candidate can forge it (SANDBOX.md); the evaluator matches
the names against the candidate's own kernels and decides what the profile means.
"""

import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

MAX_KERNELS = 200
MAX_NAME = 300


def launched(fn, trace_path):
    """Runs fn under the profiler: (result, [{name, stream, us, calls}] by total time)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    try:
        with open(trace_path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.remove(trace_path)
    totals = {}
    for e in events:
        if e.get("cat") != "kernel":
            continue
        key = (e.get("name", "")[:MAX_NAME], e.get("args", {}).get("stream"))
        us, calls = totals.get(key, (0.0, 0))
        totals[key] = (us + float(e.get("dur", 0.0)), calls + 1)
    kernels = [{"name": n, "stream": s, "us": us, "calls": c} for (n, s), (us, c) in totals.items()]
    kernels.sort(key=lambda k: -k["us"])
    return result, kernels[:MAX_KERNELS]


def default_stream(device, trace_path):
    """The stream id the profiler gives work on the default stream, learnt from an ATen op."""
    x = torch.ones(1 << 16, device=device)
    _, kernels = launched(lambda: x.mul_(2), trace_path)
    streams = {k["stream"] for k in kernels}
    return streams.pop() if len(streams) == 1 else None
