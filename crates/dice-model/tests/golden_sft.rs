//! The two-stream SFT loss and its gradients against the reference (noise draw from cases.json).

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use dice_model::{PackedRow, Sdar, TwoStreamBatch};

const TOL: f32 = 1e-4;

#[test]
fn sft_loss_and_gradients_match_reference() {
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
    let batch = TwoStreamBatch::new(&[row]).unwrap();
    let (model, vars) = Sdar::load_trainable(&tiny_dir(), DType::F32, &Device::Cpu).unwrap();
    let hidden = model.two_stream_hidden(&batch).unwrap();
    let loss = model.sft_loss(&hidden, &batch).unwrap();
    let value = loss.to_scalar::<f32>().unwrap();
    let reference = case["loss"].as_f64().unwrap() as f32;
    println!(
        "sft loss {value} (reference {reference}), diff {:e}",
        (value - reference).abs()
    );
    assert!((value - reference).abs() < TOL);

    let grads = loss.backward().unwrap();
    let data = vars.data().lock().unwrap();
    let grad_of = |name: &str| {
        grads
            .get(data[name].as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"))
            .clone()
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
            grad_of("model.layers.0.self_attn.q_proj.weight"),
        ),
    ];
    for (name, got) in checks {
        let d = max_abs_diff(&got, &expected(name));
        println!("{name} max abs diff {d:e}");
        assert!(d < TOL, "{name} differs by {d}");
    }
    for (name, norm) in case["grad_norms"].as_object().unwrap() {
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
