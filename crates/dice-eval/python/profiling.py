"""Which CUDA kernels a call launches, on which stream, for how long: CUPTI's activity API.

torch.profiler (Kineto) costs 6-7 s of host time to start in every fresh process on an H200
(bench/notes/eval-h200.md); CUPTI's activity API, which Kineto wraps, starts in milliseconds.
The library is the one torch already loaded. Records are read at the offsets of
CUpti_ActivityKernel (fields up to `name` are laid out alike in every record version since
CUPTI 10: kind, cache configs, registers, start, end, ..., streamId, ..., correlationId, gridId,
name).

Runs in the candidate's process, so a candidate can forge it (SANDBOX.md); the evaluator matches
the names against the candidate's own kernels and decides what the profile means.
"""

import ctypes
import os

import torch

MAX_KERNELS = 200
MAX_NAME = 300
ACTIVITY_KIND_CONCURRENT_KERNEL = 10
FLUSH_FORCED = 1
BUFFER_BYTES = 8 << 20
ALIGN = 8
KIND_AT, START_AT, END_AT, STREAM_AT, NAME_AT = 0, 16, 24, 48, 104

BufferRequested = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
BufferCompleted = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)


def loaded_library(stem):
    """Path of a shared library this process already mapped (torch maps libcupti at import)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith(stem + ".so"):
                return path
    raise OSError(f"{stem} is not loaded in this process (torch without CUDA profiling support?)")


def check(status, call):
    if status != 0:
        raise RuntimeError(f"{call} failed with CUPTI status {status}")


class Demangler:
    def __init__(self):
        self.cxx = ctypes.CDLL("libstdc++.so.6")
        self.demangle = getattr(self.cxx, "__cxa_demangle")
        self.demangle.restype = ctypes.c_void_p
        self.demangle.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self.free = ctypes.CDLL(None).free
        self.free.argtypes = [ctypes.c_void_p]

    def __call__(self, raw):
        status = ctypes.c_int(-1)
        text = self.demangle(raw, None, None, ctypes.byref(status))
        if status.value != 0 or not text:
            return raw.decode(errors="replace")
        try:
            return ctypes.string_at(text).decode(errors="replace")
        finally:
            self.free(text)


class Session:
    """The kernel recorder of one process: CUPTI loaded and its buffer callbacks registered."""

    def __init__(self):
        self.cupti = ctypes.CDLL(loaded_library("libcupti"))
        self.demangle = Demangler()
        self.buffers = {}
        self.records = []
        # ctypes callbacks must outlive every call CUPTI makes to them.
        self.callbacks = (BufferRequested(self._requested), BufferCompleted(self._completed))
        check(self.cupti.cuptiActivityRegisterCallbacks(*self.callbacks), "cuptiActivityRegisterCallbacks")

    def _requested(self, buffer, size, max_records):
        raw = ctypes.create_string_buffer(BUFFER_BYTES + ALIGN)
        address = (ctypes.addressof(raw) + ALIGN - 1) & ~(ALIGN - 1)
        self.buffers[address] = raw
        buffer[0] = address
        size[0] = BUFFER_BYTES
        max_records[0] = 0

    def _completed(self, context, stream, buffer, size, valid):
        record = ctypes.c_void_p()
        while self.cupti.cuptiActivityGetNextRecord(ctypes.c_void_p(buffer), ctypes.c_size_t(valid), ctypes.byref(record)) == 0:
            at = record.value
            if ctypes.c_int32.from_address(at + KIND_AT).value != ACTIVITY_KIND_CONCURRENT_KERNEL:
                continue
            start = ctypes.c_uint64.from_address(at + START_AT).value
            end = ctypes.c_uint64.from_address(at + END_AT).value
            stream_id = ctypes.c_uint32.from_address(at + STREAM_AT).value
            name = ctypes.c_char_p.from_address(at + NAME_AT).value or b"?"
            self.records.append((start, name, stream_id, max(end - start, 0) / 1e3))
        self.buffers.pop(buffer, None)

    def launched(self, fn):
        """Runs fn with kernel recording on: (default stream id, [{name, stream, us, calls}] by
        total time). A marker op runs first, so the earliest kernel names the default stream."""
        marker = torch.ones(1 << 16, device="cuda")
        torch.cuda.synchronize()
        self.records = []
        check(self.cupti.cuptiActivityEnable(ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable")
        try:
            marker.mul_(2)
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
        finally:
            self.cupti.cuptiActivityDisable(ACTIVITY_KIND_CONCURRENT_KERNEL)
            check(self.cupti.cuptiActivityFlushAll(FLUSH_FORCED), "cuptiActivityFlushAll")
        kernels = sorted(self.records)
        if not kernels:
            return None, []
        default = kernels[0][2]
        totals = {}
        for _, raw, stream_id, us in kernels[1:]:
            total, calls = totals.get((raw, stream_id), (0.0, 0))
            totals[(raw, stream_id)] = (total + us, calls + 1)
        found = [{"name": self.demangle(raw)[:MAX_NAME], "stream": s, "us": us, "calls": c} for (raw, s), (us, c) in totals.items()]
        found.sort(key=lambda k: -k["us"])
        return default, found[:MAX_KERNELS]
