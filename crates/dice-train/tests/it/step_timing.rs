//! The synthetic SFT row and the timed step of `dice bench train`, on the formula golden's tiny
//! config.

use crate::common::formula_config;
use candle_core::{DType, Device};
use dice_model::sdar::StepPhase;
use dice_train::step_timing::{synthetic_sft_row, time_sft_step};

#[test]
fn synthetic_row_is_a_quarter_prompt_and_half_masked_response() {
    let config = formula_config();
    let row = synthetic_sft_row(&config, 4096).unwrap();
    assert_eq!(row.input_ids.len(), 4096);
    assert_eq!(row.labels.iter().filter(|&&l| l == -100).count(), 1024);
    let masked = row.masked_positions.len();
    assert!((1400..1680).contains(&masked), "{masked} of 3072 masked");
    assert!(row.masked_positions.iter().all(|&i| i >= 1024));
    assert!(row
        .masked_positions
        .iter()
        .all(|&i| row.noisy_ids[i] == config.mask_token_id));
    let again = synthetic_sft_row(&config, 4096).unwrap();
    assert_eq!(again.masked_positions, row.masked_positions);
    assert_eq!(again.input_ids, row.input_ids);
}

#[test]
fn timed_step_on_random_weights_has_the_uniform_loss() {
    let config = formula_config();
    let timing = time_sft_step(&config, DType::F32, &Device::Cpu, 64, 1, true).unwrap();
    assert_eq!(timing.positions, 128);
    assert!(timing.masked > 0 && timing.seconds > 0.0);
    // Near-uniform logits: CE ≈ ln V per masked token, and the 1/p weight makes up for the
    // half of the response that is not masked.
    let uniform = (config.vocab_size as f32).ln();
    let expected = uniform * timing.masked as f32 / 0.5 / 48.0;
    println!("loss {} (ln V {uniform}, expected {expected})", timing.loss);
    assert!((timing.loss - expected).abs() < 0.05 * expected);
    // The profiled step: every phase of the step ran, the layers' phases once per layer, and
    // the phases account for the step's time but the host's bookkeeping between them.
    let profile = timing.profile.unwrap();
    let layers = config.num_hidden_layers as u64;
    for phase in &profile.phases {
        let per_layer = !matches!(
            phase.phase,
            StepPhase::Setup | StepPhase::LossHead | StepPhase::EmbeddingGradient
        );
        // The forward's projections phase also takes the embedding.
        let runs = match phase.phase {
            StepPhase::ForwardProjections => layers + 1,
            _ if per_layer => layers,
            _ => 1,
        };
        assert_eq!(phase.runs, runs, "{phase:?}");
        assert!(phase.seconds > 0.0, "{phase:?}");
    }
    let sum: f64 = profile.phases.iter().map(|p| p.seconds).sum();
    assert!(sum <= profile.step_seconds, "{profile:?}");
}
