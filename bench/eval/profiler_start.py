"""How long recording kernels costs in a fresh CUDA process: Kineto (torch.profiler) against CUPTI's
activity API through ctypes (what crates/dice-eval/python/profiling.py does), 1 and then 8 processes
at once. Children are forked from a parent that imported torch, like the evaluator's fork server.
`direct_early` enables CUPTI before the process's first CUDA call.

Run on the GPU machine: python3 bench/eval/profiler_start.py  (session 3, H200: Kineto's start
6.2-6.9 s of CPU per process with 8 at once, CUPTI's 0.03 s; bench/notes/eval-h200.md)"""
import ctypes, json, os, resource, sys, time
import torch

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def cuda_init():
    t = time.perf_counter(); x = torch.ones(1 << 20, device="cuda"); (x @ x); torch.cuda.synchronize()
    return time.perf_counter() - t

def kineto():
    from torch.profiler import ProfilerActivity, profile
    w, c = time.perf_counter(), cpu()
    with profile(activities=[ProfilerActivity.CUDA]):
        pass
    start = (time.perf_counter() - w, cpu() - c)
    w = time.perf_counter()
    x = torch.randn(1024, 1024, device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        (x @ x).relu_(); torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return dict(start_s=start[0], start_cpu_s=start[1], run_s=time.perf_counter() - w, kernels=len(names))

KIND_CONCURRENT_KERNEL = 10
BUF = 8 << 20
REQ = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
DONE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)

def direct():
    import nvidia
    w, c = time.perf_counter(), cpu()
    lib = ctypes.CDLL(os.path.join(nvidia.__path__[0], "cu13", "lib", "libcupti.so.13"))
    keep, records = [], []
    @REQ
    def requested(buf, size, maxrec):
        b = ctypes.create_string_buffer(BUF + 8); keep.append(b)
        addr = (ctypes.addressof(b) + 7) & ~7
        buf[0] = addr; size[0] = BUF; maxrec[0] = 0
    @DONE
    def completed(ctx, stream, buf, size, valid):
        rec = ctypes.c_void_p()
        while lib.cuptiActivityGetNextRecord(ctypes.c_void_p(buf), ctypes.c_size_t(valid), ctypes.byref(rec)) == 0:
            a = rec.value
            if ctypes.c_int32.from_address(a).value == KIND_CONCURRENT_KERNEL:
                s = ctypes.c_uint64.from_address(a + 16).value; e = ctypes.c_uint64.from_address(a + 24).value
                st = ctypes.c_uint32.from_address(a + 48).value
                name = ctypes.c_char_p.from_address(a + 104).value
                records.append((name.decode(errors="replace")[:60], st, (e - s) / 1e3))
    keep.append((requested, completed))
    assert lib.cuptiActivityRegisterCallbacks(requested, completed) == 0
    assert lib.cuptiActivityEnable(KIND_CONCURRENT_KERNEL) == 0
    start = (time.perf_counter() - w, cpu() - c)
    w = time.perf_counter()
    x = torch.randn(1024, 1024, device="cuda"); (x @ x).relu_(); torch.cuda.synchronize()
    assert lib.cuptiActivityFlushAll(1) == 0
    lib.cuptiActivityDisable(KIND_CONCURRENT_KERNEL)
    return dict(start_s=start[0], start_cpu_s=start[1], run_s=time.perf_counter() - w, kernels=len(records), sample=records[:4])

def direct_early():
    return direct()

def child(fn, w):
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            if fn is direct_early:
                t = time.perf_counter(); r0 = direct(); res = dict(fn=fn.__name__, early_total_s=time.perf_counter() - t, **r0)
            else:
                res = dict(fn=fn.__name__, cuda_init_s=cuda_init(), **fn())
        except Exception as e:
            res = dict(fn=fn.__name__, error=repr(e))
        os.write(wfd, json.dumps(res).encode()); os._exit(0)
    os.close(wfd)
    return pid, r

def gather(kids):
    out = []
    for pid, r in kids:
        data = b""
        while chunk := os.read(r, 65536): data += chunk
        os.waitpid(pid, 0); out.append(json.loads(data))
    return out

for n in (1, 8):
    for fn in (kineto, direct, direct_early):
        t = time.perf_counter()
        res = gather([child(fn, None) for _ in range(n)])
        print(json.dumps(dict(concurrent=n, fn=fn.__name__, wall=round(time.perf_counter() - t, 2),
              results=[{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in res[:3]])), flush=True)
