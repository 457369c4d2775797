"""The seed/input/trial/timing protocol, one code path for the reference and the candidate.

Both processes: set_seed(42) then init inputs; set_seed(42) then construct the model (on the CPU,
then moved to the device, as KernelBench does); trial seeds from torch.manual_seed(42) and
torch.randint (KernelBench §2.4); per trial set_seed(s), inputs, set_seed(s) right before forward.
Inputs are generated inside a `torch.device(device)` context, so factory calls such as torch.rand
allocate on the evaluation device from that device's generator, identically in both processes.
"""

import random
import sys
import types
from time import perf_counter_ns

import torch

SEED = 42
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
        inputs = self.inputs(problem, seed)
        set_seed(seed)
        with torch.no_grad():
            out = model(*inputs)
        self.sync()
        return out


class Timer:
    """Times model calls on fixed inputs (set_seed(42) inputs, as KernelBench §3.2)."""

    def __init__(self, setup, problem, model):
        self.setup = setup
        self.model = model
        self.inputs = setup.inputs(problem, SEED)
        self.warm = False
        self.flush = None
        if setup.device.type == "cuda":
            self.flush = torch.empty(L2_FLUSH_BYTES // 8, dtype=torch.int64, device=setup.device)

    def run(self, n):
        with torch.no_grad():
            if not self.warm:
                for _ in range(WARMUP_CALLS):
                    self.model(*self.inputs)
                    self.setup.sync()
                self.warm = True
            if self.flush is None:
                return [self._host_call() for _ in range(n)]
            return [self._event_call() for _ in range(n)]

    def _host_call(self):
        start = perf_counter_ns()
        self.model(*self.inputs)
        return (perf_counter_ns() - start) / 1e6

    def _event_call(self):
        torch.cuda.synchronize(self.setup.device)
        self.flush.fill_(42)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        self.model(*self.inputs)
        end.record()
        torch.cuda.synchronize(self.setup.device)
        return start.elapsed_time(end)


def as_tensor_list(out):
    """The tensors of a forward result (a tensor, or a tuple/list of tensors), moved to the CPU."""
    if isinstance(out, torch.Tensor):
        return [out.detach().cpu()]
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return [t.detach().cpu() for t in out]
    raise TypeError(f"forward returned {type(out).__name__}, expected a tensor")
