//! The formula golden's tiny checkpoint (`tests/data/sdar/golden/formula`: hidden size 64, two
//! layers, the full vocabulary; its weights a function of tensor name and element index) with
//! the SDAR tokenizer: the model of every CPU test that loads, decodes, serves or trains one.
//!
//! Written once per suite run for every test binary of every crate, into a folder of the system's
//! temporary folder keyed by what its bytes depend on: the golden's config and formula, the
//! tokenizer files and the source of dice-model's writer. A changed input or writer gets a new
//! folder; an unchanged one is read as it is. The folder is written under a temporary name and
//! renamed into place, so a test never sees a partial checkpoint, and of two processes writing
//! at once the first rename wins and the other's copy is dropped. Tests only read it.

use crate::test_data;
use dice_model::golden::FormulaGolden;
use dice_model::init::{fnv1a64, TOKENIZER_FILES};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The checkpoint folder's own name (what reports call the model).
pub const FORMULA_TINY: &str = "formula-golden-tiny";

/// The source of the writer: a change to it writes the checkpoint anew.
const WRITER_SOURCES: [&[u8]; 3] = [
    include_bytes!("../../dice-model/src/init.rs"),
    include_bytes!("../../dice-model/src/shards.rs"),
    include_bytes!("../../dice-model/src/config.rs"),
];

/// The formula golden's folder: config.json, cases.json, expected.safetensors, weights.json.
pub fn formula_golden_dir() -> PathBuf {
    test_data().join("sdar/golden/formula")
}

/// The formula golden: its config, cases and expected outputs.
pub fn formula_golden() -> FormulaGolden {
    FormulaGolden::open(&formula_golden_dir())
        .unwrap_or_else(|e| panic!("cannot open the formula golden: {e:#}"))
}

/// The tiny checkpoint (config.json, model.safetensors, the tokenizer files), named
/// [`FORMULA_TINY`]; written on the first call of a suite run.
pub fn formula_tiny() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let golden = formula_golden_dir();
        let tokenizer = test_data().join("sdar");
        let mut inputs: Vec<Vec<u8>> = WRITER_SOURCES.iter().map(|s| s.to_vec()).collect();
        for file in ["config.json", "weights.json"] {
            inputs.push(read(&golden.join(file)));
        }
        for file in TOKENIZER_FILES {
            let path = tokenizer.join(file);
            if path.exists() {
                inputs.push(read(&path));
            }
        }
        written_once(FORMULA_TINY, &inputs, |out| {
            formula_golden()
                .write_checkpoint(out, Some(&tokenizer))
                .unwrap_or_else(|e| panic!("cannot write the tiny checkpoint: {e:#}"));
        })
    })
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// `TEMP/dice-test-checkpoints/KEY/NAME`, where KEY hashes `inputs`: written by `write` when no
/// process has written it yet.
fn written_once(name: &str, inputs: &[Vec<u8>], write: impl FnOnce(&Path)) -> PathBuf {
    let mut keyed = Vec::new();
    for input in inputs {
        keyed.extend_from_slice(&(input.len() as u64).to_le_bytes());
        keyed.extend_from_slice(input);
    }
    let root = std::env::temp_dir().join("dice-test-checkpoints");
    let home = root.join(format!("{name}-{:016x}", fnv1a64(&keyed)));
    if !home.exists() {
        std::fs::create_dir_all(&root)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", root.display()));
        let staging = tempfile::Builder::new()
            .prefix(".staging-")
            .tempdir_in(&root)
            .unwrap_or_else(|e| panic!("cannot create a folder in {}: {e}", root.display()));
        write(&staging.path().join(name));
        // Fails when another process renamed its copy into place first: ours is dropped.
        if std::fs::rename(staging.path(), &home).is_ok() {
            let _ = staging.keep();
        }
        assert!(home.exists(), "{} was not written", home.display());
    }
    home.join(name)
}
