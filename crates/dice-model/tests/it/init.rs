//! Generated checkpoints: the formula weights bit for bit against the golden's checksums, shards,
//! seeded random weights, the files beside the weights, and a refused non-empty folder.

use crate::common::*;
use candle_core::{DType, Device, Tensor};
use dice_model::init::{fnv1a64, formula_z, InitWeights, ModelInit, TensorValues, TOKENIZER_FILES};
use dice_model::{KvCache, Sdar, SdarConfig, SdarTokenizer};
use sha2::{Digest, Sha256};
use std::path::Path;

fn sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hex_u64(text: &serde_json::Value) -> u64 {
    u64::from_str_radix(text.as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
}

#[test]
fn formula_weights_match_the_golden_checksums_bit_for_bit() {
    let weights = read_json(&formula_golden_dir().join("weights.json"));
    let config = formula_golden().config().clone();

    for example in weights["formula"]["worked_examples"].as_array().unwrap() {
        let name = example["name"].as_str().unwrap();
        let i = example["i"].as_u64().unwrap();
        assert_eq!(
            fnv1a64(name.as_bytes()),
            hex_u64(&example["fnv1a64"]),
            "{name}"
        );
        assert_eq!(
            formula_z(fnv1a64(name.as_bytes()), i),
            hex_u64(&example["z"]),
            "{name}"
        );
        let value = TensorValues::new(InitWeights::Formula, &config, name).element(i);
        assert_eq!(
            u64::from(value.to_bits()),
            hex_u64(&example["bf16_bits"]),
            "{name}[{i}]"
        );
    }

    let file = formula_tiny().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let written = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).unwrap();
    let tensors = weights["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), written.len());
    assert_eq!(tensors.len(), config.tensor_shapes().len());
    for tensor in tensors {
        let name = tensor["name"].as_str().unwrap();
        let ours = &written[name];
        assert_eq!(ours.dtype(), DType::BF16, "{name}");
        let shape: Vec<usize> = serde_json::from_value(tensor["shape"].clone()).unwrap();
        assert_eq!(ours.dims(), shape.as_slice(), "{name}");
        let values = ours.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
        let le_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let first4: Vec<u64> = values[..4].iter().map(|v| u64::from(v.to_bits())).collect();
        let want4: Vec<u64> = tensor["first4_bf16_bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(hex_u64)
            .collect();
        assert_eq!(first4, want4, "first elements of {name}");
        assert_eq!(
            sha256(&le_bytes),
            tensor["sha256_bf16_le"].as_str().unwrap(),
            "SHA-256 of {name}"
        );
    }

    let layout = &weights["model_safetensors"];
    assert_eq!(bytes.len() as u64, layout["bytes"].as_u64().unwrap());
    assert_eq!(
        u64::from_le_bytes(bytes[..8].try_into().unwrap()),
        layout["header_bytes"].as_u64().unwrap()
    );
    assert_eq!(sha256(&bytes), layout["sha256"].as_str().unwrap());

    let rule = fnv1a64(b"logit_columns");
    let columns: Vec<i64> = (0..512)
        .map(|j| (formula_z(rule, j) % config.vocab_size as u64) as i64)
        .collect();
    let stored = candle_core::safetensors::load(
        formula_golden_dir().join("expected.safetensors"),
        &Device::Cpu,
    )
    .unwrap()["logit_columns"]
        .to_vec1::<i64>()
        .unwrap();
    assert_eq!(columns, stored);
}

#[test]
fn the_folder_holds_the_tokenizer_and_a_bf16_config() {
    let dir = formula_tiny();
    for name in TOKENIZER_FILES {
        let source = test_data().join("sdar").join(name);
        if source.exists() {
            assert_eq!(
                std::fs::read(dir.join(name)).unwrap(),
                std::fs::read(&source).unwrap(),
                "{name}"
            );
        } else {
            assert!(!dir.join(name).exists(), "{name}");
        }
    }
    let mut config = formula_golden().config().clone();
    config.torch_dtype = Some("bfloat16".into());
    assert_eq!(SdarConfig::from_path(dir).unwrap(), config);
    let tokenizer = SdarTokenizer::from_dir(dir).unwrap();
    assert_eq!(tokenizer.encode("<|MASK|>").unwrap(), [151669]);
    let leftovers: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

fn prefill(dir: &Path) -> Tensor {
    let model = Sdar::load(dir, DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[151644u32, 872, 198, 55]], &Device::Cpu).unwrap();
    let mut cache = KvCache::new(model.config(), 1, 4, DType::F32, &Device::Cpu).unwrap();
    model.prefill(&ids, &mut cache).unwrap()
}

fn file_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn shards_load_like_one_file_and_a_rewrite_replaces_them() {
    let config = formula_golden().config().clone();
    let dir = tempfile::tempdir().unwrap();
    // The embedding and the lm_head (19.4 MB each) do not fit a 19.5 MB shard beside anything
    // else: the layers and the final norm (0.15 MB) share the middle one.
    let written = ModelInit {
        max_shard_bytes: 19_500_000,
        ..ModelInit::new(&config, InitWeights::Formula)
    }
    .write(dir.path())
    .unwrap();
    let shards = [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ];
    assert_eq!(
        file_names(dir.path()),
        [
            &["config.json"][..],
            &shards,
            &["model.safetensors.index.json"]
        ]
        .concat()
    );
    assert_eq!(written.parameters, config.num_parameters());
    let index = read_json(&dir.path().join("model.safetensors.index.json"));
    assert_eq!(index["metadata"]["total_size"], 2 * config.num_parameters());
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), config.tensor_shapes().len());
    assert_eq!(map["model.embed_tokens.weight"], shards[0]);
    assert_eq!(map["model.layers.1.mlp.down_proj.weight"], shards[1]);
    assert_eq!(map["lm_head.weight"], shards[2]);
    let single = prefill(formula_tiny());
    assert_eq!(max_abs_diff(&prefill(dir.path()), &single), 0.0);

    ModelInit {
        overwrite: true,
        ..ModelInit::new(&config, InitWeights::Formula)
    }
    .write(dir.path())
    .unwrap();
    assert_eq!(file_names(dir.path()), ["config.json", "model.safetensors"]);
    assert_eq!(max_abs_diff(&prefill(dir.path()), &single), 0.0);
}

#[test]
fn random_weights_follow_the_seed_and_the_reference_init() {
    let mut config = formula_golden().config().clone();
    config.vocab_size = 2048;
    let write = |seed| {
        let dir = tempfile::tempdir().unwrap();
        ModelInit::new(&config, InitWeights::Random { seed })
            .write(dir.path())
            .unwrap();
        let weights = std::fs::read(dir.path().join("model.safetensors")).unwrap();
        (dir, weights)
    };
    let (dir, first) = write(7);
    assert_eq!(first, write(7).1, "the same seed writes the same bytes");
    assert_ne!(first, write(8).1, "another seed writes other weights");

    let model = Sdar::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(model.num_parameters(), config.num_parameters());
    let tensors =
        candle_core::safetensors::load(dir.path().join("model.safetensors"), &Device::Cpu).unwrap();
    for (name, tensor) in &tensors {
        let values: Vec<f32> = tensor
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        if name.ends_with("norm.weight") {
            assert!(values.iter().all(|&v| v == 1.0), "{name}");
            continue;
        }
        let n = values.len() as f64;
        let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let std = (values
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n)
            .sqrt();
        // 2048 to 131072 draws: the sample mean and deviation are within a few standard errors.
        let std_error = config.initializer_range / n.sqrt();
        assert!(mean.abs() < 5.0 * std_error, "{name}: mean {mean}");
        assert!(
            (std / config.initializer_range - 1.0).abs() < 5.0 / (2.0 * n).sqrt() + 0.01,
            "{name}: standard deviation {std}"
        );
    }
}

#[test]
fn a_non_empty_folder_is_refused_unless_overwriting() {
    let config = formula_golden().config().clone();
    let dir = tempfile::tempdir().unwrap();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "mine").unwrap();
    let init = ModelInit::new(&config, InitWeights::Formula);
    let err = init.write(dir.path()).unwrap_err().to_string();
    assert!(err.contains("is not empty"), "{err}");
    assert_eq!(file_names(dir.path()), ["notes.txt"]);

    let err = ModelInit {
        tokenizer: Some(dir.path()),
        overwrite: true,
        ..init.clone()
    }
    .write(dir.path())
    .unwrap_err();
    assert!(format!("{err:#}").contains("tokenizer"), "{err:#}");

    ModelInit {
        overwrite: true,
        ..init
    }
    .write(dir.path())
    .unwrap();
    assert_eq!(
        file_names(dir.path()),
        ["config.json", "model.safetensors", "notes.txt"]
    );
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "mine");
}
