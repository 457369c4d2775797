//! What every store backend does: the operations the evaluator and the reports need, the same
//! for a SQLite file and any database added later.

use crate::claim::{Claimed, SampleKey, WorkerId};
use crate::record::{
    BuildRecord, KernelProfile, ProblemRecord, RunInfo, RunTimeline, SampleExtras, SampleRecord,
};
use anyhow::{anyhow, bail, Result};
use std::collections::HashSet;
use std::time::Duration;

/// A run's storage. Each finished sample is stored atomically, so a run killed at any moment
/// resumes from what was stored. Several workers (evaluating processes, on one host or many)
/// share a run through claims on its samples ([`Backend::claim`]).
pub trait Backend: Send {
    /// The run's settings as [`RunInfo`] and the others (`settings`), once a run has begun.
    fn run(&self) -> Result<Option<(RunInfo, serde_json::Value)>>;

    /// Records the run's settings, replacing earlier ones.
    fn set_run(&mut self, info: &RunInfo, settings: &serde_json::Value) -> Result<()>;

    /// Adds problems with the SHA-256 of their source; a known problem keeps its recorded
    /// reference error unless its source changed.
    fn add_problems(&mut self, problems: &[(ProblemRecord, String)]) -> Result<()>;

    fn set_reference_error(
        &mut self,
        level: u32,
        problem_id: u32,
        error: Option<&str>,
    ) -> Result<()>;

    /// Every problem, by level and id.
    fn problems(&self) -> Result<Vec<ProblemRecord>>;

    /// The SHA-256 of every problem's source (hex), by level and id: what identifies a problem
    /// across runs that number problems differently.
    fn problem_sources(&self) -> Result<Vec<((u32, u32), String)>>;

    /// (level, problem_id, sample_id) of every finished sample.
    fn finished(&self) -> Result<HashSet<(u32, u32, u32)>>;

    /// Stores one finished sample and its builds atomically, replacing an earlier result.
    fn put_sample(&mut self, sample: &SampleRecord, extras: &SampleExtras) -> Result<()>;

    /// Claims up to `n` of `wanted` for `worker` until `lease` from now, in the order given:
    /// samples without a stored result whose claim is free, `worker`'s own, expired or held by a
    /// worker that has ended ([`WorkerId::has_ended`]): those are taken over. Samples other workers hold are passed over, never waited for (a database server
    /// does this with `SELECT … FOR UPDATE SKIP LOCKED`).
    fn claim(
        &mut self,
        worker: &WorkerId,
        wanted: &[SampleKey],
        n: usize,
        lease: Duration,
    ) -> Result<Claimed>;

    /// Extends every claim `worker` holds to `lease` from now (its heartbeat); returns how many
    /// it holds.
    fn renew_claims(&mut self, worker: &WorkerId, lease: Duration) -> Result<usize>;

    /// Gives up `worker`'s claim on `sample`, or all its claims, to the next worker that asks.
    fn release_claims(&mut self, worker: &WorkerId, sample: Option<SampleKey>) -> Result<()>;

    /// Stores a claimed sample's result and its builds and ends the claim, atomically. Stores
    /// nothing and returns false unless `worker` still holds the claim and the sample has no
    /// result yet: each result is written once, by the holder of its sample's claim.
    fn put_claimed_sample(
        &mut self,
        worker: &WorkerId,
        sample: &SampleRecord,
        extras: &SampleExtras,
    ) -> Result<bool>;

    /// The workers holding unexpired claims on the run, but for those known to have ended.
    fn claim_holders(&self) -> Result<Vec<WorkerId>>;

    /// Deletes the results of `samples` and their builds, so that they are judged again.
    /// Refused while a worker other than `worker` holds unexpired claims: it is judging this
    /// run, and its results would be judged twice.
    fn forget_samples(&mut self, worker: &WorkerId, samples: &[SampleKey]) -> Result<()>;

    /// Every finished sample, by level, problem and sample id.
    fn samples(&self) -> Result<Vec<SampleRecord>>;

    /// The kernels of a sample's profiled correctness trial (CUDA runs), if recorded.
    fn kernel_profile(
        &self,
        level: u32,
        problem_id: u32,
        sample_id: u32,
    ) -> Result<Option<KernelProfile>>;

    /// Every build, in the order they were stored.
    fn builds(&self) -> Result<Vec<BuildRecord>>;

    /// Records how one batch of the evaluator spent its wall time.
    fn add_timeline(&mut self, timeline: &RunTimeline) -> Result<()>;

    /// Every batch's timeline, oldest first.
    fn timelines(&self) -> Result<Vec<RunTimeline>>;

    /// The settings the run was started with.
    fn run_info(&self) -> Result<Option<RunInfo>> {
        Ok(self.run()?.map(|(info, _)| info))
    }

    /// Records the settings of this run (`settings`: those not in [`RunInfo`]). A run resumed
    /// with different settings is refused unless `replace` (its finished samples would not
    /// compare).
    fn begin_run(
        &mut self,
        info: &RunInfo,
        settings: &serde_json::Value,
        replace: bool,
    ) -> Result<()> {
        if let Some((old, old_settings)) = self.run()? {
            let mut changed = settings_changes(&old, info);
            // A setting the run began without (an older dice) was off: null.
            for (name, value) in settings.as_object().into_iter().flatten() {
                if old_settings.get(name).unwrap_or(&serde_json::Value::Null) != value {
                    changed.push(name.clone());
                }
            }
            if !changed.is_empty() && replace {
                if let Some(holder) = self.claim_holders()?.first() {
                    return Err(judged_elsewhere(holder));
                }
            }
            if !changed.is_empty() && !replace {
                bail!(
                    "this run was started with different settings ({}); use --force to re-evaluate \
                     everything with the new ones, or choose another --run directory",
                    changed.join(", ")
                );
            }
        }
        self.set_run(info, settings)
    }
}

/// Why a worker may not redo what another is judging now.
pub(crate) fn judged_elsewhere(holder: &WorkerId) -> anyhow::Error {
    anyhow!(
        "another dice eval (worker {holder}) is judging this run now; let it finish, or stop it, \
         before re-evaluating with --force"
    )
}

/// Names of the settings that differ; hardware and versions are descriptive, not settings.
fn settings_changes(old: &RunInfo, new: &RunInfo) -> Vec<String> {
    let mut changed = Vec::new();
    let mut check = |name: &str, differs: bool| {
        if differs {
            changed.push(name.to_string());
        }
    };
    check("device", old.device != new.device);
    check(
        "correctness trials",
        old.correctness_trials != new.correctness_trials,
    );
    check("perf trials", old.perf_trials != new.perf_trials);
    check("atol", old.atol != new.atol);
    check("rtol", old.rtol != new.rtol);
    check("baseline", old.baseline != new.baseline);
    check("timing", old.timing != new.timing);
    check("strict", old.strict != new.strict);
    check("source", old.source != new.source);
    check("torch version", old.torch_version != new.torch_version);
    changed
}
