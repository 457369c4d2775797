//! HTML escaping and self-contained SVG charts for dice's report pages (`dice report --format
//! html`, the curate report, a training run's `metrics.html`): one place that decides how a
//! chart reads — axis titles, a legend, ticks on round values (whole numbers where the
//! quantity counts something, such as steps), log2 scales for ratios such as speedups,
//! reference lines — so every page reads alike.
//!
//! A chart is a [`Chart`] of [`Series`] (lines, points, bars) over two [`Axis`]; its
//! [`Chart::svg`] is one inline `<svg>` element with no script and no external resource.

mod axis;
mod chart;

pub use axis::{format_number, Axis};
pub use chart::{Bar, Chart, Point, Series};

/// `text` safe inside HTML or SVG, as element content or a quoted attribute value.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_covers_markup_and_both_quotes() {
        assert_eq!(
            escape(r#"<a href="x">Tom & 'Jerry'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;Tom &amp; &#39;Jerry&#39;&lt;/a&gt;"
        );
        assert_eq!(escape("speedup ≥ 2×"), "speedup ≥ 2×");
    }

    fn loss_chart() -> Chart {
        let train: Vec<(f64, f64)> = (1..=40)
            .map(|s| (f64::from(s), 2.0 / f64::from(s)))
            .collect();
        Chart::new("loss <train>", Axis::integer("step"), Axis::real("loss"))
            .with(Series::line("train", train))
            .with(Series::line("held-out", vec![(10.0, 0.5), (20.0, 0.3)]))
    }

    #[test]
    fn a_chart_has_its_title_axis_titles_legend_and_integer_steps() {
        let svg = loss_chart().svg();
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.ends_with("</svg>"));
        assert!(svg.contains("<title>loss &lt;train&gt;</title>"), "{svg}");
        // Axis titles: the x one under the ticks, the y one turned.
        assert!(svg.contains(">step</text>") && svg.contains("rotate(-90"));
        assert!(svg.contains(">loss</text>"));
        // A legend entry per series.
        assert_eq!(svg.matches("<g class=\"legend\">").count(), 2);
        assert!(svg.contains(">train</text></g>") && svg.contains(">held-out</text></g>"));
        // The step ticks, whole numbers.
        for step in ["1", "10", "20", "30", "40"] {
            assert!(
                svg.contains(&format!("text-anchor=\"middle\">{step}</text>")),
                "{step}"
            );
        }
        assert!(!svg.contains(">1.000<") && !svg.contains("step 1.0"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        // Few points: each marked, its value on hover.
        assert!(
            svg.contains("<title>held-out, step 20: 0.3</title>"),
            "{svg}"
        );
        assert!(!svg.contains("<script"));
    }

    #[test]
    fn an_untitled_chart_leaves_the_title_to_the_page() {
        let svg = loss_chart().untitled().svg();
        assert!(svg.contains("<title>loss &lt;train&gt;</title>"));
        assert!(!svg.contains("font-weight=\"bold\""));
    }

    #[test]
    fn speedups_per_problem_have_a_baseline_rule_legend_and_failed_band() {
        let points = |xs: &[(f64, Option<f64>)]| {
            xs.iter()
                .map(|&(x, y)| Point {
                    x,
                    y,
                    tip: format!("problem {x}"),
                })
                .collect()
        };
        let svg = Chart::new(
            "speedup per problem",
            Axis::integer("problem"),
            Axis::ratio("speedup (log scale)").including(1.0),
        )
        .missing_band("failed")
        .with(Series::points(
            "correct",
            points(&[(1.0, Some(2.0)), (2.0, Some(0.5))]),
        ))
        .with(Series::points("failed", points(&[(3.0, None)])).colour("#999"))
        .rule_at_y(1.0, "baseline (1×)", "#333")
        .svg();
        // The baseline: a dashed line, named in the legend.
        assert!(svg.contains("stroke-dasharray=\"5 3\"><title>baseline (1×)</title></line>"));
        assert!(svg.contains(">baseline (1×)</text></g>"));
        assert!(svg.contains(">failed</text>") && svg.contains("fill=\"#f3f3f3\""));
        assert!(svg.contains(">1×</text>") && svg.contains(">1/2×</text>"));
        assert!(svg.contains(">problem</text>") && svg.contains(">speedup (log scale)</text>"));
        assert_eq!(svg.matches("<g class=\"legend\">").count(), 3);
        assert_eq!(svg.matches("<circle").count(), 3 + 2);
    }

    /// A chart of raw and robust rates of `runs`, `values` per run (`None`: not run).
    fn rates(runs: &[&str], raw: Vec<Option<f64>>, robust: Vec<Option<f64>>) -> String {
        Chart::grouped_bars(
            "Level 1: Exec",
            (
                "",
                &runs.iter().map(ToString::to_string).collect::<Vec<_>>(),
            ),
            Axis::percent("").with_range(0.0, 1.0),
            &[("raw", "#2a9d8f", raw), ("robust", "#264653", robust)],
            "not run",
        )
        .size(400.0, 240.0)
        .svg()
    }

    #[test]
    fn grouped_bars_label_their_values_and_absent_categories() {
        let svg = rates(
            &["runs/a", "runs/b"],
            vec![Some(0.75), None],
            vec![Some(0.5), None],
        );
        assert!(svg.contains("<title>runs/a robust: 50.0%</title>"), "{svg}");
        assert!(svg.contains(">75%</text>") && svg.contains(">not run</text>"));
        assert!(svg.contains(">100%</text>") && svg.contains(">0%</text>"));
        assert_eq!(svg.matches("<rect").count(), 2 + 2);
    }

    #[test]
    fn a_long_category_name_takes_two_lines() {
        let three = |name: &str| {
            let values = vec![Some(0.5), Some(0.25), Some(0.0)];
            rates(&[name, "runs/b", "runs/c"], values.clone(), values)
        };
        let svg = three("runs/dice-1.7b-rl-stage2");
        assert!(svg.contains(">runs/dice-<tspan"), "{svg}");
        assert!(svg.contains(">1.7b-rl-stage2</tspan></text>"));
        assert!(svg.contains("text-anchor=\"middle\">runs/b</text>"));
        // Too long even for two lines: cut at the front, whole on hover.
        let name = "experiments/2025-06/dice-1.7b-rl-stage2-long-context";
        let svg = three(name);
        assert!(
            svg.contains(&format!("<title>{name}</title></text>")),
            "{svg}"
        );
        assert!(svg.contains(">…"));
    }

    #[test]
    fn a_chart_without_data_says_so() {
        let svg = Chart::new("kl", Axis::integer("step"), Axis::real("kl")).svg();
        assert!(svg.contains("no data yet"));
    }
}
