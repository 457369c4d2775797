//! Checkpoint loading: clear errors for bad checkpoints, sharded files, parameter counts.

use crate::common::*;
use candle_core::{DType, Device, Tensor};
use dice_model::{Sdar, SdarConfig};
use std::collections::HashMap;
use std::path::Path;

fn tiny_tensors() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(formula_tiny().join("model.safetensors"), &Device::Cpu).unwrap()
}

fn write_checkpoint(dir: &Path, config: &serde_json::Value, tensors: &HashMap<String, Tensor>) {
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    candle_core::safetensors::save(tensors, dir.join("model.safetensors")).unwrap();
}

fn load_error(config: &serde_json::Value, tensors: &HashMap<String, Tensor>) -> String {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), config, tensors);
    match Sdar::load(dir.path(), DType::F32, &Device::Cpu) {
        Ok(_) => panic!("a bad checkpoint loaded"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn missing_tensor_is_named() {
    let mut tensors = tiny_tensors();
    tensors.remove("model.layers.1.mlp.up_proj.weight");
    let err = load_error(&read_json(&formula_tiny().join("config.json")), &tensors);
    assert!(
        err.contains("missing tensor model.layers.1.mlp.up_proj.weight"),
        "{err}"
    );
}

#[test]
fn misshaped_tensor_is_named() {
    let mut tensors = tiny_tensors();
    tensors.insert(
        "model.layers.0.self_attn.k_proj.weight".into(),
        Tensor::zeros((16, 64), DType::BF16, &Device::Cpu).unwrap(),
    );
    let err = load_error(&read_json(&formula_tiny().join("config.json")), &tensors);
    assert!(
        err.contains("model.layers.0.self_attn.k_proj.weight has shape [16, 64]"),
        "{err}"
    );
    assert!(err.contains("[32, 64]"), "{err}");
}

#[test]
fn wrong_model_type_is_named() {
    let mut config = read_json(&formula_tiny().join("config.json"));
    config["model_type"] = "llama".into();
    let err = load_error(&config, &tiny_tensors());
    assert!(err.contains("model_type is \"llama\""), "{err}");
}

#[test]
fn sharded_checkpoint_loads_like_single_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        formula_tiny().join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let tensors = tiny_tensors();
    let (mut first, mut second) = (HashMap::new(), HashMap::new());
    let mut weight_map = serde_json::Map::new();
    for (name, t) in tensors {
        let shard = if name.contains("layers.1") || name.starts_with("lm_head") {
            2
        } else {
            1
        };
        let file = format!("model-0000{shard}-of-00002.safetensors");
        weight_map.insert(name.clone(), file.into());
        if shard == 1 {
            first.insert(name, t)
        } else {
            second.insert(name, t)
        };
    }
    candle_core::safetensors::save(&first, dir.path().join("model-00001-of-00002.safetensors"))
        .unwrap();
    candle_core::safetensors::save(&second, dir.path().join("model-00002-of-00002.safetensors"))
        .unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();

    let sharded = Sdar::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
    let single = Sdar::load(formula_tiny(), DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[151644u32, 872, 198, 55]], &Device::Cpu).unwrap();
    let run = |m: &Sdar| {
        let mut cache =
            dice_model::KvCache::new(m.config(), 1, 4, DType::F32, &Device::Cpu).unwrap();
        m.prefill(&ids, &mut cache).unwrap()
    };
    assert_eq!(max_abs_diff(&run(&sharded), &run(&single)), 0.0);
}

#[test]
fn parameter_counts_of_the_real_configs() {
    let configs = test_data().join("sdar/configs");
    for (file, params) in [
        ("sdar-1.7b.json", 2_031_739_904usize),
        ("sdar-4b.json", 4_411_424_256),
        ("sdar-8b.json", 8_190_735_360),
    ] {
        let config = SdarConfig::from_path(&configs.join(file)).unwrap();
        assert_eq!(config.num_parameters(), params, "{file}");
    }
}

#[test]
fn random_model_holds_the_parameters_its_config_counts() {
    let mut config = SdarConfig::from_path(formula_tiny()).unwrap();
    config.vocab_size = 1000;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let model = Sdar::random(&config, dtype, &Device::Cpu).unwrap();
        assert_eq!(model.num_parameters(), config.num_parameters());
        assert_eq!(model.dtype(), dtype);
    }
}

#[test]
fn half_precision_forward_stays_close_to_f32() {
    let ids = Tensor::new(
        &[[151644u32, 872, 198, 7985, 264, 13027, 10001, 13]],
        &Device::Cpu,
    )
    .unwrap();
    let run = |dtype| {
        let m = Sdar::load(formula_tiny(), dtype, &Device::Cpu).unwrap();
        let mut cache = dice_model::KvCache::new(m.config(), 1, 8, dtype, &Device::Cpu).unwrap();
        m.prefill(&ids, &mut cache).unwrap()
    };
    let full = run(DType::F32);
    for dtype in [DType::BF16, DType::F16] {
        let d = max_abs_diff(&run(dtype), &full);
        assert!(d < 0.1, "{dtype:?} logits differ from f32 by {d}");
    }
}
