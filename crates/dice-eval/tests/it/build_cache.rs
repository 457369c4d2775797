//! The content-addressed build cache: concurrent builds of one key compile once, evaluating the
//! same code again never compiles, nothing a candidate runs can write an entry, and a build that
//! ran out of time is a stored verdict. Slow: two cold builds (~60 s each on 2 cores) in caches
//! of their own, since what they check is what a cache without the build does.

use crate::common::*;
use dice_eval::{EvalConfig, EvalSample, SampleRecord, Store, Verdict};
use dice_test_support::shared_build_cache;
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Evaluates `samples` in a run of their own on `cache`; the records and builds it stored.
fn evaluate_on(
    cache: &Path,
    samples: Vec<EvalSample>,
    configure: impl FnOnce(&mut EvalConfig),
) -> (Vec<SampleRecord>, Vec<dice_eval::BuildRecord>) {
    let run = tempfile::tempdir().unwrap();
    let mut cfg = test_config(run.path());
    cfg.build_cache = cache.to_path_buf();
    cfg.perf_trials = 0;
    configure(&mut cfg);
    dice_eval::evaluate(cfg, example_problems(), samples, None).unwrap();
    let store = Store::open(&run.path().join("dice.db")).unwrap();
    (store.samples().unwrap(), store.builds().unwrap())
}

/// Every file of the cache's entries with its bytes (the key locks aside, which are empty).
fn cache_contents(cache: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(dir: &Path, root: &Path, files: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let relative = path.strip_prefix(root).unwrap().to_path_buf();
            if relative == Path::new("locks") {
                continue;
            }
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                files.insert(relative, Vec::new());
                walk(&path, root, files);
            } else {
                files.insert(relative, std::fs::read(&path).unwrap());
            }
        }
    }
    let mut files = BTreeMap::new();
    walk(cache, cache, &mut files);
    files
}

/// The niceness of every C++ compiler (`cc1plus`) started by one of this process's evaluator
/// fork servers (a `zygote.py` among its ancestors), seen by polling /proc until `stop`.
fn evaluator_compiler_niceness(stop: &std::sync::atomic::AtomicBool) -> BTreeMap<u32, i64> {
    // (command name, parent, niceness) of a process, from /proc/PID/stat.
    fn stat(pid: u32) -> Option<(String, u32, i64)> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (head, tail) = text.rsplit_once(')')?;
        let name = head.split_once('(')?.1.to_string();
        // After the name: state, ppid, ... niceness is field 19 of the line (16 after ')').
        let fields: Vec<&str> = tail.split_whitespace().collect();
        Some((
            name,
            fields.get(1)?.parse().ok()?,
            fields.get(16)?.parse().ok()?,
        ))
    }
    let me = std::process::id();
    let mut seen = BTreeMap::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        for pid in process_ids() {
            let Some((name, _, nice)) = stat(pid) else {
                continue;
            };
            if name != "cc1plus" {
                continue;
            }
            let (mut at, mut through_zygote) = (pid, false);
            while at > 1 && at != me {
                through_zygote |= command_line_has(at, "zygote.py");
                at = stat(at).map_or(0, |(_, parent, _)| parent);
            }
            if at == me && through_zygote {
                seen.insert(pid, nice);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    seen
}

#[test]
fn one_source_compiles_once_across_concurrent_builds_and_runs() {
    let _machine = machine_shared();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let watcher = scope.spawn(|| evaluator_compiler_niceness(&stop));
        compile_once_across_concurrent_builds_and_runs();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        // The compile stage yields the cores to the run stage (job.rs COMPILE_STAGE_NICENESS).
        let niceness = watcher.join().unwrap();
        assert!(!niceness.is_empty(), "no compiler of the build was seen");
        assert!(niceness.values().all(|&n| n == 10), "{niceness:?}");
    });
}

fn compile_once_across_concurrent_builds_and_runs() {
    // A cache of its own: it counts the compilations of a source the cache does not have yet.
    let cache = tempfile::tempdir().unwrap();
    let relu = example(1, 0);
    let twins: Vec<_> = (0..2)
        .map(|i| dice_eval::EvalSample {
            sample_id: i,
            origin: format!("copy {i}"),
            ..relu.clone()
        })
        .collect();
    let mut builds_per_run = Vec::new();
    for _ in 0..2 {
        let run = tempfile::tempdir().unwrap();
        let mut cfg = test_config(run.path());
        cfg.build_cache = cache.path().to_path_buf();
        cfg.jobs = 2;
        cfg.perf_trials = 0;
        // Both twins through the compile stage at once, as two programs with one source.
        cfg.judge_each_copy = true;
        let summary = dice_eval::evaluate(cfg, example_problems(), twins.clone(), None).unwrap();
        assert_eq!(
            summary.verdicts.get(&dice_eval::Verdict::Correct),
            Some(&2),
            "{summary:?}"
        );
        builds_per_run.push(
            Store::open(&run.path().join("dice.db"))
                .unwrap()
                .builds()
                .unwrap(),
        );
    }
    let compiled = |run: usize| builds_per_run[run].iter().filter(|b| !b.cached).count();
    assert_eq!(compiled(0), 1, "{:?}", builds_per_run[0]);
    assert_eq!(compiled(1), 0, "{:?}", builds_per_run[1]);
    assert!(builds_per_run.iter().flatten().all(|b| b.ok));
    let keys: std::collections::BTreeSet<_> = builds_per_run
        .iter()
        .flatten()
        .map(|b| b.key.clone())
        .collect();
    assert_eq!(keys.len(), 1);
    let entries: Vec<_> = std::fs::read_dir(cache.path().join("tmp"))
        .unwrap()
        .collect();
    assert!(
        entries.is_empty(),
        "a temporary build directory was left behind"
    );
}

/// Module-level code of a compile-stage candidate that tries every way into the shared cache:
/// writing into its folder, rewriting, replacing or moving another entry's files, planting an
/// entry under another key. It fails the import when any of that worked, or when it found no
/// library to attack.
/// A batch that repeats a program for a problem builds and runs it once: the repeats get copies
/// of its judgement (timings included), saying so in their logs; with `judge_each_copy` each is
/// built and run.
#[test]
fn a_program_repeated_in_a_batch_is_judged_once() {
    let _machine = machine_shared();
    let relu = example(1, 0);
    let repeats: Vec<_> = (0..3)
        .map(|i| EvalSample {
            sample_id: i,
            origin: format!("repeat {i}"),
            ..relu.clone()
        })
        .collect();
    let judge = |each: bool| {
        let run = tempfile::tempdir().unwrap();
        let mut cfg = test_config(run.path());
        cfg.judge_each_copy = each;
        let summary = dice_eval::evaluate(cfg, example_problems(), repeats.clone(), None).unwrap();
        assert_eq!(
            summary.verdicts.get(&Verdict::Correct),
            Some(&3),
            "{summary:?}"
        );
        assert_eq!(summary.copies, if each { 0 } else { 2 });
        let store = Store::open(&run.path().join("dice.db")).unwrap();
        (store.samples().unwrap(), store.builds().unwrap())
    };
    let (records, builds) = judge(false);
    let (copies, first): (Vec<SampleRecord>, Vec<SampleRecord>) = records
        .into_iter()
        .partition(|r| r.log_excerpt.contains("the same program as"));
    assert_eq!((copies.len(), first.len()), (2, 1), "{copies:?}");
    let first = &first[0];
    assert!(first.speedup.is_some());
    for copy in &copies {
        let said = format!("the same program as repeat {},", first.sample_id);
        assert!(copy.log_excerpt.contains(&said), "{}", copy.log_excerpt);
        assert_eq!(copy.speedup, first.speedup);
        assert_eq!(copy.code_hash, first.code_hash);
    }
    let (records, builds_each) = judge(true);
    assert!(records
        .iter()
        .all(|r| !r.log_excerpt.contains("the same program as")));
    assert!(!builds.is_empty());
    assert_eq!(builds_each.len(), 3 * builds.len(), "{builds_each:?}");
}

/// Under `--strict`, a program that a static rule makes deceptive whatever it runs is neither
/// built nor run: verdict `rejected`, flagged; the honest one is judged as ever.
#[test]
fn strict_judging_rejects_what_no_run_can_save_without_building_it() {
    let _machine = machine_shared();
    let honest = example(1, 0);
    let code = String::from_utf8(honest.code.clone().unwrap()).unwrap();
    let torch_in_forward = EvalSample {
        sample_id: 1,
        origin: "builds an extension, computes with torch".into(),
        code: Some(
            code.replace("return ext.relu(x)", "return torch.relu(x)")
                .into_bytes(),
        ),
        ..honest.clone()
    };
    assert_ne!(torch_in_forward.code, honest.code);
    let no_kernel = example(2, 2);
    let run = tempfile::tempdir().unwrap();
    let mut cfg = test_config(run.path());
    cfg.strict = true;
    cfg.perf_trials = 0;
    let samples = vec![honest, torch_in_forward, no_kernel];
    dice_eval::evaluate(cfg, example_problems(), samples, None).unwrap();
    let records = Store::open(&run.path().join("dice.db"))
        .unwrap()
        .samples()
        .unwrap();
    let verdict = |problem: u32, sample: u32| {
        let r = records
            .iter()
            .find(|r| (r.problem_id, r.sample_id) == (problem, sample))
            .unwrap();
        // Nothing was built or run for a rejected program.
        if r.verdict == Verdict::Rejected {
            assert!(r.stages.is_empty() && r.wall_s == 0.0, "{r:?}");
        }
        (r.verdict, r.deceptive, r.flags.clone(), r.message.clone())
    };
    assert_eq!(verdict(1, 0).0, Verdict::Correct, "{:?}", verdict(1, 0));
    let (v, deceptive, flags, message) = verdict(1, 1);
    assert_eq!((v, deceptive), (Verdict::Rejected, true), "{message:?}");
    assert!(
        flags.iter().any(|f| f == "torch_compute_in_forward"),
        "{flags:?}"
    );
    assert!(message.unwrap().contains("deceptive under --strict"));
    let (v, deceptive, flags, _) = verdict(2, 2);
    assert_eq!((v, deceptive), (Verdict::Rejected, true));
    assert!(flags.iter().any(|f| f == "no_custom_kernel"), "{flags:?}");
}

fn cache_attack(cache: &Path) -> String {
    format!(
        r#"
import glob as _glob
import os as _os

def _attack(cache):
    libraries = _glob.glob(_os.path.join(cache, "*", "*.so"))
    if not libraries:
        raise RuntimeError("found no cached library to attack")
    done = []
    def attempt(what, action):
        try:
            action()
            done.append(what)
        except OSError:
            pass
    for lib in libraries:
        entry = _os.path.dirname(lib)
        result = _os.path.join(entry, "DICE_RESULT.json")
        attempt("overwrite " + lib, lambda: open(lib, "r+b").write(bytes(16)))
        attempt("replace " + lib, lambda: _os.rename(result, lib))
        attempt("unlink " + lib, lambda: _os.unlink(lib))
        attempt("rewrite " + result, lambda: open(result, "w").write('{{"key": "x", "ok": false}}'))
        attempt("plant beside " + lib, lambda: open(_os.path.join(entry, "planted.so"), "wb").close())
        attempt("chmod " + entry, lambda: _os.chmod(entry, 0o777))
        attempt("move " + entry, lambda: _os.rename(entry, entry + ".moved"))
    attempt("plant an entry", lambda: _os.mkdir(_os.path.join(cache, "0" * 64)))
    attempt("write into the cache", lambda: open(_os.path.join(cache, "planted"), "w").close())
    attempt("write into its tmp", lambda: _os.mkdir(_os.path.join(cache, "tmp", "planted")))
    if done:
        raise RuntimeError("the build cache was written: " + "; ".join(done))

_attack({cache:?})
"#
    )
}

/// Copies the folder `from` to `to`, files with their modes.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

#[test]
fn a_compile_stage_candidate_cannot_write_the_cache() {
    let _machine = machine_shared();
    // The suite's build of the ReLU example, copied into a cache of this test's own: every file
    // of it is compared, which other tests' builds would change in the shared one.
    let relu = example(1, 0);
    let shared = shared_build_cache();
    let (records, builds) = evaluate_on(&shared, vec![relu.clone()], |_| {});
    assert_eq!(records[0].verdict, Verdict::Correct, "{records:?}");
    let cache = tempfile::tempdir().unwrap();
    for build in &builds {
        copy_tree(&shared.join(&build.key), &cache.path().join(&build.key));
    }
    // The staging folder a build leaves, the evaluator's alone, which the attack tries too.
    let staging = cache.path().join("tmp");
    std::fs::create_dir(&staging).unwrap();
    std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o700)).unwrap();
    let published = cache_contents(cache.path());

    let code = relu.code.as_deref().unwrap();
    let mut hostile = cache_attack(cache.path()).into_bytes();
    hostile.extend_from_slice(code);
    let attacker = EvalSample {
        sample_id: 1,
        origin: "cache attacker".into(),
        code: Some(hostile),
        ..relu.clone()
    };
    let (records, _) = evaluate_on(cache.path(), vec![attacker], |_| {});
    assert_eq!(records[0].verdict, Verdict::Correct, "{records:?}");
    assert_eq!(cache_contents(cache.path()), published);

    let (records, builds) = evaluate_on(cache.path(), vec![relu], |_| {});
    assert_eq!(records[0].verdict, Verdict::Correct, "{records:?}");
    assert!(builds.iter().all(|b| b.ok && b.cached), "{builds:?}");
}

/// A candidate that loads (`torch.utils.cpp_extension.load`) an extension whose static
/// initialiser hangs: its build is stored as timed out, so the next run says so at once instead
/// of waiting again. The initialiser first tries to plant files in the cache, from the builder
/// that loads it. A plain Python module in C++, without torch's headers: its build takes seconds
/// where a torch extension's takes a minute, and what is checked happens once it is built.
fn sleeping_initializer(cache: &Path) -> Vec<u8> {
    let source = format!(
        r#"#include <Python.h>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>
static int hang_at_load = [] {{
    std::error_code ignored;
    for (const auto& entry : std::filesystem::directory_iterator({cache:?}, ignored)) {{
        std::ofstream(entry.path() / "planted") << "x";
    }}
    std::ofstream(std::filesystem::path({cache:?}) / "planted") << "x";
    std::this_thread::sleep_for(std::chrono::hours(1));
    return 0;
}}();
static PyModuleDef sleeper = {{PyModuleDef_HEAD_INIT, "sleeper", nullptr, -1, nullptr}};
PyMODINIT_FUNC PyInit_sleeper() {{ return PyModule_Create(&sleeper); }}
"#
    );
    format!(
        r#"import os
import tempfile
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load

_source = os.path.join(tempfile.mkdtemp(), "sleeper.cpp")
with open(_source, "w") as f:
    f.write({source:?})
sleeper = load(name="sleeper", sources=[_source])


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(x)
"#
    )
    .into_bytes()
}

#[test]
fn a_static_initializer_that_hangs_is_a_stored_compile_timeout() {
    let _machine = machine_shared();
    // A cache of its own: the first build must time out here, not be found from an earlier run.
    let cache = tempfile::tempdir().unwrap();
    let sleeper = EvalSample {
        code: Some(sleeping_initializer(cache.path())),
        ..example(1, 0)
    };
    let timeout = Duration::from_secs(10);
    let configure = |cfg: &mut EvalConfig| cfg.timeout = timeout;
    let (first, builds) = evaluate_on(cache.path(), vec![sleeper.clone()], configure);
    assert_eq!(first[0].verdict, Verdict::CompileTimeout, "{first:?}");
    assert!(builds.iter().all(|b| !b.cached), "{builds:?}");
    assert!(first[0].wall_s >= timeout.as_secs_f64(), "{first:?}");

    let (again, builds) = evaluate_on(cache.path(), vec![sleeper], configure);
    assert_eq!(again[0].verdict, Verdict::CompileTimeout, "{again:?}");
    assert!(builds.iter().all(|b| b.cached), "{builds:?}");
    assert!(again[0].wall_s < timeout.as_secs_f64() / 2.0, "{again:?}");
    assert!(
        !cache_contents(cache.path())
            .keys()
            .any(|path| path.ends_with("planted")),
        "the builder planted a file in the cache"
    );
}

/// Builds one `load` extension of an `ops.cpp`: `#include <torch/extension.h>`, then `body`
/// (which defines `twice`), then its registration as an operator (`is_python_module=False`: no
/// bindings to compile) through buildcache.py's light build, as the builder job does; prints
/// `twice(arange(3))`, whether `ops.cpp` was left light or as written, and whether the library
/// has the extension's own name.
const LIGHT_BUILD: &str = r##"
import json, os, sys
sys.path.insert(0, sys.argv[1])
import buildcache
import torch
from torch.utils import cpp_extension

folder, body = sys.argv[2], sys.argv[3]
name = "light_" + os.path.basename(folder)
os.makedirs(os.path.join(folder, "sources"))
source = os.path.join(folder, "sources", "ops.cpp")
text = ("#include <torch/extension.h>\n" + body +
        f"TORCH_LIBRARY({name}, m) {{ m.def(\"twice(Tensor x) -> Tensor\", twice); }}\n")
open(source, "w").write(text)
arguments = {"name": name, "sources": [source], "extra_cflags": ["-O0"], "is_python_module": False}
buildcache.build_light_first(cpp_extension.load, "load", arguments, folder, {source: text})
twice = getattr(torch.ops, name).twice
built = open(source).read()
library = os.path.join(folder, name + ".so")  # where the evaluator looks for it
print(json.dumps({"twice": twice(torch.arange(3.0)).tolist(), "light": "torch/types.h" in built,
                  "as_written": built == text, "library": os.path.isfile(library)}))
"##;

/// The light build: a source that includes torch/extension.h but needs only torch/types.h is
/// compiled light; one that needs the whole C++ frontend fails light and is built as written in
/// the same folder, its text restored; both libraries work.
#[test]
fn sources_build_light_first_and_as_written_where_light_fails() {
    let _machine = machine_shared();
    let python = dice_eval::python::locate(None).unwrap();
    let modules = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let dir = tempfile::tempdir().unwrap();
    // torch finds ninja beside the interpreter, as the evaluator's workers do.
    let bin = python.parent().unwrap_or(Path::new("")).canonicalize();
    let path = match bin {
        Ok(bin) => format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        ),
        Err(_) => std::env::var("PATH").unwrap_or_default(),
    };
    let build = |case: &str, body: &str| -> serde_json::Value {
        let out = std::process::Command::new(&python)
            .env("PATH", &path)
            .args(["-c", LIGHT_BUILD])
            .arg(&modules)
            .arg(dir.path().join(case))
            .arg(body)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{case}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    };
    let light = build(
        "light",
        "torch::Tensor twice(torch::Tensor x) { return x * 2; }\n",
    );
    assert_eq!(light["twice"], serde_json::json!([0.0, 2.0, 4.0]));
    assert_eq!(light["library"], true);
    assert_eq!(
        (light["light"].as_bool(), light["as_written"].as_bool()),
        (Some(true), Some(false))
    );
    // torch::nn::functional is in torch/all.h, not torch/types.h.
    let heavy = build(
        "heavy",
        "torch::Tensor twice(torch::Tensor x) { return torch::nn::functional::relu(x) * 2; }\n",
    );
    assert_eq!(heavy["twice"], serde_json::json!([0.0, 2.0, 4.0]));
    assert_eq!(
        heavy["library"], true,
        "a second build in one process must keep the name"
    );
    assert_eq!(
        (heavy["light"].as_bool(), heavy["as_written"].as_bool()),
        (Some(false), Some(true))
    );
}

/// A host flag set asked of the cache often enough gets a precompiled torch/extension.h: built
/// once by a builder job, published beside the entries (readable, whole), and read by the host
/// compile of every later build of that set, whose extensions work as without it. The second
/// variant asks for torch's own pch (`use_pch=True`, which would write into torch's
/// installation, where no builder may: it failed to build before) and gets this one.
#[test]
fn builds_of_one_flag_set_share_a_precompiled_header() {
    let _machine = machine_shared();
    let relu = example(1, 0);
    let code = String::from_utf8(relu.code.clone().unwrap()).unwrap();
    let shared_line =
        "// Every example candidate compiles this same source, so one cached build serves them all.";
    assert!(code.contains(shared_line) && code.contains("extra_cflags=[\"-O2\"],"));
    let variants: Vec<_> = (0..2)
        .map(|i| EvalSample {
            sample_id: i,
            origin: format!("variant {i}"),
            code: Some(
                code.replace(shared_line, &format!("// variant {i}"))
                    .replace(
                        "extra_cflags=[\"-O2\"],",
                        if i == 1 {
                            "extra_cflags=[\"-O2\"], use_pch=True,"
                        } else {
                            "extra_cflags=[\"-O2\"],"
                        },
                    )
                    .into_bytes(),
            ),
            ..relu.clone()
        })
        .collect();
    let cache = tempfile::tempdir().unwrap();
    // One build at a time: the first asks for the pch (threshold 1) and makes it, the second
    // finds it published.
    let (records, builds) = evaluate_on(cache.path(), variants, |cfg| {
        cfg.pch_after_builds = 1;
        cfg.jobs = 1;
    });
    assert!(
        records.iter().all(|r| r.verdict == Verdict::Correct),
        "{records:?}"
    );
    // Each variant built once (the run stage's loads of the entries are stored as cached).
    let built: Vec<_> = builds.iter().filter(|b| !b.cached).collect();
    assert_eq!(built.len(), 2, "{builds:?}");
    for build in built {
        assert!(
            build.ok && build.log.starts_with("host code compiled with"),
            "{build:?}"
        );
    }
    let pchs: Vec<PathBuf> = std::fs::read_dir(cache.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("pch-"))
        .collect();
    assert_eq!(pchs.len(), 1, "{pchs:?}");
    let gch = pchs[0].join("pch/torch/extension.h.gch");
    let meta = std::fs::metadata(&gch).unwrap();
    assert!(meta.len() > 1 << 20, "{}", meta.len());
    assert_eq!(meta.permissions().mode() & 0o777, 0o644);
    assert!(pchs[0].join("pch/torch/extension.h").is_file());
}
