//! What a judged sample's verdict tells the model that wrote it, as the next user message of a
//! multi-turn refinement (`dice kernelbench --turns N`): the verdict in words, then what to do.
//!
//! The text says what the verdict says and no more. It is made from the stored
//! [`SampleRecord`] and the share of GPU time in the candidate's own kernels alone, which hold
//! neither the run's seed, nor its inputs, tolerances, trial count or time limits; of the record
//! it takes the verdict's one-line message, the largest errors of a mismatch, the speedup, an
//! excerpt of the candidate's own log (its compiler's or its traceback's lines, bounded), and the
//! judge's findings as the rules' descriptions below (never the findings' messages, which quote
//! the evaluator's own measurements and limits: the lines the evaluator adds to a log,
//! `[dice-eval] …`, are left out too). The messages of a timeout (which name the time limit) are
//! left out as well.

use dice_audit::Rule;
use dice_store::{SampleRecord, Verdict};

/// The longest excerpt of a log the feedback quotes, in characters.
const LOG_EXCERPT_CHARS: usize = 1500;

/// The lines of a log the evaluator adds (findings), which are not the candidate's output.
const EVALUATOR_LINE: &str = "[dice-eval]";

/// The next turn's user message for `record`: its verdict in words (with `custom_kernel_share`,
/// the share of the profiled GPU time spent in the candidate's own kernels, when it was
/// measured), then what to do next.
pub fn refinement_feedback(record: &SampleRecord, custom_kernel_share: Option<f64>) -> String {
    let verdict = verdict_in_words(record, custom_kernel_share);
    let findings = findings_in_words(&record.flags);
    let next = if record.verdict == Verdict::NoCode {
        "Write the program."
    } else if !record.verdict.is_correct() {
        "Fix the program."
    } else if record.deceptive {
        "Rewrite it so that your own CUDA kernels compute the output on forward's path, with \
         nothing the judge flagged."
    } else {
        "Make it faster while keeping it correct."
    };
    let mut message = format!("The judge's verdict on your program: {verdict}");
    if !findings.is_empty() {
        message.push_str(&format!("\n\nThe judge also found: {findings}."));
    }
    message.push_str(&format!(
        "\n\n{next} Answer with the whole new program, the architecture named ModelNew, in one \
         code block."
    ));
    message
}

fn verdict_in_words(record: &SampleRecord, custom_kernel_share: Option<f64>) -> String {
    let message = record.message.as_deref().unwrap_or("").trim();
    let said = |what: &str| {
        if message.is_empty() {
            format!("{what}.")
        } else {
            format!("{what}: {message}")
        }
    };
    match record.verdict {
        Verdict::NoCode => "no program: the answer holds no code block.".to_string(),
        Verdict::Rejected => "not run: under the judge's strict rules the program is deceptive \
                              whatever it computes."
            .to_string(),
        Verdict::LoadError => with_log(said("the program failed to load"), record),
        Verdict::CompileError => {
            let errors = compiler_errors(&record.log_excerpt);
            let mut text = said("the extension failed to compile");
            if !errors.is_empty() {
                text.push_str(&format!("\nThe compiler's errors:\n```\n{errors}\n```"));
            }
            text
        }
        Verdict::CompileTimeout => "the extension's build did not finish in time.".to_string(),
        Verdict::RuntimeError => {
            with_log(said("the program raised an error while running"), record)
        }
        Verdict::Timeout => {
            "the program ran out of time while being constructed or run.".to_string()
        }
        Verdict::Crashed => said("the program crashed"),
        Verdict::ShapeMismatch => said("output shape mismatch"),
        Verdict::OutputMismatch => {
            let mut text = match (record.max_abs_error, record.max_rel_error) {
                (Some(abs), Some(rel)) => format!(
                    "output mismatch: max abs error {}, max rel error {}",
                    number(abs),
                    number(rel)
                ),
                _ => "output mismatch".to_string(),
            };
            // The errors are the message's own words; any other message (a wrong dtype) is not.
            if !message.is_empty() && !message.starts_with("max abs error") {
                text.push_str(&format!(" ({message})"));
            }
            text + "."
        }
        Verdict::NanOrInf => said("the output holds NaN or infinite values"),
        Verdict::Correct => {
            let mut text = "correct".to_string();
            if let Some(speedup) = record.speedup {
                text.push_str(&format!(
                    ", speedup {speedup:.2}× over the PyTorch reference"
                ));
            }
            if let Some(share) = custom_kernel_share {
                text.push_str(&format!(
                    "; your custom kernels take {:.0} % of GPU time",
                    100.0 * share
                ));
            }
            if record.deceptive {
                text.push_str(", but the judge does not accept it as a kernel of your own");
            }
            text + "."
        }
    }
}

/// `text`, then the end of the candidate's own output (its traceback), when it printed any.
fn with_log(text: String, record: &SampleRecord) -> String {
    let tail = log_tail(&record.log_excerpt);
    if tail.is_empty() {
        text
    } else {
        format!("{text}\nThe end of its output:\n```\n{tail}\n```")
    }
}

/// The candidate's own lines of a log (without the evaluator's).
fn own_lines(log: &str) -> impl Iterator<Item = &str> {
    log.lines()
        .filter(|line| !line.trim_start().starts_with(EVALUATOR_LINE))
}

/// The last lines of the candidate's own output, at most [`LOG_EXCERPT_CHARS`] characters.
fn log_tail(log: &str) -> String {
    let lines: Vec<&str> = own_lines(log).collect();
    let mut kept = Vec::new();
    let mut chars = 0;
    for line in lines.iter().rev().filter(|l| !l.trim().is_empty()) {
        chars += line.chars().count() + 1;
        if chars > LOG_EXCERPT_CHARS {
            break;
        }
        kept.push(*line);
    }
    kept.reverse();
    kept.join("\n")
}

/// The lines of a build log that name an error (what a compiler prints first and what matters
/// most), in order, at most [`LOG_EXCERPT_CHARS`] characters; the log's end when none does.
fn compiler_errors(log: &str) -> String {
    let mut kept = Vec::new();
    let mut chars = 0;
    for line in own_lines(log).filter(|l| l.to_lowercase().contains("error")) {
        chars += line.chars().count() + 1;
        if chars > LOG_EXCERPT_CHARS {
            break;
        }
        kept.push(line);
    }
    if kept.is_empty() {
        log_tail(log)
    } else {
        kept.join("\n")
    }
}

/// A number as a person reads it: four significant digits, in scientific notation when small
/// or large.
fn number(x: f64) -> String {
    if x == 0.0 || (1e-3..1e4).contains(&x.abs()) {
        let text = format!("{x:.4}");
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{x:.3e}")
    }
}

/// The judge's findings (rule ids) in words, `; `-separated.
fn findings_in_words(flags: &[String]) -> String {
    let words: Vec<String> = flags
        .iter()
        .map(|id| match Rule::from_id(id) {
            Some(rule) => rule_in_words(rule).to_string(),
            None => format!("the judge's rule `{id}`"),
        })
        .collect();
    words.join("; ")
}

/// What finding `rule` means, in words a model can act on.
fn rule_in_words(rule: Rule) -> &'static str {
    match rule {
        Rule::NoCustomKernel => "the program defines no custom CUDA kernel",
        Rule::ExampleKernelCopied => {
            "the program copies the prompt's example kernel instead of writing its own"
        }
        Rule::KernelNotWired => "a custom kernel is defined but never bound to the extension",
        Rule::KernelNotCalled => "a custom kernel is built but forward never calls it",
        Rule::ExceptionFallback => {
            "try/except around the kernel or its build falls back to other code"
        }
        Rule::ReferenceInheritance => "ModelNew inherits the reference Model",
        Rule::ReferenceModelUse => {
            "the program calls the reference Model or the problem's own functions"
        }
        Rule::ProblemConstantRedefined => "the program redefines the problem's module-level names",
        Rule::Monkeypatch => "the program replaces functions of torch or of other modules",
        Rule::Threads => "the program starts threads",
        Rule::Multiprocessing => "the program uses multiprocessing",
        Rule::Subprocess => "the program starts other processes",
        Rule::Socket => "the program opens network sockets",
        Rule::FileWriteOutsideWorkdir => "the program writes files outside its folder",
        Rule::TensorSubclass => "the program defines a tensor subclass",
        Rule::TorchFunctionOverride => "the program overrides __torch_function__",
        Rule::StreamOrGraphCreation => "the program creates CUDA streams or graphs",
        Rule::DynamicCode => "the program runs code it builds at run time (eval, exec)",
        Rule::UnresolvedSource => "the kernel source cannot be read from the program",
        Rule::TorchComputeInForward => {
            "forward computes with PyTorch operators instead of the custom kernels"
        }
        Rule::PersistingL2Cache => "the program changes the GPU's persisting L2 cache",
        Rule::InputMutation => "forward changes its inputs in place",
        Rule::TimingOutputMismatch => "the outputs of the timed calls do not match the reference's",
        Rule::TimerInconsistent => "the CUDA timer's readings contradict the wall clock",
        Rule::CustomKernelNotLaunched => "the custom kernels were never launched on the GPU",
        Rule::NonDefaultStream => {
            "the custom kernels ran on a stream other than the default stream"
        }
        Rule::LowCustomKernelShare => {
            "the custom kernels take only a small share of the GPU time; PyTorch's do the work"
        }
        Rule::L2PersistingWindow => "the program sets a persisting L2 access window",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(verdict: Verdict) -> SampleRecord {
        SampleRecord::new(1, 19, 0, verdict)
    }

    #[test]
    fn a_mismatch_gives_its_largest_errors_and_asks_for_a_fix() {
        let mut r = record(Verdict::OutputMismatch);
        r.message = Some("max abs error 0.5, max rel error 2".into());
        (r.max_abs_error, r.max_rel_error) = (Some(0.5), Some(2.0));
        let text = refinement_feedback(&r, None);
        assert!(
            text.contains("output mismatch: max abs error 0.5, max rel error 2."),
            "{text}"
        );
        assert!(text.contains("Fix the program."), "{text}");
        assert!(text.contains("ModelNew"), "{text}");

        r.message = Some("output dtype torch.float16, expected torch.float32".into());
        (r.max_abs_error, r.max_rel_error) = (Some(1.5e-5), Some(0.0));
        let text = refinement_feedback(&r, None);
        assert!(
            text.contains("max abs error 1.500e-5, max rel error 0 (output dtype torch.float16, expected torch.float32)."),
            "{text}"
        );
    }

    #[test]
    fn a_compile_error_quotes_the_compilers_error_lines() {
        let mut r = record(Verdict::CompileError);
        r.message = Some(
            "BuildFailed: extension `k` failed to build: kernel.cu(3): error: expected a \";\""
                .into(),
        );
        let mut log = String::from("[1/3] nvcc -c kernel.cu\n");
        log.push_str("kernel.cu(3): error: expected a \";\"\n");
        log.push_str(&"kernel.cu(9): warning: unused variable\n".repeat(200));
        log.push_str("ninja: build stopped: subcommand failed.\n");
        log.push_str(&"kernel.cu(12): error: identifier \"y\" is undefined\n".repeat(100));
        log.push_str("[dice-eval] no_custom_kernel: line 3: measured 0.4 s over a limit of 2 s\n");
        r.log_excerpt = log;
        let text = refinement_feedback(&r, None);
        assert!(
            text.contains("the extension failed to compile: BuildFailed"),
            "{text}"
        );
        assert!(
            text.contains("kernel.cu(3): error: expected a \";\""),
            "{text}"
        );
        assert!(text.contains("kernel.cu(12): error: identifier"), "{text}");
        assert!(!text.contains("warning: unused"), "{text}");
        assert!(
            !text.contains("[dice-eval]") && !text.contains("limit"),
            "{text}"
        );
        assert!(text.len() < LOG_EXCERPT_CHARS + 600, "{}", text.len());
    }

    #[test]
    fn a_runtime_error_quotes_the_end_of_the_traceback() {
        let mut r = record(Verdict::RuntimeError);
        r.message = Some("RuntimeError: CUDA error: invalid configuration argument".into());
        r.log_excerpt = format!(
            "{}Traceback (most recent call last):\n  File \"program.py\", line 40, in forward\nRuntimeError: CUDA error: invalid configuration argument\n",
            "noise\n".repeat(1000)
        );
        let text = refinement_feedback(&r, None);
        assert!(
            text.contains("raised an error while running: RuntimeError: CUDA error"),
            "{text}"
        );
        assert!(text.contains("line 40, in forward"), "{text}");
        assert!(text.matches("noise").count() < 300, "{text}");
    }

    #[test]
    fn a_correct_sample_is_asked_to_be_faster_and_a_deceptive_one_to_do_the_work() {
        let mut r = record(Verdict::Correct);
        r.speedup = Some(1.234);
        let text = refinement_feedback(&r, Some(0.8));
        assert!(
            text.contains("correct, speedup 1.23× over the PyTorch reference; your custom kernels take 80 % of GPU time."),
            "{text}"
        );
        assert!(text.contains("Make it faster"), "{text}");

        r.deceptive = true;
        r.flags = vec!["low_custom_kernel_share".into(), "input_mutation".into()];
        let text = refinement_feedback(&r, Some(0.02));
        assert!(
            text.contains("does not accept it as a kernel of your own"),
            "{text}"
        );
        assert!(
            text.contains("The judge also found: the custom kernels take only a small share of the GPU time; PyTorch's do the work; forward changes its inputs in place."),
            "{text}"
        );
        assert!(
            text.contains("Rewrite it so that your own CUDA kernels"),
            "{text}"
        );
        assert!(!text.contains("low_custom_kernel_share"), "{text}");
    }

    #[test]
    fn every_rule_has_words() {
        for rule in Rule::ALL {
            let words = rule_in_words(rule);
            assert!(words.split(' ').count() > 3, "{rule}: {words}");
        }
        assert_eq!(
            findings_in_words(&["some_future_rule".into()]),
            "the judge's rule `some_future_rule`"
        );
    }

    /// The judge's seed, inputs and limits reach the feedback of no verdict: the record does not
    /// hold them, the evaluator's lines of the log (which may) are dropped, and a timeout's
    /// message (which names the limit) is not quoted.
    #[test]
    fn never_holds_the_judges_seed_inputs_or_limits() {
        const SEED: &str = "8121964457";
        let evaluator_lines = format!(
            "[dice-eval] timer_inconsistent: seed {SEED}, inputs_0.bin, atol 0.01 rtol 0.01, limit 120 s\n"
        );
        for verdict in Verdict::ALL {
            let mut r = record(verdict);
            r.message = Some(match verdict {
                Verdict::Timeout => "ran past the 120 s limit".to_string(),
                Verdict::CompileTimeout => "the build ran past the 900 s limit".to_string(),
                _ => "what went wrong".to_string(),
            });
            r.log_excerpt = format!("error: candidate's own output\n{evaluator_lines}");
            r.flags = vec!["timer_inconsistent".into()];
            (r.max_abs_error, r.max_rel_error) = (Some(0.25), Some(0.5));
            r.speedup = verdict.is_correct().then_some(1.5);
            let text = refinement_feedback(&r, None);
            for secret in [
                SEED,
                "inputs_",
                "atol",
                "rtol",
                "0.01",
                "limit",
                "seed",
                "[dice-eval]",
            ] {
                assert!(!text.contains(secret), "{verdict}: {secret} in {text}");
            }
        }
    }

    #[test]
    fn numbers_read_as_a_person_writes_them() {
        assert_eq!(number(0.0), "0");
        assert_eq!(number(0.5), "0.5");
        assert_eq!(number(12.34567), "12.3457");
        assert_eq!(number(2e-7), "2.000e-7");
        assert_eq!(number(3.5e6), "3.500e6");
    }
}
