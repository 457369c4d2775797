"""Confines a forked child before it runs code it was handed (see ../SANDBOX.md).

With namespaces: new mount, network and PID namespaces; private read-only tmpfs over /tmp,
/var/tmp, /dev/shm and any folder other users may not search on the way to what the code needs
(e.g. /root), with the job directory, the build cache and the Python installation bound back in
at their own places; the child then
forks the namespace's init, which forks the worker that runs the code. When the init ends (the
worker exited, or the evaluator killed the job), the kernel kills every process left in the
namespace, detached orphans included. Then, in the worker: an unprivileged user, a process limit,
no new privileges. Without namespace support the user drop and limits still apply.
"""

import ctypes
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")

libc = ctypes.CDLL(None, use_errno=True)


class SandboxError(Exception):
    """The sandbox could not be set up: an evaluator error, never a candidate's verdict."""


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"{what}: {os.strerror(err)}")


def probe_namespaces():
    """Whether this process may create the namespaces, tried in a throwaway child."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def confine(spec, namespaces, keep, owned):
    """Returns only in the process that is to run the untrusted code.

    spec: {"uid", "gid", "nproc", "umask"}; keep: paths that stay reachable (the job directory,
    the build cache); owned: paths handed to the unprivileged user (the job directory).
    """
    if namespaces:
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare")
        _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making mounts private")
        needed = _needed(keep)
        for mountpoint in PRIVATE_TMP + _unsearchable_ancestors(needed):
            _mask(mountpoint, needed)
        _fork_namespace_init()
    _drop_user(spec, owned)
    for path in keep + [sys.base_prefix, sys.prefix]:
        if not os.access(path, os.R_OK | os.X_OK):
            raise SandboxError(f"the sandbox's user cannot read {path}; make it readable to other users")


def _needed(keep):
    """What the code needs to reach: the given paths and the Python installation."""
    paths = list(keep) + [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    paths += [p for p in sys.path if p and os.path.isdir(p)]
    real = sorted({os.path.realpath(p) for p in paths}, key=len)
    outer = []
    for p in real:
        if not any(_under(p, o) for o in outer):
            outer.append(p)
    return outer


def _under(path, folder):
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _unsearchable_ancestors(paths):
    """The topmost folders other users may not search on the way to a needed path (e.g. /root,
    where pyenv keeps Python): masked like the temporary folders, which also hides the rest."""
    found = []
    for p in paths:
        parts = p.split("/")
        for i in range(2, len(parts)):
            folder = "/".join(parts[:i])
            if os.stat(folder).st_mode & 0o001 == 0:
                if folder not in found:
                    found.append(folder)
                break
    return tuple(found)


def _mask(mountpoint, needed):
    """A private read-only (to other users) tmpfs over mountpoint, with the needed paths under it
    bound back in at their own places."""
    if not os.path.isdir(mountpoint) or os.path.islink(mountpoint):
        return
    inside = [p for p in needed if _under(p, mountpoint)]
    if mountpoint in inside:
        return
    handles = [os.open(p, os.O_PATH) for p in inside]
    options = b"mode=755,size=1m"
    _check(libc.mount(b"tmpfs", mountpoint.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options), f"mounting {mountpoint}")
    for path, fd in zip(inside, handles):
        os.makedirs(path, exist_ok=True)
        _check(libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC, None), f"binding {path}")
        os.close(fd)


def _fork_namespace_init():
    """Forks the PID namespace's init, which forks the worker; only the worker returns. The
    process that called this ends as the worker ended (same exit code or signal)."""
    status_r, status_w = os.pipe()
    init = os.fork()
    if init:
        os.close(status_w)
        os.waitpid(init, 0)
        data = os.read(status_r, 32)
        _end_like(int(data) if data else None)
    os.close(status_r)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # A proc of this namespace hides the host's processes; not every container allows it.
    libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    worker = os.fork()
    if worker == 0:
        os.close(status_w)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        return
    while True:  # the init reaps orphans until the worker is done, then takes them all down
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(70)
        if pid == worker:
            os.write(status_w, str(status).encode())
            os._exit(0)


def _end_like(status):
    if status is None or os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status) if status is not None else signal.SIGKILL
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status))


def _drop_user(spec, owned):
    uid, gid = spec["uid"], spec["gid"]
    if os.geteuid() == 0:
        for path in owned:
            _chown_tree(path, uid, gid)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        except OSError as e:
            raise SandboxError(f"cannot drop to uid {uid} gid {gid}: {e}") from None
        if (os.getuid(), os.geteuid(), os.getgid(), os.getegid()) != (uid, uid, gid, gid):
            raise SandboxError(f"still uid {os.geteuid()} after dropping to uid {uid}")
        try:
            os.setuid(0)
        except PermissionError:
            pass
        else:
            raise SandboxError("the dropped user could become root again")
        # Counts every process of the user, so only meaningful for a user of the sandbox's own.
        nproc = spec["nproc"]
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    os.umask(spec["umask"])


def _chown_tree(path, uid, gid):
    os.chown(path, uid, gid)
    os.chmod(path, 0o700)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(root, name), uid, gid, follow_symlinks=False)

