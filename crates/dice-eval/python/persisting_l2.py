"""Persisting L2 lines survive an L2 flush: a program that reserves a persisting share of L2
(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, n)) and marks its data persisting through an
access-policy window keeps that data in L2 from one timed call to the next, whatever the flush
writes. Both timers call `Guard.reset` before every flush; it undoes all of it and records what
it found.

The calls go through ctypes to the CUDA runtime that torch loaded (torch exposes none of them),
so they act on the process's own context; it is found when this module is imported, in the fork
server, before a child is confined to a sandbox that may not show it /proc. Errors they raise are cleared at once: left pending,
the next kernel launch check (cudaGetLastError) of the program would report them as its own.
"""

import ctypes

import torch

LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize
ATTRIBUTE_ACCESS_POLICY_WINDOW = 1  # cudaStreamAttributeAccessPolicyWindow
# cudaStreamAttrValue is a union padded to 64 bytes; its accessPolicyWindow starts with
# {void *base_ptr; size_t num_bytes; float hitRatio; int hitProp; int missProp}.
ATTRIBUTE_VALUE_BYTES = 64
WINDOW_NUM_BYTES_AT = 8


def cuda_runtime():
    """The libcudart mapped into this process by torch; None where there is none."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


RUNTIME = cuda_runtime()


class Guard:
    """Resets the process's persisting L2 state before a flush; `found` says what was set, by
    kind ("limit": a persisting reservation, "window": an access-policy window on the timed
    stream), each described the first time it was seen. The evaluator compares the kinds with
    those the trusted baseline's own process finds: a machine may reserve persisting L2 for every
    process, but what only the candidate's process shows is the candidate's doing. Does nothing
    off CUDA."""

    def __init__(self, device):
        self.device = device
        self.found = {}
        self.runtime = RUNTIME if device.type == "cuda" else None
        self.reset()

    def reset(self):
        if self.runtime is None:
            return
        rt = self.runtime
        limit = ctypes.c_size_t(0)
        if rt.cudaDeviceGetLimit(ctypes.byref(limit), LIMIT_PERSISTING_L2) == 0 and limit.value > 0:
            self._note("limit", f"reserved {limit.value} bytes of L2 for persisting accesses (cudaLimitPersistingL2CacheSize)")
            rt.cudaDeviceSetLimit(LIMIT_PERSISTING_L2, ctypes.c_size_t(0))
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        value = ctypes.create_string_buffer(ATTRIBUTE_VALUE_BYTES)
        if rt.cudaStreamGetAttribute(stream, ATTRIBUTE_ACCESS_POLICY_WINDOW, value) == 0:
            window = ctypes.c_size_t.from_buffer(value, WINDOW_NUM_BYTES_AT).value
            if window > 0:
                self._note("window", f"set an access-policy window of {window} bytes on the timed stream")
                rt.cudaStreamSetAttribute(stream, ATTRIBUTE_ACCESS_POLICY_WINDOW, ctypes.create_string_buffer(ATTRIBUTE_VALUE_BYTES))
        rt.cudaCtxResetPersistingL2Cache()
        rt.cudaGetLastError()

    def _note(self, kind, what):
        self.found.setdefault(kind, f"before a timed call's L2 flush, the program had {what}: persisting lines survive the flush (reset before every flush)")
