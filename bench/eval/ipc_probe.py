"""Whether a judge can read a candidate's device output through CUDA IPC where the candidate runs
as the evaluator runs it (new PID, mount and network namespaces, another user), and what that
saves against the published file (python/protocol.py `publish` + `PublishedFile.read_chunks`).

    python3 bench/eval/ipc_probe.py [GIB]

Prints one JSON line per way the exporter ran (plain child; sandboxed: namespaces + user 65534)
with each way of sharing: legacy IPC (cuIpcGetMemHandle of the output's allocation, opened with
cuIpcOpenMemHandle: `ipc_*`), the evaluator's own (python/shared_output.py: the driver's virtual
memory API, a descriptor taken with pidfd_getfd, through `protocol.publish(..., share=True)` and
`PublishedFile.read_chunks` with DICE_SHARED_OUTPUTS=1: `shared_*`), and the published file's cost
for the same output (`publish_s`, `file_read_s`).
"""

import ctypes
import json
import os
import sys
import shutil
import subprocess
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../crates/dice-eval/python"))

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
GIB = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
OFFSET = 4096  # a view that does not start at its allocation's base


class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def cuda():
    lib = ctypes.CDLL("libcuda.so.1")
    return lib


def check(ret, what):
    if ret != 0:
        raise RuntimeError(f"{what}: CUresult {ret}")


def exporter(write_fd, read_fd, sandboxed):
    if sandboxed:
        libc = ctypes.CDLL(None, use_errno=True)
        check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare")
        pid = os.fork()
        if pid:
            os.write(write_fd, (json.dumps({"host_pid": pid}) + "\n").encode())
            _, status = os.waitpid(pid, 0)
            os._exit(0)
        os.setgid(65534)
        os.setuid(65534)
    import torch

    n = int(GIB * (1 << 30) / 4)
    x = torch.arange(n + OFFSET // 4, dtype=torch.float32, device="cuda")
    view = x[OFFSET // 4 :]
    torch.cuda.synchronize()
    lib = cuda()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    msg = {}
    try:
        check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(view.data_ptr())), "cuMemGetAddressRange")
        h = Handle()
        check(lib.cuIpcGetMemHandle(ctypes.byref(h), base), "cuIpcGetMemHandle")
        msg = {"handle": bytes(h.reserved).hex(), "offset": view.data_ptr() - base.value, "alloc": size.value}
    except Exception as e:
        msg = {"error": str(e)}
    msg.update(nbytes=view.numel() * 4, uid=os.getuid(), pid=os.getpid())
    # The published file of the same output, for the file path's cost.
    import protocol

    path = os.path.join(os.environ["PROBE_DIR"], "output.bin")
    t0 = time.perf_counter()
    try:
        protocol.publish([view], path)
        msg["publish_s"] = time.perf_counter() - t0
        msg["path"] = path
    except Exception as e:
        msg["publish_error"] = str(e)
    # The evaluator's own way (python/shared_output.py through protocol.publish).
    shared_path = os.path.join(os.environ["PROBE_DIR"], "shared.bin")
    t0 = time.perf_counter()
    try:
        protocol.publish([view], shared_path, share=True)
        msg["shared_publish_s"] = time.perf_counter() - t0
        msg["shared_path"] = shared_path
        msg["shared_file_bytes"] = os.path.getsize(shared_path)
    except Exception as e:
        msg["shared_publish_error"] = repr(e)
    os.write(write_fd, (json.dumps(msg) + "\n").encode())
    os.read(read_fd, 1)  # held until the importer is done
    os._exit(0)


def importer(msg, owner):
    import torch

    import protocol
    import shared_output

    out = {k: msg.get(k) for k in ("error", "offset", "nbytes", "alloc", "uid", "pid", "host_pid", "publish_s", "publish_error", "shared_publish_s", "shared_publish_error", "shared_file_bytes")}
    torch.zeros(1, device="cuda")
    lib = cuda()
    if "shared_path" in msg:
        try:
            t0 = time.perf_counter()
            ok = True
            with protocol.PublishedFile(msg["shared_path"], msg["nbytes"] * 2 + (1 << 20), owner=owner) as f:
                out["shared_entry"] = f.layout[0][3]
                start = OFFSET // 4
                for part in f.read_chunks(f.layout[0], 1 << 26, torch.device("cuda")):
                    ok &= bool(torch.equal(part, torch.arange(start, start + part.numel(), dtype=torch.float32, device="cuda")))
                    start += part.numel()
            out["shared_read_compare_s"] = time.perf_counter() - t0
            out["shared_values_ok"] = ok
        except Exception as e:
            out["shared_read_error"] = repr(e)
    if "path" in msg and os.path.exists(msg["path"]):
        t0 = time.perf_counter()
        with protocol.PublishedFile(msg["path"], msg["nbytes"] * 2 + (1 << 20)) as f:
            for part in f.read_chunks(f.layout[0], 1 << 26, torch.device("cuda")):
                part.to("cuda")
        torch.cuda.synchronize()
        out["file_read_s"] = time.perf_counter() - t0
        os.unlink(msg["path"])
    if "error" in msg:
        return out
    h = Handle()
    h.reserved = bytes.fromhex(msg["handle"])
    ptr = ctypes.c_uint64()
    t0 = time.perf_counter()
    ret = lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, ctypes.c_uint(1))
    out["open_s"] = time.perf_counter() - t0
    if ret != 0:
        out["open_error"] = ret
        return out
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "range (importer)")
    out["alloc_seen"] = size.value

    nbytes = msg["nbytes"]
    src = torch.as_tensor(shared_output.DeviceBytes(ptr.value + msg["offset"], nbytes, True), device="cuda")
    t0 = time.perf_counter()
    ok = compare_all(src, nbytes)
    out["ipc_read_compare_s"] = time.perf_counter() - t0
    out["ipc_values_ok"] = ok
    del src
    check(lib.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")
    return out


def compare_all(src, nbytes):
    """Copies src a chunk at a time into a buffer of this process and checks the values."""
    import torch

    chunk = 1 << 28
    buf = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    ok = True
    for start in range(0, nbytes, chunk):
        part = src[start : start + chunk]
        buf[: part.numel()].copy_(part)
        vals = buf[: part.numel()].view(torch.float32)
        first = start // 4 + OFFSET // 4
        expect = torch.arange(first, first + vals.numel(), dtype=torch.float32, device="cuda")
        ok &= bool(torch.equal(vals, expect))
    torch.cuda.synchronize()
    return ok


def probe(sandboxed):
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r1)
        os.close(w2)
        exporter(w1, r2, sandboxed)
    os.close(w1)
    os.close(r2)
    reader = os.fdopen(r1, "r")
    msg = {}
    for line in reader:
        msg.update(json.loads(line))
        if "host_pid" not in json.loads(line):
            break
    try:
        msg = msg if "pid" in msg else dict(msg, error="the exporter said nothing")
        result = importer(msg, pid)
    except Exception as e:
        result = {"importer_error": repr(e)}
    os.write(w2, b"x")
    os.waitpid(pid, 0)
    result["sandboxed"] = sandboxed
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ["DICE_SHARED_OUTPUTS"] = "1"
    if len(sys.argv) > 2:  # one way, in a process of its own (CUDA is not forked once started)
        probe(sys.argv[2] == "sandboxed")
        sys.exit(0)
    for way in ("plain", "sandboxed"):
        folder = f"/dev/shm/ipc-probe-{way}"
        shutil.rmtree(folder, ignore_errors=True)
        os.mkdir(folder)
        if way == "sandboxed":
            os.chown(folder, 65534, 65534)
        subprocess.run([sys.executable, __file__, str(GIB), way], env=dict(os.environ, PROBE_DIR=folder))
        shutil.rmtree(folder, ignore_errors=True)
