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


class Session:
    """The CUDA profiler of one process. Created before the device is needed: the profiler's
    first start (CUPTI) costs seconds of host time that should not hold the device."""

    def __init__(self, job_dir):
        self.trace_path = os.path.join(job_dir, "profile.json")
        with profile(activities=[ProfilerActivity.CUDA]):
            pass

    def launched(self, fn):
        """Runs fn under the profiler: (default stream id, [{name, stream, us, calls}] by total
        time). A marker op runs first, so the earliest kernel names the default stream."""
        marker = torch.ones(1 << 16, device="cuda")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            marker.mul_(2)
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
        prof.export_chrome_trace(self.trace_path)
        try:
            with open(self.trace_path) as f:
                events = json.load(f).get("traceEvents", [])
        finally:
            os.remove(self.trace_path)
        kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: float(e.get("ts", 0.0)))
        if not kernels:
            return None, []
        default = kernels[0].get("args", {}).get("stream")
        totals = {}
        for e in kernels[1:]:
            key = (e.get("name", "")[:MAX_NAME], e.get("args", {}).get("stream"))
            us, calls = totals.get(key, (0.0, 0))
            totals[key] = (us + float(e.get("dur", 0.0)), calls + 1)
        found = [{"name": n, "stream": s, "us": us, "calls": c} for (n, s), (us, c) in totals.items()]
        found.sort(key=lambda k: -k["us"])
        return default, found[:MAX_KERNELS]
