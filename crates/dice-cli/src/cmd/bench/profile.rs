//! `dice bench generate --profile`: the printing of where the time of one forward goes, stage by
//! stage ([`dice_model::sdar::ForwardProfile`]).

use super::format::count;
use dice_model::sdar::ForwardProfile;

pub(super) fn print_profile(p: &ForwardProfile) {
    let sum = p.components_ms();
    println!();
    println!(
        "profile of one {} forward at batch {}: {} new tokens per row over {} cached \
         (cache of {} positions), mean of {} after {} warm-ups",
        if p.shape.cached_tokens == 0 {
            "prefill (with logits of every position, which the engine's prefill does not compute)"
        } else {
            "decoding"
        },
        p.shape.batch,
        p.shape.tokens,
        p.shape.cached_tokens,
        p.shape.capacity,
        p.repetitions,
        p.warm_up
    );
    println!(
        "the forward as inference runs it (one synchronize, at the end): {:.3} ms, {} tensors; \
         the stages timed one by one (synchronized before and after each) sum to {sum:.3} ms; \
         floors: weights + KV cache bytes at {:.1} TB/s",
        p.forward_ms,
        count(p.forward_tensors),
        p.bytes_per_s / 1e12
    );
    let runs: u64 = p.components.iter().map(|c| c.runs).sum();
    println!(
        "{runs} stage runs per forward; an empty stage takes {:.4} ms ({:.3} ms over all runs)",
        p.empty_stage_ms,
        runs as f64 * p.empty_stage_ms
    );
    println!(
        "| stage | runs | ms | share | floor ms | x floor | tensors | per layer ms (min - max) |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    for c in &p.components {
        let over_floor = if c.floor_ms > 0.0 {
            format!("{:.1}", c.ms / c.floor_ms)
        } else {
            "-".to_string()
        };
        let per_layer = match (
            c.per_layer_ms.iter().copied().reduce(f64::min),
            c.per_layer_ms.iter().copied().reduce(f64::max),
        ) {
            (Some(min), Some(max)) => format!("{min:.4} - {max:.4}"),
            _ => "-".to_string(),
        };
        println!(
            "| {} | {} | {:.3} | {:.1}% | {:.4} | {over_floor} | {} | {per_layer} |",
            c.name,
            c.runs,
            c.ms,
            100.0 * c.ms / sum,
            c.floor_ms,
            count(c.tensors),
        );
    }
}
