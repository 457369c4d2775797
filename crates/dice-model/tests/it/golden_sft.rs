//! The two-stream SFT loss and its gradients against the formula golden (noise draw from
//! cases.json), through the single-graph path and the checkpointed one.

use crate::common::*;
use candle_core::{DType, Device, Tensor};
use dice_model::Sdar;
use std::collections::HashMap;

/// Prints and asserts the loss and gradient measurements against the golden.
fn check_against_reference(loss: f32, grads: &HashMap<String, Tensor>) {
    let measurements = formula_golden()
        .measure_sft(f64::from(loss), grads)
        .unwrap();
    assert_within_f32_tolerances(&measurements);
}

#[test]
fn sft_loss_and_gradients_match_reference() {
    let batch = formula_golden().sft_batch().unwrap();
    let (model, vars) = Sdar::load_trainable(formula_tiny(), DType::F32, &Device::Cpu).unwrap();
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
    let batch = formula_golden().sft_batch().unwrap();
    let (model, _) = Sdar::load_trainable(formula_tiny(), DType::F32, &Device::Cpu).unwrap();
    // 1024 rows: one chunk per sample; 4 rows: 8 and 10 query chunks, 2 head chunks.
    for chunk_rows in [1024, 4] {
        println!("chunk_rows {chunk_rows}");
        let step = model.sft_loss_and_grads(&batch, chunk_rows).unwrap();
        check_against_reference(step.loss, &step.grads);
    }
}
