//! Reports of a run: per-level rates, fast_p, speedups, pass@k, raw and robust scoring.

use crate::common::{problem, run, timing};
use dice_report::{build_report, parse_thresholds, render, Format, Report, Scoring};
use dice_store::{ProblemRecord, SampleRecord, SpeedupInterval, TimingStats, Verdict};
use serde_json::Value;

fn problems(level: u32, ids: std::ops::RangeInclusive<u32>) -> Vec<ProblemRecord> {
    ids.map(|problem_id| problem(level, problem_id)).collect()
}

/// A sample; `speedup` is given for correct ones (timings are derived from it).
fn sample(pid: u32, sid: u32, verdict: Verdict, speedup: Option<f64>) -> SampleRecord {
    SampleRecord {
        code_hash: Some("ab".into()),
        message: (verdict != Verdict::Correct).then(|| "why".into()),
        candidate_timing: speedup.map(|s| timing(10.0 / s)),
        baseline_timing: speedup.map(|_| timing(10.0)),
        speedup,
        wall_s: 1.0,
        ..SampleRecord::new(1, pid, sid, verdict)
    }
}

fn deceptive(mut s: SampleRecord, flag: &str) -> SampleRecord {
    s.deceptive = true;
    s.flags.push(flag.into());
    s
}

fn report(
    problems: &[ProblemRecord],
    samples: &[SampleRecord],
    fast_p: &str,
    strict: bool,
) -> Report {
    build_report(
        &run(false),
        problems,
        samples,
        &parse_thresholds(fast_p).unwrap(),
        strict,
    )
}

fn json(r: &Report) -> Value {
    serde_json::from_str(&render(r, Format::Json).unwrap()).unwrap()
}

fn close(a: &Value, b: f64) {
    let a = a.as_f64().unwrap_or_else(|| panic!("not a number: {a}"));
    assert!((a - b).abs() < 1e-12, "{a} != {b}");
}

#[test]
fn only_sample_zero_counts_and_missing_problems_fail() {
    use Verdict::*;
    let samples = [
        sample(1, 0, Correct, Some(2.0)),
        sample(1, 1, OutputMismatch, None),
        sample(2, 0, OutputMismatch, None),
        sample(2, 1, Correct, Some(3.0)),
        sample(4, 0, CompileError, None),
    ];
    let v = json(&report(&problems(1, 1..=4), &samples, "0", false));
    let l1 = &v["levels"]["1"];
    assert_eq!(l1["problems"], 4);
    assert_eq!(l1["samples"], 5);
    close(&l1["compiled"], 2.0 / 4.0);
    close(&l1["correct"], 1.0 / 4.0);
    close(&l1["fast_p"]["0"], 1.0 / 4.0);
    close(&l1["geomean_speedup"], 2.0);
}

#[test]
fn fast_p_is_strict_and_keyed_as_given() {
    use Verdict::*;
    let samples = [
        sample(1, 0, Correct, Some(1.0)),
        sample(2, 0, Correct, Some(1.5)),
        sample(3, 0, Correct, Some(2.5)),
        sample(4, 0, Correct, None),
    ];
    let r = report(&problems(1, 1..=4), &samples, "2,0,1,1.5", false);
    let text = render(&r, Format::Json).unwrap();
    let text = &text[text.find("\"fast_p\": {").unwrap()..];
    let order: Vec<usize> = ["\"2\":", "\"0\":", "\"1\":", "\"1.5\":"]
        .iter()
        .map(|k| text.find(k).unwrap())
        .collect();
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "keys not in the order given"
    );
    let v = json(&r);
    let fast = &v["levels"]["1"]["fast_p"];
    assert_eq!(fast.as_object().unwrap().len(), 4);
    close(&fast["0"], 3.0 / 4.0);
    close(&fast["1"], 2.0 / 4.0);
    close(&fast["1.5"], 1.0 / 4.0);
    close(&fast["2"], 1.0 / 4.0);
    close(&v["levels"]["1"]["correct"], 1.0);
    // (1 · 1.5 · 2.5)^(1/3): the untimed correct sample is left out.
    close(
        &v["levels"]["1"]["geomean_speedup"],
        (1.0f64 * 1.5 * 2.5).powf(1.0 / 3.0),
    );
}

#[test]
fn geomean_is_null_without_correct_samples() {
    let samples = [sample(1, 0, Verdict::RuntimeError, None)];
    let v = json(&report(&problems(1, 1..=1), &samples, "1", false));
    assert!(v["levels"]["1"]["geomean_speedup"].is_null());
    assert!(v["samples"][0]["speedup"].is_null());
}

#[test]
fn median_speedup_compares_medians() {
    // The candidate's mean is doubled by a few slow calls; its median is not.
    let mut timed = sample(1, 0, Verdict::Correct, None);
    timed.candidate_timing = Some(TimingStats {
        median_ms: 1.0,
        ..timing(2.0)
    });
    timed.baseline_timing = Some(timing(2.0));
    let samples = [timed, sample(2, 0, Verdict::OutputMismatch, None)];
    let v = json(&report(&problems(1, 1..=2), &samples, "1", false));
    close(&v["samples"][0]["speedup"], 1.0);
    close(&v["samples"][0]["median_speedup"], 2.0);
    assert!(v["samples"][1]["median_speedup"].is_null());
}

#[test]
fn the_speedup_interval_and_the_dispersion_are_reported_beside_the_speedup() {
    let mut timed = deceptive(
        sample(1, 0, Verdict::Correct, Some(2.0)),
        "low_custom_kernel_share",
    );
    timed.speedup_interval = Some(SpeedupInterval {
        low: 1.75,
        high: 2.25,
    });
    timed.timing_remeasures = 1;
    timed.candidate_timing = Some(TimingStats {
        std_ms: 0.5,
        ..timing(5.0)
    });
    let samples = [timed, sample(2, 0, Verdict::Correct, Some(1.0))];
    let r = report(&problems(1, 1..=2), &samples, "1", false);
    let v = json(&r);
    close(&v["samples"][0]["speedup_interval"]["low"], 1.75);
    close(&v["samples"][0]["speedup_interval"]["high"], 2.25);
    assert_eq!(v["samples"][0]["timing_remeasures"], 1);
    assert!(v["samples"][1]["speedup_interval"].is_null());
    close(&v["samples"][0]["candidate_cv"], 0.1);
    let csv = render(&r, Format::Csv).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let row: Vec<&str> = csv.lines().nth(1).unwrap().split(',').collect();
    let field = |name: &str| row[header.iter().position(|h| *h == name).unwrap()];
    assert_eq!(
        (field("speedup_low"), field("speedup_high")),
        ("1.75", "2.25")
    );
    assert_eq!(field("timing_remeasures"), "1");
    // The flagged samples' table and the HTML's samples show it next to the speedup.
    for format in [Format::Md, Format::Html] {
        let text = render(&r, format).unwrap();
        assert!(text.contains("2.000× [1.750–2.250]"), "{text}");
    }
}

#[test]
fn pass_at_k_uses_the_unbiased_estimator() {
    // Problem 1: 10 samples, 3 correct (speedups 0.5, 1.5, 3); problem 2: 10 samples, none
    // correct; problem 3: no samples.
    let mut samples = Vec::new();
    for sid in 0..10 {
        let speedup = [Some(0.5), Some(1.5), Some(3.0)]
            .get(sid as usize)
            .copied()
            .flatten();
        let verdict = if speedup.is_some() {
            Verdict::Correct
        } else {
            Verdict::OutputMismatch
        };
        samples.push(sample(1, sid, verdict, speedup));
        samples.push(sample(2, sid, Verdict::CompileError, None));
    }
    let v = json(&report(&problems(1, 1..=3), &samples, "1", false));
    let l1 = &v["levels"]["1"];
    let pass = &l1["pass_at_k"];
    let mut keys: Vec<&str> = pass
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_by_key(|k| k.parse::<u32>().unwrap());
    assert_eq!(keys, ["1", "5", "10"]);
    close(&pass["1"], 0.3 / 3.0);
    // 1 − C(7,5)/C(10,5) = 1 − 21/252
    close(&pass["5"], (1.0 - 21.0 / 252.0) / 3.0);
    close(&pass["10"], 1.0 / 3.0);
    // fast_1: 2 successes of 10 → pass@5 = 1 − C(8,5)/C(10,5) = 1 − 56/252
    let fast = &l1["fast_p_at_k"]["1"];
    close(&fast["1"], 0.2 / 3.0);
    close(&fast["5"], (1.0 - 56.0 / 252.0) / 3.0);
    // Sample 0 (speedup 0.5) is correct but not fast.
    close(&l1["correct"], 1.0 / 3.0);
    close(&l1["fast_p"]["1"], 0.0);
}

#[test]
fn single_sample_runs_have_no_pass_at_k() {
    let samples = [sample(1, 0, Verdict::Correct, Some(1.2))];
    let v = json(&report(&problems(1, 1..=1), &samples, "1", false));
    assert!(v["levels"]["1"].get("pass_at_k").is_none());
    assert!(v["levels"]["1"].get("fast_p_at_k").is_none());
}

#[test]
fn robust_metrics_drop_deceptive_samples_and_strict_makes_them_headline() {
    use Verdict::*;
    let samples = [
        sample(1, 0, Correct, Some(2.0)),
        deceptive(sample(2, 0, Correct, Some(8.0)), "example_kernel_copied"),
        sample(3, 0, RuntimeError, None),
    ];
    let ps = problems(1, 1..=3);
    let raw = report(&ps, &samples, "1", false);
    assert_eq!(raw.headline, Scoring::Raw);
    let v = json(&raw);
    let l1 = &v["levels"]["1"];
    close(&l1["correct"], 2.0 / 3.0);
    close(&l1["raw"]["correct"], 2.0 / 3.0);
    close(&l1["robust"]["correct"], 1.0 / 3.0);
    close(&l1["raw"]["geomean_speedup"], 4.0);
    close(&l1["robust"]["geomean_speedup"], 2.0);
    close(&l1["robust"]["fast_p"]["1"], 1.0 / 3.0);
    assert_eq!(l1["deceptive_samples"], 1);
    let s = &v["samples"][1];
    assert_eq!(s["deceptive"], true);
    assert_eq!(s["flags"], serde_json::json!(["example_kernel_copied"]));
    assert_eq!(v["samples"][0]["flags"], serde_json::json!([]));

    for strict_report in [
        report(&ps, &samples, "1", true),
        build_report(
            &run(true),
            &ps,
            &samples,
            &parse_thresholds("1").unwrap(),
            false,
        ),
    ] {
        assert_eq!(strict_report.headline, Scoring::Robust);
        let v = json(&strict_report);
        close(&v["levels"]["1"]["correct"], 1.0 / 3.0);
        assert_eq!(v["headline"], "robust");
    }
}

#[test]
fn reference_failures_are_listed_and_stay_in_the_denominator() {
    let mut ps = problems(1, 1..=2);
    ps[1].reference_error = Some("CUDA out of memory".into());
    let samples = [
        sample(1, 0, Verdict::Correct, Some(1.1)),
        sample(2, 0, Verdict::RuntimeError, None),
    ];
    let v = json(&report(&ps, &samples, "1", false));
    close(&v["levels"]["1"]["correct"], 0.5);
    let errors = v["problem_errors"].as_array().unwrap();
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0]["problem_id"], 2);
    assert_eq!(errors[0]["reference_error"], "CUDA out of memory");
}

#[test]
fn sample_rows_carry_the_contract_fields() {
    let mut s = sample(3, 0, Verdict::Correct, None);
    s.candidate_timing = Some(timing(4.0));
    s.baseline_timing = Some(timing(6.0));
    let mut ps = problems(1, 1..=3);
    ps.extend(problems(2, 1..=1));
    let v = json(&report(&ps, &[s], "0", false));
    let row = &v["samples"][0];
    for key in [
        "level",
        "problem_id",
        "sample_id",
        "verdict",
        "speedup",
        "flags",
        "deceptive",
    ] {
        assert!(row.get(key).is_some(), "{key} missing");
    }
    assert_eq!(row["verdict"], "correct");
    close(&row["speedup"], 1.5);
    assert_eq!(v["levels"]["2"]["problems"], 1);
    close(&v["levels"]["2"]["correct"], 0.0);
}

#[test]
fn text_formats_cover_every_sample() {
    use Verdict::*;
    let mut odd = sample(2, 0, LoadError, None);
    odd.message = Some("bad, \"quoted\" <tag> | pipe\nnext".into());
    let samples = [
        sample(1, 0, Correct, Some(2.0)),
        deceptive(
            sample(1, 1, Correct, Some(9.0)),
            "no_candidate_kernel_launched",
        ),
        odd,
    ];
    let r = report(&problems(1, 1..=2), &samples, "0,1", false);

    let csv = render(&r, Format::Csv).unwrap();
    assert!(csv.starts_with("level,problem_id,name,sample_id,verdict,"));
    assert!(csv.contains("\"bad, \"\"quoted\"\" <tag> | pipe\nnext\""));
    assert!(csv.contains("no_candidate_kernel_launched"));

    let md = render(&r, Format::Md).unwrap();
    assert!(md.contains("## Level 1: 2 problems, 3 samples"));
    assert!(md.contains("| fast_1 |"));
    assert!(md.contains("no_candidate_kernel_launched"));

    let html = render(&r, Format::Html).unwrap();
    assert!(html.contains("<svg") && html.contains("&lt;tag&gt;"));
    assert!(!html.contains("<tag>"));
    for external in ["src=", "href=", "<script", "<link", "@import", "url("] {
        assert!(!html.contains(external), "{external}");
    }
}

#[test]
fn evaluator_time_sums_each_stage_most_total_first() {
    let mut a = sample(1, 0, Verdict::Correct, Some(2.0));
    a.stages = vec![("import".into(), 1.0), ("timing".into(), 0.5)];
    let mut b = sample(2, 0, Verdict::Correct, Some(2.0));
    b.stages = vec![("import".into(), 3.0), ("timing".into(), 0.25)];
    let mut c = sample(3, 0, Verdict::LoadError, None);
    c.stages = vec![("import".into(), 2.0)];
    let r = report(&problems(1, 1..=3), &[a, b, c], "1", false);
    let t = &r.evaluator_time;
    assert_eq!(t.len(), 2);
    assert_eq!((t[0].stage.as_str(), t[0].samples), ("import", 3));
    assert_eq!((t[0].median_s, t[0].total_s), (2.0, 6.0));
    assert_eq!((t[1].stage.as_str(), t[1].samples), ("timing", 2));
    assert_eq!((t[1].median_s, t[1].total_s), (0.375, 0.75));
    let md = render(&r, Format::Md).unwrap();
    assert!(md.contains("| import | 3 | 2.000 | 6.0 |"), "{md}");
    assert_eq!(json(&r)["evaluator_time"][1]["stage"], "timing");
}
