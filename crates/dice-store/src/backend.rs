//! What every store backend does: the operations the evaluator and the reports need, the same
//! for a SQLite file and any database added later.

use crate::record::{
    BuildRecord, KernelProfile, ProblemRecord, RunInfo, RunTimeline, SampleExtras, SampleRecord,
};
use anyhow::{bail, Result};
use std::collections::HashSet;

/// A run's storage. Each finished sample is stored atomically, so a run killed at any moment
/// resumes from what was stored.
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

    /// (level, problem_id, sample_id) of every finished sample.
    fn finished(&self) -> Result<HashSet<(u32, u32, u32)>>;

    /// Stores one finished sample and its builds atomically, replacing an earlier result.
    fn put_sample(&mut self, sample: &SampleRecord, extras: &SampleExtras) -> Result<()>;

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
            for (name, value) in settings.as_object().into_iter().flatten() {
                if old_settings.get(name) != Some(value) {
                    changed.push(name.clone());
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
    check("strict", old.strict != new.strict);
    check("source", old.source != new.source);
    check("torch version", old.torch_version != new.torch_version);
    changed
}
