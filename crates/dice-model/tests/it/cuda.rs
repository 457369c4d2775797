//! CUDA against CPU on a random checkpoint (run with `--features cuda` on a GPU machine):
//! every forward path, including per-row cache writes, the differentiable SFT path and the
//! checkpointed SFT step.
//! Without the `cuda` feature the tests are ignored; with it, a machine without a GPU fails them.

use candle_core::{DType, Device, IndexOp, Tensor};
use dice_model::device::cuda_device;
use dice_model::{KvCache, PackedRow, Sdar, SdarConfig, TwoStreamBatch};
use std::collections::HashMap;

fn random_checkpoint() -> (tempfile::TempDir, SdarConfig) {
    let config = serde_json::json!({
        "model_type": "sdar", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "block_size": 4, "mask_token_id": 511
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let config: SdarConfig = serde_json::from_value(config).unwrap();
    let tensors: HashMap<String, Tensor> = config
        .tensor_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let t = if shape.len() == 1 {
                (Tensor::randn(0f32, 0.1, shape, &Device::Cpu).unwrap() + 1.0).unwrap()
            } else {
                Tensor::randn(0f32, 0.05, shape, &Device::Cpu).unwrap()
            };
            (name, t.to_dtype(DType::BF16).unwrap())
        })
        .collect();
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
    (dir, config)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let b = b
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// Batched prefill of rows with 12 and 4 real tokens, one read-only and one storing step.
fn run_paths(model: &Sdar, device: &Device) -> Vec<Tensor> {
    let cfg = model.config();
    let long: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 500).collect();
    let mut short: Vec<u32> = long[..4].to_vec();
    short.resize(12, 0);
    let ids = Tensor::from_vec([long.clone(), short].concat(), (2, 12), device).unwrap();
    let mut cache = KvCache::new(cfg, 2, 32, model.dtype(), device).unwrap();
    let pre = model.forward(&ids, &mut cache, &[12, 4]).unwrap();
    let block = Tensor::new(&[[7u32, 511, 511, 511], [9, 511, 511, 511]], device).unwrap();
    let dec = model
        .block_forward(&block, &mut cache, &[false, true])
        .unwrap();
    let dec2 = model
        .block_forward(&block, &mut cache, &[false, false])
        .unwrap();
    let one = Tensor::new(long.as_slice(), device)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mut single = KvCache::new(cfg, 1, 16, model.dtype(), device).unwrap();
    let alone = model.prefill(&one, &mut single).unwrap();
    vec![pre, dec, dec2, alone]
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs the cuda feature and a GPU")]
fn cuda_forward_matches_cpu() {
    let (dir, _) = random_checkpoint();
    let gpu = cuda_device(0).unwrap();
    let cpu_model = Sdar::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
    let reference = run_paths(&cpu_model, &Device::Cpu);
    for (dtype, tol) in [
        (DType::F32, 1e-4f32),
        (DType::BF16, 0.1),
        (DType::F16, 0.05),
    ] {
        let model = Sdar::load(dir.path(), dtype, &gpu).unwrap();
        let got = run_paths(&model, &gpu);
        for (i, (g, r)) in got.iter().zip(&reference).enumerate() {
            let d = max_diff(g, r);
            println!("{dtype:?} path {i}: max abs diff {d:e}");
            assert!(d < tol, "{dtype:?} path {i} differs by {d}");
        }
        assert!(max_diff(&got[3].i(0).unwrap(), &got[0].i(0).unwrap()) < tol);
    }
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs the cuda feature and a GPU")]
fn cuda_sft_gradients_match_cpu() {
    let (dir, _) = random_checkpoint();
    let batch = TwoStreamBatch::new(&[scored_row(16, 1)]).unwrap();
    let grads_on = |device: &Device| {
        let (model, vars) = Sdar::load_trainable(dir.path(), DType::F32, device).unwrap();
        let loss = model
            .sft_loss(&model.two_stream_hidden(&batch).unwrap(), &batch)
            .unwrap();
        let grads = loss.backward().unwrap();
        let data = vars.data().lock().unwrap();
        let q = grads
            .get(data["model.layers.0.self_attn.q_proj.weight"].as_tensor())
            .unwrap()
            .clone();
        (loss, q)
    };
    let (cpu_loss, cpu_q) = grads_on(&Device::Cpu);
    let gpu = cuda_device(0).unwrap();
    let (gpu_loss, gpu_q) = grads_on(&gpu);
    assert!(max_diff(&cpu_loss, &gpu_loss) < 1e-4);
    assert!(max_diff(&cpu_q, &gpu_q) < 1e-4);
    // The checkpointed step on the GPU, with query and head chunks of 5 rows.
    let model = Sdar::load(dir.path(), DType::F32, &gpu).unwrap();
    let step = model.sft_loss_and_grads(&batch, 5).unwrap();
    let cpu_loss: f32 = cpu_loss.to_scalar().unwrap();
    assert!((step.loss - cpu_loss).abs() < 1e-4);
    assert!(
        max_diff(
            &cpu_q,
            &step.grads["model.layers.0.self_attn.q_proj.weight"]
        ) < 1e-4
    );
}

/// A packed row of `n` tokens whose positions from 5 on are scored, every third of them noised.
fn scored_row(n: usize, seed: u32) -> PackedRow {
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 13 + seed) % 500).collect();
    let noised: Vec<usize> = (5..n).filter(|i| i % 3 == 0).collect();
    PackedRow {
        noisy_ids: ids
            .iter()
            .enumerate()
            .map(|(i, &t)| if noised.contains(&i) { 511 } else { t })
            .collect(),
        input_ids: ids.clone(),
        labels: (0..n)
            .map(|i| if i > 4 { ids[i] as i64 } else { -100 })
            .collect(),
        position_ids: (0..n as u32).collect(),
        p_mask: vec![0.5; noised.len()],
        masked_positions: noised,
    }
}

/// ‖a − b‖ / ‖b‖ over all elements, in f32 on the CPU.
fn relative_error(a: &Tensor, b: &Tensor) -> f32 {
    let on_cpu = |t: &Tensor| {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let (a, b) = (on_cpu(a), on_cpu(b));
    let norm = |t: &Tensor| -> f32 {
        t.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .sqrt()
            .unwrap()
            .to_scalar()
            .unwrap()
    };
    norm(&(&a - &b).unwrap()) / norm(&b)
}

/// The checkpointed SFT step in bf16 on the GPU, where the layers take the fused training
/// layer and attention (two packed samples spanning several query and key tiles, GQA), against
/// the same step in f32 on the CPU's composite path: the loss and every weight's gradient agree
/// to bf16's rounding.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs the cuda feature and a GPU")]
fn cuda_fused_sft_step_matches_the_composite_cpu_step() {
    let (dir, _) = random_checkpoint();
    let batch = TwoStreamBatch::new(&[scored_row(150, 1), scored_row(41, 7)]).unwrap();
    let cpu = Sdar::load(dir.path(), DType::F32, &Device::Cpu)
        .unwrap()
        .sft_loss_and_grads(&batch, 64)
        .unwrap();
    let gpu = cuda_device(0).unwrap();
    let fused = Sdar::load(dir.path(), DType::BF16, &gpu)
        .unwrap()
        .sft_loss_and_grads(&batch, 64)
        .unwrap();
    println!("loss: cpu f32 {} gpu bf16 {}", cpu.loss, fused.loss);
    assert!((fused.loss - cpu.loss).abs() < 2e-2 * cpu.loss.abs().max(1.0));
    assert_eq!(fused.grads.len(), cpu.grads.len());
    for (key, want) in &cpu.grads {
        let error = relative_error(&fused.grads[key], want);
        println!("{key}: relative error {error:e}");
        assert!(error < 3e-2, "{key}: relative error {error}");
    }
}

/// A TraceRL-shaped masked sequence (block-causal rows over a left-padded prompt, each row
/// seeing itself) with its key spans: in bf16 on the GPU the fused training layer and attention
/// take it; its loss and every weight's gradient agree with the f32 composite step on the CPU
/// to bf16's rounding.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs the cuda feature and a GPU")]
fn cuda_fused_masked_step_matches_the_composite_cpu_step() {
    use dice_model::masks::{additive_mask, block_causal_allowed, KeySpans};
    use dice_model::MaskedSequence;
    let (dir, _) = random_checkpoint();
    let n = 150;
    let visible = |q: usize, k: usize| (k >= 6 && block_causal_allowed(q, k, 4)) || k == q;
    let sequence_on = |device: &Device| MaskedSequence {
        tokens: (0..n as u32).map(|i| (i * 7 + 3) % 500).collect(),
        positions: (0..n as u32).collect(),
        mask: Some(additive_mask(n, n, visible, device).unwrap()),
        spans: KeySpans::from_predicate(n, visible),
        rows: (10..n as u32).step_by(3).collect(),
        labels: (10..n as u32).step_by(3).map(|i| (i * 11) % 500).collect(),
    };
    let loss = |log_probs: &Tensor, _: std::ops::Range<usize>| log_probs.neg()?.sum_all();
    let cpu = Sdar::load(dir.path(), DType::F32, &Device::Cpu)
        .unwrap()
        .masked_loss_and_grads(&sequence_on(&Device::Cpu), loss, 64)
        .unwrap();
    let gpu = cuda_device(0).unwrap();
    let fused = Sdar::load(dir.path(), DType::BF16, &gpu)
        .unwrap()
        .masked_loss_and_grads(&sequence_on(&gpu), loss, 64)
        .unwrap();
    println!("masked loss: cpu f32 {} gpu bf16 {}", cpu.loss, fused.loss);
    assert!((fused.loss - cpu.loss).abs() < 2e-2 * cpu.loss.abs().max(1.0));
    for (key, want) in &cpu.grads {
        let error = relative_error(&fused.grads[key], want);
        println!("{key}: relative error {error:e}");
        assert!(error < 3e-2, "{key}: relative error {error}");
    }
}

/// Decoding over caches long enough for the fused attention to split each row's keys over
/// several CTAs and merge them (batch 2, rows of 196 and 100 cached positions, block forwards
/// storing and read-only), against the CPU's matmul attention.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs the cuda feature and a GPU")]
fn cuda_decoding_over_a_long_cache_matches_cpu() {
    let (dir, _) = random_checkpoint();
    let decode = |model: &Sdar, device: &Device| -> Vec<Tensor> {
        let cfg = model.config();
        let prompt: Vec<u32> = (0..196).map(|i| (i * 53 + 11) % 500).collect();
        let mut short = prompt[..100].to_vec();
        short.resize(prompt.len(), 0);
        let ids = Tensor::from_vec([prompt.clone(), short].concat(), (2, 196), device).unwrap();
        let mut cache = KvCache::new(cfg, 2, 256, model.dtype(), device).unwrap();
        model.forward(&ids, &mut cache, &[196, 100]).unwrap();
        let block = Tensor::new(&[[3u32, 511, 511, 511], [8, 511, 511, 511]], device).unwrap();
        let stored = model
            .block_forward(&block, &mut cache, &[true, true])
            .unwrap();
        let read_only = model
            .block_forward(&block, &mut cache, &[false, false])
            .unwrap();
        assert_eq!(cache.lens(), &[200, 104]);
        vec![stored, read_only]
    };
    let cpu_model = Sdar::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
    let reference = decode(&cpu_model, &Device::Cpu);
    let gpu = cuda_device(0).unwrap();
    for (dtype, tol) in [
        (DType::F32, 1e-4f32),
        (DType::BF16, 0.1),
        (DType::F16, 0.05),
    ] {
        let model = Sdar::load(dir.path(), dtype, &gpu).unwrap();
        for (i, (g, r)) in decode(&model, &gpu).iter().zip(&reference).enumerate() {
            let d = max_diff(g, r);
            println!("{dtype:?} long-cache step {i}: max abs diff {d:e}");
            assert!(d < tol, "{dtype:?} long-cache step {i} differs by {d}");
        }
    }
}

/// A captured decoding forward replayed step after step (positions moving on, rows of unequal
/// lengths, storing and read-only steps) gives the CPU's op-by-op logits, with the separate and
/// with the stacked q/k/v and gate/up weights.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs the cuda feature and a GPU")]
fn cuda_graph_replays_match_cpu() {
    #[cfg(feature = "cuda")]
    graph_replays_match_cpu();
}

/// The body of [`cuda_graph_replays_match_cpu`]: CUDA graphs exist only with the cuda feature.
#[cfg(feature = "cuda")]
fn graph_replays_match_cpu() {
    let (dir, _) = random_checkpoint();
    let steps: [[usize; 2]; 4] = [[4, 4], [0, 0], [4, 0], [0, 4]];
    let prompt: Vec<u32> = (0..196).map(|i| (i * 29 + 3) % 500).collect();
    let mut short = prompt[..100].to_vec();
    short.resize(prompt.len(), 0);
    let prefill = |model: &Sdar, device: &Device| -> KvCache {
        let ids =
            Tensor::from_vec([prompt.clone(), short.clone()].concat(), (2, 196), device).unwrap();
        let mut cache = KvCache::new(model.config(), 2, 256, model.dtype(), device).unwrap();
        model.forward(&ids, &mut cache, &[196, 100]).unwrap();
        cache
    };
    let block = |step: usize, device: &Device| {
        let s = step as u32;
        Tensor::new(&[[3 + s, 511, 511, 511], [8 + s, 7, 511, 511]], device).unwrap()
    };
    let cpu_model = Sdar::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
    let mut cpu_cache = prefill(&cpu_model, &Device::Cpu);
    let reference: Vec<Tensor> = steps
        .iter()
        .enumerate()
        .map(|(i, commit)| {
            cpu_model
                .forward(&block(i, &Device::Cpu), &mut cpu_cache, commit)
                .unwrap()
        })
        .collect();
    let gpu = cuda_device(0).unwrap();
    for (dtype, tol, stacked) in [
        (DType::F32, 1e-4f32, false),
        (DType::BF16, 0.1, false),
        (DType::F32, 1e-4, true),
    ] {
        let mut model = Sdar::load(dir.path(), dtype, &gpu).unwrap();
        if stacked {
            model.concatenate_projections().unwrap();
        }
        let mut cache = prefill(&model, &gpu);
        let graph = model
            .capture_decode(&cache, 4)
            .unwrap()
            .expect("a CUDA graph for the fused decoding forward");
        for (i, commit) in steps.iter().enumerate() {
            let hidden = graph
                .forward_hidden(
                    &model,
                    &block(i, &Device::Cpu)
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<u32>()
                        .unwrap(),
                    &mut cache,
                    commit,
                )
                .unwrap();
            let d = max_diff(&model.logits(&hidden).unwrap(), &reference[i]);
            println!(
                "{dtype:?} (stacked projections: {stacked}) graph replay {i}: max abs diff {d:e}"
            );
            assert!(d < tol, "{dtype:?} graph replay {i} differs by {d}");
        }
        assert_eq!(cache.lens(), cpu_cache.lens());
    }
}

/// The greedy kernel gives what a plain scan of the logits gives: the lowest index of each row's
/// maximum, how many entries tie with it, and whether the row is unusable (a NaN, a +inf
/// maximum, only -inf), over a real vocabulary with many exact ties.
#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs the cuda feature and a GPU")]
fn cuda_greedy_summary_matches_a_scan() {
    #[cfg(feature = "cuda")]
    greedy_summary_matches_a_scan();
}

/// The body of [`cuda_greedy_summary_matches_a_scan`]: the greedy kernel exists only with the
/// cuda feature.
#[cfg(feature = "cuda")]
fn greedy_summary_matches_a_scan() {
    let gpu = cuda_device(0).unwrap();
    let (rows, vocab) = (6, 151_936);
    let mut values: Vec<f32> = (0..rows * vocab)
        .map(|i| ((i * 7919) % 17) as f32 - 8.0)
        .collect();
    values[vocab / 2] = f32::NAN;
    values[2 * vocab - 1] = f32::INFINITY;
    values[2 * vocab..3 * vocab].fill(f32::NEG_INFINITY);
    values[4 * vocab - 1] = 100.0;
    let logits = Tensor::from_vec(values, (rows, vocab), &gpu).unwrap();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let logits = logits.to_dtype(dtype).unwrap();
        let got = dice_model::greedy_summary(&logits)
            .unwrap()
            .to_vec2::<u32>()
            .unwrap();
        let host = logits
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (r, row) in host.iter().enumerate() {
            let (mut best, mut index, mut ties, mut nan) = (0f32, 0u32, 0u32, false);
            for (i, &v) in row.iter().enumerate() {
                if v.is_nan() {
                    nan = true;
                } else if ties == 0 || v > best {
                    (best, index, ties) = (v, i as u32, 1);
                } else if v == best {
                    ties += 1;
                }
            }
            let unusable = u32::from(nan || best.is_infinite());
            let want = [index, ties, unusable];
            assert_eq!([got[0][r], got[1][r], got[2][r]], want, "{dtype:?} row {r}");
        }
    }
}

#[test]
#[cfg_attr(not(feature = "cuda"), ignore = "needs the cuda feature and a GPU")]
fn cuda_freed_memory_stays_pooled_and_counts_as_free() {
    let device = cuda_device(0).unwrap();
    let (free_before, _) = dice_model::memory::free_and_total(&device)
        .unwrap()
        .unwrap();
    let buffer = Tensor::zeros(256 << 20, DType::F32, &device).unwrap(); // 1 GiB
    device.synchronize().unwrap();
    let (free_with_buffer, _) = dice_model::memory::free_and_total(&device)
        .unwrap()
        .unwrap();
    assert!(free_before - free_with_buffer >= 1 << 30);
    drop(buffer);
    // The synchronization that would hand the bytes back to the driver by CUDA's default.
    device.synchronize().unwrap();
    let (free_after, _) = dice_model::memory::free_and_total(&device)
        .unwrap()
        .unwrap();
    let pooled = free_before.abs_diff(free_after);
    assert!(
        pooled < 64 << 20,
        "{pooled} bytes neither free nor in use after the drop"
    );
    // Allocating again reuses the pooled bytes: what the driver counts as used does not grow.
    let driver_free = driver_free_bytes(&device);
    let again = Tensor::zeros(256 << 20, DType::F32, &device).unwrap();
    device.synchronize().unwrap();
    assert!(driver_free.abs_diff(driver_free_bytes(&device)) < 64 << 20);
    drop(again);
}

/// Free bytes as the driver counts them (the pool's idle bytes as used).
#[cfg(feature = "cuda")]
fn driver_free_bytes(device: &Device) -> usize {
    match device {
        Device::Cuda(cuda) => cuda.cuda_stream().context().mem_get_info().unwrap().0,
        _ => unreachable!("a CUDA device"),
    }
}

#[cfg(not(feature = "cuda"))]
fn driver_free_bytes(_device: &Device) -> usize {
    unreachable!("the test is ignored without the cuda feature")
}
