"""The seed/input/trial/timing protocol, one code path for the reference and the candidate.

Both processes: set_seed(42) then init inputs; set_seed(42) then construct the model (on the CPU,
then moved to the device, as KernelBench does); trial seeds from torch.manual_seed(42) and
torch.randint (KernelBench §2.4); per trial set_seed(s), inputs, set_seed(s) right before forward.
Inputs are generated inside a `torch.device(device)` context, so factory calls such as torch.rand
allocate on the evaluation device from that device's generator, identically in both processes.
"""

import os
import random
import sys
import types
from time import perf_counter_ns

import torch

SEED = 42
TIMING_SEEDS = (SEED, SEED + 1)
WARMUP_CALLS = 3
L2_FLUSH_BYTES = 256 << 20
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def set_seed(seed):
    torch.manual_seed(seed)
    random.seed(seed)


def trial_seeds(n):
    torch.manual_seed(SEED)
    return [int(torch.randint(0, 2**32 - 1, (1,)).item()) for _ in range(n)]


def load_module(name, path):
    """Executes a program file (read as bytes) as a fresh module of its own."""
    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec")
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    exec(code, module.__dict__)
    return module


class Setup:
    def __init__(self, req):
        # One GPU per worker (CUDA_VISIBLE_DEVICES), so always index 0.
        self.device = torch.device("cuda", 0) if req["device"] == "cuda" else torch.device("cpu")
        self.dtype = DTYPES.get(req.get("precision"))

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

    The input sets come from TIMING_SEEDS (the first is KernelBench's set_seed(42), §3.2). Before
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
        self.sets = [setup.inputs(problem, seed) for seed in TIMING_SEEDS]
        self.buffers = [v.clone() if isinstance(v, torch.Tensor) else v for v in self.sets[0]]
        self.calls = 0
        self.kept = [[] for _ in self.sets]
        self.alive = [None] * len(self.sets)
        self.last = [None] * len(self.sets)
        self.reused = None
        self.one_buffer = False
        self.own = {storage_of(t) for t in self.buffers if isinstance(t, torch.Tensor)}
        self.own |= {storage_of(t) for t in list(model.parameters()) + list(model.buffers())}
        self.flush = None
        if setup.device.type == "cuda":
            self.flush = torch.empty(L2_FLUSH_BYTES // 8, dtype=torch.int64, device=setup.device)

    def run(self, n):
        # Small kernels are timed by how fast Python launches them: on cores of their own,
        # other processes of the evaluation (builds, imports) cannot slow the launches down.
        if self.cores:
            os.sched_setaffinity(0, self.cores["timed"])
        try:
            with torch.no_grad():
                if self.calls == 0:
                    for _ in range(WARMUP_CALLS):
                        self._call(0)
                return [self._timed(self.calls % len(self.sets)) for _ in range(n)]
        finally:
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
        set_seed(TIMING_SEEDS[k])
        self.setup.sync()
        return args

    def _call(self, k):
        args = self._prepare(k)
        self.model(*args)
        self.setup.sync()

    def _timed(self, k):
        args = self._prepare(k)
        if self.flush is None:
            start = perf_counter_ns()
            out = self.model(*args)
            ms = (perf_counter_ns() - start) / 1e6
        else:
            self.flush.fill_(42)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.model(*args)
            end.record()
            torch.cuda.synchronize(self.setup.device)
            ms = start.elapsed_time(end)
        self._keep(k, out)
        self.calls += 1
        return ms

    def _keep(self, k, out):
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        tensors = [t for t in outs if isinstance(t, torch.Tensor) and t.numel() > 0]
        storages = [storage_of(t) for t in tensors]
        others = {s for j, kept in enumerate(self.kept) if j != k for s in kept}
        if any(s in others for s in storages):
            # One output buffer for every input set: recomputed each call, so not a cache.
            self.one_buffer = True
        elif self.reused is None and any(s in self.kept[k] for s in storages):
            self.reused = f"a timed call on input set {k + 1} returned the output storage of the previous call on that set"
        self.kept[k] = storages
        self.alive[k] = tensors  # while they live, a freshly computed output cannot get their addresses
        # Published outputs must survive later calls that overwrite a shared buffer or an input.
        self.last[k] = [t.clone() if self.one_buffer or storage_of(t) in self.own else t for t in tensors]

    def outputs(self, k):
        """The last output of input set k, as published tensors."""
        return as_tensor_list(self.last[k])


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


def as_tensor_list(out, device="cpu"):
    """The tensors of a forward result (a tensor, or a tuple/list of tensors), on `device`."""
    if isinstance(out, torch.Tensor):
        return [out.detach().to(device)]
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return [t.detach().to(device) for t in out]
    raise TypeError(f"forward returned {type(out).__name__}, expected a tensor")
