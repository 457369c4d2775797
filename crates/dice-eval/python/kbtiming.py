"""KernelBench's timing (`--timing kernelbench`, `--timing kernelbench-v0.1`), call for call.

KB HEAD (`timing.time_execution_with_cuda_event`, KB spec §3.1): warm-up calls with a
synchronisation after each, `torch.cuda.empty_cache()`, then per trial: synchronise, new start
and end events, the L2 flush (a fresh 256 MiB int64 tensor filled with 42), record start, call,
record end, synchronise, elapsed time; the first trial is discarded. The candidate is timed as
`eval_kernel_against_ref` does (3 warm-ups, autograd on), the baseline as
`measure_ref_program_time` does (5 warm-ups, under no_grad). KB v0.1, the harness of DICE's
paper: 3 warm-ups on both sides, and per trial only record start, call, record end, synchronise:
no flush, no synchronisation before the call, nothing discarded, no empty_cache.

Both call the model with one input set, the same tensors every call (KB spec §3.2: set_seed(42),
`protocol.Seeds.timed_call` under these methods), drawn as dice draws inputs (on the evaluation
device), so that the last timed output can be judged against the reference's. Where CUDA events
do not exist (the CPU), the same loop reads perf_counter around the call. Unlike dice's own Timer, garbage collection stays on, as in
KernelBench's process; the timed process is still kept on its cores (the evaluator's builds run
beside it, which KernelBench's harness never has). The persisting L2 state is reset before each
round of calls and before every flush (persisting_l2.py).
"""

import os
from time import perf_counter

import torch

import persisting_l2
import protocol

L2_FLUSH_SHAPE = (32, 1024, 1024)  # int64: 256 MiB


class Method:
    def __init__(self, candidate_warmups, baseline_warmups, flush, sync_before, discard_first, empty_cache):
        self.candidate_warmups = candidate_warmups
        self.baseline_warmups = baseline_warmups
        self.flush = flush
        self.sync_before = sync_before
        self.discard_first = discard_first
        self.empty_cache = empty_cache


METHODS = {
    "kernelbench": Method(candidate_warmups=3, baseline_warmups=5, flush=True, sync_before=True, discard_first=1, empty_cache=True),
    "kernelbench-v0.1": Method(candidate_warmups=3, baseline_warmups=3, flush=False, sync_before=False, discard_first=0, empty_cache=False),
}


class Timer:
    """`run(n)` times the next n trials; the first call warms up (and discards) first. `side` is
    "candidate" or "baseline": KernelBench times them differently."""

    host = []  # KernelBench's timing keeps no record of the host side (protocol.HostSide)

    def __init__(self, setup, problem, model, method, side, cores=None):
        self.method = METHODS[method]
        self.setup = setup
        self.model = model
        self.cores = cores
        self.baseline = side == "baseline"
        # One input set, as KernelBench times: the evaluator judges the last timed output.
        self.inputs = setup.inputs(problem, setup.seeds.timed_call(0))
        self.last = None
        self.last_call = None
        self.started = False
        self.untimed_calls = 0  # made by the last run before its timed ones
        self.cuda = setup.device.type == "cuda"
        self.l2 = persisting_l2.Guard(setup.device)

    def run(self, n, first_call, call_keys):
        """Times calls first_call .. first_call + n - 1, all on the one input set (no call's key
        is asked for: KernelBench times one input set)."""
        if self.cores:
            os.sched_setaffinity(0, self.cores["timed"])
        self.l2.reset()
        try:
            with torch.set_grad_enabled(not self.baseline):
                self.untimed_calls = 0
                if not self.started:
                    self.untimed_calls = self._warm_up() + self.method.discard_first
                    self.started = True
                    for _ in range(self.method.discard_first):
                        self._trial()
                times = [self._trial() for _ in range(n)]
                self.last_call = first_call + n - 1
                return times
        finally:
            if self.cores:
                os.sched_setaffinity(0, self.cores["untimed"])

    def _warm_up(self):
        warmups = self.method.baseline_warmups if self.baseline else self.method.candidate_warmups
        for _ in range(warmups):
            self.model(*self.inputs)
            self.setup.sync()
        if self.cuda and self.method.empty_cache:
            torch.cuda.empty_cache()
        return warmups

    def _trial(self):
        if not self.cuda:
            start = perf_counter()
            self.last = self.model(*self.inputs)
            return (perf_counter() - start) * 1e3
        if self.method.sync_before:
            torch.cuda.synchronize(self.setup.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        if self.method.flush:
            self.l2.reset()
            flush = torch.empty(L2_FLUSH_SHAPE, dtype=torch.int64, device=self.setup.device)
            flush.fill_(42)
            del flush
        start.record()
        self.last = self.model(*self.inputs)
        end.record()
        torch.cuda.synchronize(self.setup.device)
        return start.elapsed_time(end)

    def checked_outputs(self):
        """(call, outputs) of the last timed call, the one judged, as `protocol.Timer`'s."""
        return [(self.last_call, protocol.as_tensor_list(self.last))]
