"""The seed/input/trial/timing protocol, one code path for the reference and the candidate.

Both processes: set_seed(42) then init inputs; set_seed(42) then construct the model (on the CPU,
then moved to the device, as KernelBench does); trial and timing seeds from the run's seed
(`Seeds`); per trial set_seed(s), inputs, set_seed(s) right before forward.
Inputs are generated inside a `torch.device(device)` context, so factory calls such as torch.rand
allocate on the evaluation device from that device's generator, identically in both processes.
"""

import errno
import gc
import json
import os
import random
import stat
import sys
import types
from time import perf_counter_ns

import torch

import persisting_l2
# KernelBench's seed: the model's construction always, and the run's seed under `--input-seed 42`.
SEED = 42
WARMUP_CALLS = 3
L2_FLUSH_BYTES = 256 << 20
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def set_seed(seed):
    torch.manual_seed(seed)
    random.seed(seed)


class Seeds:
    """The seeds of a run's correctness trials and timing input sets, all from one run seed that
    the evaluator draws when the run begins (stored with the run, handed to both processes in
    their requests): a program cannot carry its expected outputs for inputs it cannot predict.
    From SEED they are KernelBench's: the trial seeds of torch.manual_seed(42) and torch.randint
    (§2.4), and set_seed(42) for the first timing set (§3.2). KernelBench's timing methods
    (`kernelbench_timing`) always time on that set, as its harness does: the timed outputs are
    judged, but the correctness trials' inputs stay the run's."""

    def __init__(self, run_seed, kernelbench_timing=False):
        self.run_seed = run_seed
        self.timing = (SEED if kernelbench_timing else run_seed, run_seed + 1)

    def trials(self, n):
        generator = torch.Generator().manual_seed(self.run_seed)
        return [int(torch.randint(0, 2**32 - 1, (1,), generator=generator).item()) for _ in range(n)]


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
        self.seeds = Seeds(req["seed"], req.get("timing", "dice") != "dice")
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
    """Times model calls, rotating input sets through fixed buffers (same process in both roles).

    The input sets come from the run's timing seeds (`Seeds`). Before
    each call the next set is copied into the same tensors and the seed is set again, so an output
    cached by input pointer is stale, and the last output of each set can be judged like a
    correctness trial. Outputs of earlier calls are kept alive: a call that returns the storage of
    the previous call on the same set, but not of the other sets (a cache keyed by value), is
    recorded in `reused`.
    """

    def __init__(self, setup, problem, model, cores=None):
        self.setup = setup
        self.model = model
        self.cores = cores
        self.sets = [setup.inputs(problem, seed) for seed in setup.seeds.timing]
        self.buffers = [v.clone() if isinstance(v, torch.Tensor) else v for v in self.sets[0]]
        self.calls = 0
        self.untimed_calls = 0  # made by the last run before its timed ones: the warm-ups
        self.kept = [[] for _ in self.sets]
        self.alive = [None] * len(self.sets)
        self.last = [None] * len(self.sets)
        self.reused = None
        self.flush = None
        if setup.device.type == "cuda":
            self.flush = torch.empty(L2_FLUSH_BYTES // 8, dtype=torch.int64, device=setup.device)
        self.l2 = persisting_l2.Guard(setup.device)

    def run(self, n):
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
                self.untimed_calls = WARMUP_CALLS if self.calls == 0 else 0
                for _ in range(self.untimed_calls):
                    self._call(0)
                return [self._timed(self.calls % len(self.sets), final=i >= n - len(self.sets)) for i in range(n)]
        finally:
            if collecting:
                gc.enable()
            if self.cores:
                os.sched_setaffinity(0, self.cores["untimed"])

    def _prepare(self, k):
        args = []
        for buf, value in zip(self.buffers, self.sets[k]):
            if isinstance(buf, torch.Tensor):
                buf.copy_(value)
                args.append(buf)
            else:
                args.append(value)
        set_seed(self.setup.seeds.timing[k])
        self.setup.sync()
        return args

    def _call(self, k):
        args = self._prepare(k)
        self.model(*args)
        self.setup.sync()

    def _timed(self, k, final):
        args = self._prepare(k)
        if self.flush is None:
            start = perf_counter_ns()
            out = self.model(*args)
            ms = (perf_counter_ns() - start) / 1e6
        else:
            self.l2.reset()
            self.flush.fill_(42)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.model(*args)
            end.record()
            torch.cuda.synchronize(self.setup.device)
            ms = start.elapsed_time(end)
        self._keep(k, out, final)
        self.calls += 1
        return ms

    def _keep(self, k, out, final):
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        tensors = [t for t in outs if isinstance(t, torch.Tensor) and t.numel() > 0]
        storages = [storage_of(t) for t in tensors]
        others = {s for j, kept in enumerate(self.kept) if j != k for s in kept}
        # One output buffer for every input set is recomputed each call, so not a cache.
        one_buffer = any(s in others for s in storages)
        if not one_buffer and self.reused is None and any(s in self.kept[k] for s in storages):
            self.reused = f"a timed call on input set {k + 1} returned the output storage of the previous call on that set"
        self.kept[k] = storages
        self.alive[k] = tensors  # while they live, a freshly computed output cannot get their addresses
        # Published outputs must survive later calls that overwrite a shared buffer or an input,
        # so they are copies. Only the last call on each set in a round can be published (a later
        # round replaces it), and it is copied whatever it returned: the copies cost every process
        # the same, in wall time only, so the candidate's rounds stay comparable with the
        # baseline's in the evaluator's clock check (runtime.rs `check_clock`).
        if final:
            self.last[k] = [t.clone() for t in tensors]

    def outputs(self, k):
        """The last output of input set k."""
        return self.last[k]


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


def publish(tensors, path):
    """Writes tensors (on any device) to path in the published format."""
    header = json.dumps([{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for t in tensors]).encode()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for t in tensors:
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


def read_published(path, limit):
    """The tensors of a file a candidate published, read into this process's memory;
    Unacceptable when the path is not a regular file of its folder's owner or holds more than
    `limit` bytes, ValueError when malformed. The writer is not trusted: the file is opened without
    following a link and without blocking (a FIFO would hold the judge until its timeout), and read
    once, so that a file changed or truncated meanwhile cannot crash the judge the way a mapping of
    it would; every size is checked against the bytes read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Unacceptable("the published output is a symbolic link") from None
        raise Unacceptable(f"the published output cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unacceptable(f"the published output is not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_uid != os.stat(os.path.dirname(path)).st_uid:
            raise Unacceptable("the published output belongs to another user than the program's")
        if st.st_size > limit:
            raise Unacceptable(f"the published output has {st.st_size} bytes, far more than the reference's outputs")
        data = bytearray(st.st_size)
        view = memoryview(data)
        done = 0
        while done < len(data):
            n = os.readv(fd, [view[done:]])
            if n == 0:
                raise Unacceptable("the published output shrank while the judge read it")
            done += n
    finally:
        os.close(fd)
    return parse_published(data)


def parse_published(data):
    """The tensors of published bytes (a bytearray, which they share); ValueError when malformed."""
    size = len(data)
    length = int.from_bytes(data[:8], "little")
    if not 0 < length <= HEADER_BYTES_MAX or 8 + length > size:
        raise ValueError("bad header length")
    header = json.loads(bytes(data[8 : 8 + length]))
    if not isinstance(header, list):
        raise ValueError("the header is not a list")
    layout = []
    offset = 8 + length
    for entry in header:
        dtype = PUBLISHED_DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        shape = entry.get("shape") if dtype is not None else None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError("bad tensor entry in the header")
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        layout.append((dtype, shape, offset, nbytes))
        offset += nbytes
    if offset != size:
        raise ValueError(f"the header describes {offset} bytes, the file has {size}")
    tensors = []
    for dtype, shape, at, nbytes in layout:
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
        else:
            tensors.append(torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=at).view(dtype).reshape(shape))
    return tensors
