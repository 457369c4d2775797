"""Content-addressed cache of torch C++/CUDA extension builds.

Wraps torch.utils.cpp_extension.load_inline and load. The key is the SHA-256 of everything that
changes the binary: sources, function list, name, every flag, the compiler identity (and nvcc's),
the torch build, TORCH_CUDA_ARCH_LIST and the platform. A build runs in a private temporary
directory under an flock on its key and is renamed into <cache>/<key>/ only when complete, so
concurrent builds of one key never collide and a killed build never leaves a half entry. A hit
imports the built library directly, without ninja. Deterministic build failures are cached too,
so the same broken code is never compiled twice.
"""

import fcntl
import glob
import hashlib
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import torch

# Filled by install(): torch.utils.cpp_extension is imported only in children, because its import
# asks torch.cuda.is_available(), which would initialise CUDA in the fork server.
ORIGINAL = {}
# Arguments that only change where or how loudly a build happens, not the binary.
VOLATILE_ARGS = {"build_directory", "verbose", "keep_intermediates"}
# A failure mentioning one of these is the machine's fault, so it is not cached.
TRANSIENT_FAILURES = ("Killed", "No space left", "Cannot allocate memory", "Resource temporarily")
TOOLCHAIN = {}


class BuildFailed(Exception):
    """An extension failed to compile or link."""


class State:
    cache_dir = None
    channel = None
    failed = False


def probe_toolchain(with_cuda):
    TOOLCHAIN.update(
        cxx=_version_of([os.environ.get("CXX", "c++"), "--version"]),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        python=sys.version,
        platform=platform.platform(),
        machine=platform.machine(),
    )
    if with_cuda:
        TOOLCHAIN["nvcc"] = _version_of([os.path.join(_cuda_home(), "bin", "nvcc"), "--version"])


def _cuda_home():
    """Where torch.utils.cpp_extension will look for CUDA (its _find_cuda_home, minus CUDA calls)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(nvcc)) if nvcc else "/usr/local/cuda"


def _version_of(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable: {e}"


def install(cache_dir, channel):
    from torch.utils import cpp_extension

    State.cache_dir = cache_dir
    State.channel = channel
    ORIGINAL.update(load_inline=cpp_extension.load_inline, load=cpp_extension.load, module=cpp_extension)
    cpp_extension.load_inline = load_inline
    cpp_extension.load = load


def load_inline(*args, **kwargs):
    return _cached("load_inline", args, kwargs)


def load(*args, **kwargs):
    return _cached("load", args, kwargs)


def _cached(kind, args, kwargs):
    original = ORIGINAL[kind]
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    name = arguments["name"]
    key = _key(kind, arguments)
    entry = os.path.join(State.cache_dir, key)
    hit = _lookup(entry, name, arguments)
    if hit is not None:
        return hit
    root = _writable_root()
    entry = os.path.join(root, key)
    State.channel.send(event="build_start", key=key, name=name)
    os.makedirs(os.path.join(root, "locks"), exist_ok=True)
    with open(os.path.join(root, "locks", key), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        hit = _lookup(entry, name, arguments)
        if hit is not None:
            return hit
        return _build(original, key, root, entry, arguments)


def _writable_root():
    """The shared cache, or where run-stage children (which may only read it) build instead: a
    private cache in the job directory, gone with the job."""
    if os.access(State.cache_dir, os.W_OK):
        return State.cache_dir
    return os.path.join(os.getcwd(), "build-cache")


def _key(kind, arguments):
    material = {k: v for k, v in arguments.items() if k not in VOLATILE_ARGS}
    if kind == "load":
        sources = material["sources"]
        paths = [sources] if isinstance(sources, str) else list(sources)
        material["sources"] = [(os.path.basename(p), _file_digest(p)) for p in paths]
    material.update(
        kind=kind,
        toolchain=TOOLCHAIN,
        arch=os.environ.get("TORCH_CUDA_ARCH_LIST"),
        cxx=os.environ.get("CXX"),
    )
    blob = json.dumps(material, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()


def _file_digest(path):
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        return f"unreadable: {e}"


def _lookup(entry, name, arguments):
    """The cached result for a key: the imported module, a BuildFailed, or None when absent."""
    marker = os.path.join(entry, "DICE_RESULT.json")
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        result = json.load(f)
    _report(result["key"], name, result["ok"], 0.0, True, result.get("log", ""))
    if not result["ok"]:
        State.failed = True
        print(result.get("log", ""), file=sys.stderr)
        raise BuildFailed(f"extension `{name}` failed to build: {first_error(result.get('log', ''))}")
    if arguments.get("is_standalone"):
        return os.path.join(entry, name)
    return ORIGINAL["module"]._import_module_from_library(name, entry, arguments["is_python_module"])


def _build(original, key, root, entry, arguments):
    name = arguments["name"]
    tmp_root = os.path.join(root, "tmp")
    for stale in glob.glob(os.path.join(tmp_root, key + ".*")):
        shutil.rmtree(stale, ignore_errors=True)  # left by a killed build; we hold the key's lock
    tmp = os.path.join(tmp_root, f"{key}.{os.getpid()}")
    os.makedirs(tmp)
    args = dict(arguments, build_directory=tmp, verbose=False, keep_intermediates=True)
    started = time.monotonic()
    try:
        module = original(**args)
    except Exception as e:
        log = str(e)
        if not (isinstance(e, RuntimeError) and log.startswith("Error building extension")):
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        wall = time.monotonic() - started
        State.failed = True
        _report(key, name, False, wall, False, log)
        if any(t in log for t in TRANSIENT_FAILURES):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _commit(tmp, entry, {"key": key, "ok": False, "log": log})
        print(log, file=sys.stderr)
        raise BuildFailed(f"extension `{name}` failed to build: {first_error(log)}") from None
    wall = time.monotonic() - started
    _commit(tmp, entry, {"key": key, "ok": True, "wall_s": wall})
    _report(key, name, True, wall, False, "")
    return module


def first_error(log):
    for line in log.splitlines():
        if "error" in line.lower() and not line.startswith("Error building extension"):
            return line.strip()[:300]
    return "see the log"


def _commit(tmp, entry, result):
    with open(os.path.join(tmp, "DICE_RESULT.json"), "w") as f:
        json.dump(result, f)
    os.rename(tmp, entry)


def _report(key, name, ok, wall, cached, log):
    State.channel.send(event="build", key=key, name=name, ok=ok, wall_s=wall, cached=cached, log=log[-16384:])
