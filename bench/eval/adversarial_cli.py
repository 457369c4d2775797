"""The GPU programs of tests/adversarial for `dice eval` alone, where the dice-cli test binary
(`every_gpu_hack_is_caught_by_dice_eval`) is not at hand: `prepare` writes them as candidates
(sample id = the program's index in manifest.json) and their problems with module-level sizes
capped at 64, as the test shrinks them; `check` reads `dice report --format json` of the run and
prints each program's verdict, flags and speedup beside the manifest's expectation, with the
test's rule of "caught" (crates/dice-cli/tests/it/adversarial_eval.rs), exiting 1 if one is not.

    python3 bench/eval/adversarial_cli.py prepare CANDIDATES_DIR KERNELBENCH_DIR
    python3 bench/eval/adversarial_cli.py check REPORT.json
"""

import json
import pathlib
import re
import sys

MANIFEST = pathlib.Path("tests/adversarial/manifest.json")
SHRUNK = 64


def shrink(source):
    """Caps the integers of top-level assignments (not of names like conv3d) at SHRUNK."""
    def cap(line):
        return re.sub(r"(?<![A-Za-z0-9_.])\d+", lambda m: str(min(int(m.group()), SHRUNK)), line)
    top_level = re.compile(r"^[A-Za-z].* = ")
    return "".join(
        cap(line) if top_level.match(line) and not line.startswith(("def ", "class ")) else line
        for line in source.splitlines(keepends=True)
    )


def gpu_programs():
    return [(i, e) for i, e in enumerate(json.loads(MANIFEST.read_text())) if e["device"] == "cuda"]


def prepare(candidates, tree):
    candidates, tree = pathlib.Path(candidates), pathlib.Path(tree)
    for i, e in gpu_programs():
        level, pid = e["level"], e["problem_id"]
        (candidates).mkdir(parents=True, exist_ok=True)
        (candidates / f"level_{level}_problem_{pid}_sample_{i}_kernel.py").write_text(
            (MANIFEST.parent / e["file"]).read_text())
        source = next(pathlib.Path(f"tests/data/kernelbench/level{level}").glob(f"{pid}_*.py"))
        (tree / f"level{level}").mkdir(parents=True, exist_ok=True)
        (tree / f"level{level}" / source.name).write_text(shrink(source.read_text()))


def caught(expect, s):
    # An output cache right for every input runs to `correct` at its kernel's speed; any other
    # verdict means the program itself broke (as crates/dice-cli/tests/it/adversarial_eval.rs).
    if "speedup_at_most" in expect:
        return s["verdict"] == "correct" and s.get("speedup") is not None and s["speedup"] <= expect["speedup_at_most"]
    if s["verdict"] != "correct":
        return True
    rule = expect.get("rule") or expect.get("runtime_rule")
    flagged = rule in s["flags"]
    if expect.get("severity") == "warning":
        return flagged and not s["deceptive"]
    return s["deceptive"] and flagged


def check(report):
    samples = {s["sample_id"]: s for s in json.load(open(report))["samples"]}
    missed = 0
    for i, e in gpu_programs():
        s = samples.get(i)
        if s is None:
            print(f"{e['file']:<38} NO RESULT")
            missed += 1
            continue
        ok = caught(e["expect"], s) and (
            "runtime_rule" not in e["expect"] or e["expect"]["runtime_rule"] in s["flags"])
        missed += not ok
        print(f"{e['file']:<38} {'caught' if ok else 'MISSED':<7} {s['verdict']:<16} "
              f"deceptive={s['deceptive']} flags={s['flags']} speedup={s.get('speedup')} "
              f"expect={e['expect']}")
    print(f"{missed} of {len(gpu_programs())} not caught")
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    {"prepare": prepare, "check": check}[sys.argv[1]](*sys.argv[2:])
