//! The four greedy generations of the formula golden (`cases.json` "generate") on its tiny
//! checkpoint, CPU f32, token for token; batching and seeding on the same checkpoint.

use candle_core::{DType, Device};
use dice_engine::{
    DecodeParams, Engine, EngineConfig, Request, SamplingParams, SdarDecoder, Strategy,
};
use dice_test_support::checkpoint::{formula_golden, formula_tiny};
use serde_json::Value;

fn cases() -> Vec<Value> {
    formula_golden().generations().unwrap().to_vec()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn engine(block_length: usize, max_batch: usize) -> Engine<SdarDecoder> {
    let model = SdarDecoder::load(formula_tiny(), DType::F32, &Device::Cpu, block_length).unwrap();
    let config = EngineConfig {
        max_batch,
        max_seq_len: 256,
        max_prefill_tokens: 4096,
    };
    Engine::new(model, config).unwrap()
}

fn params_of(case: &Value) -> DecodeParams {
    DecodeParams::from_reference_case(case).unwrap()
}

#[test]
fn greedy_generations_match_the_reference_token_for_token() {
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let prompt = u32s(&case["prompt_ids"]);
        let expected = u32s(&case["output_ids"]);
        let params = params_of(&case);
        let mut e = engine(params.block_length, 1);
        let out = e
            .generate(vec![Request {
                prompt: prompt.clone(),
                params,
            }])
            .unwrap()
            .remove(0);
        assert_eq!(out.token_ids, expected[prompt.len()..], "case {name}");
    }
}

#[test]
fn greedy_static_trace_is_one_forward_per_token_left_to_right() {
    let case = &cases()[0];
    let prompt = u32s(&case["prompt_ids"]);
    let params = params_of(case);
    let out = engine(4, 1)
        .generate(vec![Request { prompt, params }])
        .unwrap()
        .remove(0);
    // Spec §8 item 5: within each block the positions are unmasked 0,1,2,3 (c..3 in the first
    // block), one per forward, so the trace counts 1, 2, 3, ... over the whole response.
    let expected: Vec<u32> = (1..=out.token_ids.len() as u32).collect();
    assert_eq!(out.trace, expected);
}

fn prompts() -> Vec<Vec<u32>> {
    let base = u32s(&cases()[0]["prompt_ids"]);
    vec![
        base.clone(),
        base[..9].to_vec(),
        [&base[..3], &[7985, 264, 2038, 13], &base[8..]].concat(),
        base[4..].to_vec(),
        [&base[..], &base[..]].concat(),
    ]
}

#[test]
fn batched_greedy_generation_equals_generating_each_alone() {
    let params = DecodeParams::dice_eval(16);
    let requests: Vec<Request> = prompts()
        .into_iter()
        .map(|prompt| Request {
            prompt,
            params: params.clone(),
        })
        .collect();
    let alone: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| {
            engine(4, 1)
                .generate(vec![r.clone()])
                .unwrap()
                .remove(0)
                .token_ids
        })
        .collect();
    // Three slots for five prompts of different lengths: rows at different cache lengths,
    // and slots refilled while others are mid-generation.
    let together = engine(4, 3).generate(requests).unwrap();
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, &b.token_ids, "prompt {i}");
    }
}

#[test]
fn same_seed_same_sample_other_seeds_differ() {
    let prompt = u32s(&cases()[0]["prompt_ids"]);
    let sample = |seed: u64, others: usize| {
        let params = DecodeParams {
            strategy: Strategy::LowConfidenceDynamic { threshold: 0.9 },
            sampling: SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
            },
            seed,
            ..DecodeParams::dice_eval(12)
        };
        let mut requests = vec![Request {
            prompt: prompt.clone(),
            params: params.clone(),
        }];
        // Unrelated sequences in the batch must not change this one's draws.
        for other in 0..others {
            requests.push(Request {
                prompt: prompt[other..].to_vec(),
                params: DecodeParams {
                    seed: seed + 100 + other as u64,
                    ..params.clone()
                },
            });
        }
        engine(4, 4).generate(requests).unwrap().remove(0).token_ids
    };
    let first = sample(5, 0);
    assert_eq!(first, sample(5, 0));
    assert_eq!(first, sample(5, 3));
    assert_ne!(first, sample(6, 0));
    assert_ne!(first, sample(7, 0));
}

/// What `dice bench golden` checks of the generations, on the CPU in f32: every case equal.
#[test]
fn check_generations_finds_every_case_equal_in_f32() {
    let checks = dice_engine::golden::check_generations(
        &formula_golden(),
        formula_tiny(),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(checks.len(), cases().len());
    for check in &checks {
        assert_eq!(check.first_difference, None, "case {}", check.name);
        assert!(check.passes(DType::F32));
    }
}
