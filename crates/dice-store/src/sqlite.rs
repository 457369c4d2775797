//! The SQLite backend: one file holding the run's settings, its problems, every finished sample
//! and every extension build. Each finished sample is one transaction.

use crate::backend::{judged_elsewhere, Backend};
use crate::claim::{unix_time, Claimed, SampleKey, WorkerId};
use crate::record::{
    BuildRecord, KernelProfile, ProblemRecord, RunInfo, RunTimeline, SampleExtras, SampleRecord,
    SpeedupInterval, TimingStats,
};
use crate::verdict::Verdict;
use anyhow::{anyhow, bail, Context, Result};
use rusqlite::backup::Backup;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension, TransactionBehavior};
use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS run (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    info TEXT NOT NULL,
    settings TEXT NOT NULL DEFAULT '{}',
    started_at TEXT NOT NULL DEFAULT (datetime('now')),
    updated_at TEXT NOT NULL DEFAULT (datetime('now'))
);
CREATE TABLE IF NOT EXISTS problems (
    level INTEGER NOT NULL,
    problem_id INTEGER NOT NULL,
    name TEXT NOT NULL,
    source_sha256 TEXT NOT NULL,
    reference_error TEXT,
    PRIMARY KEY (level, problem_id)
);
CREATE TABLE IF NOT EXISTS samples (
    level INTEGER NOT NULL,
    problem_id INTEGER NOT NULL,
    sample_id INTEGER NOT NULL,
    origin TEXT NOT NULL,
    code_hash TEXT,
    verdict TEXT NOT NULL,
    message TEXT,
    max_abs_error REAL,
    max_rel_error REAL,
    trials_passed INTEGER NOT NULL,
    candidate_timing TEXT,
    baseline_timing TEXT,
    speedup REAL,
    speedup_low REAL,
    speedup_high REAL,
    timing_remeasures INTEGER,
    candidate_wall_ms REAL,
    baseline_wall_ms REAL,
    flags TEXT NOT NULL,
    deceptive INTEGER NOT NULL,
    log_excerpt TEXT NOT NULL,
    wall_s REAL NOT NULL,
    custom_kernel_share REAL,
    launched_kernels TEXT,
    stages TEXT,
    evaluated_at TEXT NOT NULL DEFAULT (datetime('now')),
    PRIMARY KEY (level, problem_id, sample_id)
);
CREATE TABLE IF NOT EXISTS builds (
    key TEXT NOT NULL,
    level INTEGER NOT NULL,
    problem_id INTEGER NOT NULL,
    sample_id INTEGER NOT NULL,
    name TEXT NOT NULL,
    ok INTEGER NOT NULL,
    cached INTEGER NOT NULL,
    wall_s REAL NOT NULL,
    log TEXT NOT NULL,
    at TEXT NOT NULL DEFAULT (datetime('now'))
);
CREATE TABLE IF NOT EXISTS invocations (
    at TEXT NOT NULL DEFAULT (datetime('now')),
    timeline TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS claims (
    level INTEGER NOT NULL,
    problem_id INTEGER NOT NULL,
    sample_id INTEGER NOT NULL,
    worker TEXT NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (level, problem_id, sample_id)
);
";

/// The tables reports read: a store that lacks one (or a column of [`ADDED_SAMPLE_COLUMNS`]) is
/// from an earlier release.
const READ_TABLES: [&str; 5] = ["run", "problems", "samples", "builds", "invocations"];

/// Columns added after the first release, with their types, for stores made before them.
const ADDED_SAMPLE_COLUMNS: [(&str, &str); 6] = [
    ("custom_kernel_share", "REAL"),
    ("launched_kernels", "TEXT"),
    ("stages", "TEXT"),
    ("speedup_low", "REAL"),
    ("speedup_high", "REAL"),
    ("timing_remeasures", "INTEGER"),
];

/// The `stages` column: `[[stage, seconds], ...]` in the order the stages ran (stores of the
/// first release with stages hold an object instead, read in name order).
fn parse_stages(text: Option<String>) -> Result<Vec<(String, f64)>> {
    let Some(text) = text else {
        return Ok(Vec::new());
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).context("corrupt stage times in the store")?;
    let pairs: Vec<(String, f64)> = match value {
        serde_json::Value::Object(object) => object
            .into_iter()
            .filter_map(|(name, s)| Some((name, s.as_f64()?)))
            .collect(),
        value => serde_json::from_value(value).context("corrupt stage times in the store")?,
    };
    Ok(pairs)
}

fn stages_json(stages: &[(String, f64)]) -> Result<Option<String>> {
    if stages.is_empty() {
        return Ok(None);
    }
    Ok(Some(serde_json::to_string(stages)?))
}

pub struct Sqlite {
    conn: Connection,
}

impl Sqlite {
    /// Opens the store at `path`, creating it (and its folder) when missing and adding the
    /// columns of later releases to an older one.
    pub fn open(path: &Path) -> Result<Sqlite> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create the run directory {}", dir.display()))?;
        }
        let mut conn = Connection::open(path)
            .with_context(|| format!("cannot open the run database {}", path.display()))?;
        conn.busy_timeout(Duration::from_secs(30))?;
        // Workers sharing the run write through short transactions that take the write lock at
        // once, so that none fails halfway waiting for another.
        conn.set_transaction_behavior(TransactionBehavior::Immediate);
        conn.pragma_update(None, "journal_mode", "WAL")
            .and_then(|_| conn.pragma_update(None, "synchronous", "NORMAL"))
            .and_then(|_| conn.execute_batch(SCHEMA))
            .with_context(|| format!("{} is not a dice run database", path.display()))?;
        add_missing_columns(&conn)
            .with_context(|| format!("cannot upgrade the run database {}", path.display()))?;
        Ok(Sqlite { conn })
    }

    /// Opens the store at `path` to read it only: nothing is created or changed, so reports
    /// work on run folders they may not write. A store of an earlier release is copied into
    /// memory and upgraded there.
    pub fn open_read_only(path: &Path) -> Result<Sqlite> {
        let run = match path.parent().filter(|d| !d.as_os_str().is_empty()) {
            Some(dir) => dir.display().to_string(),
            None => ".".to_string(),
        };
        let no_results =
            |why: String| anyhow!("{run} has no dice results ({why}): run `dice eval` first");
        match std::fs::metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(no_results(format!("no {}", path.display())));
            }
            Err(e) => {
                return Err(e).with_context(|| format!("cannot read {}", path.display()));
            }
            Ok(meta) if meta.len() == 0 => {
                return Err(no_results(format!("{} is empty", path.display())));
            }
            Ok(_) => {}
        }
        let conn = open_read_only(path)?;
        let tables = table_names(&conn)
            .with_context(|| format!("{} is not a dice run database", path.display()))?;
        if !tables.contains("run") || !tables.contains("samples") {
            return Err(no_results(format!(
                "{} is not a dice run database",
                path.display()
            )));
        }
        let current = READ_TABLES.iter().all(|t| tables.contains(*t))
            && missing_sample_columns(&conn)?.is_empty();
        if current {
            return Ok(Sqlite { conn });
        }
        let mut memory = Connection::open_in_memory()?;
        Backup::new(&conn, &mut memory)?
            .run_to_completion(1024, Duration::ZERO, None)
            .with_context(|| format!("cannot read {}", path.display()))?;
        memory.execute_batch(SCHEMA)?;
        add_missing_columns(&memory)?;
        Ok(Sqlite { conn: memory })
    }
}

/// A read-only connection to `path`. Reading a WAL store needs its `-shm` index, which SQLite
/// cannot make in a folder it may not write: there (and in any folder without write permission,
/// where the evaluator is not writing either), the file is read as immutable, which is exact
/// unless a `-wal` file holds results not yet merged into it (a run killed in a folder made
/// read-only afterwards), an error then.
fn open_read_only(path: &Path) -> Result<Connection> {
    let cannot_open = || format!("cannot open the run database {}", path.display());
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let folder = path.parent().filter(|d| !d.as_os_str().is_empty());
    let folder_read_only = std::fs::metadata(folder.unwrap_or(Path::new(".")))
        .is_ok_and(|meta| meta.permissions().readonly());
    if !folder_read_only {
        let conn = Connection::open_with_flags(path, flags).with_context(cannot_open)?;
        let readable = conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| {
            r.get::<_, i64>(0)
        });
        if readable.is_ok() {
            return Ok(conn);
        }
    }
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    if std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0) {
        bail!(
            "{} holds results not yet merged into {}, which needs write access to the folder: \
             make it writable, or copy the run folder, and report again",
            Path::new(&wal).display(),
            path.display()
        );
    }
    let uri = format!("file:{}?immutable=1", uri_path(path));
    Connection::open_with_flags(uri, flags | OpenFlags::SQLITE_OPEN_URI).with_context(cannot_open)
}

/// `path` as the path of a `file:` URI.
fn uri_path(path: &Path) -> String {
    path.to_string_lossy()
        .replace('%', "%25")
        .replace('?', "%3f")
        .replace('#', "%23")
}

fn table_names(conn: &Connection) -> Result<HashSet<String>> {
    let mut stmt = conn.prepare("SELECT name FROM sqlite_master WHERE type = 'table'")?;
    let names = stmt.query_map([], |r| r.get(0))?;
    names.collect::<rusqlite::Result<_>>().map_err(Into::into)
}

impl Backend for Sqlite {
    fn run(&self) -> Result<Option<(RunInfo, serde_json::Value)>> {
        let row: Option<(String, String)> = self
            .conn
            .query_row("SELECT info, settings FROM run WHERE id = 1", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .optional()?;
        let Some((info, settings)) = row else {
            return Ok(None);
        };
        let info = serde_json::from_str(&info).context("corrupt run settings in the store")?;
        let settings = serde_json::from_str(&settings).unwrap_or_default();
        Ok(Some((info, settings)))
    }

    fn set_run(&mut self, info: &RunInfo, settings: &serde_json::Value) -> Result<()> {
        self.conn.execute(
            "INSERT INTO run (id, info, settings) VALUES (1, ?1, ?2)
             ON CONFLICT(id) DO UPDATE SET info = excluded.info, settings = excluded.settings,
               updated_at = datetime('now')",
            params![serde_json::to_string(info)?, settings.to_string()],
        )?;
        Ok(())
    }

    fn add_problems(&mut self, problems: &[(ProblemRecord, String)]) -> Result<()> {
        let tx = self.conn.transaction()?;
        for (p, source_sha256) in problems {
            tx.execute(
                "INSERT INTO problems (level, problem_id, name, source_sha256, reference_error)
                 VALUES (?1, ?2, ?3, ?4, NULL)
                 ON CONFLICT(level, problem_id) DO UPDATE SET name = excluded.name,
                   reference_error = CASE WHEN source_sha256 = excluded.source_sha256
                                          THEN reference_error END,
                   source_sha256 = excluded.source_sha256",
                params![p.level, p.problem_id, p.name, source_sha256],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    fn set_reference_error(
        &mut self,
        level: u32,
        problem_id: u32,
        error: Option<&str>,
    ) -> Result<()> {
        self.conn.execute(
            "UPDATE problems SET reference_error = ?3 WHERE level = ?1 AND problem_id = ?2",
            params![level, problem_id, error],
        )?;
        Ok(())
    }

    fn problems(&self) -> Result<Vec<ProblemRecord>> {
        let mut stmt = self.conn.prepare(
            "SELECT level, problem_id, name, reference_error FROM problems ORDER BY level, problem_id",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok(ProblemRecord {
                level: r.get(0)?,
                problem_id: r.get(1)?,
                name: r.get(2)?,
                reference_error: r.get(3)?,
            })
        })?;
        rows.collect::<rusqlite::Result<_>>().map_err(Into::into)
    }

    fn problem_sources(&self) -> Result<Vec<((u32, u32), String)>> {
        let mut stmt = self.conn.prepare(
            "SELECT level, problem_id, source_sha256 FROM problems ORDER BY level, problem_id",
        )?;
        let rows = stmt.query_map([], |r| Ok(((r.get(0)?, r.get(1)?), r.get(2)?)))?;
        rows.collect::<rusqlite::Result<_>>().map_err(Into::into)
    }

    fn finished(&self) -> Result<HashSet<(u32, u32, u32)>> {
        let mut stmt = self
            .conn
            .prepare("SELECT level, problem_id, sample_id FROM samples")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        rows.collect::<rusqlite::Result<_>>().map_err(Into::into)
    }

    fn put_sample(&mut self, s: &SampleRecord, extras: &SampleExtras) -> Result<()> {
        // A savepoint, so that a claimed sample is stored inside its claim's transaction.
        let tx = self.conn.savepoint()?;
        let key = params![s.level, s.problem_id, s.sample_id];
        tx.execute(
            "DELETE FROM builds WHERE level = ?1 AND problem_id = ?2 AND sample_id = ?3",
            key,
        )?;
        tx.execute(
            "INSERT OR REPLACE INTO samples (level, problem_id, sample_id, origin, code_hash, verdict,
               message, max_abs_error, max_rel_error, trials_passed, candidate_timing,
               baseline_timing, speedup, candidate_wall_ms, baseline_wall_ms, flags, deceptive,
               log_excerpt, wall_s, custom_kernel_share, launched_kernels, stages, speedup_low,
               speedup_high, timing_remeasures)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19,
                     ?20, ?21, ?22, ?23, ?24, ?25)",
            params![
                s.level,
                s.problem_id,
                s.sample_id,
                extras.origin,
                s.code_hash,
                s.verdict.as_str(),
                s.message,
                s.max_abs_error,
                s.max_rel_error,
                s.trials_passed,
                timing_json(&s.candidate_timing)?,
                timing_json(&s.baseline_timing)?,
                s.speedup,
                extras.candidate_wall_ms,
                extras.baseline_wall_ms,
                serde_json::to_string(&s.flags)?,
                s.deceptive,
                s.log_excerpt,
                s.wall_s,
                extras.kernels.as_ref().and_then(|k| k.custom_share),
                extras.kernels.as_ref().map(serde_json::to_string).transpose()?,
                stages_json(&s.stages)?,
                s.speedup_interval.map(|i| i.low),
                s.speedup_interval.map(|i| i.high),
                s.timing_remeasures,
            ],
        )?;
        for b in &extras.builds {
            tx.execute(
                "INSERT INTO builds (key, level, problem_id, sample_id, name, ok, cached, wall_s, log)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                params![b.key, s.level, s.problem_id, s.sample_id, b.name, b.ok, b.cached, b.wall_s, b.log],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    fn samples(&self) -> Result<Vec<SampleRecord>> {
        let mut stmt = self.conn.prepare(
            "SELECT level, problem_id, sample_id, code_hash, verdict, message, max_abs_error,
                    max_rel_error, trials_passed, candidate_timing, baseline_timing, speedup, flags,
                    deceptive, log_excerpt, wall_s, stages, speedup_low, speedup_high,
                    timing_remeasures
             FROM samples ORDER BY level, problem_id, sample_id",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok((
                SampleRecord {
                    level: r.get(0)?,
                    problem_id: r.get(1)?,
                    sample_id: r.get(2)?,
                    code_hash: r.get(3)?,
                    verdict: Verdict::NoCode,
                    message: r.get(5)?,
                    max_abs_error: r.get(6)?,
                    max_rel_error: r.get(7)?,
                    trials_passed: r.get(8)?,
                    candidate_timing: None,
                    baseline_timing: None,
                    speedup: r.get(11)?,
                    speedup_interval: match (r.get(17)?, r.get(18)?) {
                        (Some(low), Some(high)) => Some(SpeedupInterval { low, high }),
                        _ => None,
                    },
                    // NULL in stores made before re-measurement existed.
                    timing_remeasures: r.get::<_, Option<u32>>(19)?.unwrap_or(0),
                    flags: Vec::new(),
                    deceptive: r.get(13)?,
                    log_excerpt: r.get(14)?,
                    wall_s: r.get(15)?,
                    stages: Vec::new(),
                },
                r.get::<_, String>(4)?,
                r.get::<_, Option<String>>(9)?,
                r.get::<_, Option<String>>(10)?,
                r.get::<_, String>(12)?,
                r.get::<_, Option<String>>(16)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (mut s, verdict, cand, base, flags, stages) = row?;
            s.stages = parse_stages(stages)?;
            s.verdict = verdict.parse().map_err(anyhow::Error::msg)?;
            s.candidate_timing = parse_timing(cand)?;
            s.baseline_timing = parse_timing(base)?;
            s.flags = serde_json::from_str(&flags).context("corrupt flags in the store")?;
            out.push(s);
        }
        Ok(out)
    }

    fn kernel_profile(
        &self,
        level: u32,
        problem_id: u32,
        sample_id: u32,
    ) -> Result<Option<KernelProfile>> {
        let text: Option<Option<String>> = self
            .conn
            .query_row(
                "SELECT launched_kernels FROM samples
                 WHERE level = ?1 AND problem_id = ?2 AND sample_id = ?3",
                params![level, problem_id, sample_id],
                |r| r.get(0),
            )
            .optional()?;
        text.flatten()
            .map(|t| serde_json::from_str(&t).context("corrupt kernel profile in the store"))
            .transpose()
    }

    fn builds(&self) -> Result<Vec<BuildRecord>> {
        let mut stmt = self
            .conn
            .prepare("SELECT key, name, ok, cached, wall_s, log FROM builds ORDER BY rowid")?;
        let rows = stmt.query_map([], |r| {
            Ok(BuildRecord {
                key: r.get(0)?,
                name: r.get(1)?,
                ok: r.get(2)?,
                cached: r.get(3)?,
                wall_s: r.get(4)?,
                log: r.get(5)?,
            })
        })?;
        rows.collect::<rusqlite::Result<_>>().map_err(Into::into)
    }

    fn add_timeline(&mut self, timeline: &RunTimeline) -> Result<()> {
        self.conn.execute(
            "INSERT INTO invocations (timeline) VALUES (?1)",
            params![serde_json::to_string(timeline)?],
        )?;
        Ok(())
    }

    fn timelines(&self) -> Result<Vec<RunTimeline>> {
        let mut stmt = self
            .conn
            .prepare("SELECT timeline FROM invocations ORDER BY rowid")?;
        let texts = stmt
            .query_map([], |r| r.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        texts
            .iter()
            .map(|t| serde_json::from_str(t).context("corrupt invocation timeline in the store"))
            .collect()
    }

    fn claim(
        &mut self,
        worker: &WorkerId,
        wanted: &[SampleKey],
        n: usize,
        lease: Duration,
    ) -> Result<Claimed> {
        let now = unix_time().as_secs_f64();
        let tx = self.conn.transaction()?;
        let mut claimed = Claimed::default();
        {
            let mut stored = tx.prepare(
                "SELECT 1 FROM samples WHERE level = ?1 AND problem_id = ?2 AND sample_id = ?3",
            )?;
            let mut holder = tx.prepare(
                "SELECT worker, expires_at FROM claims
                 WHERE level = ?1 AND problem_id = ?2 AND sample_id = ?3",
            )?;
            let mut take = tx.prepare(
                "INSERT INTO claims (level, problem_id, sample_id, worker, expires_at)
                 VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (level, problem_id, sample_id) DO UPDATE
                   SET worker = excluded.worker, expires_at = excluded.expires_at",
            )?;
            for &key in wanted {
                if claimed.samples.len() >= n {
                    break;
                }
                let (level, problem_id, sample_id) = key;
                if stored.exists(params![level, problem_id, sample_id])? {
                    claimed.finished.push(key);
                    continue;
                }
                let held: Option<(String, f64)> = holder
                    .query_row(params![level, problem_id, sample_id], |r| {
                        Ok((r.get(0)?, r.get(1)?))
                    })
                    .optional()?;
                let taken_over = match held {
                    Some((other, expires_at)) if other != worker.as_str() => {
                        let other = WorkerId::from_name(other);
                        if expires_at > now && !other.has_ended() {
                            continue;
                        }
                        Some(other)
                    }
                    _ => None,
                };
                let expires_at = now + lease.as_secs_f64();
                take.execute(params![
                    level,
                    problem_id,
                    sample_id,
                    worker.as_str(),
                    expires_at
                ])?;
                claimed.samples.push((key, taken_over));
            }
        }
        tx.commit()?;
        Ok(claimed)
    }

    fn renew_claims(&mut self, worker: &WorkerId, lease: Duration) -> Result<usize> {
        let expires_at = unix_time().as_secs_f64() + lease.as_secs_f64();
        let held = self.conn.execute(
            "UPDATE claims SET expires_at = ?2 WHERE worker = ?1",
            params![worker.as_str(), expires_at],
        )?;
        Ok(held)
    }

    fn release_claims(&mut self, worker: &WorkerId, sample: Option<SampleKey>) -> Result<()> {
        match sample {
            Some((level, problem_id, sample_id)) => self.conn.execute(
                "DELETE FROM claims
                 WHERE worker = ?1 AND level = ?2 AND problem_id = ?3 AND sample_id = ?4",
                params![worker.as_str(), level, problem_id, sample_id],
            )?,
            None => self.conn.execute(
                "DELETE FROM claims WHERE worker = ?1",
                params![worker.as_str()],
            )?,
        };
        Ok(())
    }

    fn put_claimed_sample(
        &mut self,
        worker: &WorkerId,
        s: &SampleRecord,
        extras: &SampleExtras,
    ) -> Result<bool> {
        // One transaction: the claim ends where the result is stored (put_sample's savepoint
        // nests in it).
        self.conn.execute_batch("BEGIN IMMEDIATE")?;
        let stored = self.end_claim_and_store(worker, s, extras);
        let end = if matches!(stored, Ok(true)) {
            "COMMIT"
        } else {
            "ROLLBACK"
        };
        self.conn.execute_batch(end)?;
        stored
    }

    fn claim_holders(&self) -> Result<Vec<WorkerId>> {
        claim_holders(&self.conn)
    }

    fn forget_samples(&mut self, worker: &WorkerId, samples: &[SampleKey]) -> Result<()> {
        let tx = self.conn.transaction()?;
        if let Some(other) = claim_holders(&tx)?.iter().find(|w| *w != worker) {
            return Err(judged_elsewhere(other));
        }
        for &(level, problem_id, sample_id) in samples {
            let key = params![level, problem_id, sample_id];
            tx.execute(
                "DELETE FROM samples WHERE level = ?1 AND problem_id = ?2 AND sample_id = ?3",
                key,
            )?;
            tx.execute(
                "DELETE FROM builds WHERE level = ?1 AND problem_id = ?2 AND sample_id = ?3",
                key,
            )?;
        }
        tx.commit()?;
        Ok(())
    }
}

/// The workers holding unexpired claims, but for those known to have ended.
fn claim_holders(conn: &Connection) -> Result<Vec<WorkerId>> {
    let mut stmt =
        conn.prepare("SELECT DISTINCT worker FROM claims WHERE expires_at > ?1 ORDER BY worker")?;
    let names = stmt.query_map(params![unix_time().as_secs_f64()], |r| {
        r.get::<_, String>(0)
    })?;
    let names = names.collect::<rusqlite::Result<Vec<_>>>()?;
    let workers = names.into_iter().map(WorkerId::from_name);
    Ok(workers.filter(|w| !w.has_ended()).collect())
}

impl Sqlite {
    /// Inside a transaction: ends `worker`'s claim on the sample and stores its result, unless
    /// the claim is not `worker`'s (anymore) or the sample has a result (false).
    fn end_claim_and_store(
        &mut self,
        worker: &WorkerId,
        s: &SampleRecord,
        extras: &SampleExtras,
    ) -> Result<bool> {
        let key = params![s.level, s.problem_id, s.sample_id];
        let held = self.conn.execute(
            "DELETE FROM claims
             WHERE level = ?1 AND problem_id = ?2 AND sample_id = ?3 AND worker = ?4",
            params![s.level, s.problem_id, s.sample_id, worker.as_str()],
        )?;
        let stored = self
            .conn
            .prepare_cached(
                "SELECT 1 FROM samples WHERE level = ?1 AND problem_id = ?2 AND sample_id = ?3",
            )?
            .exists(key)?;
        if held == 0 || stored {
            return Ok(false);
        }
        self.put_sample(s, extras)?;
        Ok(true)
    }
}

fn add_missing_columns(conn: &Connection) -> Result<()> {
    for (name, kind) in missing_sample_columns(conn)? {
        conn.execute_batch(&format!("ALTER TABLE samples ADD COLUMN {name} {kind}"))?;
    }
    Ok(())
}

fn missing_sample_columns(conn: &Connection) -> Result<Vec<(&'static str, &'static str)>> {
    let mut stmt = conn.prepare("SELECT name FROM pragma_table_info('samples')")?;
    let present: HashSet<String> = stmt
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    Ok(ADDED_SAMPLE_COLUMNS
        .into_iter()
        .filter(|(name, _)| !present.contains(*name))
        .collect())
}

fn timing_json(t: &Option<TimingStats>) -> Result<Option<String>> {
    t.as_ref()
        .map(serde_json::to_string)
        .transpose()
        .map_err(Into::into)
}

fn parse_timing(text: Option<String>) -> Result<Option<TimingStats>> {
    text.map(|t| serde_json::from_str(&t).context("corrupt timing in the store"))
        .transpose()
}
