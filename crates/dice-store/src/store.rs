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
