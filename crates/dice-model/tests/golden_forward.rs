//! Prefill and cached-decode logits against the reference (f32 compute on the bf16 tiny
//! checkpoint), and the batched cache API against the single-sequence results.

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use common::*;
use dice_model::{KvCache, Sdar};

const TOL: f32 = 1e-4;

fn model() -> Sdar {
    Sdar::load(&tiny_dir(), DType::F32, &Device::Cpu).unwrap()
}

fn ids(v: &[u32]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap().unsqueeze(0).unwrap()
}

#[test]
fn prefill_and_decode_logits_match_reference() {
    let model = model();
    let cases = cases();
    let prompt = u32s(&cases["prefill"]["input_ids"]);
    let mut cache = KvCache::new(model.config(), 1, 32, DType::F32, &Device::Cpu).unwrap();
    let logits = model
        .prefill(&ids(&prompt), &mut cache)
        .unwrap()
        .squeeze(0)
        .unwrap();
    let d = max_abs_diff(&logits, &expected("prefill_logits"));
    println!("prefill logits max abs diff {d:e}");
    assert!(d < TOL, "prefill logits differ by {d}");
    assert_eq!(cache.lens(), &[prompt.len()]);

    let block = u32s(&cases["decode"]["input_ids"]);
    let logits = model
        .block_forward(&ids(&block), &mut cache, &[false])
        .unwrap()
        .squeeze(0)
        .unwrap();
    let d = max_abs_diff(&logits, &expected("decode_logits"));
    println!("decode logits max abs diff {d:e}");
    assert!(d < TOL, "decode logits differ by {d}");
    assert_eq!(
        cache.lens(),
        &[prompt.len()],
        "store_kv=false must not commit"
    );

    // A read-only step leaves the cache as it was: the same step again gives the same logits.
    let again = model
        .block_forward(&ids(&block), &mut cache, &[false])
        .unwrap()
        .squeeze(0)
        .unwrap();
    assert_eq!(max_abs_diff(&again, &logits), 0.0);
}

#[test]
fn storing_a_block_equals_prefilling_it() {
    let model = model();
    let prompt = u32s(&cases()["prefill"]["input_ids"]);
    let next = [198u32, 40, 41, 42];
    let probe = [43u32, 151669, 151669, 151669];

    let mut stepwise = KvCache::new(model.config(), 1, 32, DType::F32, &Device::Cpu).unwrap();
    model.prefill(&ids(&prompt[..8]), &mut stepwise).unwrap();
    model
        .block_forward(&ids(&prompt[8..]), &mut stepwise, &[true])
        .unwrap();
    model
        .block_forward(&ids(&next), &mut stepwise, &[true])
        .unwrap();
    let a = model
        .block_forward(&ids(&probe), &mut stepwise, &[false])
        .unwrap();

    let mut whole = KvCache::new(model.config(), 1, 32, DType::F32, &Device::Cpu).unwrap();
    let all: Vec<u32> = prompt.iter().chain(&next).copied().collect();
    model.prefill(&ids(&all), &mut whole).unwrap();
    let b = model
        .block_forward(&ids(&probe), &mut whole, &[false])
        .unwrap();
    let d = max_abs_diff(&a, &b);
    assert!(
        d < 1e-5,
        "block-by-block cache differs from one prefill by {d}"
    );
}

#[test]
fn rows_of_different_lengths_batch_like_single_sequences() {
    let model = model();
    let prompt = u32s(&cases()["prefill"]["input_ids"]);
    let short = &prompt[..4];
    let block = [198u32, 151669, 151669, 151669];
    let cfg = model.config();

    let single = |p: &[u32]| {
        let mut cache = KvCache::new(cfg, 1, 32, DType::F32, &Device::Cpu).unwrap();
        let pre = model
            .prefill(&ids(p), &mut cache)
            .unwrap()
            .squeeze(0)
            .unwrap();
        let dec = model
            .block_forward(&ids(&block), &mut cache, &[false])
            .unwrap()
            .squeeze(0)
            .unwrap();
        (pre, dec)
    };
    let (long_pre, long_dec) = single(&prompt);
    let (short_pre, short_dec) = single(short);

    // Batched prefill with right padding: row 1 commits only its 4 real tokens.
    let mut padded = short.to_vec();
    padded.resize(prompt.len(), 151643);
    let flat: Vec<u32> = prompt.iter().chain(&padded).copied().collect();
    let batch = Tensor::from_vec(flat, (2, prompt.len()), &Device::Cpu).unwrap();
    let mut cache = KvCache::new(cfg, 2, 32, DType::F32, &Device::Cpu).unwrap();
    let pre = model
        .forward(&batch, &mut cache, &[prompt.len(), short.len()])
        .unwrap();
    assert_eq!(cache.lens(), &[12, 4]);
    assert!(max_abs_diff(&pre.i(0).unwrap(), &long_pre) < 1e-5);
    assert!(max_abs_diff(&pre.i((1, ..4)).unwrap(), &short_pre) < 1e-5);

    // One decoding step over rows with 12 and 4 cached positions.
    let blocks = Tensor::new(&[block, block], &Device::Cpu).unwrap();
    let dec = model
        .block_forward(&blocks, &mut cache, &[false, false])
        .unwrap();
    assert!(max_abs_diff(&dec.i(0).unwrap(), &long_dec) < 1e-5);
    assert!(max_abs_diff(&dec.i(1).unwrap(), &short_dec) < 1e-5);

    // Rows move between caches without changing their results.
    let mut moved = KvCache::new(cfg, 2, 32, DType::F32, &Device::Cpu).unwrap();
    moved
        .copy_row_from(1, &cache.select_rows(&[1, 0]).unwrap(), 1)
        .unwrap();
    moved.truncate_row(0, 0).unwrap();
    assert_eq!(moved.lens(), &[0, 12]);
    let dec = model
        .block_forward(&blocks, &mut moved, &[false, false])
        .unwrap();
    assert!(max_abs_diff(&dec.i(1).unwrap(), &long_dec) < 1e-5);
}

#[test]
fn cache_overflow_is_an_error() {
    let model = model();
    let mut cache = KvCache::new(model.config(), 1, 4, DType::F32, &Device::Cpu).unwrap();
    let err = model
        .prefill(&ids(&[1, 2, 3, 4, 5, 6, 7, 8]), &mut cache)
        .unwrap_err();
    assert!(format!("{err:#}").contains("capacity"), "{err:#}");
    let err = model.prefill(&ids(&[1, 2, 3]), &mut cache).unwrap_err();
    assert!(format!("{err:#}").contains("block size"), "{err:#}");
}

#[test]
fn long_prefill_in_query_chunks_equals_two_prefills() {
    let model = model();
    let cfg = model.config();
    let tokens: Vec<u32> = (0..1032u32).map(|i| (i * 7919) % 151000).collect();
    let mut whole = KvCache::new(cfg, 1, 1032, DType::F32, &Device::Cpu).unwrap();
    let all = model
        .forward_hidden(&ids(&tokens), &mut whole, &[1032])
        .unwrap();
    let mut split = KvCache::new(cfg, 1, 1032, DType::F32, &Device::Cpu).unwrap();
    let head = model
        .forward_hidden(&ids(&tokens[..1024]), &mut split, &[1024])
        .unwrap();
    let tail = model
        .forward_hidden(&ids(&tokens[1024..]), &mut split, &[8])
        .unwrap();
    let joined = Tensor::cat(&[head, tail], 1).unwrap();
    let d = max_abs_diff(&all, &joined);
    assert!(d < 1e-5, "chunked prefill differs by {d}");
}

/// Static greedy decoding (top_k = 1: every candidate has confidence 1, so each step unmasks
/// the leftmost mask, spec §4.4) driven through the public cache API reproduces the
/// reference generation token for token.
#[test]
fn static_greedy_generation_through_the_cache_api() {
    let model = model();
    let case = &cases()["generate"][0];
    assert_eq!(case["name"], "static_greedy");
    let expected_ids = u32s(&case["output_ids"]);
    let prompt = u32s(&case["prompt_ids"]);
    let (bs, mask) = (4, model.config().mask_token_id);
    let mut x = prompt.clone();
    x.resize(expected_ids.len(), mask);
    let prefill = prompt.len() / bs * bs;
    let mut cache = KvCache::new(model.config(), 1, x.len(), DType::F32, &Device::Cpu).unwrap();
    model.prefill(&ids(&x[..prefill]), &mut cache).unwrap();
    for start in (prefill..x.len()).step_by(bs) {
        while let Some(i) = x[start..start + bs].iter().position(|&t| t == mask) {
            let logits = model
                .block_forward(&ids(&x[start..start + bs]), &mut cache, &[false])
                .unwrap();
            x[start + i] = logits
                .i((0, i))
                .unwrap()
                .argmax(0)
                .unwrap()
                .to_scalar::<u32>()
                .unwrap();
        }
        model
            .block_forward(&ids(&x[start..start + bs]), &mut cache, &[true])
            .unwrap();
    }
    assert_eq!(x, expected_ids);
}

/// Stacking each layer's q/k/v and gate/up weights (what the fused CUDA forward multiplies by)
/// leaves every forward as it was: the separate weights become exact views of the stacks.
#[test]
fn stacked_projections_give_the_same_logits() {
    let prompt: Vec<u32> = (0..12).map(|i| (i * 31 + 7) % 500).collect();
    let run = |model: &Sdar| {
        let mut cache = KvCache::new(model.config(), 1, 32, DType::F32, &Device::Cpu).unwrap();
        let prefill = model.prefill(&ids(&prompt), &mut cache).unwrap();
        let block = model
            .block_forward(&ids(&prompt[..4]), &mut cache, &[false])
            .unwrap();
        [prefill, block]
    };
    let separate = run(&model());
    let mut stacked = model();
    stacked.concatenate_projections().unwrap();
    for (a, b) in separate.iter().zip(&run(&stacked)) {
        assert_eq!(max_abs_diff(a, b), 0.0);
    }
}
