//! The decoding-forward profile on the CPU, with the formula golden's tiny checkpoint. The
//! tensor counts read candle's process-wide counter, which the other tests of this binary,
//! running in parallel threads, move too: the counts are compared on the first of three
//! profiles that no other thread disturbed (one that did counts more in some stage or in the
//! whole forward, never the same in both but by chance).

use candle_core::{DType, Device};
use dice_model::sdar::{BlockForwardShape, ProfileSettings, Stage};
use dice_model::Sdar;
use dice_test_support::checkpoint::formula_tiny;

#[test]
fn every_stage_of_a_decoding_forward_is_timed_counted_and_floored() {
    let model = Sdar::load(formula_tiny(), DType::F32, &Device::Cpu).unwrap();
    let cfg = model.config().clone();
    let shape = BlockForwardShape {
        batch: 3,
        cached_tokens: 12,
        capacity: 24,
        tokens: cfg.block_size,
    };
    let settings = ProfileSettings {
        warm_up: 1,
        repetitions: 3,
        bytes_per_s: 1e9,
    };
    let profiles: Vec<_> = (0..3)
        .map(|_| model.profile_block_forward(shape, settings).unwrap())
        .collect();
    let counted = |profile: &dice_model::sdar::ForwardProfile| -> Vec<u64> {
        profile
            .components
            .iter()
            .map(|c| c.tensors.expect("candle shows its tensor counter"))
            .collect()
    };
    let profile = profiles
        .iter()
        .find(|p| Some(counted(p).iter().sum::<u64>()) == p.forward_tensors)
        .unwrap_or(&profiles[0]);
    assert_eq!(profile.shape.tokens, cfg.block_size);

    // The CPU runs candle's forward: every stage but the fused forward's own.
    let fused = [Stage::QkNormRotaryCacheWrite, Stage::ResidualNorm];
    let stages: Vec<Stage> = profile.components.iter().map(|c| c.stage).collect();
    let candle_stages: Vec<Stage> = Stage::ALL
        .into_iter()
        .filter(|s| !fused.contains(s))
        .collect();
    assert_eq!(stages, candle_stages);
    for c in &profile.components {
        assert!(c.ms > 0.0, "{} took no time", c.name);
        assert!(c.runs > 0, "{} never ran", c.name);
        if c.stage.in_layer() {
            assert_eq!(c.runs % cfg.num_hidden_layers as u64, 0, "{}", c.name);
            assert_eq!(c.per_layer_ms.len(), cfg.num_hidden_layers, "{}", c.name);
            assert!(c.per_layer_ms.iter().all(|&ms| ms > 0.0), "{}", c.name);
            let layers_sum: f64 = c.per_layer_ms.iter().sum();
            assert!(
                (layers_sum - c.ms).abs() <= 1e-9 * c.ms.max(1.0),
                "{}",
                c.name
            );
        } else {
            assert!(c.per_layer_ms.is_empty(), "{}", c.name);
        }
        assert!(
            (c.floor_ms - c.floor_bytes as f64 / 1e9 * 1e3).abs() < 1e-12,
            "{}",
            c.name
        );
    }

    assert!(profile.empty_stage_ms >= 0.0 && profile.empty_stage_ms < 1.0);

    // On the CPU synchronizing costs nothing, so the stages add up to about the plain forward.
    let ratio = profile.components_ms() / profile.forward_ms;
    assert!(
        (0.2..10.0).contains(&ratio),
        "stages sum to {} ms, the forward takes {} ms",
        profile.components_ms(),
        profile.forward_ms
    );

    // Every tensor of the forward is created inside exactly one stage.
    assert_eq!(
        Some(counted(profile).iter().sum::<u64>()),
        profile.forward_tensors
    );
    let attention = &profile.components[Stage::ALL
        .iter()
        .position(|&s| s == Stage::Attention)
        .unwrap()];
    assert!(attention.tensors.unwrap() > 0);

    let lm_head = profile.components.last().unwrap();
    assert_eq!(lm_head.stage, Stage::LmHead);
    assert_eq!(
        lm_head.floor_bytes,
        (cfg.vocab_size * cfg.hidden_size * 4) as u64
    );
}
