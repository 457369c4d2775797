"""What a forked child does: `build`, `extension` (builds one for the evaluator: buildcache.py),
`reference` (trusted; also the judge) or `candidate`.

Children talk to the evaluator over a unix socket, one JSON object per line: events out
({"event": ...}), operations in ({"op": ...}). The judge lives in the reference process: it reads
a candidate's published outputs as plain tensors (the bytes of a regular file the candidate owns,
never through a link) and never runs candidate code.
"""

import json
import os
import traceback
from time import perf_counter

import torch

import buildcache
import kbtiming
import profiling
import protocol
import shared_output

MESSAGE_CHARS = 500


class Channel:
    def __init__(self, conn):
        self.conn = conn
        self.reader = conn.makefile("r", encoding="utf-8")

    def send(self, **msg):
        self.conn.sendall((json.dumps(msg) + "\n").encode())

    def ops(self):
        for line in self.reader:
            if line.strip():
                yield json.loads(line)


def run(role, channel, req):
    handlers = {"build": build, "extension": buildcache.build_extension, "pch": buildcache.build_pch,
                "reference": reference, "candidate": candidate}
    handlers[role](channel, req)


def one_line(exc):
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:MESSAGE_CHARS]


def classify(exc, problem=None):
    """The verdict of an exception raised by candidate code while constructing or running it."""
    text = str(exc)
    if isinstance(exc, MemoryError):
        return "crashed", "out of memory (evaluator limit): " + one_line(exc)
    if "CUDA error" in text or "illegal memory access" in text or type(exc).__name__ == "AcceleratorError":
        return "crashed", one_line(exc)
    return "runtime_error", one_line(exc) + missing_global(exc, problem)


def missing_global(exc, problem):
    """Why a NameError on a name of the problem module happened, and the flag that avoids it."""
    name = getattr(exc, "name", None) if isinstance(exc, NameError) else None
    if problem is None or not name or not hasattr(problem, name):
        return ""
    return (
        f" (`{name}` is a global of the problem file: KernelBench's harness runs the program in the problem's"
        " namespace, dice in its own; --kernelbench-namespace gives the program the problem's globals)"
    )


def fail(channel, verdict, message, phase):
    traceback.print_exc()
    channel.send(event="failed", verdict=verdict, message=message, phase=phase)


def device_setup(channel, req, verdict):
    """The process's device (protocol.Setup, which makes the CUDA context), or None after reporting
    why it could not be made. No program code has run yet, so it is never the program's doing:
    crowded out of device memory by the other processes of a batch, the sample goes back to the
    evaluator's queue, and runs with the device to itself only if that happens again and again
    (run_slot.rs)."""
    try:
        return protocol.Setup(req)
    except BaseException as e:  # noqa: B036
        fail(channel, verdict, "setting up the device: " + one_line(e), "setup")
        return None


def load_candidate(channel, req, problem=None):
    """Imports the candidate (given the problem module's globals with `kernelbench_namespace`);
    returns its module or None after reporting why it failed."""
    buildcache.install(req["cache_dir"], channel, evaluator_builds=req["role"] == "build")
    shared = vars(problem) if problem is not None and req.get("kernelbench_namespace") else None
    try:
        return protocol.load_module("dice_candidate", req["candidate_path"], shared)
    except BaseException as e:  # noqa: B036 (SystemExit and KeyboardInterrupt are candidate failures too)
        if buildcache.State.failed:
            fail(channel, "compile_error", one_line(e), "build")
        elif isinstance(e, MemoryError):
            fail(channel, "crashed", "out of memory (evaluator limit) while importing", "load")
        else:
            fail(channel, "load_error", one_line(e) + missing_global(e, problem), "load")
        return None


def build(channel, req):
    """Compile stage: import the candidate with CUDA hidden, only to trigger its extension builds."""
    load_candidate(channel, req)
    channel.send(event="done")


def await_op(ops, name):
    """Blocks until the evaluator sends `name`: device work waits for its turn (the evaluator
    keeps the device free while another candidate is timed). False when the evaluator hung up."""
    for op in ops:
        if op["op"] == name:
            return True
        if op["op"] == "quit":
            return False
    return False


def candidate(channel, req):
    setup = device_setup(channel, req, "crashed")
    if setup is None:
        return
    problem = protocol.load_module("dice_problem", req["problem_path"])
    module = load_candidate(channel, req, problem)
    if module is None:
        return
    model_class = getattr(module, "ModelNew", None)
    if not isinstance(model_class, type):
        channel.send(event="failed", verdict="load_error", message="the program defines no class ModelNew", phase="load")
        return
    channel.send(event="loaded")
    ops = channel.ops()
    if not await_op(ops, "construct"):
        return
    try:
        model = setup.build_model(problem, model_class)
    except BaseException as e:  # noqa: B036
        fail(channel, *classify(e, problem), "construct")
        return
    channel.send(event="constructed")
    mutation_seen = False
    for trial, seed in enumerate(setup.seeds.trials(req["trials"])):
        if not await_op(ops, "trial"):
            return
        # The last trial's shared output is judged (the evaluator asks for a trial only then).
        shared_output.release()
        try:
            inputs = setup.inputs(problem, seed)
            before = protocol.snapshot(inputs)
            out = setup.forward(model, inputs, seed)
            outputs = protocol.as_tensor_list(out)
            changed = protocol.mutated(before, inputs)
            aliased = protocol.aliased(inputs, out)
        except BaseException as e:  # noqa: B036
            fail(channel, *classify(e, problem), "forward")
            return
        # The inputs as forward left them, for the judge to compare with its own: this process's
        # check above is only extra evidence, since the program can patch it.
        protocol.publish(protocol.tensors_of(inputs), os.path.join(req["dir"], f"inputs_{trial}.bin"))
        del before, inputs, out
        if (changed or aliased) and not mutation_seen:
            mutation_seen = True
            if changed:
                message = f"forward changed its input {changed[0]} in place (correctness trial {trial + 1})"
            else:
                message = f"forward returned the storage of its input {aliased[0]}: it computes in place on the caller's tensor"
            channel.send(event="finding", rule="input_mutation", message=message)
        path = os.path.join(req["dir"], f"output_{trial}.bin")
        protocol.publish(outputs, path, share=True)
        channel.send(event="output", trial=trial, path=path)
    profiled = Profiled(channel, setup, problem, model, req)
    make_timer = lambda: timer_for(req, setup, problem, model, "candidate")  # noqa: E731
    serve_timing(channel, ops, req["dir"], make_timer, profiled)


class Profiled:
    """The first correctness trial again, under the CUDA profiler, after timing: CUPTI, once
    started, may slow every later launch of the process, so it never runs before the timed
    calls. Its output is published for judging like any trial's."""

    def __init__(self, channel, setup, problem, model, req):
        self.channel = channel
        self.profiler = None
        self.setup = setup
        self.problem = problem
        self.model = model
        self.path = os.path.join(req["dir"], "output_profiled.bin")
        self.seed = setup.seeds.trials(1)[0]

    def start(self):
        """Loads the kernel recorder, outside the evaluator's device pass."""
        if self.setup.device.type == "cuda":
            try:
                self.profiler = profiling.Session()
            except Exception as e:
                self.channel.send(event="profile_unavailable", message=one_line(e))
        self.channel.send(event="profiler_ready")

    def run(self):
        inputs = self.setup.inputs(self.problem, self.seed)
        call = lambda: self.setup.forward(self.model, inputs, self.seed)  # noqa: E731
        result = []
        if self.profiler is None:
            result.append(call())
        else:
            try:
                default, kernels = self.profiler.launched(lambda: result.append(call()))
                self.channel.send(event="kernels", default_stream=default, kernels=kernels)
            except Exception as e:
                if not result:
                    raise
                self.channel.send(event="profile_unavailable", message=one_line(e))
        protocol.publish(protocol.as_tensor_list(result[0]), self.path, share=True)
        self.channel.send(event="profiled", path=self.path)


def key_source(channel, ops):
    """`call_keys(first, count)` of a `Timer.run`: the keys of timed calls first .. first +
    count - 1, asked of the evaluator when the timer needs them (`Seeds.timed_call`)."""

    def call_keys(first, count):
        channel.send(event="keys", first=first, n=count)
        op = next(ops, None)
        keys = op.get("keys") if op is not None and op.get("op") == "keys" else None
        if not isinstance(keys, list) or len(keys) != count:
            raise RuntimeError(f"the evaluator sent no keys for timed calls {first}..{first + count - 1}")
        return [int(k) for k in keys]

    return call_keys


def serve_timing(channel, ops, job_dir, make_timer, profiled):
    timer = None  # held here alone, and freed before the profiled trial
    for op in ops:
        if op["op"] == "prepare_timing":
            shared_output.release()  # the last trial's, judged
            # The L2 flush buffer (and KernelBench's one input set) go on the device while the
            # evaluator holds an untimed pass: its exclusive window is for the timed calls alone.
            try:
                timer = make_timer()
            except BaseException as e:  # noqa: B036
                fail(channel, *classify(e), "timing")
                return
            channel.send(event="timing_ready")
        elif op["op"] == "time":
            try:
                # The baseline's hold comes with the rounds of `--timing dice-queued` alone.
                held = [op["hold_ms"]] if "hold_ms" in op else []
                ms = timer.run(op["n"], op["first_call"], key_source(channel, ops), *held)
            except BaseException as e:  # noqa: B036
                fail(channel, *classify(e), "timing")
                return
            channel.send(event="times", ms=ms, persisting_l2=timer.l2.found, host=timer.host)
        elif op["op"] == "publish_timing":
            calls = []
            for k, (call, outputs) in enumerate(timer.checked_outputs()):
                protocol.publish(outputs, os.path.join(job_dir, f"timing_{k}.bin"))
                calls.append(call)
            channel.send(event="timing_outputs", calls=calls)
        elif op["op"] == "start_profiler":
            # Timing is over: its inputs and kept outputs make room for the profiled trial.
            timer = None
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            profiled.start()
        elif op["op"] == "profile":
            try:
                profiled.run()
            except BaseException as e:  # noqa: B036
                fail(channel, *classify(e), "profiled trial")
                return
        elif op["op"] == "quit":
            return


def timer_for(req, setup, problem, model, side):
    """dice's own Timer, or KernelBench's (kbtiming.py) for `--timing kernelbench*`."""
    timing = req.get("timing", "dice")
    if timing in protocol.DICE_TIMINGS:
        return protocol.Timer(setup, problem, model, req["checked_timed_calls"], req["timed_outputs_whole_up_to"], req.get("cores"), timing == "dice-queued")
    return kbtiming.Timer(setup, problem, model, timing, side, req.get("cores"))


def reference(channel, req):
    setup = device_setup(channel, req, "reference_error")
    if setup is None:
        return
    ops = channel.ops()
    try:
        problem = protocol.load_module("dice_problem", req["problem_path"])
        for name in ("Model", "get_inputs", "get_init_inputs"):
            if not hasattr(problem, name):
                raise AttributeError(f"the problem defines no {name}")
    except BaseException as e:  # noqa: B036
        traceback.print_exc()
        channel.send(event="failed", verdict="reference_error", message=one_line(e), phase="reference")
        return
    channel.send(event="loaded")
    if not await_op(ops, "construct"):
        return
    try:
        model = setup.build_model(problem, problem.Model)
        timed = torch.compile(model) if req.get("baseline") == "torch_compile" else model
        timer = timer_for(req, setup, problem, timed, "baseline")
        expected = Expected(setup, problem, model, req["trials"])
        footprint = expected.footprint(req["checked_timed_calls"])
    except BaseException as e:  # noqa: B036
        traceback.print_exc()
        channel.send(event="failed", verdict="reference_error", message=one_line(e), phase="reference")
        return
    channel.send(event="ready", **footprint)
    judge = Judge(expected, req["atol"], req["rtol"], setup.device)
    for op in ops:
        if op["op"] == "judge":
            try:
                timed_call = op.get("timed_call")
                if timed_call is None:
                    reference_outputs = expected.for_judging(op["trial"])
                else:
                    reference_outputs = expected.timed_call(timed_call, op["key"])
                pristine = expected.inputs(op["trial"]) if op.get("inputs") else None
            except BaseException as e:  # noqa: B036
                fail(channel, "reference_error", one_line(e), "reference")
                return
            # From here on the candidate's files decide: the evaluator blames the candidate, not
            # the reference, for a judge that dies or hangs on them.
            channel.send(event="judging")
            judged = judge.check(reference_outputs, op["path"], samples=timed_call is not None, owner=op.get("owner"))
            # A device copy handed out for this judgement goes back to the allocator before the
            # next expected output is computed (the footprint counts one at a time).
            del reference_outputs
            if timed_call is None:
                judged["reference_ms"] = expected.forward_ms[op["trial"]]
            if pristine is not None:
                judged["input_mutation"] = input_mutation(pristine, op["inputs"], op["trial"])
            channel.send(event="judged", **judged)
        elif op["op"] == "time":
            try:
                ms = timer.run(op["n"], op["first_call"], key_source(channel, ops))
            except BaseException as e:  # noqa: B036
                fail(channel, "reference_error", one_line(e), "timing")
                return
            # Trusted to say how many untimed calls its round made (the candidate is not: the
            # evaluator counts those itself), which the clock check leaves out of the overhead.
            channel.send(event="times", ms=ms, untimed=timer.untimed_calls, persisting_l2=timer.l2.found, host=timer.host, hold_ms=getattr(timer, "hold_ms", None))
        elif op["op"] == "quit":
            return


class Expected:
    """The reference's outputs of the correctness trials, kept on the evaluation device, and of
    a candidate's checked timed calls, computed when judged and dropped. The first trial's is
    computed with the model's construction (for the process's footprint), the others when first
    needed, while the evaluator holds the device for the trial that needs them; always in this
    order (a stateful model sees the same calls)."""

    def __init__(self, setup, problem, model, trials):
        self.setup = setup
        self.problem = problem
        self.model = model
        self.seeds = setup.seeds.trials(trials)
        self.outputs = []
        # (trial, its output on the device) for the trial last computed where its kept copy is on
        # the host (`for_judging`).
        self.fresh = None
        # Each trial's forward in ms (wall, synchronised), which the evaluator takes to size a
        # slow program's timing before its first round (stage_timing.rs).
        self.forward_ms = []

    def footprint(self, checked_calls):
        """Computes the first expected output (its forward's peak is part of the footprint), then
        returns what this process will hold on the device once every expected output is computed
        (a candidate of the problem needs about as much) and the device's size; {} on the CPU."""
        first = self[0]
        if self.setup.device.type != "cuda":
            return {}
        kept = sum(t.numel() * t.element_size() for t in first if t.is_cuda)
        # The other trials' outputs, one timed call's while it is judged, and the copies of the
        # `checked_calls` timed outputs the timer keeps (`CheckedCalls`): kept where a trial's
        # output is (`kept_copies`), by both processes alike (outputs past DEVICE_KEPT_BYTES are
        # kept on the host, and their timed calls' as samples: `kept` counts none of them).
        peak = torch.cuda.max_memory_reserved() + (len(self.seeds) + checked_calls) * kept
        # A candidate's correctness trial copies its large outputs into device memory it shares
        # with the judge (shared_output.py) beside the outputs themselves.
        if shared_output.enabled():
            peak += sum(n for n in (t.numel() * t.element_size() for t in first) if n >= shared_output.SHARED_FROM_BYTES)
        return {"device_bytes": peak, "device_total": torch.cuda.mem_get_info()[1]}

    def inputs(self, index):
        """The inputs of trial `index` as the candidate got them before its call, on the CPU."""
        made = self.setup.inputs(self.problem, self.seeds[index])
        return [v.cpu() if isinstance(v, torch.Tensor) else v for v in made]

    def timed_call(self, call, key):
        """The output of timing call `call`, whose key was `key`, on the inputs the candidate's
        call got."""
        seed = self.setup.seeds.timed_call(call, key)
        return protocol.as_tensor_list(self.setup.run_trial(self.problem, self.model, seed))

    def __getitem__(self, index):
        while len(self.outputs) <= index:
            seed = self.seeds[len(self.outputs)]
            inputs = self.setup.inputs(self.problem, seed)
            self.setup.sync()
            start = perf_counter()
            out = self.setup.forward(self.model, inputs, seed)
            self.forward_ms.append((perf_counter() - start) * 1e3)
            del inputs
            out = protocol.as_tensor_list(out)
            kept = protocol.kept_copies(out)
            on_host = any(o.is_cuda and not k.is_cuda for o, k in zip(out, kept))
            self.fresh = (len(self.outputs), out) if on_host else None
            del out
            self.outputs.append(kept)
        return self.outputs[index]

    def for_judging(self, index):
        """Trial `index`'s expected output for one judgement: the device's own where it was the
        last computed and is kept on the host (over DEVICE_KEPT_BYTES: a candidate's first
        judgement of each trial then compares on the device without sending GBs up from host
        memory a chunk at a time), else the kept copy. The device's is dropped once handed out."""
        kept = self[index]
        fresh, self.fresh = self.fresh, None
        return fresh[1] if fresh is not None and fresh[0] == index else kept


def input_mutation(pristine, path, trial):
    """Why the inputs a candidate published after correctness trial `trial` (python/protocol.py
    `tensors_of`) show that its forward changed them in place, or None when they are unchanged."""
    positions = [i for i, v in enumerate(pristine) if isinstance(v, torch.Tensor)]
    expected = [pristine[i] for i in positions]
    limit = 2 * sum(t.numel() * t.element_size() for t in expected) + (1 << 20)
    try:
        published = protocol.read_published(path, limit)
    except Exception as e:
        return f"the inputs after correctness trial {trial + 1} could not be checked: " + one_line(e)
    if len(published) != len(expected):
        return f"the program published {len(published)} inputs after correctness trial {trial + 1}, not {len(expected)}"
    changed = protocol.mutated(expected, published)
    if not changed:
        return None
    return f"forward changed its input {positions[changed[0]]} in place (correctness trial {trial + 1}; seen by the judge)"


class Judge:
    """Compares on the evaluation device, a chunk at a time: multi-GB outputs take seconds per
    trial on the CPU, and whole-tensor float copies of them may not fit beside other processes.
    The published output is read a chunk at a time too, into one page-locked buffer on a CUDA
    device (`protocol.PublishedFile.read_chunks`): a whole 8.6 GB output read at once held as
    much host memory again per judge, beside the expected outputs it keeps on the host, and went
    up to the device from pageable memory (bench/notes/eval-h200.md, session 29)."""

    def __init__(self, expected, atol, rtol, device):
        self.expected = expected
        self.atol = atol
        self.rtol = rtol
        self.device = device

    def check(self, expected, path, samples=False, owner=None):
        """The verdict of the output published at `path` against `expected` (a timed call's
        output may be published as samples where `samples`; large tensors as device memory shared
        by the candidate's process below `owner`: protocol.PublishedFile); whatever the file holds
        is the candidate's failure, never an exception of the judge."""
        try:
            return self._check(expected, path, samples, owner)
        except Exception as e:
            return verdict("runtime_error", "the judge could not compare the published output: " + one_line(e))

    def _check(self, expected, path, samples, owner):
        # The format's header, and slack for a candidate whose outputs are wider than the reference's.
        limit = 2 * sum(t.numel() * t.element_size() for t in expected) + (1 << 20)
        try:
            published = protocol.PublishedFile(path, limit, samples, owner)
        except protocol.Unacceptable as e:
            return verdict("runtime_error", str(e))
        except Exception as e:
            return verdict("runtime_error", "unreadable published output: " + one_line(e))
        with published:
            layout = published.layout
            if len(layout) != len(expected):
                return verdict("shape_mismatch", f"expected {len(expected)} output tensors, got {len(layout)}")
            for ref, (_, shape, _, _) in zip(expected, layout):
                if tuple(ref.shape) != tuple(shape):
                    return verdict("shape_mismatch", f"output shape mismatch: expected {tuple(ref.shape)}, got {tuple(shape)}")
            try:
                outcomes = [self._compare_entry(ref, entry, published) for ref, entry in zip(expected, layout)]
            except protocol.Unacceptable as e:
                return verdict("runtime_error", str(e))
        worst_abs = max((o["max_abs"] for o in outcomes), default=0.0)
        worst_rel = max((o["max_rel"] for o in outcomes), default=0.0)
        failure = next((o for o in outcomes if o["verdict"] != "ok"), None)
        if failure is None:
            return dict(verdict("ok", None), max_abs=worst_abs, max_rel=worst_rel)
        return dict(failure, max_abs=worst_abs, max_rel=worst_rel)

    def _compare_entry(self, ref, entry, published):
        """The comparison of the published file's next entry with `ref`: a tensor read and
        compared a chunk at a time, a sample whole."""
        if entry[2] is not None:
            sample = published.read_whole(entry)
            fault = sample_fault(ref, sample)
            if fault is not None:
                return dict(verdict("runtime_error", fault), max_abs=0.0, max_rel=0.0)
            values = sample.values
            chunks = (values[start : start + COMPARE_CHUNK] for start in range(0, values.numel(), COMPARE_CHUNK))
            return self.compare(protocol.values_at(ref, sample.positions), values.dtype, chunks)
        chunks = published.read_chunks(entry, COMPARE_CHUNK, self.device)
        return self.compare(ref, entry[0], chunks)

    def compare(self, ref, dtype, chunks):
        """`ref` against a candidate's tensor of `dtype` given as its flat values, COMPARE_CHUNK at
        a time in order (`chunks`, an iterator of as many chunks as `ref` has)."""
        same_dtype = dtype == ref.dtype
        ref = ref.reshape(-1)
        total = Comparison()
        for start, n in zip(range(0, ref.numel(), COMPARE_CHUNK), chunks):
            r = ref[start : start + COMPARE_CHUNK]
            try:
                part = self._compare(r.to(self.device), n.to(self.device), same_dtype)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                part = self._compare(r.cpu(), n.cpu(), same_dtype)
            total.add(part)
        errors = dict(max_abs=total.max_abs, max_rel=total.max_rel)
        if total.spoiled:
            return dict(verdict("nan_or_inf", f"{total.spoiled} non-finite values where the reference is finite"), **errors)
        if not same_dtype:
            return dict(verdict("output_mismatch", f"output dtype {dtype}, expected {ref.dtype}"), **errors)
        if not total.close:
            message = f"max abs error {total.max_abs:.6g}, max rel error {total.max_rel:.6g}"
            return dict(verdict("output_mismatch", message), **errors)
        return dict(verdict("ok", None), **errors)

    def _compare(self, ref, new, same_dtype):
        wide = torch.float64 if ref.dtype == torch.float64 else torch.float32
        r = ref.to(wide)
        n = new.to(wide)
        diff = (r - n).abs()
        diff = torch.where(r == n, torch.zeros_like(diff), diff)  # equal infinities are no error
        finite = torch.isfinite(diff)
        rel = diff / r.abs().clamp_min(self.atol)
        return Comparison(
            max_abs=float(diff[finite].max()) if finite.any() else 0.0,
            max_rel=float(rel[finite].max()) if finite.any() else 0.0,
            spoiled=int((torch.isfinite(r) & ~torch.isfinite(n)).sum()),
            close=same_dtype and torch.allclose(ref, new, atol=self.atol, rtol=self.rtol, equal_nan=True),
        )


def sample_fault(ref, sample):
    """Why a published sample of an output like `ref` is not one the timer keeps (its size, or
    positions outside the output), or None."""
    positions, numel = sample.positions, ref.numel()
    if sample.values.numel() != min(numel, protocol.SAMPLE_ELEMENTS):
        return f"a timed output sampled at {sample.values.numel()} of its {numel} values"
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= numel):
        return "a timed output sampled outside its values"
    return None


# Elements compared at once: a few float temporaries of 256 MB each.
COMPARE_CHUNK = 1 << 26


class Comparison:
    """Errors of one output tensor, folded over its chunks."""

    def __init__(self, max_abs=0.0, max_rel=0.0, spoiled=0, close=True):
        self.max_abs = max_abs
        self.max_rel = max_rel
        self.spoiled = spoiled
        self.close = close

    def add(self, part):
        self.max_abs = max(self.max_abs, part.max_abs)
        self.max_rel = max(self.max_rel, part.max_rel)
        self.spoiled += part.spoiled
        self.close = self.close and part.close


def verdict(name, message):
    return {"verdict": name, "message": message}
