"""The seed/input/trial/timing protocol, one code path for the reference and the candidate.

Both processes: set_seed(42) then init inputs; set_seed(42) then construct the model (on the CPU,
then moved to the device, as KernelBench does); trial and timing seeds from the run's seed
(`Seeds`); per trial set_seed(s), inputs, set_seed(s) right before forward.
Inputs are generated inside a `torch.device(device)` context, so factory calls such as torch.rand
allocate on the evaluation device from that device's generator, identically in both processes.
"""

import errno
import gc
import hashlib
import json
import os
import random
import resource
import stat
import sys
import types
from time import perf_counter_ns, thread_time_ns

import torch

import persisting_l2
import shared_output
# KernelBench's seed: the model's construction always, and the run's seed under `--input-seed 42`.
SEED = 42
WARMUP_CALLS = 3
L2_FLUSH_BYTES = 256 << 20
# Copies of a call's outputs up to this size stay on the device (`kept_copies`): the reference's
# seven trials and the timers' kept calls, times the problems in flight, must leave room for the
# candidates.
DEVICE_KEPT_BYTES = 1 << 30
# Values a timed call's output tensor keeps when it is judged by a sample (`kept_sample`): a
# stale or partly computed output wrong on a share w of its values escapes with probability
# (1 - w) ** SAMPLE_ELEMENTS (w = 1e-5: e^-10).
SAMPLE_ELEMENTS = 1 << 20
# The most input bytes the CPU's timer makes ahead of the calls that take them (Timer
# `_timed_premade`): a round of small inputs is made at once, large ones a few calls at a time.
CPU_PREMADE_INPUT_BYTES = 256 << 20
# dice's own timings (`--timing`): the others are KernelBench's (kbtiming.py).
DICE_TIMINGS = ("dice", "dice-queued")
# Under `--timing dice-queued` a timed call starts behind a spin on the device as long as the
# baseline's enqueue of one call (its least over the warm-ups) times HOLD_FACTOR plus HOLD_EXTRA_MS:
# both sides' launches are queued before the start event runs, so the events time the device's
# work alone, and a candidate's host time beyond the baseline's margin still counts.
HOLD_FACTOR = 1.5
HOLD_EXTRA_MS = 0.02
# After each of its timed rounds the baseline's process sets the hold from that round's
# enqueues (Timer `_adapt_hold`): the HOLD_QUANTILE of them with the same margin, never below the
# warm-ups' hold, nor above HOLD_MAX_MS (the device spins that long before every timed call).
HOLD_QUANTILE = 0.9
HOLD_MAX_MS = 1.0
# The spin measured once per process to turn a hold into the device's clock cycles.
SPIN_CALIBRATION_CYCLES = 1 << 21
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def set_seed(seed):
    # torch.manual_seed's effect on the generators inputs and models draw from, the CPU's and,
    # where CUDA runs (Setup starts it first on a CUDA device), the devices', without the rest:
    # it seeds every other backend and queues the seed for a CUDA not started yet, recording
    # the caller's stack each time. That took 75 us a call on the CPU machine, twice per timed
    # call, in the untimed part of the rounds that the clock check compares across processes
    # (runtime.rs `check_clock`), and made garbage there.
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    random.seed(seed)


class Seeds:
    """The seeds of a run's correctness trials and timed calls, all from one run seed that the
    evaluator draws when the run begins (stored with the run, handed to both processes in their
    requests): a program cannot carry its expected outputs for inputs it cannot predict.
    From SEED the trial seeds are KernelBench's: those of torch.manual_seed(42) and torch.randint
    (§2.4). KernelBench's timing methods (`kernelbench_timing`) time every call on set_seed(42)'s
    inputs (§3.2), as its harness does; dice times each call on inputs of its own (`Timer`)."""

    def __init__(self, run_seed, kernelbench_timing=False):
        self.run_seed = run_seed
        self.kernelbench_timing = kernelbench_timing

    def trials(self, n):
        generator = torch.Generator().manual_seed(self.run_seed)
        return [int(torch.randint(0, 2**32 - 1, (1,), generator=generator).item()) for _ in range(n)]

    def timed_call(self, call, key=None):
        """The seed of the inputs of timing call `call` (numbered from 0 in a candidate's timing;
        negative for warm-ups). 64 bits from a hash of the run seed, the call and the call's key:
        distinct for every call, never a trial's (those are below 2**32 but for a 2**-32 chance),
        and the same in both processes, so the baseline's call `call` gets the same inputs. The
        evaluator draws each call's key and hands it over only when the timer asks for it, right
        before the call's inputs are made (`Timer.run`): the run seed is in this process from its
        start, so with keys known ahead a program could make the coming calls' inputs itself and
        compute their outputs ahead, or all at once in one batched call. Warm-ups (no key) are
        neither timed nor judged."""
        if self.kernelbench_timing:
            return SEED
        salt = f"{self.run_seed}:{call}" if key is None else f"{self.run_seed}:{call}:{key}"
        digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")


def load_module(name, path, shared=None):
    """Executes a program file (read as bytes) as a fresh module of its own; with `shared` (a
    module's namespace), the module starts with a copy of its names, as a program exec'd into that
    namespace sees them (a copy: rebinding them leaves `shared` as it was)."""
    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec")
    module = types.ModuleType(name)
    if shared is not None:
        module.__dict__.update((k, v) for k, v in shared.items() if not k.startswith("__"))
    module.__file__ = path
    sys.modules[name] = module
    exec(code, module.__dict__)
    return module


class Setup:
    def __init__(self, req):
        # One GPU per worker (CUDA_VISIBLE_DEVICES), so always index 0.
        self.device = torch.device("cuda", 0) if req["device"] == "cuda" else torch.device("cpu")
        self.dtype = DTYPES.get(req.get("precision"))
        self.seeds = Seeds(req["seed"], req.get("timing", "dice") not in DICE_TIMINGS)
        if self.device.type == "cuda":
            # The CUDA context now, with the process's start-up and outside any device pass: made
            # lazily by the model's construction it held the pass for up to a second under load,
            # and every other process of the device (a timed one too) waited for it.
            torch.zeros(1, device=self.device)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def place(self, values):
        placed = []
        for v in values:
            if isinstance(v, torch.Tensor):
                v = v.to(self.device)
                if self.dtype is not None and v.is_floating_point():
                    v = v.to(self.dtype)
            placed.append(v)
        return placed

    def inputs(self, problem, seed):
        set_seed(seed)
        with self.device:
            values = problem.get_inputs()
        return self.place(values)

    def build_model(self, problem, model_class):
        set_seed(SEED)
        init = self.place(problem.get_init_inputs())
        set_seed(SEED)
        with torch.no_grad():
            model = model_class(*init)
        model = model.to(self.device)
        if self.dtype is not None:
            model = model.to(self.dtype)
        self.sync()
        return model

    def run_trial(self, problem, model, seed):
        return self.forward(model, self.inputs(problem, seed), seed)

    def forward(self, model, inputs, seed):
        set_seed(seed)
        with torch.no_grad():
            out = model(*inputs)
        self.sync()
        return out


class Timer:
    """Times model calls, each on inputs no call has seen before (same process in both roles).

    Call c's inputs are the problem's own `get_inputs()` under seed `Seeds.timed_call(c)`, made
    on the evaluation device before the call and copied into buffers that every round uses
    again: an output cached by input value or fingerprint is never found again, and one cached
    by pointer is stale. Making them costs both processes alike, outside the timed region
    (before the synchronisation and the flush). On the device every call takes one set of
    buffers; on the CPU a round's inputs are made before its first call, call j of the round
    in the j-th set (`_timed_premade`). A uniform sample of the timed calls keeps copies of its
    outputs (`CheckedCalls`), which the evaluator has judged against the reference's output on
    the same inputs.

    `queued` (`--timing dice-queued`, on the device): every timed call starts behind a spin of
    `hold_ms` (HOLD_FACTOR), so the host's launches, and any stall of the host between them,
    fall before the start event runs. The baseline's process sets the hold from its own
    warm-ups, then from each of its timed rounds (`_adapt_hold`); the evaluator hands it to the
    candidate's rounds (which come after the baseline's first).
    """

    def __init__(self, setup, problem, model, checked_calls, whole_up_to, cores=None, queued=False):
        self.setup = setup
        self.problem = problem
        self.model = model
        self.cores = cores
        self.slots = []  # sets of input buffers (`_fill`)
        self.held = []  # inputs made, until their calls returned (`_fill`)
        self.warmed = False
        self.untimed_calls = 0  # made by the last run before its timed ones: the warm-ups
        self.keys = {}  # of the round's timed calls, by call, as the evaluator handed them
        # A program wrong on a share w of its timed calls passes with probability
        # (1 - w) ** checked_calls.
        self.checked_calls = checked_calls
        self.whole_up_to = whole_up_to
        self.checked = CheckedCalls(checked_calls, whole_up_to)
        self.flush = None
        self.events = None
        self.host = []  # the last round's `HostSide` of each timed call on the device
        self.queued = queued and setup.device.type == "cuda"
        self.hold_ms = None  # the spin before each timed call, when queued
        self.warm_hold_ms = None  # the baseline's hold from its warm-ups
        if setup.device.type == "cuda":
            self.flush = torch.empty(L2_FLUSH_BYTES // 8, dtype=torch.int64, device=setup.device)
            # One pair of events for every timed call, made here (torch makes a CUDA event at its
            # first record): an end event made after the call's launches asks the driver for it
            # inside the timed interval, where another process making or tearing down a context
            # can hold the driver up (identity candidates in a batch showed a few calls of 8-66 ms
            # among calls of tens of microseconds: bench/notes/eval-h200.md, session 23).
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for event in self.events:
                event.record()
            self.events[1].synchronize()
            if self.queued:
                self.cycles_per_ms = spin_cycles_per_ms(self.events)
        self.l2 = persisting_l2.Guard(setup.device)
        # The input buffers on the device now, under the untimed pass the timer is made in (and
        # in the reference's footprint): the first warm-up's inputs.
        self._prepare(-1)
        self.held = []

    def run(self, n, first_call, call_keys, hold_ms=None):
        """Times calls first_call .. first_call + n - 1, each on the inputs of its key
        (`Seeds.timed_call`), which `call_keys(first, count)` asks the evaluator for: on the
        device one call's right before its inputs are made, so no call's inputs are known before
        the calls ahead of it have run; on the CPU, whose round makes its inputs before its first
        call (`_timed_premade`), the round's at once. A timing starts at call 0 (the reference's
        process times the baseline for one candidate after another). `hold_ms`: the spin before
        each timed call when queued, the baseline's; None in the baseline's process, which sets
        it from its warm-ups."""
        self.call_keys = call_keys
        self.keys = {}
        if first_call == 0:
            self.checked = CheckedCalls(self.checked_calls, self.whole_up_to)
        self.host = []
        # Small kernels are timed by how fast Python launches them: on cores of their own,
        # other processes of the evaluation (builds, imports) cannot slow the launches down.
        if self.cores:
            os.sched_setaffinity(0, self.cores["timed"])
        # As timeit does: a collection of this process's heap (torch's import alone leaves
        # hundreds of thousands of objects) takes milliseconds, and one such pause inside a
        # timed call of a 20 us kernel moves the mean of 100 calls by several times its size.
        # No collection before either: its time would count against the candidate's clock check.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.no_grad():
                self.untimed_calls = 0 if self.warmed else WARMUP_CALLS
                self.warmed = True
                enqueued_ms = [self._call(-1 - warmup) for warmup in range(self.untimed_calls)]
                if self.queued:
                    if hold_ms is not None:
                        self.hold_ms = hold_ms
                    elif enqueued_ms:
                        self.hold_ms = HOLD_FACTOR * min(enqueued_ms) + HOLD_EXTRA_MS
                        self.warm_hold_ms = self.hold_ms
                calls = range(first_call, first_call + n)
                if self.setup.device.type == "cpu":
                    self.keys = dict(zip(calls, call_keys(first_call, n)))
                    return self._timed_premade(calls)
                times = [self._timed(call, self._prepare(call)) for call in calls]
                if self.queued and hold_ms is None:
                    self._adapt_hold()
                return times
        finally:
            if collecting:
                gc.enable()
            if self.cores:
                os.sched_setaffinity(0, self.cores["untimed"])

    def _adapt_hold(self):
        """The baseline's hold for the rounds after this one, both sides': from what its own
        calls of this round took to enqueue (`host`, trusted: the baseline's process). The
        warm-ups' least enqueue is the host at its best; in a cold batch most calls took longer
        (16 builds and 16 Python processes on 16 cores), the device waited on the host, and
        programs of a few microseconds were timed at up to three times their device time by
        their median call (bench/notes/eval-h200.md, session 36). A longer hold changes no
        measured time; it only spins the device longer before each call. Rare stalls longer than
        the quantile still count, on both sides alike."""
        walls = sorted(host[0] for host in self.host)
        if not walls or self.warm_hold_ms is None:
            return
        typical = walls[int(HOLD_QUANTILE * (len(walls) - 1))]
        hold = HOLD_FACTOR * typical + HOLD_EXTRA_MS
        self.hold_ms = min(max(hold, self.warm_hold_ms), max(HOLD_MAX_MS, self.warm_hold_ms))

    def _seed(self, call):
        if call < 0:
            return self.setup.seeds.timed_call(call)
        if call not in self.keys:
            self.keys[call] = self.call_keys(call, 1)[0]
        return self.setup.seeds.timed_call(call, self.keys[call])

    def _fill(self, slot, fresh):
        """The arguments of a call on inputs `fresh`: copied into the buffers of set `slot`."""
        while len(self.slots) <= slot:
            self.slots.append([])
        buffers = self.slots[slot]
        if len(buffers) != len(fresh):
            buffers[:] = [None] * len(fresh)
        args = []
        for i, value in enumerate(fresh):
            buf = buffers[i]
            # A tensor of another shape or type than the last call's (a problem whose inputs
            # vary) takes its own place.
            if isinstance(value, torch.Tensor) and isinstance(buf, torch.Tensor) and buf.shape == value.shape and buf.dtype == value.dtype:
                buf.copy_(value)
            else:
                buffers[i] = buf = value
            args.append(buf)
        # On the CPU, freed inputs go back to the C heap, where a program that keeps its outputs
        # (a cache) would place the next one, and the next call's inputs would be made on pages
        # never touched: an untimed cost of the candidate's rounds that the baseline, which keeps
        # nothing, never pays (0.1 ms a call at 64x256, more than a relu: a false clock finding).
        # Held through the call, a kept output takes new memory inside the timed call, where its
        # cost belongs. CUDA's caching allocator has no such cost, and holding inputs twice
        # there would raise the footprint.
        if self.setup.device.type == "cpu":
            self.held.append(fresh)
        return args

    def _prepare(self, call):
        seed = self._seed(call)
        args = self._fill(0, self.setup.inputs(self.problem, seed))
        set_seed(seed)
        self.setup.sync()
        return args

    def _call(self, call):
        """An untimed call; the host's time in ms to make it (to enqueue it, on the device)."""
        args = self._prepare(call)
        started = perf_counter_ns()
        self.model(*args)
        enqueued_ms = (perf_counter_ns() - started) / 1e6
        self.setup.sync()
        self.held = []
        return enqueued_ms

    def _timed_premade(self, calls):
        """Times `calls` on the CPU, their inputs made before the first of them (in groups of at
        most CPU_PREMADE_INPUT_BYTES): no input is made or copied between two timed calls.

        Made between calls, inputs are copied by torch's thread pool, whose threads fall asleep
        while a single-threaded program runs; every call of such a candidate then waited for
        them to wake, outside its timed region but inside the evaluator's wall time of the
        round, which the baseline (torch's own ops keep the pool awake) never paid: on a loaded
        machine milliseconds a call, enough for a false clock finding (`runtime.rs`,
        check_clock). Made up front, that wait is paid once a group by both processes alike."""
        times = []
        pending = list(calls)
        while pending:
            group, size = [], 0
            while pending and (not group or size < CPU_PREMADE_INPUT_BYTES):
                call = pending.pop(0)
                seed = self._seed(call)
                args = self._fill(len(group), self.setup.inputs(self.problem, seed))
                size += sum(a.nbytes for a in args if isinstance(a, torch.Tensor))
                group.append((call, seed, args))
            for call, seed, args in group:
                set_seed(seed)
                times.append(self._timed(call, args))
            self.held = []
        return times

    def _timed(self, call, args):
        if self.flush is None:
            start = perf_counter_ns()
            out = self.model(*args)
            ms = (perf_counter_ns() - start) / 1e6
        else:
            self.l2.reset()
            self.flush.fill_(42)
            if self.hold_ms:
                torch.cuda._sleep(int(self.hold_ms * self.cycles_per_ms))
            start, end = self.events
            host = HostSide()
            start.record()
            out = self.model(*args)
            end.record()
            self.host.append(host.since())
            torch.cuda.synchronize(self.setup.device)
            ms = start.elapsed_time(end)
        self.checked.offer(call, out)
        return ms

    def checked_outputs(self):
        """(call, copies of its outputs) of each timed call to judge."""
        return self.checked.kept


def spin_cycles_per_ms(events):
    """The device's clock cycles per ms of `torch.cuda._sleep`'s spin, timed by `events` once
    warm."""
    start, end = events
    torch.cuda._sleep(SPIN_CALIBRATION_CYCLES)
    start.record()
    torch.cuda._sleep(SPIN_CALIBRATION_CYCLES)
    end.record()
    end.synchronize()
    return SPIN_CALIBRATION_CYCLES / max(start.elapsed_time(end), 1e-3)


class HostSide:
    """What the timing thread's host side did while it enqueued one timed call on the device:
    [wall ms, cpu ms, involuntary context switches, page faults]. A call far above its round's
    median with its wall time here (the host fell behind the device) and preemptions or faults
    says the host was held up; one with a short wall time here was held up on the device. The
    evaluator logs the long calls with these (job.rs `log_long_calls`); read outside the timed
    interval's events, so they cost the call nothing."""

    def __init__(self):
        self.usage = resource.getrusage(resource.RUSAGE_THREAD)
        self.cpu = thread_time_ns()
        self.wall = perf_counter_ns()

    def since(self):
        wall, cpu = perf_counter_ns(), thread_time_ns()
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        return [
            (wall - self.wall) / 1e6,
            (cpu - self.cpu) / 1e6,
            usage.ru_nivcsw - self.usage.ru_nivcsw,
            usage.ru_minflt + usage.ru_majflt - self.usage.ru_minflt - self.usage.ru_majflt,
        ]


class CheckedCalls:
    """A uniform sample of up to `size` timed calls and copies of their outputs (reservoir
    sampling). Whether a call is kept is drawn after it returned, from the operating system's
    randomness: no state of the process says beforehand which calls will be judged. Kept outputs
    are copies, since a later call may overwrite a buffer the program returns again; both
    processes make them alike, in wall time only, so the candidate's rounds stay comparable with
    the baseline's in the evaluator's clock check (runtime.rs `check_clock`). A call's outputs of
    more than `whole_up_to` bytes are kept as samples (`kept_sample`)."""

    def __init__(self, size, whole_up_to):
        self.size = size
        self.whole_up_to = whole_up_to
        self.offered = 0
        self.kept = []
        self.draw = random.SystemRandom()

    def offer(self, call, out):
        self.offered += 1
        slot = len(self.kept) if len(self.kept) < self.size else self.draw.randrange(self.offered)
        if slot < self.size:
            tensors = as_tensor_list(out)
            if sum(t.numel() * t.element_size() for t in tensors) > self.whole_up_to:
                copies = [kept_sample(t, self.draw) for t in tensors]
            else:
                copies = kept_copies(tensors)
            if slot == len(self.kept):
                self.kept.append((call, copies))
            else:
                self.kept[slot] = (call, copies)


def kept_copies(tensors):
    """Copies of a call's output tensors that its next call cannot overwrite (a forward may
    return storage it reuses): on the device up to DEVICE_KEPT_BYTES in all (host memory is the
    scarcer one with several evaluations in flight), on the host beyond it or when the device is
    full. An output of several GiB kept three times on the device beside its forward's own
    memory took two processes past an 80 GB card (bench/notes/eval-h200.md, session 23)."""
    size = sum(t.numel() * t.element_size() for t in tensors)
    try:
        return [t.clone() if size <= DEVICE_KEPT_BYTES else t.to("cpu", copy=True) for t in tensors]
    except torch.OutOfMemoryError:
        return [t.to("cpu", copy=True) for t in tensors]


class Sample:
    """An output tensor of `shape` judged by its values at `positions` (flat, C order): what a
    timed call keeps of an output too large to copy whole."""

    def __init__(self, shape, positions, values):
        self.shape = torch.Size(shape)
        self.positions = positions
        self.values = values


def kept_sample(t, draw):
    """`t`'s values at SAMPLE_ELEMENTS flat positions (every one of a smaller tensor) drawn,
    after the call returned, by a generator seeded from `draw` (the operating system's
    randomness): gathered where `t` is, without copying it. An 8.6 GB output copied to the host
    for each kept call held the device alone for a minute of its timing and took 29 s more to
    publish and judge (bench/notes/eval-h200.md, sessions 27-28); its sample is 12 MB."""
    numel = t.numel()
    if numel <= SAMPLE_ELEMENTS:
        positions = torch.arange(numel, device=t.device)
    else:
        generator = torch.Generator(device=t.device)
        generator.manual_seed(draw.getrandbits(63))
        positions = torch.randint(numel, (SAMPLE_ELEMENTS,), generator=generator, device=t.device)
    return Sample(t.shape, positions, values_at(t.detach(), positions))


def values_at(t, positions):
    """`t`'s values at flat (C-order) `positions`, gathered where `t` is without a flat copy of
    it (`t` may be a multi-GB output with any strides)."""
    if t.dim() == 0:
        return t.reshape(1).clone()
    return t[torch.unravel_index(positions.to(t.device), t.shape)]


def storage_of(t):
    return t.untyped_storage().data_ptr()


def snapshot(values):
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]


def aliased(inputs, out):
    """Indices of tensor inputs whose storage the output shares: computed in place on them."""
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    produced = {storage_of(t) for t in outs if isinstance(t, torch.Tensor) and t.numel() > 0}
    return [i for i, v in enumerate(inputs) if isinstance(v, torch.Tensor) and v.numel() > 0 and storage_of(v) in produced]


def mutated(before, after):
    """Indices of tensor inputs whose values changed (NaN equals NaN)."""
    changed = []
    for i, (b, a) in enumerate(zip(before, after)):
        if not isinstance(b, torch.Tensor):
            continue
        same = b.shape == a.shape and b.dtype == a.dtype
        if same and not torch.equal(b, a):
            same = b.is_floating_point() and bool(((b == a) | (b.isnan() & a.isnan())).all())
        if not same:
            changed.append(i)
    return changed


def tensors_of(values):
    """The tensors among a call's arguments, in order (what a candidate publishes of its inputs)."""
    return [v for v in values if isinstance(v, torch.Tensor)]


def as_tensor_list(out):
    """The tensors of a forward result (a tensor, or a tuple/list of tensors), detached."""
    if isinstance(out, torch.Tensor):
        return [out.detach()]
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return [t.detach() for t in out]
    raise TypeError(f"forward returned {type(out).__name__}, expected a tensor")


# How a process hands output tensors to the judge: an 8-byte little-endian header length, a JSON
# header [{"dtype": "float32", "shape": [...]}, ...], then each tensor's bytes in order, C-contiguous.
# A `Sample` of a tensor is the entry {"dtype": ..., "shape": [...], "sampled": k}: its k flat
# positions as int64, then its k values.
# Raw bytes rather than torch.save: no pickle for the judge to parse, no CRC over GBs of output,
# and device outputs stream out through one pinned buffer.
PUBLISHED_DTYPES = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16", "int8", "uint8", "bool")
}
HEADER_BYTES_MAX = 1 << 20
STAGING_BYTES = 256 << 20
# Smaller device outputs are copied out directly: pinning the staging buffer costs more than
# their copy (and would be paid by every candidate).
STAGED_FROM_BYTES = 32 << 20


class Staging:
    """One pinned host buffer per process for device-to-file copies of large outputs; None where
    pinning fails."""

    buffer = None
    tried = False

    @classmethod
    def get(cls):
        if not cls.tried:
            cls.tried = True
            try:
                cls.buffer = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
            except Exception:  # no CUDA host allocation here: pageable copies then
                cls.buffer = None
        return cls.buffer


def publish(tensors, path, share=False):
    """Writes tensors (on any device) and samples of tensors (`Sample`) to path in the published
    format. Where `share` (a candidate's correctness trial) and sharing is on, device tensors of
    at least `shared_output.SHARED_FROM_BYTES` go to the judge as shared device memory, named in
    the header instead of written (shared_output.py), where this process can share them."""

    def entry(t, shared):
        if isinstance(t, Sample):
            return {"dtype": str(t.values.dtype).removeprefix("torch."), "shape": list(t.shape), "sampled": t.values.numel()}
        described = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        return dict(described, shared=shared) if shared is not None else described

    def shared_part(t):
        large = isinstance(t, torch.Tensor) and t.is_cuda and t.numel() * t.element_size() >= shared_output.SHARED_FROM_BYTES
        return shared_output.export(t.detach()) if share and large and shared_output.enabled() else None

    shared = [shared_part(t) for t in tensors]
    header = json.dumps([entry(t, s) for t, s in zip(tensors, shared)]).encode()
    parts = [p for t, s in zip(tensors, shared) if s is None for p in ((t.positions, t.values) if isinstance(t, Sample) else (t,))]
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for t in parts:
            data = t.detach().contiguous().reshape(-1).view(torch.uint8)
            staging = Staging.get() if data.is_cuda and data.numel() >= STAGED_FROM_BYTES else None
            if data.is_cuda and staging is None:
                data = data.cpu()
            if not data.is_cuda:
                f.write(memoryview(data.numpy()))
                continue
            for start in range(0, data.numel(), STAGING_BYTES):
                part = data[start : start + STAGING_BYTES]
                chunk = staging[: part.numel()]
                chunk.copy_(part)
                f.write(memoryview(chunk.numpy()))


class Unacceptable(ValueError):
    """A published file the judge will not read: the candidate's failure, never the judge's."""


class PublishedFile:
    """A file a candidate published, opened for the judge and read once, front to back: its
    layout from the header (every size checked against the file's), then each tensor's bytes as
    asked (`read_whole`, or `read_chunks` a part at a time, so that a judge comparing a multi-GB
    output holds one chunk of it instead of all of it). Tensors the header names as shared device
    memory (shared_output.py) are accepted only where `owner`, the evaluator's process of the
    candidate, is given, and read from there by `read_chunks`. The writer is not trusted: the file is
    opened without following a link and without blocking (a FIFO would hold the judge until its
    timeout), must be a regular file of its folder's owner of at most `limit` bytes, and is read
    (never mapped), so that a file changed or truncated meanwhile cannot crash the judge; a read
    that comes short is Unacceptable. Malformed layouts are ValueErrors; `Sample`s are accepted
    only where `samples` allows them."""

    def __init__(self, path, limit, samples=False, owner=None):
        self.owner = owner
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise Unacceptable("the published output is a symbolic link") from None
            raise Unacceptable(f"the published output cannot be opened: {e.strerror}") from None
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise Unacceptable(f"the published output is not a regular file (mode {stat.filemode(st.st_mode)})")
            if st.st_uid != os.stat(os.path.dirname(path)).st_uid:
                raise Unacceptable("the published output belongs to another user than the program's")
            if st.st_size > limit:
                raise Unacceptable(f"the published output has {st.st_size} bytes, far more than the reference's outputs")
            self.layout = self._read_layout(st.st_size, samples)
        except BaseException:
            os.close(self.fd)
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self.fd)

    def _read_into(self, view):
        done = 0
        while done < len(view):
            n = os.readv(self.fd, [view[done:]])
            if n == 0:
                raise Unacceptable("the published output shrank while the judge read it")
            done += n

    def _read(self, nbytes):
        data = bytearray(nbytes)
        self._read_into(memoryview(data))
        return data

    def _read_layout(self, size, samples):
        """[(dtype, shape, sampled, shared)] of the header, which must describe `size` bytes in
        all (a shared tensor's bytes are not in the file)."""
        if size < 8:
            raise ValueError("bad header length")
        length = int.from_bytes(self._read(8), "little")
        if not 0 < length <= HEADER_BYTES_MAX or 8 + length > size:
            raise ValueError("bad header length")
        header = json.loads(bytes(self._read(length)))
        if not isinstance(header, list):
            raise ValueError("the header is not a list")
        layout = []
        offset = 8 + length
        for entry in header:
            dtype = PUBLISHED_DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
            shape = entry.get("shape") if dtype is not None else None
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError("bad tensor entry in the header")
            sampled = entry.get("sampled")
            if sampled is not None and not (samples and type(sampled) is int and sampled > 0):
                raise ValueError("a sample of an output where the whole output was asked for" if not samples else "bad sample entry in the header")
            shared = entry.get("shared")
            if shared is not None and (self.owner is None or sampled is not None or not shared_output.valid_entry(shared)):
                raise ValueError("bad shared output entry in the header")
            values = torch.Size(shape).numel() if sampled is None else sampled
            layout.append((dtype, shape, sampled, shared))
            if shared is None:
                offset += values * dtype.itemsize + (0 if sampled is None else sampled * 8)
        if offset != size:
            raise ValueError(f"the header describes {offset} bytes, the file has {size}")
        return layout

    def _tensor(self, dtype, shape):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._read(nbytes), dtype=torch.uint8).view(dtype).reshape(shape)

    def read_whole(self, entry):
        """The next entry of the layout, whole: a tensor, or a `Sample`; not a shared one."""
        dtype, shape, sampled, shared = entry
        if shared is not None:
            raise Unacceptable("a shared output where the judge reads whole tensors")
        if sampled is None:
            return self._tensor(dtype, shape)
        positions = self._tensor(torch.int64, [sampled])
        return Sample(shape, positions, self._tensor(dtype, [sampled]))

    def read_chunks(self, entry, elements, device):
        """The next entry of the layout (a tensor's, not a sample's), flat, `elements` values at a
        time, each chunk in the same buffer (valid until the next is read): from the file through
        host memory (page-locked where `device` is a CUDA device), or from the candidate's shared
        device memory into a buffer on `device`."""
        dtype, shape, _, shared = entry
        numel = torch.Size(shape).numel()
        if shared is not None:
            if device.type != "cuda":
                raise Unacceptable("the published output names shared device memory where there is no device")
            try:
                imported = shared_output.Imported(self.owner, shared, numel * dtype.itemsize, device)
            except shared_output.Refused as e:
                raise Unacceptable(str(e)) from None
            try:
                yield from imported.chunks(dtype, elements)
            finally:
                imported.close()
            return
        step = min(elements, numel) * dtype.itemsize
        buffer = None
        if device.type == "cuda" and step:
            try:
                buffer = torch.empty(step, dtype=torch.uint8, pin_memory=True)
            except Exception:  # no CUDA host allocation here: pageable then
                buffer = None
        if buffer is None:
            buffer = torch.empty(step, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        for start in range(0, numel, elements):
            nbytes = min(elements, numel - start) * dtype.itemsize
            self._read_into(view[:nbytes])
            yield buffer[:nbytes].view(dtype)


def read_published(path, limit, samples=False):
    """The tensors of a file a candidate published (and its `Sample`s where `samples` allows
    them), read whole into this process's memory (`PublishedFile`)."""
    with PublishedFile(path, limit, samples) as published:
        return [published.read_whole(entry) for entry in published.layout]
