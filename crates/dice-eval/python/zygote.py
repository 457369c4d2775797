"""Fork server: imports torch once (never touching CUDA), then forks one child per job.

Speaks JSON lines with the Rust evaluator on stdin/stdout:
  in:  {"op": "spawn", "job": N, "role": ..., "dir": ..., "fifo": ..., "socket": ..., "env": {...}, ...}
  out: {"event": "ready", ...} once; {"event": "spawned", "job": N, "pid": P};
       {"event": "exited", "job": N, "pid": P, "code": C|null, "signal": S|null}
Children start a new session, so the evaluator can kill a child and everything it started at once.
If the evaluator goes away (stdin closes), every child's session is killed and the zygote exits.
A request with "sandbox" is confined (sandbox.py) before its role runs; "ready" says whether this
machine lets the zygote create namespaces.
"""

import ctypes
import json
import os
import resource
import select
import signal
import socket
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import setuptools  # noqa: E402,F401  (the slow part of torch.utils.cpp_extension's import)
import torch  # noqa: E402  (imported once here so that children start warm; CUDA stays untouched)

import buildcache  # noqa: E402
import roles  # noqa: E402
import sandbox  # noqa: E402

PR_SET_PDEATHSIG = 1


class Sandbox:
    namespaces = False


def main():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctl = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints of the zygote must never reach the control channel
    buildcache.probe_toolchain(os.environ.get("DICE_DEVICE") == "cuda")
    Sandbox.namespaces = sandbox.probe_namespaces()
    ready = {"event": "ready", "torch": torch.__version__, "pid": os.getpid()}
    # The toolchain is part of every build's content key, which the evaluator computes itself.
    send(ctl, dict(ready, namespaces=Sandbox.namespaces, root=os.geteuid() == 0, toolchain=buildcache.TOOLCHAIN))
    children = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            data = os.read(0, 1 << 16)
            if not data:
                kill_all(children)
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line.strip():
                    spawn(ctl, children, json.loads(line))
        reap(ctl, children)


def send(ctl, msg):
    ctl.write(json.dumps(msg) + "\n")


def spawn(ctl, children, req):
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        ready_r, ready_w = os.pipe()
        pid = os.fork()
    except OSError as e:
        print(f"cannot fork job {req['job']}: {e}", file=sys.stderr)
        send(ctl, {"event": "spawned", "job": req["job"], "pid": 0})
        send(ctl, {"event": "exited", "job": req["job"], "pid": 0, "code": 71, "signal": None})
        return
    if pid == 0:
        code = 70
        try:
            os.close(ready_r)
            os.setsid()
            os.write(ready_w, b"1")
            os.close(ready_w)
            child_main(req)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(ready_w)
    os.read(ready_r, 1)  # the child is its own session leader before anyone may kill its group
    os.close(ready_r)
    children[pid] = req["job"]
    send(ctl, {"event": "spawned", "job": req["job"], "pid": pid})


def child_main(req):
    """The one place where a child is confined before it runs anything it was handed."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    out = os.open(req["fifo"], os.O_WRONLY)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.closerange(3, 1 << 16)
    sys.stdout = os.fdopen(1, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    os.chdir(req["dir"])
    os.environ.update(req.get("env", {}))
    tempfile.tempdir = None  # the zygote may have cached its own TMPDIR
    apply_limits(req.get("limits", {}))
    cores = req.get("cores")
    if cores:
        # Off the cores kept for timing (protocol.Timer moves there while it times); builds
        # and everything a child starts inherit this.
        os.sched_setaffinity(0, cores["untimed"])
    if req.get("nice"):
        # The compile stage yields the cores to the run stage (job.rs COMPILE_STAGE_NICENESS).
        os.nice(req["nice"])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(req["socket"])
    channel = roles.Channel(conn)
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    if "sandbox" in req:
        keep = [req["dir"]] + [req[k] for k in ("cache_dir", "pch") if req.get(k)]
        try:
            sandbox.confine(req["sandbox"], Sandbox.namespaces, keep=keep, owned=[req["dir"]])
        except (sandbox.SandboxError, OSError) as e:
            channel.send(event="sandbox_error", message=str(e))
            raise SystemExit(71) from None
    roles.run(req["role"], channel, req)


def apply_limits(limits):
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for name, value in limits.items():
        res = getattr(resource, name)
        _, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(res, (value, value))


def reap(ctl, children):
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        job = children.pop(pid, None)
        if job is None:
            continue
        msg = {"event": "exited", "job": job, "pid": pid, "code": None, "signal": None}
        if os.WIFSIGNALED(status):
            msg["signal"] = os.WTERMSIG(status)
        else:
            msg["code"] = os.WEXITSTATUS(status)
        send(ctl, msg)


def kill_all(children):
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


if __name__ == "__main__":
    main()
