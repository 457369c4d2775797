//! The formula golden (`tests/data/sdar/golden/formula`) and its tiny checkpoint.

use dice_model::golden::FormulaGolden;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// `tests/data` of the workspace.
fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data")
}

pub(crate) fn golden() -> FormulaGolden {
    FormulaGolden::open(&data_dir().join("sdar/golden/formula")).unwrap()
}

/// The golden's checkpoint with the SDAR tokenizer, written once per test binary into the
/// build's temporary folder (the same bytes from every binary, each file renamed into place).
pub(crate) fn tiny_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("formula-golden-tiny");
        golden()
            .write_checkpoint(&dir, Some(&data_dir().join("sdar")))
            .unwrap();
        dir
    })
}
