//! The two-stream SFT loss and its gradients against the reference (noise draw from cases.json),
//! through the single-graph path and the checkpointed one.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use dice_model::{PackedRow, Sdar, TwoStreamBatch};
use std::collections::HashMap;

const TOL: f32 = 1e-4;

fn golden_batch() -> TwoStreamBatch {
    let case = &cases()["sft_loss"];
    let row = PackedRow {
        input_ids: u32s(&case["input_ids"]),
        noisy_ids: u32s(&case["noisy_input_ids"]),
        labels: case["labels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect(),
        position_ids: u32s(&case["position_ids"]),
        masked_positions: u32s(&case["masked_positions"])
            .iter()
            .map(|&p| p as usize)
            .collect(),
        p_mask: case["p_mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect(),
    };
    TwoStreamBatch::new(&[row]).unwrap()
}

/// Loss, embedding and lm_head rows, layer-0 q_proj and all gradient norms of the reference.
fn check_against_reference(loss: f32, grads: &HashMap<String, Tensor>) {
    let case = &cases()["sft_loss"];
    let reference = case["loss"].as_f64().unwrap() as f32;
    println!(
        "sft loss {loss} (reference {reference}), diff {:e}",
        (loss - reference).abs()
    );
    assert!((loss - reference).abs() < TOL);
    let grad_of = |name: &str| {
        grads
            .get(name)
            .unwrap_or_else(|| panic!("no gradient for {name}"))
    };
    let rows = Tensor::new(u32s(&case["grad_rows"]), &Device::Cpu).unwrap();
    let checks = [
        (
            "sft_grad_embed_rows",
            grad_of("model.embed_tokens.weight")
                .index_select(&rows, 0)
                .unwrap(),
        ),
        (
            "sft_grad_lm_head_rows",
            grad_of("lm_head.weight").index_select(&rows, 0).unwrap(),
        ),
        (
            "sft_grad_layer0_q_proj",
            grad_of("model.layers.0.self_attn.q_proj.weight").clone(),
        ),
    ];
    for (name, got) in checks {
        let d = max_abs_diff(&got, &expected(name));
        println!("{name} max abs diff {d:e}");
        assert!(d < TOL, "{name} differs by {d}");
    }
    let norms = case["grad_norms"].as_object().unwrap();
    assert_eq!(
        norms.len(),
        grads.len(),
        "one gradient per checkpoint tensor"
    );
    for (name, norm) in norms {
        let got = grad_of(name)
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .sqrt()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let want = norm.as_f64().unwrap() as f32;
        assert!(
            (got - want).abs() < TOL * want.max(1.0),
            "gradient norm of {name}: {got} vs {want}"
        );
    }
}

#[test]
fn sft_loss_and_gradients_match_reference() {
    let batch = golden_batch();
    let (model, vars) = Sdar::load_trainable(&tiny_dir(), DType::F32, &Device::Cpu).unwrap();
    let hidden = model.two_stream_hidden(&batch).unwrap();
    let loss = model.sft_loss(&hidden, &batch).unwrap();
    let grads = loss.backward().unwrap();
    let grads: HashMap<String, Tensor> = vars
        .data()
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(name, var)| Some((name.clone(), grads.get(var.as_tensor())?.clone())))
        .collect();
    check_against_reference(loss.to_scalar::<f32>().unwrap(), &grads);
}

#[test]
fn checkpointed_sft_loss_and_gradients_match_reference() {
    let batch = golden_batch();
    let (model, _) = Sdar::load_trainable(&tiny_dir(), DType::F32, &Device::Cpu).unwrap();
    // 1024 rows: one chunk per sample; 4 rows: 8 and 10 query chunks, 2 head chunks.
    for chunk_rows in [1024, 4] {
        println!("chunk_rows {chunk_rows}");
        let step = model.sft_loss_and_grads(&batch, chunk_rows).unwrap();
        check_against_reference(step.loss, &step.grads);
    }
}
