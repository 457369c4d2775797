use std::path::PathBuf;

/// The shared read-only data folder: `$DICE_SHARED`, else `<workspace>/../shared`.
pub fn shared() -> PathBuf {
    std::env::var_os("DICE_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"))
}
