//! The PostgreSQL backend: one database holding many runs, every table keyed by the run's name,
//! so that workers on many hosts judge one run together. The tables are SQLite's, with a `run`
//! column. A claim is taken with `SELECT … FOR UPDATE SKIP LOCKED` (a worker never waits for
//! another), and a result is stored in the transaction that ends its claim, refused when the
//! claim is gone (a stale worker's late write) or the sample has a result.

use crate::backend::{judged_elsewhere, Backend};
use crate::claim::{unix_time, Claimed, SampleKey, WorkerId};
use crate::record::{
    BuildRecord, KernelProfile, ProblemRecord, RunInfo, RunTimeline, SampleExtras, SampleRecord,
    SpeedupInterval, TimingStats,
};
use crate::verdict::Verdict;
use anyhow::{anyhow, Context, Result};
use postgres::types::ToSql;
use postgres::{Client, GenericClient, NoTls, Row};
use std::cell::RefCell;
use std::collections::HashSet;
use std::time::Duration;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS runs (
    run TEXT PRIMARY KEY,
    info TEXT NOT NULL,
    settings TEXT NOT NULL DEFAULT '{}',
    started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS problems (
    run TEXT NOT NULL,
    level BIGINT NOT NULL,
    problem_id BIGINT NOT NULL,
    name TEXT NOT NULL,
    source_sha256 TEXT NOT NULL,
    reference_error TEXT,
    PRIMARY KEY (run, level, problem_id)
);
CREATE TABLE IF NOT EXISTS samples (
    run TEXT NOT NULL,
    level BIGINT NOT NULL,
    problem_id BIGINT NOT NULL,
    sample_id BIGINT NOT NULL,
    origin TEXT NOT NULL,
    code_hash TEXT,
    verdict TEXT NOT NULL,
    message TEXT,
    max_abs_error DOUBLE PRECISION,
    max_rel_error DOUBLE PRECISION,
    trials_passed BIGINT NOT NULL,
    candidate_timing TEXT,
    baseline_timing TEXT,
    speedup DOUBLE PRECISION,
    speedup_low DOUBLE PRECISION,
    speedup_high DOUBLE PRECISION,
    timing_remeasures BIGINT NOT NULL,
    candidate_wall_ms DOUBLE PRECISION,
    baseline_wall_ms DOUBLE PRECISION,
    flags TEXT NOT NULL,
    deceptive BOOLEAN NOT NULL,
    log_excerpt TEXT NOT NULL,
    wall_s DOUBLE PRECISION NOT NULL,
    custom_kernel_share DOUBLE PRECISION,
    launched_kernels TEXT,
    stages TEXT NOT NULL,
    evaluated_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (run, level, problem_id, sample_id)
);
CREATE TABLE IF NOT EXISTS builds (
    id BIGSERIAL PRIMARY KEY,
    run TEXT NOT NULL,
    key TEXT NOT NULL,
    level BIGINT NOT NULL,
    problem_id BIGINT NOT NULL,
    sample_id BIGINT NOT NULL,
    name TEXT NOT NULL,
    ok BOOLEAN NOT NULL,
    cached BOOLEAN NOT NULL,
    wall_s DOUBLE PRECISION NOT NULL,
    log TEXT NOT NULL,
    at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS builds_of_sample ON builds (run, level, problem_id, sample_id);
CREATE TABLE IF NOT EXISTS invocations (
    id BIGSERIAL PRIMARY KEY,
    run TEXT NOT NULL,
    at TIMESTAMPTZ NOT NULL DEFAULT now(),
    timeline TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS claims (
    run TEXT NOT NULL,
    level BIGINT NOT NULL,
    problem_id BIGINT NOT NULL,
    sample_id BIGINT NOT NULL,
    worker TEXT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (run, level, problem_id, sample_id)
);
CREATE INDEX IF NOT EXISTS claims_of_worker ON claims (run, worker);
";

/// Serialises the schema's creation by workers starting together (`CREATE TABLE IF NOT EXISTS`
/// races with itself); any constant the database's other users do not take.
const SCHEMA_LOCK: i64 = 0x6469_6365_5f73_6368;

/// A run in a PostgreSQL database.
pub struct Postgres {
    /// Queries take the client mutably; the trait's readers take `&self`.
    client: RefCell<Client>,
    run: String,
}

impl Postgres {
    /// Connects to the database at `url` (`postgres://USER@HOST:PORT/DB`, or any connection
    /// string libpq takes) and opens the run `run` in it, creating the tables when missing.
    pub fn open(url: &str, run: &str) -> Result<Postgres> {
        if run.is_empty() {
            anyhow::bail!("--run names the run inside the database: give it a name");
        }
        let config: postgres::Config = url.parse().map_err(|e| {
            anyhow!("{url} is not a PostgreSQL URL (postgres://USER@HOST:PORT/DB): {e}")
        })?;
        let mut client = config.connect(NoTls).map_err(|e| match e.as_db_error() {
            // The server answered: a missing database or role, a refused login.
            Some(refusal) => anyhow!("could not connect to {url}: {}", refusal.message()),
            None => match std::error::Error::source(&e) {
                Some(why) => {
                    anyhow!("could not connect to {url}: {e}: {why} — is the server running?")
                }
                None => anyhow!("could not connect to {url}: {e} — is the server running?"),
            },
        })?;
        let mut tx = client.transaction()?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])?;
        tx.batch_execute(SCHEMA)
            .with_context(|| format!("cannot create dice's tables in {url}"))?;
        tx.commit()?;
        Ok(Postgres {
            client: RefCell::new(client),
            run: run.to_string(),
        })
    }
}

fn key(sample: SampleKey) -> [i64; 3] {
    [sample.0.into(), sample.1.into(), sample.2.into()]
}

fn u32_of(row: &Row, column: usize) -> Result<u32> {
    let value: i64 = row.try_get(column)?;
    u32::try_from(value).context("corrupt sample key in the store")
}

fn json_or_none<T: serde::Serialize>(value: &Option<T>) -> Result<Option<String>> {
    value
        .as_ref()
        .map(serde_json::to_string)
        .transpose()
        .map_err(Into::into)
}

fn parse_json<T: serde::de::DeserializeOwned>(
    text: Option<String>,
    what: &str,
) -> Result<Option<T>> {
    text.map(|t| serde_json::from_str(&t).with_context(|| format!("corrupt {what} in the store")))
        .transpose()
}

/// Stores `s` and its builds, replacing an earlier result of the sample.
fn store_sample(
    db: &mut impl GenericClient,
    run: &str,
    s: &SampleRecord,
    extras: &SampleExtras,
) -> Result<()> {
    let [level, problem_id, sample_id] = key((s.level, s.problem_id, s.sample_id));
    db.execute(
        "DELETE FROM builds WHERE run = $1 AND level = $2 AND problem_id = $3 AND sample_id = $4",
        &[&run, &level, &problem_id, &sample_id],
    )?;
    db.execute(
        "INSERT INTO samples (run, level, problem_id, sample_id, origin, code_hash, verdict,
           message, max_abs_error, max_rel_error, trials_passed, candidate_timing,
           baseline_timing, speedup, candidate_wall_ms, baseline_wall_ms, flags, deceptive,
           log_excerpt, wall_s, custom_kernel_share, launched_kernels, stages, speedup_low,
           speedup_high, timing_remeasures)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18,
                 $19, $20, $21, $22, $23, $24, $25, $26)
         ON CONFLICT (run, level, problem_id, sample_id) DO UPDATE SET
           origin = excluded.origin, code_hash = excluded.code_hash, verdict = excluded.verdict,
           message = excluded.message, max_abs_error = excluded.max_abs_error,
           max_rel_error = excluded.max_rel_error, trials_passed = excluded.trials_passed,
           candidate_timing = excluded.candidate_timing, baseline_timing = excluded.baseline_timing,
           speedup = excluded.speedup, candidate_wall_ms = excluded.candidate_wall_ms,
           baseline_wall_ms = excluded.baseline_wall_ms, flags = excluded.flags,
           deceptive = excluded.deceptive, log_excerpt = excluded.log_excerpt,
           wall_s = excluded.wall_s, custom_kernel_share = excluded.custom_kernel_share,
           launched_kernels = excluded.launched_kernels, stages = excluded.stages,
           speedup_low = excluded.speedup_low, speedup_high = excluded.speedup_high,
           timing_remeasures = excluded.timing_remeasures, evaluated_at = now()",
        &[
            &run,
            &level,
            &problem_id,
            &sample_id,
            &extras.origin,
            &s.code_hash,
            &s.verdict.as_str(),
            &s.message,
            &s.max_abs_error,
            &s.max_rel_error,
            &i64::from(s.trials_passed),
            &json_or_none(&s.candidate_timing)?,
            &json_or_none(&s.baseline_timing)?,
            &s.speedup,
            &extras.candidate_wall_ms,
            &extras.baseline_wall_ms,
            &serde_json::to_string(&s.flags)?,
            &s.deceptive,
            &s.log_excerpt,
            &s.wall_s,
            &extras.kernels.as_ref().and_then(|k| k.custom_share),
            &json_or_none(&extras.kernels)?,
            &serde_json::to_string(&s.stages)?,
            &s.speedup_interval.map(|i| i.low),
            &s.speedup_interval.map(|i| i.high),
            &i64::from(s.timing_remeasures),
        ],
    )?;
    for b in &extras.builds {
        db.execute(
            "INSERT INTO builds (run, key, level, problem_id, sample_id, name, ok, cached, wall_s, log)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            &[
                &run, &b.key, &level, &problem_id, &sample_id, &b.name, &b.ok, &b.cached,
                &b.wall_s, &b.log,
            ],
        )?;
    }
    Ok(())
}

fn has_result(db: &mut impl GenericClient, run: &str, sample: SampleKey) -> Result<bool> {
    let [level, problem_id, sample_id] = key(sample);
    let row = db.query_opt(
        "SELECT 1 FROM samples WHERE run = $1 AND level = $2 AND problem_id = $3 AND sample_id = $4",
        &[&run, &level, &problem_id, &sample_id],
    )?;
    Ok(row.is_some())
}

/// The workers holding unexpired claims on `run`, but for those known to have ended.
fn claim_holders(db: &mut impl GenericClient, run: &str) -> Result<Vec<WorkerId>> {
    let rows = db.query(
        "SELECT DISTINCT worker FROM claims WHERE run = $1 AND expires_at > $2 ORDER BY worker",
        &[&run, &unix_time().as_secs_f64()],
    )?;
    let workers = rows
        .iter()
        .map(|r| WorkerId::from_name(r.get::<_, String>(0)));
    Ok(workers.filter(|w| !w.has_ended()).collect())
}

/// What asking for one sample's claim got.
enum Attempt {
    /// Claimed, with the worker whose expired or ended claim was taken over.
    Claimed(Option<WorkerId>),
    /// Another live worker holds it.
    Held,
    /// It has a stored result.
    Finished,
}

impl Postgres {
    /// Claims `sample` for `worker` unless another live worker holds it or it has a result.
    /// Its own transaction, so that workers asking for samples in different orders never wait
    /// on each other.
    fn claim_one(
        &mut self,
        worker: &WorkerId,
        sample: SampleKey,
        now: f64,
        expires_at: f64,
    ) -> Result<Attempt> {
        let [level, problem_id, sample_id] = key(sample);
        let run = self.run.as_str();
        let claim: [&(dyn ToSql + Sync); 6] = [
            &run,
            &level,
            &problem_id,
            &sample_id,
            &worker.as_str(),
            &expires_at,
        ];
        let mut tx = self.client.get_mut().transaction()?;
        let inserted = tx.execute(
            "INSERT INTO claims (run, level, problem_id, sample_id, worker, expires_at)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
            &claim,
        )?;
        let taken_over = if inserted == 1 {
            None
        } else {
            let held = tx.query_opt(
                "SELECT worker, expires_at FROM claims
                 WHERE run = $1 AND level = $2 AND problem_id = $3 AND sample_id = $4
                 FOR UPDATE SKIP LOCKED",
                &claim[..4],
            )?;
            let Some(held) = held else {
                return Ok(Attempt::Held);
            };
            let (holder, held_until): (String, f64) = (held.get(0), held.get(1));
            let taken_over = (holder != worker.as_str()).then(|| WorkerId::from_name(holder));
            if taken_over
                .as_ref()
                .is_some_and(|other| held_until > now && !other.has_ended())
            {
                return Ok(Attempt::Held);
            }
            tx.execute(
                "UPDATE claims SET worker = $5, expires_at = $6
                 WHERE run = $1 AND level = $2 AND problem_id = $3 AND sample_id = $4",
                &claim,
            )?;
            taken_over
        };
        // The insert may have waited for a worker storing this sample's result (its claim's
        // delete was in flight), and this statement sees what that worker committed: without
        // this check the sample would be judged a second time.
        if has_result(&mut tx, run, sample)? {
            return Ok(Attempt::Finished);
        }
        tx.commit()?;
        Ok(Attempt::Claimed(taken_over))
    }
}

impl Backend for Postgres {
    fn run(&self) -> Result<Option<(RunInfo, serde_json::Value)>> {
        read(self, |db, run| {
            let row = db.query_opt("SELECT info, settings FROM runs WHERE run = $1", &[&run])?;
            let Some(row) = row else {
                return Ok(None);
            };
            let info =
                serde_json::from_str(row.get(0)).context("corrupt run settings in the store")?;
            let settings = serde_json::from_str(row.get(1)).unwrap_or_default();
            Ok(Some((info, settings)))
        })
    }

    fn set_run(&mut self, info: &RunInfo, settings: &serde_json::Value) -> Result<()> {
        self.client.get_mut().execute(
            "INSERT INTO runs (run, info, settings) VALUES ($1, $2, $3)
             ON CONFLICT (run) DO UPDATE SET info = excluded.info, settings = excluded.settings,
               updated_at = now()",
            &[
                &self.run,
                &serde_json::to_string(info)?,
                &settings.to_string(),
            ],
        )?;
        Ok(())
    }

    fn add_problems(&mut self, problems: &[(ProblemRecord, String)]) -> Result<()> {
        let mut tx = self.client.get_mut().transaction()?;
        for (p, source_sha256) in problems {
            tx.execute(
                "INSERT INTO problems (run, level, problem_id, name, source_sha256, reference_error)
                 VALUES ($1, $2, $3, $4, $5, NULL)
                 ON CONFLICT (run, level, problem_id) DO UPDATE SET name = excluded.name,
                   reference_error = CASE WHEN problems.source_sha256 = excluded.source_sha256
                                          THEN problems.reference_error END,
                   source_sha256 = excluded.source_sha256",
                &[
                    &self.run,
                    &i64::from(p.level),
                    &i64::from(p.problem_id),
                    &p.name,
                    source_sha256,
                ],
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
        self.client.get_mut().execute(
            "UPDATE problems SET reference_error = $4
             WHERE run = $1 AND level = $2 AND problem_id = $3",
            &[&self.run, &i64::from(level), &i64::from(problem_id), &error],
        )?;
        Ok(())
    }

    fn problems(&self) -> Result<Vec<ProblemRecord>> {
        read(self, |db, run| {
            let rows = db.query(
                "SELECT level, problem_id, name, reference_error FROM problems
                 WHERE run = $1 ORDER BY level, problem_id",
                &[&run],
            )?;
            rows.iter()
                .map(|r| {
                    Ok(ProblemRecord {
                        level: u32_of(r, 0)?,
                        problem_id: u32_of(r, 1)?,
                        name: r.get(2),
                        reference_error: r.get(3),
                    })
                })
                .collect()
        })
    }

    fn problem_sources(&self) -> Result<Vec<((u32, u32), String)>> {
        read(self, |db, run| {
            let rows = db.query(
                "SELECT level, problem_id, source_sha256 FROM problems
                 WHERE run = $1 ORDER BY level, problem_id",
                &[&run],
            )?;
            rows.iter()
                .map(|r| Ok(((u32_of(r, 0)?, u32_of(r, 1)?), r.get(2))))
                .collect()
        })
    }

    fn finished(&self) -> Result<HashSet<(u32, u32, u32)>> {
        read(self, |db, run| {
            let rows = db.query(
                "SELECT level, problem_id, sample_id FROM samples WHERE run = $1",
                &[&run],
            )?;
            rows.iter()
                .map(|r| Ok((u32_of(r, 0)?, u32_of(r, 1)?, u32_of(r, 2)?)))
                .collect()
        })
    }

    fn put_sample(&mut self, sample: &SampleRecord, extras: &SampleExtras) -> Result<()> {
        let mut tx = self.client.get_mut().transaction()?;
        store_sample(&mut tx, &self.run, sample, extras)?;
        tx.commit()?;
        Ok(())
    }

    fn claim(
        &mut self,
        worker: &WorkerId,
        wanted: &[SampleKey],
        n: usize,
        lease: Duration,
    ) -> Result<Claimed> {
        let now = unix_time().as_secs_f64();
        let expires_at = now + lease.as_secs_f64();
        let mut claimed = Claimed::default();
        for &sample in wanted {
            if claimed.samples.len() >= n {
                break;
            }
            match self.claim_one(worker, sample, now, expires_at)? {
                Attempt::Claimed(taken_over) => claimed.samples.push((sample, taken_over)),
                Attempt::Finished => claimed.finished.push(sample),
                Attempt::Held => {}
            }
        }
        Ok(claimed)
    }

    fn renew_claims(&mut self, worker: &WorkerId, lease: Duration) -> Result<usize> {
        let expires_at = unix_time().as_secs_f64() + lease.as_secs_f64();
        let held = self.client.get_mut().execute(
            "UPDATE claims SET expires_at = $3 WHERE run = $1 AND worker = $2",
            &[&self.run, &worker.as_str(), &expires_at],
        )?;
        Ok(held as usize)
    }

    fn release_claims(&mut self, worker: &WorkerId, sample: Option<SampleKey>) -> Result<()> {
        match sample {
            Some(sample) => {
                let [level, problem_id, sample_id] = key(sample);
                self.client.get_mut().execute(
                    "DELETE FROM claims WHERE run = $1 AND worker = $2
                       AND level = $3 AND problem_id = $4 AND sample_id = $5",
                    &[&self.run, &worker.as_str(), &level, &problem_id, &sample_id],
                )?
            }
            None => self.client.get_mut().execute(
                "DELETE FROM claims WHERE run = $1 AND worker = $2",
                &[&self.run, &worker.as_str()],
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
        let [level, problem_id, sample_id] = key((s.level, s.problem_id, s.sample_id));
        let run = self.run.as_str();
        let mut tx = self.client.get_mut().transaction()?;
        // Deleting the claim locks it: a worker taking it over waits for this transaction, and
        // one that took it over already leaves nothing to delete here.
        let held = tx.execute(
            "DELETE FROM claims WHERE run = $1 AND level = $2 AND problem_id = $3
               AND sample_id = $4 AND worker = $5",
            &[&run, &level, &problem_id, &sample_id, &worker.as_str()],
        )?;
        if held == 0 || has_result(&mut tx, run, (s.level, s.problem_id, s.sample_id))? {
            return Ok(false);
        }
        store_sample(&mut tx, run, s, extras)?;
        tx.commit()?;
        Ok(true)
    }

    fn claim_holders(&self) -> Result<Vec<WorkerId>> {
        read(self, claim_holders)
    }

    fn forget_samples(&mut self, worker: &WorkerId, samples: &[SampleKey]) -> Result<()> {
        let run = self.run.as_str();
        let mut tx = self.client.get_mut().transaction()?;
        if let Some(other) = claim_holders(&mut tx, run)?.iter().find(|w| *w != worker) {
            return Err(judged_elsewhere(other));
        }
        for &sample in samples {
            let [level, problem_id, sample_id] = key(sample);
            for table in ["samples", "builds"] {
                tx.execute(
                    &format!(
                        "DELETE FROM {table}
                         WHERE run = $1 AND level = $2 AND problem_id = $3 AND sample_id = $4"
                    ),
                    &[&run, &level, &problem_id, &sample_id],
                )?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn samples(&self) -> Result<Vec<SampleRecord>> {
        read(self, |db, run| {
            let rows = db.query(
                "SELECT level, problem_id, sample_id, code_hash, verdict, message, max_abs_error,
                        max_rel_error, trials_passed, candidate_timing, baseline_timing, speedup,
                        flags, deceptive, log_excerpt, wall_s, stages, speedup_low, speedup_high,
                        timing_remeasures
                 FROM samples WHERE run = $1 ORDER BY level, problem_id, sample_id",
                &[&run],
            )?;
            rows.iter().map(sample_of).collect()
        })
    }

    fn kernel_profile(
        &self,
        level: u32,
        problem_id: u32,
        sample_id: u32,
    ) -> Result<Option<KernelProfile>> {
        let [level, problem_id, sample_id] = key((level, problem_id, sample_id));
        read(self, |db, run| {
            let row = db.query_opt(
                "SELECT launched_kernels FROM samples
                 WHERE run = $1 AND level = $2 AND problem_id = $3 AND sample_id = $4",
                &[&run, &level, &problem_id, &sample_id],
            )?;
            parse_json(row.and_then(|r| r.get(0)), "kernel profile")
        })
    }

    fn builds(&self) -> Result<Vec<BuildRecord>> {
        read(self, |db, run| {
            let rows = db.query(
                "SELECT key, name, ok, cached, wall_s, log FROM builds WHERE run = $1 ORDER BY id",
                &[&run],
            )?;
            Ok(rows
                .iter()
                .map(|r| BuildRecord {
                    key: r.get(0),
                    name: r.get(1),
                    ok: r.get(2),
                    cached: r.get(3),
                    wall_s: r.get(4),
                    log: r.get(5),
                })
                .collect())
        })
    }

    fn add_timeline(&mut self, timeline: &RunTimeline) -> Result<()> {
        self.client.get_mut().execute(
            "INSERT INTO invocations (run, timeline) VALUES ($1, $2)",
            &[&self.run, &serde_json::to_string(timeline)?],
        )?;
        Ok(())
    }

    fn timelines(&self) -> Result<Vec<RunTimeline>> {
        read(self, |db, run| {
            let rows = db.query(
                "SELECT timeline FROM invocations WHERE run = $1 ORDER BY id",
                &[&run],
            )?;
            rows.iter()
                .map(|r| {
                    serde_json::from_str(r.get(0))
                        .context("corrupt invocation timeline in the store")
                })
                .collect()
        })
    }
}

/// Runs the reading `query` on the store's client and run.
fn read<T>(store: &Postgres, query: impl FnOnce(&mut Client, &str) -> Result<T>) -> Result<T> {
    query(&mut store.client.borrow_mut(), &store.run)
}

fn sample_of(r: &Row) -> Result<SampleRecord> {
    let verdict: String = r.get(4);
    let flags: String = r.get(12);
    let stages: String = r.get(16);
    Ok(SampleRecord {
        level: u32_of(r, 0)?,
        problem_id: u32_of(r, 1)?,
        sample_id: u32_of(r, 2)?,
        code_hash: r.get(3),
        verdict: verdict.parse::<Verdict>().map_err(anyhow::Error::msg)?,
        message: r.get(5),
        max_abs_error: r.get(6),
        max_rel_error: r.get(7),
        trials_passed: u32_of(r, 8)?,
        candidate_timing: parse_json::<TimingStats>(r.get(9), "timing")?,
        baseline_timing: parse_json::<TimingStats>(r.get(10), "timing")?,
        speedup: r.get(11),
        speedup_interval: match (r.get(17), r.get(18)) {
            (Some(low), Some(high)) => Some(SpeedupInterval { low, high }),
            _ => None,
        },
        timing_remeasures: u32_of(r, 19)?,
        flags: serde_json::from_str(&flags).context("corrupt flags in the store")?,
        deceptive: r.get(13),
        log_excerpt: r.get(14),
        wall_s: r.get(15),
        stages: serde_json::from_str(&stages).context("corrupt stage times in the store")?,
    })
}
