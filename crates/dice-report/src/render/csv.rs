//! CSV: one row per sample (RFC 4180 quoting).

use super::optional_ms;
use crate::report::Report;

const HEADER: &str = "level,problem_id,name,sample_id,verdict,compiled,correct,robust_correct,\
speedup,speedup_low,speedup_high,median_speedup,candidate_ms,baseline_ms,candidate_cv,baseline_cv,\
timing_remeasures,deceptive,flags,message";

pub(super) fn render(r: &Report) -> String {
    let mut out = String::from(HEADER);
    out.push('\n');
    for s in &r.samples {
        let fields = [
            s.level.to_string(),
            s.problem_id.to_string(),
            s.name.clone().unwrap_or_default(),
            s.sample_id.to_string(),
            s.verdict.to_string(),
            s.compiled.to_string(),
            s.correct.to_string(),
            s.robust_correct.to_string(),
            optional(s.speedup),
            optional(s.speedup_interval.map(|i| i.low)),
            optional(s.speedup_interval.map(|i| i.high)),
            optional(s.median_speedup),
            optional_ms(s.candidate_ms),
            optional_ms(s.baseline_ms),
            optional(s.candidate_cv),
            optional(s.baseline_cv),
            s.timing_remeasures.to_string(),
            s.deceptive.to_string(),
            s.flags.join(";"),
            s.message.clone().unwrap_or_default(),
        ];
        let line: Vec<String> = fields.iter().map(|f| quote(f)).collect();
        out.push_str(&line.join(","));
        out.push('\n');
    }
    out
}

fn optional(x: Option<f64>) -> String {
    x.map_or(String::new(), |v| v.to_string())
}

fn quote(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::quote;

    #[test]
    fn quotes_only_when_needed() {
        assert_eq!(quote("plain"), "plain");
        assert_eq!(quote("a,b"), "\"a,b\"");
        assert_eq!(quote("say \"hi\"\n"), "\"say \"\"hi\"\"\n\"");
    }
}
