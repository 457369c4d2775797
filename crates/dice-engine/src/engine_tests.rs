use super::*;
use crate::sampling::SamplingParams;
use crate::strategy::{Overflow, Strategy};
use crate::test_model::{HashModel, MASK, VOCAB};

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (seed * 7 + i * 3) % 60).collect()
}

fn engine(max_batch: usize) -> Engine<HashModel> {
    Engine::new(
        HashModel::default(),
        EngineConfig {
            max_batch,
            max_seq_len: 128,
            max_prefill_tokens: 16,
        },
    )
    .unwrap()
}

fn request(prompt: Vec<u32>, params: &DecodeParams) -> Request {
    Request {
        prompt,
        params: params.clone(),
    }
}

fn sampled(seed: u64) -> DecodeParams {
    DecodeParams {
        strategy: Strategy::LowConfidenceDynamic { threshold: 0.6 },
        sampling: SamplingParams {
            temperature: 1.3,
            top_k: 0,
            top_p: 0.95,
        },
        seed,
        ..DecodeParams::dice_eval(20)
    }
}

#[test]
fn batched_generation_equals_generating_alone() {
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(i, 5 + 3 * i as usize)).collect();
    for params in [DecodeParams::dice_eval(13), sampled(11)] {
        let alone: Vec<Completion> = prompts
            .iter()
            .map(|p| {
                engine(1)
                    .generate(vec![request(p.clone(), &params)])
                    .unwrap()
                    .remove(0)
            })
            .collect();
        let mut batched = engine(3);
        let together = batched
            .generate(
                prompts
                    .iter()
                    .map(|p| request(p.clone(), &params))
                    .collect(),
            )
            .unwrap();
        for (a, b) in alone.iter().zip(&together) {
            assert_eq!(a.token_ids, b.token_ids);
            assert_eq!(a.trace, b.trace);
        }
        let calls = batched.model().calls.borrow();
        assert!(calls
            .iter()
            .any(|&(kind, rows)| kind == "forward" && rows == 3));
    }
}

#[test]
fn greedy_and_sampled_rows_of_one_forward_equal_generating_alone() {
    // Greedy rows take their candidates on the logits' device, sampled rows on the host.
    let requests: Vec<Request> = (0..4)
        .map(|i| {
            let params = if i % 2 == 0 {
                DecodeParams::dice_eval(13)
            } else {
                sampled(i)
            };
            request(prompt(i as u32, 6 + i as usize), &params)
        })
        .collect();
    let alone: Vec<Completion> = requests
        .iter()
        .map(|r| engine(1).generate(vec![r.clone()]).unwrap().remove(0))
        .collect();
    let mut together = engine(4);
    let batched = together.generate(requests).unwrap();
    for (a, b) in alone.iter().zip(&batched) {
        assert_eq!((&a.token_ids, &a.trace), (&b.token_ids, &b.trace));
    }
    let calls = together.model().calls.borrow();
    assert!(calls
        .iter()
        .any(|&(kind, rows)| kind == "forward" && rows == 4));
}

#[test]
fn a_freed_slot_is_refilled_before_the_next_forward() {
    let mut e = engine(2);
    let short = DecodeParams::dice_eval(4);
    let long = DecodeParams::dice_eval(40);
    e.submit(request(prompt(1, 8), &short)).unwrap();
    e.submit(request(prompt(2, 8), &long)).unwrap();
    e.submit(request(prompt(3, 8), &long)).unwrap();
    let mut steps = 0;
    loop {
        steps += 1;
        let events = e.step().unwrap();
        if events.iter().any(|ev| matches!(ev, Event::Finished(_))) {
            break;
        }
    }
    // 4 denoising forwards for the single block of the short request, then the step that
    // commits it (the long requests store their first block beside it).
    assert_eq!(steps, 5);
    e.model().calls.borrow_mut().clear();
    e.step().unwrap();
    assert_eq!(e.active.len(), 2, "the third request took the free slot");
    assert!(e.waiting.is_empty());
    assert_eq!(
        *e.model().calls.borrow(),
        vec![("prefill", 1), ("forward", 2), ("store", 0), ("merged", 0)]
    );
}

/// Sequences that finish in slot order give their slots back in that order; once none runs,
/// the next request still takes slot 0, as in a new engine.
#[test]
fn an_idle_engine_hands_out_its_slots_as_a_new_one() {
    let mut e = engine(3);
    let first: Vec<Request> = (0..3)
        .map(|i| request(prompt(i, 8), &DecodeParams::dice_eval(4 + 8 * i as usize)))
        .collect();
    e.generate(first).unwrap();
    assert!(!e.has_work());
    e.submit(request(prompt(5, 8), &DecodeParams::dice_eval(4)))
        .unwrap();
    e.step().unwrap();
    let slots: Vec<usize> = e.active.iter().map(|a| a.slot).collect();
    assert_eq!(slots, [0]);
}

/// The sum of the calls of `kind` (their rows) and how many there were.
fn calls_of(model: &HashModel, kind: &str) -> (usize, usize) {
    let calls = model.calls.borrow();
    let of_kind: Vec<usize> = calls.iter().filter(|c| c.0 == kind).map(|c| c.1).collect();
    (of_kind.iter().sum(), of_kind.len())
}

#[test]
fn greedy_static_trace_unmasks_left_to_right_storing_each_block_with_the_next() {
    // Prompt of 6: 4 prefilled, the first block holds 2 prompt-tail tokens; 10 new tokens in
    // blocks of 2 + 4 + 4.
    let mut e = engine(1);
    let out = e
        .generate(vec![request(prompt(4, 6), &DecodeParams::dice_eval(10))])
        .unwrap()
        .remove(0);
    assert_eq!(out.token_ids.len(), 10);
    assert_eq!(out.trace, (1..=10).collect::<Vec<u32>>());
    assert_eq!(e.model().calls.borrow()[0], ("prefill", 1));
    // One forward per denoising step: the first two blocks are stored by the first forward of
    // the block after them, the last one by none (the sequence ends with it).
    assert_eq!(calls_of(e.model(), "forward"), (10, 10));
    assert_eq!(calls_of(e.model(), "store").0, 2);
    assert_eq!(calls_of(e.model(), "merged").0, 2);
}

/// Generates `params[i]` for prompt i in one batch, checks that each equals its generation
/// alone, and returns the model's calls.
fn out_of_step_batch(params: &[DecodeParams]) -> Vec<(&'static str, usize)> {
    let prompts: Vec<Vec<u32>> = (0..params.len()).map(|i| prompt(i as u32, 8)).collect();
    let mut e = engine(params.len());
    let out = e
        .generate(
            prompts
                .iter()
                .zip(params)
                .map(|(p, q)| request(p.clone(), q))
                .collect(),
        )
        .unwrap();
    for ((p, q), together) in prompts.iter().zip(params).zip(&out) {
        let alone = engine(1)
            .generate(vec![request(p.clone(), q)])
            .unwrap()
            .remove(0);
        assert_eq!(together.token_ids, alone.token_ids);
        assert_eq!(together.trace, alone.trace);
    }
    e.into_model().calls.into_inner()
}

#[test]
fn out_of_step_sequences_store_alone_when_few_and_ride_along_when_many() {
    // Blocks of 4 in 4 steps beside blocks of 4 in 2 steps: the fast sequences reach their
    // block boundaries while the slow ones are mid-block.
    let slow = DecodeParams::dice_eval(8);
    let fast = DecodeParams {
        steps: 2,
        ..slow.clone()
    };
    // A forward's entries: ("forward", rows), ("store", n), ("merged", n).
    let has = |calls: &[(&str, usize)], forward: [(&str, usize); 3]| {
        calls.windows(3).any(|c| c == forward)
    };
    let calls = out_of_step_batch(&[slow.clone(), slow.clone(), fast.clone()]);
    assert!(
        has(&calls, [("forward", 3), ("store", 1), ("merged", 0)]),
        "one sequence of three at its boundary did not store alone: {calls:?}"
    );
    let calls = out_of_step_batch(&[fast.clone(), fast, slow]);
    assert!(
        has(&calls, [("forward", 3), ("store", 2), ("merged", 2)]),
        "two sequences of three at their boundary did not denoise their next blocks: {calls:?}"
    );
}

#[test]
fn a_sequence_that_ends_at_the_cache_capacity_leaves_room_for_a_two_block_forward() {
    // Capacity 16: the first sequence (prompt 8 + 8 new) ends at the capacity while the second
    // (prompt 4 + 12 new) stores the block before its last one beside it, two blocks per row.
    let mut e = Engine::new(
        HashModel::default(),
        EngineConfig {
            max_batch: 2,
            max_seq_len: 16,
            max_prefill_tokens: 16,
        },
    )
    .unwrap();
    let out = e
        .generate(vec![
            request(prompt(1, 8), &DecodeParams::dice_eval(8)),
            request(prompt(2, 4), &DecodeParams::dice_eval(12)),
        ])
        .unwrap();
    assert_eq!(out[0].token_ids.len(), 8);
    assert_eq!(out[1].token_ids.len(), 12);
    let merged = calls_of(e.model(), "merged");
    assert!(merged.0 >= 3, "{:?}", e.model().calls.borrow());
}

#[test]
fn forward_counts_are_the_model_calls_of_the_static_schedule() {
    // Two prompts of 8 tokens prefilled in one chunk (16 <= max_prefill_tokens), then per
    // 4-token block 4 denoising forwards, both rows in each; a block is stored by the first
    // forward of the next one.
    let mut e = engine(2);
    let params = DecodeParams::dice_eval(8);
    let prompts = [prompt(1, 8), prompt(2, 8)];
    e.generate(
        prompts
            .iter()
            .map(|p| request(p.clone(), &params))
            .collect(),
    )
    .unwrap();
    let blocks = 8 / params.block_length as u64;
    let expected = ForwardCounts {
        prefill: 1,
        decode: blocks * params.steps as u64,
    };
    assert_eq!(e.forward_counts(), expected);
    let calls = e.model().calls.borrow();
    let count = |kind: &str| calls.iter().filter(|c| c.0 == kind).count() as u64;
    assert_eq!(count("prefill"), expected.prefill);
    assert_eq!(count("forward"), expected.decode);
    drop(calls);
    assert_eq!(
        e.into_model().calls.borrow().len() as u64,
        1 + 3 * expected.decode
    );
}

#[test]
fn token_limit_ends_with_the_block_of_the_last_token_unless_exact() {
    let mut params = DecodeParams::dice_eval(5);
    let out = engine(1)
        .generate(vec![request(prompt(5, 7), &params)])
        .unwrap()
        .remove(0);
    // 7 + 5 = 12 → blocks up to 12: exactly 5 new tokens; 7 + 6 → 16: 9 new tokens.
    assert_eq!(out.token_ids.len(), 5);
    params.max_new_tokens = 6;
    let long = engine(1)
        .generate(vec![request(prompt(5, 7), &params)])
        .unwrap()
        .remove(0);
    assert_eq!(long.token_ids.len(), 9);
    assert_eq!(long.finish_reason, FinishReason::Length);
    params.exact_max = true;
    let exact = engine(1)
        .generate(vec![request(prompt(5, 7), &params)])
        .unwrap()
        .remove(0);
    assert_eq!(exact.token_ids, long.token_ids[..6]);
    assert_eq!(exact.trace, long.trace[..6]);
}

#[test]
fn a_stop_id_ends_generation_and_the_output() {
    let free = engine(1)
        .generate(vec![request(prompt(6, 4), &DecodeParams::dice_eval(24))])
        .unwrap()
        .remove(0);
    let stop = free.token_ids[9];
    let first = free.token_ids.iter().position(|&t| t == stop).unwrap();
    let params = DecodeParams {
        stop_ids: vec![stop],
        ..DecodeParams::dice_eval(24)
    };
    let stopped = engine(1)
        .generate(vec![request(prompt(6, 4), &params)])
        .unwrap()
        .remove(0);
    assert_eq!(stopped.finish_reason, FinishReason::Stop);
    assert_eq!(stopped.token_ids, free.token_ids[..=first]);
}

#[test]
fn same_seed_same_output_other_seeds_differ() {
    let run = |seed| {
        engine(2)
            .generate(vec![request(prompt(7, 9), &sampled(seed))])
            .unwrap()
            .remove(0)
            .token_ids
    };
    let first = run(1);
    assert_eq!(first, run(1));
    assert!((2..6).any(|s| run(s) != first));
}

/// Every generated token has a forward index, and each block's tokens were all unmasked
/// after every token of the blocks before it.
fn assert_trace_is_ordered_by_block(trace: &[u32], prompt_len: usize, block_length: usize) {
    assert!(trace.iter().all(|&t| t >= 1));
    let first = block_length - prompt_len % block_length;
    let mut blocks = vec![&trace[..first.min(trace.len())]];
    blocks.extend(trace[first.min(trace.len())..].chunks(block_length));
    for pair in blocks.windows(2) {
        let earlier = pair[0].iter().max().unwrap();
        let later = pair[1].iter().min().unwrap();
        assert!(earlier < later, "trace {trace:?}");
    }
}

#[test]
fn every_strategy_fills_every_mask() {
    for strategy in [
        Strategy::Sequential,
        Strategy::LowConfidenceStatic,
        Strategy::LowConfidenceDynamic { threshold: 0.9 },
        Strategy::EntropyBounded { threshold: 0.35 },
    ] {
        for (block_length, steps) in [(4, 4), (8, 4), (5, 2), (4, 1)] {
            let params = DecodeParams {
                strategy,
                block_length,
                steps,
                ..sampled(3)
            };
            let out = engine(2)
                .generate(vec![request(prompt(8, 11), &params)])
                .unwrap()
                .remove(0);
            assert!(
                !out.token_ids.contains(&MASK),
                "{strategy:?} {block_length}/{steps}"
            );
            assert_trace_is_ordered_by_block(&out.trace, 11, block_length);
        }
    }
}

#[test]
fn mixed_block_lengths_share_the_engine() {
    let b4 = DecodeParams::dice_eval(8);
    let b8 = DecodeParams {
        block_length: 8,
        ..DecodeParams::dice_eval(8)
    };
    let alone4 = engine(1)
        .generate(vec![request(prompt(9, 5), &b4)])
        .unwrap();
    let alone8 = engine(1)
        .generate(vec![request(prompt(9, 5), &b8)])
        .unwrap();
    let both = engine(4)
        .generate(vec![request(prompt(9, 5), &b4), request(prompt(9, 5), &b8)])
        .unwrap();
    assert_eq!(both[0].token_ids, alone4[0].token_ids);
    assert_eq!(both[1].token_ids, alone8[0].token_ids);
}

#[test]
fn reference_overflow_rewrites_the_lowest_unmasked_position() {
    // Prompt of 13 with block 8: the first block holds 5 prompt tokens and 3 masks, and the
    // schedule [2,2,2,2] asks for 2 in the second step when only one mask is left.
    let prompt = prompt(10, 13);
    let run_two_steps = |overflow| {
        let params = DecodeParams {
            block_length: 8,
            overflow,
            ..DecodeParams::dice_eval(11)
        };
        let mut e = engine(1);
        e.submit(request(prompt.clone(), &params)).unwrap();
        e.step().unwrap();
        let before = e.active[0].sequence.block().to_vec();
        let logits = HashModel::block_logits(&prompt[..8], &before);
        e.step().unwrap();
        (
            before,
            logits,
            e.active[0].sequence.block().to_vec(),
            e.active[0].sequence.phase,
        )
    };
    let argmax = |logits: &[f32], position: usize| {
        let row = &logits[position * VOCAB..(position + 1) * VOCAB];
        (0..VOCAB)
            .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
            .unwrap() as u32
    };
    let (_, _, clamped, phase) = run_two_steps(Overflow::Clamp);
    assert_eq!(clamped[..5], prompt[8..13]);
    assert_eq!(phase, Phase::Store);
    let (before, logits, rewritten, phase) = run_two_steps(Overflow::Reference);
    assert_eq!(before.iter().filter(|&&t| t == MASK).count(), 1);
    assert_eq!(rewritten[0], argmax(&logits, 0));
    assert_eq!(rewritten[7], argmax(&logits, 7));
    assert_eq!(rewritten[1..7], before[1..7]);
    assert_eq!(phase, Phase::Store);
}

#[test]
fn the_lm_head_runs_for_the_positions_a_step_asks_for() {
    // A prompt of two whole blocks, block 4 and 4 steps: each step unmasks one position, so the
    // four forwards of a block want the logits of 4, 3, 2 and 1 positions; with the reference's
    // overflow every step wants all 4 (its surplus picks may rewrite unmasked positions).
    for (overflow, wanted) in [
        (Overflow::Clamp, [4, 3, 2, 1]),
        (Overflow::Reference, [4; 4]),
    ] {
        let params = DecodeParams {
            overflow,
            ..DecodeParams::dice_eval(4)
        };
        let mut e = engine(1);
        e.generate(vec![request(prompt(3, 8), &params)]).unwrap();
        assert_eq!(*e.model().logit_positions.borrow(), wanted, "{overflow:?}");
    }
}

#[test]
fn invalid_requests_are_rejected() {
    let mut e = engine(1);
    assert!(e
        .submit(request(vec![1, 2, 999], &DecodeParams::dice_eval(4)))
        .is_err());
    let zero = DecodeParams::dice_eval(0);
    assert!(e.submit(request(vec![1], &zero)).is_err());
    let too_long = DecodeParams::dice_eval(200);
    assert!(e.submit(request(vec![1], &too_long)).is_err());
    let wide = DecodeParams {
        block_length: 32,
        ..DecodeParams::dice_eval(4)
    };
    assert!(e.submit(request(vec![1], &wide)).is_err());
}

#[test]
fn nan_logits_fail_the_step_and_abort_frees_everything() {
    let model = HashModel {
        overflow: true,
        ..HashModel::default()
    };
    let config = EngineConfig {
        max_batch: 1,
        max_seq_len: 64,
        max_prefill_tokens: 64,
    };
    let mut e = Engine::new(model, config).unwrap();
    let a = e
        .submit(request(prompt(1, 6), &DecodeParams::dice_eval(4)))
        .unwrap();
    let b = e
        .submit(request(prompt(2, 6), &DecodeParams::dice_eval(4)))
        .unwrap();
    let error = e.step().unwrap_err();
    assert!(format!("{error:#}").contains("NaN"), "{error:#}");
    assert_eq!(e.abort_all(), vec![a, b]);
    assert!(!e.has_work());
    assert_eq!(e.free_slots, vec![0]);
}

#[test]
fn a_model_that_predicts_masks_still_finishes() {
    let model = HashModel {
        predict_mask: true,
        ..HashModel::default()
    };
    let config = EngineConfig {
        max_batch: 1,
        max_seq_len: 64,
        max_prefill_tokens: 64,
    };
    let mut e = Engine::new(model, config).unwrap();
    let out = e
        .generate(vec![request(prompt(1, 8), &DecodeParams::dice_eval(8))])
        .unwrap()
        .remove(0);
    assert_eq!(out.token_ids, vec![MASK; 8]);
    // Per block: 4 scheduled steps and one forced step; stores ride along.
    let forwards = e
        .model()
        .calls
        .borrow()
        .iter()
        .filter(|c| c.0 == "forward")
        .count();
    assert_eq!(forwards, 2 * 5);
}
