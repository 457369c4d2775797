//! What the candidate's process cannot decide (issue #15, holes (b) and (d), and mutation
//! checks): files it plants where the judge reads its outputs, a table of outputs for the seeds
//! of earlier releases, and a mutation check it patches away. Pure-Python candidates, CPU.

use crate::common::{machine_shared, relu_problem_and_samples, test_config};
use dice_eval::{EvalConfig, SampleRecord, Store, Timing, Verdict};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

const RELU: &str = "
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)

def get_inputs():
    return [torch.randn(4, 8)]

def get_init_inputs():
    return []
";

/// A ReLU candidate whose process replaces the evaluator's `publish` (python/protocol.py) with
/// `plant(tensors, path, **_)`, where `tensors` are its correct outputs.
fn planting(plant: &str) -> Vec<u8> {
    format!(
        "import os, sys, threading, torch\nimport torch.nn as nn\n_p = sys.modules['protocol']\n_publish = _p.publish\n{plant}\n_p.publish = plant\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n"
    )
    .into_bytes()
}

fn honest() -> Vec<u8> {
    b"import torch\nimport torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return torch.clamp(x, min=0)\n"
        .to_vec()
}

fn evaluate(cfg: EvalConfig, codes: Vec<Vec<u8>>) -> Vec<SampleRecord> {
    let db = cfg.db.clone();
    let (problem, samples) = relu_problem_and_samples(RELU, codes, "trusted judge test sample");
    let summary = dice_eval::evaluate(cfg, vec![problem], samples, None).unwrap();
    assert!(
        summary.reference_errors.is_empty() && summary.skipped == 0,
        "{:?}",
        summary.reference_errors
    );
    Store::open(&db).unwrap().samples().unwrap()
}

#[test]
fn files_planted_where_the_judge_reads_fail_their_candidate_alone() {
    let _machine = machine_shared();
    let huge = 8u64 << 30;
    let cases = [
        // A FIFO: opening it for reading would block the judge until its timeout.
        "def plant(tensors, path, **_):\n    os.mkfifo(path)",
        "def plant(tensors, path, **_):\n    os.symlink('/dev/zero', path)",
        // A sparse file of 8 GiB, directly and through a link.
        &format!("def plant(tensors, path, **_):\n    with open(path, 'wb') as f:\n        f.truncate({huge})"),
        &format!("def plant(tensors, path, **_):\n    with open(path + '.big', 'wb') as f:\n        f.truncate({huge})\n    os.symlink(path + '.big', path)"),
        // Published right, then truncated over and over while the judge reads it (a mapping
        // of the file would crash the judge with SIGBUS).
        "def plant(tensors, path, **_):\n    _publish(tensors, path)\n    def shrink():\n        for _ in range(20000):\n            try:\n                os.truncate(path, 8)\n            except OSError:\n                pass\n    threading.Thread(target=shrink, daemon=True).start()",
        // Published right, then replaced by a FIFO.
        "def plant(tensors, path, **_):\n    _publish(tensors, path)\n    os.mkfifo(path + '.fifo')\n    os.replace(path + '.fifo', path)",
        // A header naming shared device memory (python/shared_output.py): its process's stdin.
        "def plant(tensors, path, **_):\n    import json\n    t = tensors[0]\n    h = json.dumps([{'dtype': 'float32', 'shape': list(t.shape), 'shared': {'pid': os.getpid(), 'fd': 0, 'size': 4 * t.numel()}}]).encode()\n    with open(path, 'wb') as f:\n        f.write(len(h).to_bytes(8, 'little') + h)",
    ];
    let mut codes: Vec<Vec<u8>> = cases.iter().map(|c| planting(c)).collect();
    codes.push(honest());
    let run = tempfile::tempdir().unwrap();
    let records = evaluate(test_config(run.path()), codes);
    assert_eq!(
        records.len(),
        cases.len() + 1,
        "every sample gets a verdict"
    );
    for (r, case) in records.iter().zip(&cases[..4]) {
        assert_eq!(r.verdict, Verdict::RuntimeError, "{case}: {r:?}");
        assert_eq!(r.trials_passed, 0, "{case}: {r:?}");
    }
    // Replaced by a FIFO before the judge reads it. (The truncated file may be read whole
    // before it shrinks, so its sample only has to get a verdict.)
    assert_eq!(
        records[5].verdict,
        Verdict::RuntimeError,
        "{:?}",
        records[5]
    );
    let message = |i: usize| records[i].message.clone().unwrap_or_default();
    assert_eq!(
        records[6].verdict,
        Verdict::RuntimeError,
        "{:?}",
        records[6]
    );
    assert!(
        message(6).contains("shared device memory"),
        "{}",
        message(6)
    );
    assert!(message(0).contains("not a regular file"), "{}", message(0));
    assert!(message(1).contains("symbolic link"), "{}", message(1));
    assert!(message(2).contains("far more"), "{}", message(2));
    let last = records.last().unwrap();
    assert_eq!(last.verdict, Verdict::Correct, "{last:?}");
}

/// Seeds of the releases before per-run seeds: KernelBench's trial seeds from seed 42, and the
/// timing input sets of seeds 42 and 43.
const OLD_SEEDS: &str = "
torch.manual_seed(42)
_seeds = [int(torch.randint(0, 2**32 - 1, (1,)).item()) for _ in range(5)] + [42, 43]
";

/// No arithmetic in forward: the outputs of the inputs the old seeds make, looked up by the
/// input's first value (the table is built at import from the old constants, as a program's
/// author would have built it offline).
fn lookup_table() -> Vec<u8> {
    format!(
        "import random, torch\nimport torch.nn as nn\n{OLD_SEEDS}\n_table = {{}}\nfor _s in _seeds:\n    torch.manual_seed(_s)\n    random.seed(_s)\n    _x = torch.randn(4, 8)\n    _table[float(_x[0, 0])] = torch.relu(_x)\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return _table.get(float(x[0, 0]), torch.zeros_like(x))\n"
    )
    .into_bytes()
}

#[test]
fn a_table_for_public_seeds_fails_under_the_seed_drawn_for_the_run() {
    let _machine = machine_shared();
    let run = tempfile::tempdir().unwrap();
    let mut cfg = test_config(run.path());
    cfg.seed = Some(42);
    // dice's own timing gives every call inputs of its own; KernelBench's times one public set.
    cfg.timing = Timing::KernelBench;
    let records = evaluate(cfg, vec![lookup_table()]);
    assert_eq!(
        records[0].verdict,
        Verdict::Correct,
        "under --input-seed 42 and KernelBench's timing the table has every output: {:?}",
        records[0]
    );

    let run = tempfile::tempdir().unwrap();
    let records = evaluate(test_config(run.path()), vec![lookup_table()]);
    assert_eq!(
        records[0].verdict,
        Verdict::OutputMismatch,
        "{:?}",
        records[0]
    );

    // The drawn seed is stored with the run, where the candidates' users cannot read it, and a
    // resumed run with another is refused.
    let db = run.path().join("dice.db");
    let mode = std::fs::metadata(&db).unwrap().permissions().mode();
    assert_eq!(mode & 0o077, 0, "mode {mode:o}");
    let seed = stored_seed(&db).unwrap();
    assert_ne!(seed, 42);
    let mut cfg = test_config(run.path());
    cfg.seed = Some(seed ^ 1);
    let err = dice_eval::evaluate(cfg, vec![], vec![], None).unwrap_err();
    assert!(err.to_string().contains("seed"), "{err}");

    // Resumed without --input-seed, the run keeps its seed; a run stored before seeds were drawn
    // resumes with KernelBench's, which it was judged with, and is not refused.
    dice_eval::evaluate(test_config(run.path()), vec![], vec![], None).unwrap();
    assert_eq!(stored_seed(&db), Some(seed));
    rusqlite::Connection::open(&db)
        .unwrap()
        .execute(
            "UPDATE run SET settings = json_remove(settings, '$.seed')",
            [],
        )
        .unwrap();
    dice_eval::evaluate(test_config(run.path()), vec![], vec![], None).unwrap();
    assert_eq!(stored_seed(&db), None);
}

fn stored_seed(db: &Path) -> Option<u64> {
    let (_, settings) = Store::open(db).unwrap().run().unwrap().unwrap();
    settings["seed"].as_u64()
}

#[test]
fn a_candidate_that_patches_the_mutation_check_is_still_flagged() {
    let _machine = machine_shared();
    let patched = b"import sys, torch\nimport torch.nn as nn\n_p = sys.modules['protocol']\n_p.mutated = lambda before, after: []\n_p.aliased = lambda inputs, out: []\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        y = torch.relu(x)\n        x.zero_()\n        return y\n".to_vec();
    let run = tempfile::tempdir().unwrap();
    let records = evaluate(test_config(run.path()), vec![patched, honest()]);
    let (forger, honest) = (&records[0], &records[1]);
    assert_eq!(forger.verdict, Verdict::Correct, "{forger:?}");
    assert!(
        forger.flags.iter().any(|f| f == "input_mutation"),
        "{forger:?}"
    );
    assert!(forger.deceptive);
    assert!(
        forger.log_excerpt.contains("seen by the judge"),
        "{forger:?}"
    );
    assert_eq!(honest.verdict, Verdict::Correct, "{honest:?}");
    assert!(
        !honest.flags.iter().any(|f| f == "input_mutation"),
        "{honest:?}"
    );
}
