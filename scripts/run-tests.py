#!/usr/bin/env python3
"""Runs the workspace's test binaries concurrently (scripts/test.sh calls it).

`cargo test` runs one test binary after another. Most of the suite's time is tests waiting on
compilers and Python worker processes, so on a small machine one binary at a time leaves it idle.
This builds every test target once (`cargo test --no-run`), then runs the binaries side by side,
each in its package's folder with the environment cargo gives it, the longest first (durations of
the last run are kept in the target folder), and the doctests after. Each binary's output is
printed whole when it ends, so the libtest lines of one binary stay together; the last line
counts passed, failed and ignored (skipped, with the reason libtest prints) tests over all.

usage: scripts/run-tests.py [--jobs N] [cargo build args...] [-- test binary args...]
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

RESULT = re.compile(
    r"^test result: (ok|FAILED)\. (\d+) passed; (\d+) failed; (\d+) ignored; \d+ measured; (\d+) filtered out"
)


def parse_args(argv):
    # Each binary already runs its tests on every core (libtest's threads), and most tests
    # start compilers and Python workers of their own: on a small machine more binaries at once
    # only oversubscribe it (measured on 2 cores: 3 at a time took 58 minutes where one at a time
    # took 41, and timing checks grew flaky). Half the cores, at least one.
    jobs = int(os.environ.get("DICE_TEST_JOBS", str(max(1, (os.cpu_count() or 2) // 2))))
    cargo, binary = [], []
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if arg == "--":
            binary = rest
            break
        if arg == "--jobs":
            jobs = int(rest.pop(0))
        elif arg.startswith("--jobs="):
            jobs = int(arg.split("=", 1)[1])
        elif arg == "--no-fail-fast":
            pass  # every binary runs to its end anyway
        else:
            cargo.append(arg)
    return max(1, jobs), cargo, binary


def build(cargo_args):
    """Builds every test target; returns (name, package dir, executable, package env) per binary."""
    cmd = ["cargo", "test", "--workspace", "--locked", "--no-run",
           "--message-format=json-render-diagnostics", *cargo_args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.exit(proc.returncode)
    binaries = []
    packages = {}
    for line in proc.stdout.splitlines():
        if not line.startswith("{"):
            continue
        msg = json.loads(line)
        if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
            continue
        if not msg["profile"]["test"]:
            continue
        manifest = msg["manifest_path"]
        package = packages.setdefault(manifest, package_env(manifest))
        kind = msg["target"]["kind"][0]
        name = f"{package['CARGO_PKG_NAME']} {kind} {msg['target']['name']}"
        binaries.append((name, os.path.dirname(manifest), msg["executable"], package))
    return binaries


def package_env(manifest):
    """What `cargo test` sets for a test binary at run time that tests may read."""
    text = open(manifest, encoding="utf-8").read()
    found = re.search(r'^name\s*=\s*"([^"]+)"', text, re.M)
    return {
        "CARGO_MANIFEST_DIR": os.path.dirname(manifest),
        "CARGO_PKG_NAME": found.group(1) if found else "",
    }


def run(binary, extra, log_dir):
    name, cwd, exe, package = binary
    env = dict(os.environ, **package)
    start = time.monotonic()
    log = os.path.join(log_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".log")
    with open(log, "w+", encoding="utf-8", errors="replace") as out:
        proc = subprocess.run([exe, *extra], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        out.seek(0)
        text = out.read()
    return name, proc.returncode, time.monotonic() - start, text


def main():
    jobs, cargo_args, extra = parse_args(sys.argv[1:])
    binaries = build(cargo_args)
    target = os.environ.get("CARGO_TARGET_DIR", "target")
    times_path = os.path.join(target, "test-durations.json")
    try:
        last = json.load(open(times_path, encoding="utf-8"))
    except (OSError, ValueError):
        last = {}
    # Longest first, so the slowest binary does not start last and leave the others' slots idle.
    binaries.sort(key=lambda b: -last.get(b[0], 1e9))
    totals = {"passed": 0, "failed": 0, "ignored": 0}
    failed_binaries = []
    durations = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dice-tests-") as log_dir, ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(run, b, extra, log_dir) for b in binaries]
        for future in as_completed(futures):
            name, code, seconds, text = future.result()
            durations[name] = seconds
            print(f"\n===== {name}: exit {code} in {seconds:.1f} s", flush=True)
            print(text, end="", flush=True)
            counted = False
            for line in text.splitlines():
                match = RESULT.match(line)
                if match:
                    counted = True
                    totals["passed"] += int(match.group(2))
                    totals["failed"] += int(match.group(3))
                    totals["ignored"] += int(match.group(4))
            if code != 0 or not counted:
                failed_binaries.append(name)
    os.makedirs(target, exist_ok=True)
    json.dump({**last, **durations}, open(times_path, "w", encoding="utf-8"), indent=1, sort_keys=True)
    print(f"\n{len(binaries)} test binaries in {time.monotonic() - started:.0f} s, {jobs} at a time; "
          "the longest:", flush=True)
    for name, seconds in sorted(durations.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {seconds:7.1f} s  {name}")
    doc = subprocess.run(["cargo", "test", "--workspace", "--locked", "--doc", *cargo_args,
                          "--", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(doc.stdout, end="")
    for line in doc.stdout.splitlines():
        match = RESULT.match(line)
        if match:
            totals["passed"] += int(match.group(2))
            totals["failed"] += int(match.group(3))
            totals["ignored"] += int(match.group(4))
    if doc.returncode != 0:
        failed_binaries.append("doctests")
    if failed_binaries:
        print("\nfailed: " + ", ".join(failed_binaries))
    print(f"\n{totals['passed']} passed, {totals['failed']} failed, {totals['ignored']} skipped")
    sys.exit(1 if failed_binaries else 0)


if __name__ == "__main__":
    main()
