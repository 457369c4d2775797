//! CSV: one row per sample (RFC 4180 quoting).

use super::optional_ms;
use crate::report::Report;

const HEADER: &str = "level,problem_id,name,sample_id,verdict,compiled,correct,robust_correct,\
speedup,median_speedup,candidate_ms,baseline_ms,deceptive,flags,message";

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
            s.speedup.map_or(String::new(), |v| v.to_string()),
            s.median_speedup.map_or(String::new(), |v| v.to_string()),
            optional_ms(s.candidate_ms),
            optional_ms(s.baseline_ms),
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
