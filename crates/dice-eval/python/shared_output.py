"""A candidate's large device output handed to the judge on the device, not through a file.

A correctness trial's output of several GB went device → pinned staging → /dev/shm file → the
judge's pinned buffer → device, a chunk at a time: 10 s a trial for problem 6936's 8.6 GB output,
most of a warm quiet evaluation of its pair (bench/notes/eval-h200.md, sessions 29-38).

The candidate's process copies such an output into device memory made with the CUDA driver's
virtual memory API (`cuMemCreate`, exportable as a POSIX file descriptor) and names the
descriptor in the published file's header ({"shared": {"pid", "fd", "size"}}: its own PID as its
namespace sees it). The judge takes that descriptor out of the candidate's process itself
(`pidfd_getfd`), but only from a process below the one the evaluator started for the candidate
(`owner`): a candidate cannot point the judge at another program's memory. It maps the memory
read-only, copies it a chunk at a time into buffers of its own and compares those, then unmaps
it. Whatever the header says that does not hold (a process outside the candidate's, a descriptor
that is no CUDA allocation, a size the allocation lacks) is the candidate's failure (`Refused`,
which the judge reports as protocol.py's `Unacceptable`). Where the candidate's side cannot share
(no VMM support, no room), it publishes the bytes in the file as before.

Off unless the evaluator's environment has DICE_SHARED_OUTPUTS=1 (`enabled`): not yet run on a
GPU (bench/notes/eval-h200.md, session 38, has the probe and the runs that decide the default).
"""

import ctypes
import functools
import os

import torch

# Outputs of at least this many bytes go through shared device memory.
SHARED_FROM_BYTES = 256 << 20
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
SYS_PIDFD_OPEN = 434
SYS_PIDFD_GETFD = 438


def enabled():
    """Whether candidates share their large outputs (the evaluator's processes all inherit its
    environment; a candidate that changes its own only decides how it publishes)."""
    return os.environ.get("DICE_SHARED_OUTPUTS") == "1"


class SharingFailed(Exception):
    """A driver or system call on the way failed."""


class Refused(Exception):
    """What a candidate's header says of its shared output does not hold: its failure."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DeviceBytes:
    """Device bytes as torch reads them (`__cuda_array_interface__`), without a copy."""

    def __init__(self, address, nbytes, readonly):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "strides": None, "data": (address, readonly), "version": 3}


@functools.cache
def _cuda():
    return ctypes.CDLL("libcuda.so.1")


def _check(result, what):
    if result != 0:
        raise SharingFailed(f"{what} failed (CUresult {result})")


def _prop(device):
    prop = _AllocProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, device)
    return prop


class _Mapping:
    """An allocation handle mapped at a reserved address range of this process with the first
    of `access` (CU_MEM_ACCESS_FLAGS_*) the driver grants; `close` unmaps it and gives both
    back."""

    def __init__(self, handle, size, device, access):
        lib = _cuda()
        self.handle, self.size = handle, size
        self.address = ctypes.c_uint64()
        _check(lib.cuMemAddressReserve(ctypes.byref(self.address), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "reserving an address range")
        try:
            _check(lib.cuMemMap(self.address, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)), "mapping the shared output")
            try:
                results = []
                for flags in access:
                    desc = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, device), flags)
                    results.append(lib.cuMemSetAccess(self.address, ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1)))
                    if results[-1] == 0:
                        break
                _check(results[-1], f"setting access to the shared output (results {results})")
            except SharingFailed:
                lib.cuMemUnmap(self.address, ctypes.c_size_t(size))
                raise
        except SharingFailed:
            lib.cuMemAddressFree(self.address, ctypes.c_size_t(size))
            lib.cuMemRelease(handle)
            raise

    def close(self):
        lib = _cuda()
        lib.cuMemUnmap(self.address, ctypes.c_size_t(self.size))
        lib.cuMemAddressFree(self.address, ctypes.c_size_t(self.size))
        lib.cuMemRelease(self.handle)


# What this (candidate's) process shares until `release`: (mapping, descriptor) of each export.
_held = []


def export(t):
    """The header entry's "shared" part for device tensor `t`, its values copied (C order, as a
    published file holds them) into exportable device memory held until `release`; None where
    this process cannot share it."""
    if not t.is_cuda:
        return None
    nbytes = t.numel() * t.element_size()
    device = t.device.index if t.device.index is not None else torch.cuda.current_device()
    try:
        lib = _cuda()
        prop = _prop(device)
        granularity = ctypes.c_size_t()
        _check(lib.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(prop), 0), "asking the allocation granularity")
        size = -(-nbytes // granularity.value) * granularity.value
        handle = ctypes.c_uint64()
        _check(lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)), "allocating shared device memory")
        mapping = _Mapping(handle, size, device, (CU_MEM_ACCESS_FLAGS_PROT_READWRITE,))
        try:
            torch.cuda.synchronize(t.device)
            # One copy straight from `t`'s layout: a contiguous copy of a strided output first
            # would hold its size once more on the device.
            target = torch.as_tensor(DeviceBytes(mapping.address.value, nbytes, False), device=t.device)
            target.view(t.dtype).view(t.shape).copy_(t)
            torch.cuda.synchronize(t.device)
            fd = ctypes.c_int()
            _check(lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, ctypes.c_ulonglong(0)), "exporting the shared output")
        except BaseException:
            mapping.close()
            raise
    except (OSError, SharingFailed, RuntimeError):
        return None
    _held.append((mapping, fd.value))
    return {"pid": os.getpid(), "fd": fd.value, "size": size}


def release():
    """Gives back everything `export` holds (the judge has read it: the evaluator asks for the
    next step only after the judgement)."""
    while _held:
        mapping, fd = _held.pop()
        os.close(fd)
        mapping.close()


def valid_entry(shared):
    """Whether a header's "shared" part has the form `export` gives it."""
    return isinstance(shared, dict) and all(type(shared.get(k)) is int and shared[k] >= 0 for k in ("pid", "fd", "size"))


def _children(pid):
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return found


def _namespace_pid(pid):
    """The PID of host process `pid` in its innermost PID namespace, from /proc's NSpid."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def owned_process(owner, pid):
    """The host PID of the process below `owner` (the evaluator's candidate process, itself
    included) that sees itself as `pid`, or None."""
    pending, seen = [owner], set()
    while pending:
        p = pending.pop()
        if p in seen:
            continue
        seen.add(p)
        if _namespace_pid(p) == pid:
            return p
        pending += _children(p)
    return None


class Imported:
    """A candidate's shared output (`export`'s entry) mapped read-only in this (the judge's)
    process, from its process below `owner`; `chunks` copies it out a part at a time."""

    def __init__(self, owner, shared, nbytes, device):
        if shared["size"] < nbytes or shared["size"] > 2 * nbytes + (64 << 20):
            raise Refused("the shared output's size does not match its tensor's")
        host_pid = owned_process(owner, shared["pid"])
        if host_pid is None:
            raise Refused("the shared output is not held by the program's own process")
        libc = ctypes.CDLL(None, use_errno=True)
        pidfd = libc.syscall(ctypes.c_long(SYS_PIDFD_OPEN), ctypes.c_int(host_pid), ctypes.c_uint(0))
        if pidfd < 0:
            raise Refused("the program's process holding its shared output is gone")
        fd = libc.syscall(ctypes.c_long(SYS_PIDFD_GETFD), ctypes.c_int(pidfd), ctypes.c_int(shared["fd"]), ctypes.c_uint(0))
        os.close(pidfd)
        if fd < 0:
            raise Refused(f"the shared output's descriptor cannot be taken: {os.strerror(ctypes.get_errno())}")
        self.device = device
        self.nbytes = nbytes
        try:
            lib = _cuda()
            handle = ctypes.c_uint64()
            _check(lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "importing the shared output")
            index = device.index if device.index is not None else torch.cuda.current_device()
            # Read-only where the driver maps device memory so; the judge only copies out of it.
            access = (CU_MEM_ACCESS_FLAGS_PROT_READ, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            self.mapping = _Mapping(handle, shared["size"], index, access)
        except SharingFailed as e:
            raise Refused(f"the shared output cannot be read: {e}") from None
        finally:
            os.close(fd)

    def chunks(self, dtype, elements):
        """The output's values, flat, `elements` at a time, each copied into one buffer of this
        process (valid until the next chunk): what is compared is a copy the candidate's process
        cannot change."""
        source = torch.as_tensor(DeviceBytes(self.mapping.address.value, self.nbytes, True), device=self.device)
        step = min(elements * dtype.itemsize, self.nbytes)
        buffer = torch.empty(step, dtype=torch.uint8, device=self.device)
        for start in range(0, self.nbytes, step):
            part = source[start : start + step]
            buffer[: part.numel()].copy_(part)
            yield buffer[: part.numel()].view(dtype)

    def close(self):
        torch.cuda.synchronize(self.device)
        self.mapping.close()
