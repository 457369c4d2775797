//! `diversify` through the real evaluator on the CPU: every catalogue entry at the tiny scale is
//! judged (its reference imports and runs forward in the evaluator's Python), attempts go in
//! rounds, each is recorded with its verdict, a rerun asks and judges nothing; and export takes
//! the pairs diversify kept.

use crate::common::judging;
use dice_curate::catalogue::{draw, Scale, COMPONENTS};
use dice_curate::{
    diversify, export, Difficulty, DiversifyOptions, ExportOptions, KernelPrompt, KernelWriter,
    Pair, RunDir, SftFormat,
};
use dice_eval::Precision;
use dice_kernelbench::prompt::one_shot_prompt;
use serde_json::Value;
use std::cell::Cell;
use std::collections::HashMap;
use std::path::Path;

/// Answers attempt 0 without a program, attempt 1 with the reference itself as `ModelNew`
/// (correct, and no faster than the reference).
struct ReferenceWriter {
    references: HashMap<String, String>,
    prompts: Cell<usize>,
}

impl KernelWriter for ReferenceWriter {
    fn write(
        &self,
        prompts: Vec<KernelPrompt>,
        store: &mut dyn FnMut(usize, String) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        self.prompts.set(self.prompts.get() + prompts.len());
        for (k, prompt) in prompts.iter().enumerate() {
            let answer = match prompt.attempt {
                0 => "I would write a fused kernel here.".to_string(),
                _ => format!(
                    "```python\n{}```",
                    self.references[&prompt.text]
                        .replace("class Model(nn.Module):", "class ModelNew(nn.Module):")
                ),
            };
            store(k, answer)?;
        }
        Ok(())
    }
}

#[test]
fn every_tiny_entry_is_judged_and_a_rerun_does_nothing() {
    let options = DiversifyOptions {
        components: COMPONENTS.to_vec(),
        scale: Scale::Tiny,
        variants: 1,
        seed: 3,
        attempts: 2,
        min_speedup: 2.0,
        kernelbench_tolerance: false,
    };
    let problems = draw(&options.components, options.scale, 1, options.seed);
    assert_eq!(problems.len(), COMPONENTS.len());
    assert!(problems.iter().any(|p| p.precision() == Precision::Bf16));
    assert!(problems.iter().any(|p| p.precision() == Precision::Fp32));
    let writer = ReferenceWriter {
        references: problems
            .iter()
            .map(|p| (one_shot_prompt(&p.source), p.source.clone()))
            .collect(),
        prompts: Cell::new(0),
    };
    let tmp = tempfile::tempdir().unwrap();
    let run = RunDir::new(tmp.path().join("run"));
    let summary = diversify(&run, &options, &judging(2, 8, 2), &writer, &mut |_| {}).unwrap();

    let attempts: Vec<Value> = std::fs::read_to_string(run.diversify_attempts())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for a in &attempts {
        println!(
            "{} #{}: {} {}",
            a["problem"], a["attempt"], a["verdict"], a["reason"]
        );
    }
    // Nothing is kept, so every problem gets both attempts: attempt 0 has no program, attempt 1
    // is rejected before it runs (pure PyTorch is deceptive in strict mode, whatever it computes).
    assert_eq!(
        (summary.problems, summary.attempts, summary.kept),
        (15, 30, 0)
    );
    assert_eq!(writer.prompts.get(), 30);
    for problem in &problems {
        let of = |n: u64| {
            attempts
                .iter()
                .find(|a| a["problem"] == problem.name.as_str() && a["attempt"] == n)
                .unwrap_or_else(|| panic!("no attempt {n} of {}", problem.name))
        };
        assert_eq!(of(0)["verdict"], "no_code", "{}", problem.name);
        assert_eq!(of(1)["verdict"], "rejected", "{}: {}", problem.name, of(1));
        assert_eq!(of(1)["kept"], false);
        assert!(of(1)["reason"].as_str().unwrap().starts_with("deceptive"));
    }
    assert_eq!(summary.dropped.values().sum::<usize>(), 30);
    assert_eq!(std::fs::read_to_string(run.diversify_pairs()).unwrap(), "");

    // Everything is answered and judged: a rerun asks nothing, starts no judge (the stores are
    // untouched) and writes the same files.
    let stores = [Precision::Fp32, Precision::Bf16].map(|p| run.diversify_store(p));
    let modified = |path: &Path| std::fs::metadata(path).unwrap().modified().unwrap();
    let before: Vec<_> = stores.iter().map(|s| modified(s)).collect();
    let first = std::fs::read(run.diversify_attempts()).unwrap();
    let again = diversify(&run, &options, &judging(2, 8, 2), &writer, &mut |_| {}).unwrap();
    assert_eq!(again, summary);
    assert_eq!(writer.prompts.get(), 30);
    assert_eq!(std::fs::read(run.diversify_attempts()).unwrap(), first);
    let after: Vec<_> = stores.iter().map(|s| modified(s)).collect();
    assert_eq!(before, after);

    // Other draw settings are refused in this run folder.
    let other = DiversifyOptions { seed: 4, ..options };
    let refused = diversify(&run, &other, &judging(2, 8, 2), &writer, &mut |_| {}).unwrap_err();
    assert!(refused.to_string().contains("other settings"), "{refused}");
}

#[test]
fn export_takes_the_pairs_diversify_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let run = RunDir::new(tmp.path().join("run"));
    run.create().unwrap();
    let problem = &draw(&COMPONENTS[8..9], Scale::Tiny, 1, 0)[0];
    let pair = Pair {
        id: "0123456789abcdef".into(),
        pytorch_code: problem.source.clone(),
        cuda_code: Some("import torch\n\nclass ModelNew: pass\n".into()),
        origin: format!("diversify:{}#0", problem.name),
        label: None,
    };
    std::fs::write(
        run.diversify_pairs(),
        format!("{}\n", serde_json::to_string(&pair).unwrap()),
    )
    .unwrap();
    let out = tmp.path().join("export");
    let exported = export(
        &run,
        &ExportOptions {
            out: out.clone(),
            format: SftFormat::Alpaca,
            dataset: "diverse".into(),
            difficulty: Difficulty::Label,
        },
    )
    .unwrap();
    assert_eq!((exported.sft, exported.end_to_end), (1, 1));
    let sft: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("sft.json")).unwrap()).unwrap();
    assert!(sft[0]["instruction"]
        .as_str()
        .unwrap()
        .contains("class Model(nn.Module):"));
    assert!(sft[0]["output"]
        .as_str()
        .unwrap()
        .contains("class ModelNew"));
}
