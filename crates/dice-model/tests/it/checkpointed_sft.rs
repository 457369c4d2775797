//! The checkpointed SFT step against the single-graph path on packed rows of several samples.

use crate::common::*;
use candle_core::{DType, Device, Tensor};
use dice_model::{PackedRow, Sdar, SdarConfig, TwoStreamBatch};
use std::collections::HashMap;

/// A packed row of samples of the given lengths (position ids restart at 0), then `padding`
/// pad positions (labels -100); in each sample the first 3 tokens are prompt and the response
/// tokens are masked by a fixed-seed draw with p in {0.25, 0.5, 0.75}.
fn packed_row(config: &SdarConfig, sample_lens: &[usize], padding: usize) -> PackedRow {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut row = PackedRow {
        input_ids: Vec::new(),
        noisy_ids: Vec::new(),
        labels: Vec::new(),
        position_ids: Vec::new(),
        masked_positions: Vec::new(),
        p_mask: Vec::new(),
    };
    for &n in sample_lens {
        let p = [0.25f32, 0.5, 0.75][(next() % 3) as usize];
        for pos in 0..n {
            let id = (next() % config.mask_token_id as u64) as u32;
            let response = pos >= 3;
            let masked = response && (next() % 1000) as f32 / 1000.0 < p;
            if masked {
                row.masked_positions.push(row.input_ids.len());
                row.p_mask.push(p);
            }
            row.input_ids.push(id);
            row.noisy_ids
                .push(if masked { config.mask_token_id } else { id });
            row.labels.push(if response { id as i64 } else { -100 });
            row.position_ids.push(pos as u32);
        }
    }
    for _ in 0..padding {
        row.input_ids.push(0);
        row.noisy_ids.push(0);
        row.labels.push(-100);
        row.position_ids.push(0);
    }
    row
}

/// Loss and every gradient of the single-graph path (weights as `Var`s).
fn single_graph(dir: &std::path::Path, batch: &TwoStreamBatch) -> (f32, HashMap<String, Tensor>) {
    let (model, vars) = Sdar::load_trainable(dir, DType::F32, &Device::Cpu).unwrap();
    let loss = model
        .sft_loss(&model.two_stream_hidden(batch).unwrap(), batch)
        .unwrap();
    let grads = loss.backward().unwrap();
    let grads = vars
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(name, var)| (name.clone(), grads.get(var.as_tensor()).unwrap().clone()))
        .collect();
    (loss.to_scalar().unwrap(), grads)
}

fn assert_same(
    label: &str,
    (loss, grads): (f32, &HashMap<String, Tensor>),
    (want_loss, want): (f32, &HashMap<String, Tensor>),
) {
    assert!(
        (loss - want_loss).abs() < 1e-5 * want_loss.abs().max(1.0),
        "{label}: loss {loss} vs {want_loss}"
    );
    let mut names: Vec<_> = grads.keys().collect();
    let mut want_names: Vec<_> = want.keys().collect();
    names.sort();
    want_names.sort();
    assert_eq!(names, want_names, "{label}: gradient names");
    for (name, w) in want {
        let scale = max_abs_diff(w, &w.zeros_like().unwrap());
        let d = max_abs_diff(&grads[name], w);
        assert!(
            d <= 1e-4 * scale + 1e-7,
            "{label}: {name} differs by {d} (largest entry {scale})"
        );
    }
}

fn compare_paths(dir: &std::path::Path, sample_lens: &[usize], padding: usize) {
    let config = SdarConfig::from_path(dir).unwrap();
    let row = packed_row(&config, sample_lens, padding);
    assert!(
        row.masked_positions.len() > 4,
        "the row must mask several positions"
    );
    let batch = TwoStreamBatch::new(&[row]).unwrap();
    let (want_loss, want) = single_graph(dir, &batch);
    let (trainable, _) = Sdar::load_trainable(dir, DType::F32, &Device::Cpu).unwrap();
    let plain = Sdar::load(dir, DType::F32, &Device::Cpu).unwrap();
    // 5 rows: query chunks that do not divide the samples, several head chunks.
    for (label, model, chunk_rows) in [
        ("Var weights, 1024-row chunks", &trainable, 1024),
        ("Var weights, 5-row chunks", &trainable, 5),
        ("plain weights, 5-row chunks", &plain, 5),
    ] {
        let step = model.sft_loss_and_grads(&batch, chunk_rows).unwrap();
        assert_same(label, (step.loss, &step.grads), (want_loss, &want));
    }
}

#[test]
fn checkpointed_equals_single_graph_on_a_multi_sample_row() {
    compare_paths(formula_tiny(), &[14, 23], 3);
}

#[test]
fn checkpointed_equals_single_graph_with_tied_embeddings() {
    let config = serde_json::json!({
        "model_type": "sdar", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1e4, "block_size": 4, "mask_token_id": 299, "tie_word_embeddings": true
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let config: SdarConfig = serde_json::from_value(config).unwrap();
    let tensors: HashMap<String, Tensor> = config
        .tensor_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let t = Tensor::randn(0f32, 0.3, shape.as_slice(), &Device::Cpu).unwrap();
            let t = if shape.len() == 1 {
                (t + 1.0).unwrap()
            } else {
                t
            };
            (name, t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
    compare_paths(dir.path(), &[9, 17, 12], 0);
}

#[test]
fn bf16_checkpointed_step_is_close_to_f32() {
    let dir = formula_tiny();
    let config = SdarConfig::from_path(dir).unwrap();
    let batch = TwoStreamBatch::new(&[packed_row(&config, &[14, 23], 3)]).unwrap();
    let (want_loss, want) = single_graph(dir, &batch);
    let model = Sdar::load(dir, DType::BF16, &Device::Cpu).unwrap();
    let step = model.sft_loss_and_grads(&batch, 5).unwrap();
    println!("bf16 loss {} vs f32 {want_loss}", step.loss);
    assert!((step.loss - want_loss).abs() < 0.01 * want_loss);
    let norm = |t: &Tensor| {
        t.to_dtype(DType::F32)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .sqrt()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    for (name, w) in &want {
        let got = &step.grads[name];
        assert_eq!(got.dtype(), DType::BF16, "{name}");
        let error = norm(&(got.to_dtype(DType::F32).unwrap() - w).unwrap()) / norm(w);
        println!("{name}: relative error {error:e}");
        assert!(error < 0.05, "{name}: relative error {error}");
    }
}
