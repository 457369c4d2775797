//! An open run store, whichever backend keeps it.

use crate::backend::Backend;
use crate::postgres::Postgres;
use crate::sqlite::Sqlite;
use anyhow::Result;
use std::ops::{Deref, DerefMut};
use std::path::Path;

/// A run's store: the [`Backend`] operations on the backend it was opened with.
pub struct Store(Box<dyn Backend>);

impl Store {
    /// The SQLite store at `path` (`RUN_DIR/dice.db`), created when missing.
    pub fn open(path: &Path) -> Result<Store> {
        Ok(Store(Box::new(Sqlite::open(path)?)))
    }

    /// The SQLite store at `path`, to read only: never created, changed or upgraded on disk (a
    /// missing or empty file is an error that says to run `dice eval` first).
    pub fn open_read_only(path: &Path) -> Result<Store> {
        Ok(Store(Box::new(Sqlite::open_read_only(path)?)))
    }

    /// The run named `run` in the PostgreSQL database at `url` (`postgres://USER@HOST:PORT/DB`),
    /// its tables created when missing: one database holds many runs.
    pub fn open_postgres(url: &str, run: &str) -> Result<Store> {
        Ok(Store(Box::new(Postgres::open(url, run)?)))
    }

    /// A run's store, to read its results, and where it is (for messages): the run named
    /// `run_dir` in the PostgreSQL database at `url`, else the SQLite file `db` (by default
    /// `run_dir/dice.db`) opened read-only.
    pub fn open_run_to_read(
        run_dir: &Path,
        db: Option<&Path>,
        url: Option<&str>,
    ) -> Result<(Store, String)> {
        Ok(match url {
            Some(url) => {
                let name = run_dir.to_string_lossy();
                (
                    Store::open_postgres(url, &name)?,
                    format!("{url} (run {name})"),
                )
            }
            None => {
                let db = db.map_or_else(|| run_dir.join("dice.db"), Path::to_path_buf);
                (Store::open_read_only(&db)?, db.display().to_string())
            }
        })
    }
}

impl Deref for Store {
    type Target = dyn Backend;

    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

impl DerefMut for Store {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut *self.0
    }
}
