"""torch C++/CUDA extension builds, through the evaluator's content-addressed cache.

Wraps torch.utils.cpp_extension.load_inline and load in candidate processes. An extension is
described by everything that changes the binary (sources, function list, name, every flag); its
key is the SHA-256 of that description, the compiler identity (and nvcc's), the torch build,
TORCH_CUDA_ARCH_LIST and the platform. The evaluator computes the same key (src/build_cache.rs)
and alone writes the shared cache: in the compile stage a candidate's call sends the description
and waits for the evaluator's answer, then imports the published library read-only. A builder
job (`build_extension`, run by the evaluator as a user of its own) compiles a missing one and
loads it once. In the run stage a candidate only reads the shared cache; an extension first
loaded there is built in its own job folder.
"""

import contextlib
import hashlib
import inspect
import json
import os
import platform
import re
import shlex
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
# Headers beside a `load`ed source travel with it, so relative includes keep working in the
# builder's own folder.
HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".cuh", ".inl")
MAX_HEADERS = 64
LOG_CHARS = 16384
# A failure mentioning one of these is the machine's fault, so it is not cached.
TRANSIENT_FAILURES = ("Killed", "No space left", "Cannot allocate memory", "Resource temporarily")
TOOLCHAIN = {}
# A light build first: candidates' sources include torch/extension.h (the whole C++ frontend and
# pybind11) where their kernels and launchers need torch/types.h (tensors, ATen, the factories),
# and nvcc's three front ends (cudafe++, cicc, the host compiler) each parse all of it: pair 0's
# .cu took 67.6 s as written and 25.2 s with the include made torch/types.h
# (bench/notes/build-speed.md). Rewritten: load_inline's CUDA sources (torch compiles them apart
# from the generated bindings), and the C++/CUDA sources of a `load` the builder wrote itself;
# never a source that binds (pybind11 needs the whole header). Where the light text fails to
# build, the sources as written are built in the same folder (ninja recompiles only what
# changed), so no verdict depends on it.
EXTENSION_INCLUDE = re.compile(r'^([ \t]*#[ \t]*include[ \t]*)[<"]torch/extension\.h[>"]', re.M)
LIGHT_SUFFIXES = (".cu", ".cpp", ".cc", ".cxx")


class BuildFailed(Exception):
    """An extension failed to compile or link."""


class State:
    cache_dir = None
    channel = None
    # Compile stage: the evaluator builds; run stage: this process builds privately.
    evaluator_builds = False
    failed = False


def probe_toolchain(with_cuda):
    TOOLCHAIN.update(
        cxx=_version_of([os.environ.get("CXX", "c++"), "--version"]),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        python=sys.version,
        # The OS and C library, not the kernel's release (platform.platform() has it): hosts that
        # share a cache run other kernels, which build the same binaries.
        platform="-".join([platform.system(), *platform.libc_ver()]),
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


def install(cache_dir, channel, evaluator_builds):
    from torch.utils import cpp_extension

    State.cache_dir = cache_dir
    State.channel = channel
    State.evaluator_builds = evaluator_builds
    ORIGINAL.update(load_inline=cpp_extension.load_inline, load=cpp_extension.load, module=cpp_extension)
    cpp_extension.load_inline = load_inline
    cpp_extension.load = load


def load_inline(*args, **kwargs):
    return _cached("load_inline", args, kwargs)


def load(*args, **kwargs):
    return _cached("load", args, kwargs)


def _cached(kind, args, kwargs):
    bound = inspect.signature(ORIGINAL[kind]).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    name = arguments["name"]
    try:
        extension = describe(kind, arguments)
    except BuildFailed:
        State.failed = True
        raise
    if State.evaluator_builds:
        State.channel.send(event="build_request", extension=extension)
        reply = next((op for op in State.channel.ops() if op["op"] == "built"), None)
        if reply is None:
            raise SystemExit(1)  # the evaluator hung up
        if not reply["ok"]:
            _fail(name, reply["log"])
        return _load(os.path.join(State.cache_dir, reply["key"]), name, arguments)
    key = content_key(extension)
    shared = os.path.join(State.cache_dir, key)
    hit = _lookup(shared, key, name, arguments)
    if hit is not None:
        return hit
    private = os.path.join(os.getcwd(), "build-cache", key)
    hit = _lookup(private, key, name, arguments)
    if hit is not None:
        return hit
    return _build_privately(kind, key, private, arguments)


def describe(kind, arguments):
    """What decides the binary, as plain JSON: a `load`'s sources travel by content."""
    material = {k: v for k, v in arguments.items() if k not in VOLATILE_ARGS}
    sources = {}
    if kind == "load":
        paths = [material["sources"]] if isinstance(material["sources"], str) else list(material["sources"])
        material["sources"] = [os.path.basename(p) for p in paths]
        for path in paths + _headers_beside(paths):
            name = os.path.basename(path)
            if name in sources:
                raise BuildFailed(f"two sources of extension `{arguments['name']}` are named {name}")
            sources[name] = _read_text(path)
    return json.loads(json.dumps({"kind": kind, "arguments": material, "sources": sources}, default=str))


def _headers_beside(paths):
    folders = {os.path.dirname(os.path.abspath(p)) for p in paths}
    names = {os.path.abspath(p) for p in paths}
    headers = []
    for folder in sorted(folders):
        try:
            entries = sorted(os.listdir(folder))
        except OSError:
            continue
        for entry in entries:
            path = os.path.join(folder, entry)
            if entry.endswith(HEADER_SUFFIXES) and path not in names and os.path.isfile(path):
                headers.append(path)
    return headers[:MAX_HEADERS]


def _read_text(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode()
    except (OSError, UnicodeDecodeError) as e:
        raise BuildFailed(f"cannot read the source {path} as UTF-8 text: {e}") from None


def content_key(extension):
    """The key src/build_cache.rs computes from the same description: keep the two identical."""
    material = {
        "extension": extension,
        "toolchain": TOOLCHAIN,
        "arch": os.environ.get("TORCH_CUDA_ARCH_LIST"),
        "cxx": os.environ.get("CXX"),
    }
    blob = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def _lookup(entry, key, name, arguments):
    """The cached result for a key: the imported module, a BuildFailed, or None when absent (a
    build that timed out counts as absent: this process builds it within its own limit)."""
    try:
        with open(os.path.join(entry, "DICE_RESULT.json")) as f:
            result = json.load(f)
    except FileNotFoundError:
        return None
    if result.get("timed_out"):
        return None
    _report(key, name, result["ok"], 0.0, True, result.get("log", ""))
    if not result["ok"]:
        _fail(name, result.get("log", ""))
    return _load(entry, name, arguments)


def _load(entry, name, arguments):
    if arguments.get("is_standalone"):
        return os.path.join(entry, name)
    return ORIGINAL["module"]._import_module_from_library(name, entry, arguments["is_python_module"])


def _fail(name, log):
    State.failed = True
    print(log, file=sys.stderr)
    raise BuildFailed(f"extension `{name}` failed to build: {first_error(log)}")


def _build_privately(kind, key, entry, arguments):
    """A run-stage build, in this job's folder: no one else reads it."""
    name = arguments["name"]
    State.channel.send(event="build_start", key=key, name=name)
    tmp = entry + ".building"
    shutil.rmtree(tmp, ignore_errors=True)  # left by an import that failed after its build
    os.makedirs(tmp)
    started = time.monotonic()
    try:
        module = build_light_first(ORIGINAL[kind], kind, arguments, tmp)
    except Exception as e:
        log = str(e)
        if not _is_build_failure(e):
            raise
        _report(key, name, False, time.monotonic() - started, False, log)
        if not any(t in log for t in TRANSIENT_FAILURES):
            _write_result(tmp, {"key": key, "ok": False, "log": log})
            os.rename(tmp, entry)
        _fail(name, log)
    _write_result(tmp, {"key": key, "ok": True})
    os.rename(tmp, entry)
    _report(key, name, True, time.monotonic() - started, False, "")
    return module


def light_source(text):
    """A source with its torch/extension.h includes made torch/types.h, unless it binds."""
    return text if "PYBIND11" in text else EXTENSION_INCLUDE.sub(r"\1<torch/types.h>", text)


def build_light_first(build, kind, arguments, folder, written=None):
    """build(**arguments) into `folder` (load_inline or load), light first where that changes a
    source; `written`: for a `load`, {path: text} of the sources this process wrote there (a
    candidate's own files are never rewritten)."""
    if arguments.get("use_pch"):
        # torch's own precompiled header is written into torch's installation, which no builder
        # may write: the build would fail where KernelBench's harness builds it. It changes how
        # fast the host code compiles, never the binary; the evaluator's pch serves it instead.
        arguments = dict(arguments, use_pch=False)
    run = lambda args: build(**dict(args, build_directory=folder, verbose=False))  # noqa: E731
    light, rewrites = dict(arguments), {}
    if kind == "load_inline" and arguments.get("cuda_sources"):
        sources = arguments["cuda_sources"]
        sources = [sources] if isinstance(sources, str) else list(sources)
        light["cuda_sources"] = [light_source(s) for s in sources]
        changed = light["cuda_sources"] != sources
    else:
        rewrites = {p: light_source(t) for p, t in (written or {}).items() if p.endswith(LIGHT_SUFFIXES)}
        rewrites = {p: t for p, t in rewrites.items() if t != written[p]}
        changed = bool(rewrites)
    if not changed:
        return run(arguments)
    _write_texts(rewrites)
    try:
        return run(light)
    except Exception as e:
        if not _is_build_failure(e) or any(t in str(e) for t in TRANSIENT_FAILURES):
            raise
    from torch.utils import cpp_extension

    # torch names a second build of one name in a process name_v1: forget the first.
    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(arguments["name"], None)
    _write_texts({p: written[p] for p in rewrites})
    return run(arguments)


def _write_texts(texts):
    for path, text in texts.items():
        with open(path, "w") as f:
            f.write(text)


def _is_build_failure(e):
    return isinstance(e, RuntimeError) and str(e).startswith("Error building extension")


def _write_result(folder, result):
    with open(os.path.join(folder, "DICE_RESULT.json"), "w") as f:
        json.dump(result, f)


def first_error(log):
    for line in log.splitlines():
        if "error" in line.lower() and not line.startswith("Error building extension"):
            return line.strip()[:300]
    return "see the log"


def _report(key, name, ok, wall, cached, log):
    State.channel.send(event="build", key=key, name=name, ok=ok, wall_s=wall, cached=cached, log=log[-LOG_CHARS:])


def build_extension(channel, req):
    """The builder job: compiles one described extension in its own job folder, then loads it
    once (its static initialisers run here, where the evaluator bounds them). It runs no
    candidate Python, and can write no cache entry: the evaluator publishes what it leaves.
    With `pch` (a published folder of `build_pch`), main.cpp finds the precompiled
    torch/extension.h there first; GCC reads the header itself wherever the pch does not fit
    (`-Winvalid-pch` only warns), so the binary is the same either way."""
    from torch.utils import cpp_extension

    extension = req["extension"]
    kind = extension["kind"]
    arguments = dict(extension["arguments"])
    folder = req["dir"]
    if req.get("pch"):
        arguments["extra_cflags"] = [*(arguments.get("extra_cflags") or []), f"-I{req['pch']}", "-Winvalid-pch"]
    written = {}
    if kind == "load":
        sources = os.path.join(folder, "sources")
        os.makedirs(sources)
        written = {os.path.join(sources, os.path.basename(n)): t for n, t in extension["sources"].items()}
        _write_texts(written)
        arguments["sources"] = [os.path.join(sources, os.path.basename(s)) for s in arguments["sources"]]
    import_library = cpp_extension._import_module_from_library
    # torch loads what it built; here that waits until the evaluator has heard "compiled".
    cpp_extension._import_module_from_library = lambda name, path, is_python_module: None
    started = time.monotonic()
    try:
        build_light_first(getattr(cpp_extension, kind), kind, arguments, folder, written)
    except Exception as e:
        if not _is_build_failure(e):
            raise
        log = str(e)[-LOG_CHARS:]
        transient = any(t in log for t in TRANSIENT_FAILURES)
        channel.send(event="compiled", ok=False, log=log, transient=transient, wall_s=time.monotonic() - started)
        return
    finally:
        cpp_extension._import_module_from_library = import_library
    channel.send(event="compiled", ok=True, log="", wall_s=time.monotonic() - started, pch_used=req.get("pch") is not None and _read_pch(folder))
    if not arguments.get("is_standalone"):
        # An import that fails here fails the same way in the candidate, which gets its verdict.
        with contextlib.suppress(Exception):
            import_library(arguments["name"], folder, arguments["is_python_module"])
    channel.send(event="loaded")


# The header a pch is made of, as load_inline's main.cpp includes it first.
PCH_HEADER = ("torch", "extension.h")


def build_pch(channel, req):
    """The pch job: torch/extension.h compiled into `<dir>/pch/torch/extension.h.gch` with the
    flags torch gives a load_inline's main.cpp for `extra_cflags` and `with_cuda`, minus the
    extension's name (GCC refuses a pch built with another value of a command-line macro, and
    torch's headers never read it), so one pch serves every extension of that flag set. A copy
    of the header sits beside it: a program that includes torch/extension.h again after
    main.cpp's own line makes GCC open the header where it found the pch. The evaluator decides
    which flags may go into a pch (src/build_cache.rs) and publishes the folder; this job only
    compiles torch's own header."""
    from torch.utils import cpp_extension

    folder = req["dir"]
    target = os.path.join(folder, "pch", *PCH_HEADER[:-1])
    os.makedirs(target)
    probe = os.path.join(folder, "probe.ninja")
    cpp_extension._write_ninja_file_to_build_library(
        probe, "dice_pch", [os.path.join(folder, "main.cpp")], list(req["extra_cflags"]),
        [], [], [], [], bool(req["with_cuda"]), False, False)
    variables = {}
    with open(probe) as f:
        for line in f:
            if " = " in line and not line.startswith(" "):
                name, value = line.rstrip("\n").split(" = ", 1)
                variables[name] = value
    cflags = [f for f in shlex.split(variables["cflags"]) if not f.startswith("-DTORCH_EXTENSION_NAME=")]
    header = os.path.join(target, PCH_HEADER[-1])
    shutil.copyfile(os.path.join(cpp_extension.include_paths()[0], *PCH_HEADER), header)
    command = [variables["cxx"], *cflags, "-x", "c++-header", header, "-o", header + ".gch",
               *shlex.split(variables.get("post_cflags", ""))]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    log = f"{shlex.join(command)}\n{done.stdout}{done.stderr}"[-LOG_CHARS:]
    channel.send(event="compiled", ok=done.returncode == 0, log=log,
                 transient=any(t in log for t in TRANSIENT_FAILURES), wall_s=time.monotonic() - started)


def _read_pch(folder):
    """Whether main.cpp's compile read the pch: its recorded dependencies then hold no header of
    torch's (GCC lists what it parsed, and a pch stands for all of it)."""
    try:
        deps = subprocess.run(["ninja", "-t", "deps", "main.o"], cwd=folder, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "main.cpp" in deps and "/".join(PCH_HEADER) not in deps
