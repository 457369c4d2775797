//! The formula golden's `adamw` case (dice_train::golden) on the CPU.

use crate::common::TrainingGolden;
use anyhow::Result;
use candle_core::Device;
use dice_train::golden::{AdamWGolden, ADAMW_RUNS};

#[test]
fn two_clipped_adamw_steps_match_torch() -> Result<()> {
    let training = TrainingGolden::open()?;
    let case = AdamWGolden::open(&training.golden)?;
    for run in ADAMW_RUNS {
        println!(
            "{run}: {}",
            case.check_run(training.model_dir.path(), run, &Device::Cpu)?
        );
    }
    Ok(())
}
