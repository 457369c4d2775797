//! One chart: a frame (title, legend, axes with their ticks and titles) around lines, points
//! and bars, drawn as one inline SVG element.

use crate::axis::{Axis, Kind, Resolved};
use crate::escape;
use std::fmt::Write;

/// Colours of series that name none, in order (Tableau 10: told apart in print and by most
/// readers with a colour vision deficiency).
const PALETTE: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];
/// Lines with at most this many points also mark each point, with its value as a tooltip (and
/// a lone point stays visible).
const MARKED_POINTS: usize = 40;
const FONT: f64 = 11.0;
const TITLE_FONT: f64 = 13.0;
/// The width of a character at `FONT`, for laying out text without measuring it.
const CHAR_WIDTH: f64 = 0.58 * FONT;
const PAD: f64 = 8.0;
const ROW: f64 = 16.0;
/// The dashes of a reference line, in its legend entry too.
const RULE_DASH: &str = "5 3";
/// The height of the band under the plot where points without a value sit.
const BAND: f64 = 18.0;

/// A chart: build it with [`Chart::new`] and the adders, draw it with [`Chart::svg`].
#[derive(Clone, Debug)]
pub struct Chart {
    title: String,
    title_shown: bool,
    x: Axis,
    y: Axis,
    series: Vec<Series>,
    rules: Vec<Rule>,
    notes: Vec<Note>,
    missing: Option<String>,
    width: f64,
    height: f64,
}

/// One named set of marks, shown in the legend.
#[derive(Clone, Debug)]
pub struct Series {
    label: String,
    colour: Option<String>,
    marks: Marks,
}

#[derive(Clone, Debug)]
enum Marks {
    Line(Vec<(f64, f64)>),
    Points(Vec<Point>),
    Bars { bars: Vec<Bar>, valued: bool },
}

/// A point of a scatter; one without `y` sits in the chart's missing band.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub x: f64,
    pub y: Option<f64>,
    /// Shown on hover.
    pub tip: String,
}

/// A bar from `from` to `to` along x (data units), `value` high.
#[derive(Clone, Debug, PartialEq)]
pub struct Bar {
    pub from: f64,
    pub to: f64,
    pub value: f64,
    /// Shown on hover.
    pub tip: String,
}

/// A dashed reference line across the plot at a value of one axis.
#[derive(Clone, Debug)]
struct Rule {
    /// Whether `at` is an x value (the line is vertical) or a y value.
    vertical: bool,
    at: f64,
    label: String,
    colour: String,
}

/// Text just above the x axis at `x` (data units).
#[derive(Clone, Debug)]
struct Note {
    x: f64,
    text: String,
}

impl Series {
    fn new(label: &str, marks: Marks) -> Self {
        Self {
            label: label.to_string(),
            colour: None,
            marks,
        }
    }

    /// A line through `(x, y)` points in the given order; non-finite values are left out.
    pub fn line(label: &str, points: Vec<(f64, f64)>) -> Self {
        Self::new(label, Marks::Line(points))
    }

    /// Separate points, each with its tooltip.
    pub fn points(label: &str, points: Vec<Point>) -> Self {
        Self::new(label, Marks::Points(points))
    }

    /// Bars, drawn under lines and points; a later series' bars cover an earlier one's.
    pub fn bars(label: &str, bars: Vec<Bar>) -> Self {
        Self::new(
            label,
            Marks::Bars {
                bars,
                valued: false,
            },
        )
    }

    /// Writes each bar's value above it.
    #[must_use]
    pub fn with_values(mut self) -> Self {
        if let Marks::Bars { valued, .. } = &mut self.marks {
            *valued = true;
        }
        self
    }

    /// Draws the series in `colour` (any SVG colour) instead of the palette's next one.
    #[must_use]
    pub fn colour(mut self, colour: &str) -> Self {
        self.colour = Some(colour.to_string());
        self
    }

    fn is_empty(&self) -> bool {
        match &self.marks {
            Marks::Line(points) => points.is_empty(),
            Marks::Points(points) => points.is_empty(),
            Marks::Bars { bars, .. } => bars.is_empty(),
        }
    }
}

impl Chart {
    /// An empty 720 × 260 chart titled `title` (shown above the plot and read by screen
    /// readers).
    pub fn new(title: &str, x: Axis, y: Axis) -> Self {
        Self {
            title: title.to_string(),
            title_shown: true,
            x,
            y,
            series: Vec::new(),
            rules: Vec::new(),
            notes: Vec::new(),
            missing: None,
            width: 720.0,
            height: 260.0,
        }
    }

    /// Bars of several series side by side per category (runs, levels), each bar's value
    /// written above it and in its tooltip (`{category} {series}: {value}`); a category
    /// without any value says `absent` instead.
    pub fn grouped_bars(
        title: &str,
        (x_title, names): (&str, &[String]),
        y: Axis,
        series: &[(&str, &str, Vec<Option<f64>>)],
        absent: &str,
    ) -> Self {
        let mut chart = Self::new(title, Axis::categories(x_title, names.to_vec()), y);
        // Each category's slot is 1 wide; its bars fill 70 % of it.
        let bar = 0.7 / series.len().max(1) as f64;
        for (k, (label, colour, values)) in series.iter().enumerate() {
            let bars = names
                .iter()
                .zip(values)
                .enumerate()
                .filter_map(|(i, (name, value))| {
                    let value = (*value)?;
                    let from = i as f64 - 0.35 + k as f64 * bar;
                    Some(Bar {
                        from,
                        to: from + bar,
                        value,
                        tip: format!("{name} {label}: {}", chart.y.format(value)),
                    })
                })
                .collect();
            chart
                .series
                .push(Series::bars(label, bars).colour(colour).with_values());
        }
        for i in 0..names.len() {
            if series
                .iter()
                .all(|(_, _, v)| v.get(i).copied().flatten().is_none())
            {
                chart.notes.push(Note {
                    x: i as f64,
                    text: absent.to_string(),
                });
            }
        }
        chart
    }

    /// Sets the size in pixels.
    #[must_use]
    pub fn size(mut self, width: f64, height: f64) -> Self {
        self.width = width;
        self.height = height;
        self
    }

    /// Leaves the title out of the drawing (the page shows it as a heading); screen readers
    /// still read it.
    #[must_use]
    pub fn untitled(mut self) -> Self {
        self.title_shown = false;
        self
    }

    /// Adds a series.
    #[must_use]
    pub fn with(mut self, series: Series) -> Self {
        self.series.push(series);
        self
    }

    /// Adds a dashed vertical line at `x`, named `label` in the legend.
    #[must_use]
    pub fn rule_at_x(self, x: f64, label: &str, colour: &str) -> Self {
        self.rule(true, x, label, colour)
    }

    /// Adds a dashed horizontal line at `y`, named `label` in the legend.
    #[must_use]
    pub fn rule_at_y(self, y: f64, label: &str, colour: &str) -> Self {
        self.rule(false, y, label, colour)
    }

    fn rule(mut self, vertical: bool, at: f64, label: &str, colour: &str) -> Self {
        self.rules.push(Rule {
            vertical,
            at,
            label: label.to_string(),
            colour: colour.to_string(),
        });
        self
    }

    /// Draws points without a y value in a band under the plot, labelled `label`.
    #[must_use]
    pub fn missing_band(mut self, label: &str) -> Self {
        self.missing = Some(label.to_string());
        self
    }

    fn is_empty(&self) -> bool {
        self.series.iter().all(Series::is_empty)
    }

    /// The chart as one `<svg>` element: no script, no external resource.
    pub fn svg(&self) -> String {
        let frame = Frame::new(self);
        let mut svg = String::new();
        let title = escape(&self.title);
        let _ = write!(
            svg,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {w} {h}\" width=\"{w}\" \
             height=\"{h}\" role=\"img\" aria-label=\"{title}\" font-family=\"system-ui, sans-serif\" \
             font-size=\"{FONT}\" fill=\"#333\"><title>{title}</title>",
            w = self.width,
            h = self.height,
        );
        frame.draw_axes(self, &mut svg);
        if self.is_empty() {
            let _ = write!(
                svg,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#888\">no data yet</text>",
                (frame.left + frame.right) / 2.0,
                (frame.top + frame.bottom) / 2.0
            );
        }
        let colours = &frame.colours;
        // Bars under lines, lines under points.
        for rank in 0..3 {
            for (series, colour) in self.series.iter().zip(colours) {
                match &series.marks {
                    Marks::Bars { bars, valued } if rank == 0 => {
                        frame.draw_bars(self, bars, *valued, colour, &mut svg);
                    }
                    Marks::Line(points) if rank == 1 => {
                        frame.draw_line(self, &series.label, points, colour, &mut svg);
                    }
                    Marks::Points(points) if rank == 2 => {
                        frame.draw_points(self, points, colour, &mut svg);
                    }
                    _ => {}
                }
            }
        }
        frame.draw_rules(self, &mut svg);
        frame.draw_notes(self, &mut svg);
        frame.draw_heading(self, &mut svg);
        svg.push_str("</svg>");
        svg
    }

    /// Each series' colour: its own, or the palette's next.
    fn colours(&self) -> Vec<String> {
        let mut next = 0;
        self.series
            .iter()
            .map(|s| {
                s.colour.clone().unwrap_or_else(|| {
                    next += 1;
                    PALETTE[(next - 1) % PALETTE.len()].to_string()
                })
            })
            .collect()
    }

    /// The data's x and y values in axis units, reference lines included.
    fn data(&self) -> (Vec<f64>, Vec<f64>) {
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for series in &self.series {
            match &series.marks {
                Marks::Line(points) => {
                    for &(x, y) in points.iter().filter(|p| p.1.is_finite()) {
                        xs.extend(self.x.unit(x));
                        ys.extend(self.y.unit(y));
                    }
                }
                Marks::Points(points) => {
                    for p in points {
                        xs.extend(self.x.unit(p.x));
                        ys.extend(p.y.and_then(|y| self.y.unit(y)));
                    }
                }
                Marks::Bars { bars, .. } => {
                    for b in bars.iter().filter(|b| b.value != 0.0) {
                        xs.extend(self.x.unit(b.from));
                        xs.extend(self.x.unit(b.to));
                        ys.extend(self.y.unit(b.value));
                        ys.extend(self.y.unit(0.0));
                    }
                }
            }
        }
        for rule in &self.rules {
            let (axis, values) = if rule.vertical {
                (&self.x, &mut xs)
            } else {
                (&self.y, &mut ys)
            };
            values.extend(axis.unit(rule.at));
        }
        (xs, ys)
    }
}

/// Where things go: the resolved axes and the plot's edges in pixels.
struct Frame {
    x: Resolved,
    y: Resolved,
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
    colours: Vec<String>,
    legend: Vec<Vec<Entry>>,
    /// Lines of each x tick label (category names too long for their slot take two).
    x_labels: Vec<Vec<String>>,
}

/// What a legend entry shows beside its label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Swatch {
    Line,
    Point,
    Bar,
    Rule,
}

struct Entry {
    label: String,
    colour: String,
    swatch: Swatch,
}

fn text_width(text: &str) -> f64 {
    text.chars().count() as f64 * CHAR_WIDTH
}

/// Each x tick's label in lines: one, or for a category name too long for its slot, two split
/// at a separator near its middle, each cut to the slot.
fn x_labels(chart: &Chart, x: &Resolved, width: f64) -> Vec<Vec<String>> {
    let categories = matches!(chart.x.kind, Kind::Categories(_));
    let fits = (width / x.ticks.len().max(1) as f64 / CHAR_WIDTH) as usize;
    x.ticks
        .iter()
        .map(|(_, label)| {
            if !categories || label.chars().count() <= fits {
                return vec![label.clone()];
            }
            match split_near_middle(label) {
                Some((first, second)) => vec![tail(first, fits), tail(second, fits)],
                None => vec![tail(label, fits)],
            }
        })
        .collect()
}

/// `label` in two after the separator (`/`, `-`, `_`, space) nearest its middle.
fn split_near_middle(label: &str) -> Option<(&str, &str)> {
    let middle = label.len() / 2;
    label
        .char_indices()
        .filter(|(_, c)| matches!(c, '/' | '-' | '_' | ' '))
        .map(|(i, c)| i + c.len_utf8())
        .filter(|&i| i < label.len())
        .min_by_key(|&i| i.abs_diff(middle))
        .map(|i| label.split_at(i))
}

/// The last `chars` characters of `text`, `…` marking a cut (run labels are often paths; their
/// ends tell them apart).
fn tail(text: &str, chars: usize) -> String {
    let count = text.chars().count();
    let chars = chars.max(2);
    if count <= chars {
        return text.to_string();
    }
    let kept: String = text.chars().skip(count + 1 - chars).collect();
    format!("…{kept}")
}

impl Frame {
    fn new(chart: &Chart) -> Self {
        let (xs, ys) = chart.data();
        let x = chart.x.resolve(&xs, true);
        let y = chart.y.resolve(&ys, false);
        let widest_y = y
            .ticks
            .iter()
            .map(|(_, l)| text_width(l))
            .fold(0.0, f64::max);
        let y_title = if chart.y.title.is_empty() {
            0.0
        } else {
            ROW + 4.0
        };
        let band_label = chart.missing.as_deref().map_or(0.0, text_width);
        let left = PAD + y_title + widest_y.max(band_label) + 8.0;
        // The last tick's label, centred on the plot's right edge, may reach past it; a
        // category's stays within its slot.
        let last_x = match chart.x.kind {
            Kind::Categories(_) => 0.0,
            _ => x.ticks.last().map_or(0.0, |(_, l)| text_width(l) / 2.0),
        };
        let right = chart.width - PAD - last_x.max(8.0);
        let colours = chart.colours();
        let legend = legend_rows(legend_entries(chart, &colours), right - left);
        let title = if chart.title_shown { ROW + 6.0 } else { 0.0 };
        let top = PAD + title + ROW * legend.len() as f64 + 14.0;
        let band = if chart.missing.is_some() {
            BAND + 4.0
        } else {
            0.0
        };
        let x_title = if chart.x.title.is_empty() { 0.0 } else { ROW };
        let x_labels = x_labels(chart, &x, right - left);
        let label_rows = x_labels.iter().map(Vec::len).max().unwrap_or(1) as f64;
        let bottom = chart.height - PAD - x_title - ROW * label_rows - band;
        Self {
            x,
            y,
            left,
            right,
            top,
            bottom,
            colours,
            legend,
            x_labels,
        }
    }

    /// x in pixels of an x in axis units, held inside the plot.
    fn px(&self, x: f64) -> f64 {
        let span = (self.x.hi - self.x.lo).max(f64::MIN_POSITIVE);
        let t = ((x - self.x.lo) / span).clamp(0.0, 1.0);
        self.left + t * (self.right - self.left)
    }

    /// y in pixels of a y in axis units, held inside the plot.
    fn py(&self, y: f64) -> f64 {
        let span = (self.y.hi - self.y.lo).max(f64::MIN_POSITIVE);
        let t = ((y - self.y.lo) / span).clamp(0.0, 1.0);
        self.bottom - t * (self.bottom - self.top)
    }

    fn draw_axes(&self, chart: &Chart, svg: &mut String) {
        let (l, r, t, b) = (self.left, self.right, self.top, self.bottom);
        for (y, label) in &self.y.ticks {
            let py = self.py(*y);
            let _ = write!(
                svg,
                "<line x1=\"{l:.1}\" y1=\"{py:.1}\" x2=\"{r:.1}\" y2=\"{py:.1}\" stroke=\"#e6e6e6\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                l - 6.0,
                py + 4.0,
                escape(label)
            );
        }
        let categories = matches!(chart.x.kind, Kind::Categories(_));
        let band = if chart.missing.is_some() {
            BAND + 4.0
        } else {
            0.0
        };
        let label_y = b + band + 14.0;
        for ((x, label), lines) in self.x.ticks.iter().zip(&self.x_labels) {
            let px = self.px(*x);
            if !categories {
                let _ = write!(
                    svg,
                    "<line x1=\"{px:.1}\" y1=\"{t:.1}\" x2=\"{px:.1}\" y2=\"{b:.1}\" stroke=\"#f0f0f0\"/>\
                     <line x1=\"{px:.1}\" y1=\"{b:.1}\" x2=\"{px:.1}\" y2=\"{:.1}\" stroke=\"#666\"/>",
                    b + 4.0
                );
            }
            let _ = write!(
                svg,
                "<text x=\"{px:.1}\" y=\"{label_y:.1}\" text-anchor=\"middle\">{}",
                escape(&lines[0])
            );
            for line in &lines[1..] {
                let _ = write!(
                    svg,
                    "<tspan x=\"{px:.1}\" dy=\"{ROW}\">{}</tspan>",
                    escape(line)
                );
            }
            if lines.concat() != *label {
                let _ = write!(svg, "<title>{}</title>", escape(label));
            }
            svg.push_str("</text>");
        }
        let label_rows = self.x_labels.iter().map(Vec::len).max().unwrap_or(1) as f64;
        let _ = write!(
            svg,
            "<line x1=\"{l:.1}\" y1=\"{b:.1}\" x2=\"{r:.1}\" y2=\"{b:.1}\" stroke=\"#666\"/>\
             <line x1=\"{l:.1}\" y1=\"{t:.1}\" x2=\"{l:.1}\" y2=\"{b:.1}\" stroke=\"#666\"/>"
        );
        if let Some(label) = &chart.missing {
            let _ = write!(
                svg,
                "<rect x=\"{l:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{BAND}\" fill=\"#f3f3f3\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                b + 4.0,
                r - l,
                l - 6.0,
                b + 4.0 + BAND / 2.0 + 4.0,
                escape(label)
            );
        }
        if !chart.x.title.is_empty() {
            let _ = write!(
                svg,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"12\">{}</text>",
                (l + r) / 2.0,
                label_y + ROW * label_rows,
                escape(&chart.x.title)
            );
        }
        if !chart.y.title.is_empty() {
            let (x, y) = (PAD + 10.0, (t + b) / 2.0);
            let _ = write!(
                svg,
                "<text x=\"{x:.1}\" y=\"{y:.1}\" text-anchor=\"middle\" font-size=\"12\" \
                 transform=\"rotate(-90 {x:.1} {y:.1})\">{}</text>",
                escape(&chart.y.title)
            );
        }
    }

    fn draw_bars(&self, chart: &Chart, bars: &[Bar], valued: bool, colour: &str, svg: &mut String) {
        let base = chart.y.unit(0.0).map_or(self.bottom, |z| self.py(z));
        for bar in bars.iter().filter(|b| b.value != 0.0) {
            let (Some(from), Some(to), Some(value)) = (
                chart.x.unit(bar.from),
                chart.x.unit(bar.to),
                chart.y.unit(bar.value),
            ) else {
                continue;
            };
            let (x0, x1) = (self.px(from), self.px(to));
            let gap = if x1 - x0 > 4.0 { 1.0 } else { 0.0 };
            let top = self.py(value);
            let (y, h) = (top.min(base), (base - top).abs());
            let _ = write!(
                svg,
                "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"{colour}\">\
                 <title>{}</title></rect>",
                x0 + gap,
                (x1 - x0 - 2.0 * gap).max(0.5),
                escape(&bar.tip)
            );
            if valued {
                let _ = write!(
                    svg,
                    "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"10\">{}</text>",
                    (x0 + x1) / 2.0,
                    y - 3.0,
                    escape(&chart.y.format_short(bar.value))
                );
            }
        }
    }

    fn draw_line(
        &self,
        chart: &Chart,
        label: &str,
        points: &[(f64, f64)],
        colour: &str,
        svg: &mut String,
    ) {
        let placed: Vec<((f64, f64), (f64, f64))> = points
            .iter()
            .filter_map(|&(x, y)| {
                let at = (self.px(chart.x.unit(x)?), self.py(chart.y.unit(y)?));
                Some(((x, y), at))
            })
            .collect();
        if placed.is_empty() {
            return;
        }
        let path: Vec<String> = placed
            .iter()
            .map(|(_, (x, y))| format!("{x:.1},{y:.1}"))
            .collect();
        let _ = write!(
            svg,
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.8\" \
             stroke-linejoin=\"round\" points=\"{}\"/>",
            path.join(" ")
        );
        if placed.len() <= MARKED_POINTS {
            for ((x, y), (px, py)) in &placed {
                let _ = write!(
                    svg,
                    "<circle cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"2.5\" fill=\"{colour}\"><title>{}</title></circle>",
                    escape(&format!(
                        "{label}, {} {}: {}",
                        chart.x.title,
                        chart.x.format(*x),
                        chart.y.format(*y)
                    ))
                );
            }
        }
    }

    fn draw_points(&self, chart: &Chart, points: &[Point], colour: &str, svg: &mut String) {
        let band = self.bottom + 4.0 + BAND / 2.0;
        for p in points {
            let Some(x) = chart.x.unit(p.x) else {
                continue;
            };
            let y = match (p.y.and_then(|y| chart.y.unit(y)), &chart.missing) {
                (Some(y), _) => self.py(y),
                (None, Some(_)) => band,
                (None, None) => continue,
            };
            let _ = write!(
                svg,
                "<circle cx=\"{:.1}\" cy=\"{y:.1}\" r=\"3.5\" fill=\"{colour}\" fill-opacity=\"0.8\">\
                 <title>{}</title></circle>",
                self.px(x),
                escape(&p.tip)
            );
        }
    }

    fn draw_rules(&self, chart: &Chart, svg: &mut String) {
        for rule in &chart.rules {
            let axis = if rule.vertical { &chart.x } else { &chart.y };
            let Some(at) = axis.unit(rule.at) else {
                continue;
            };
            let (x1, y1, x2, y2) = if rule.vertical {
                let x = self.px(at);
                (x, self.top, x, self.bottom)
            } else {
                let y = self.py(at);
                (self.left, y, self.right, y)
            };
            // Labelled in the legend, so it covers no data.
            let _ = write!(
                svg,
                "<line x1=\"{x1:.1}\" y1=\"{y1:.1}\" x2=\"{x2:.1}\" y2=\"{y2:.1}\" stroke=\"{}\" \
                 stroke-width=\"1.5\" stroke-dasharray=\"{RULE_DASH}\"><title>{}</title></line>",
                rule.colour,
                escape(&rule.label)
            );
        }
    }

    fn draw_notes(&self, chart: &Chart, svg: &mut String) {
        for note in &chart.notes {
            let Some(x) = chart.x.unit(note.x) else {
                continue;
            };
            let _ = write!(
                svg,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#888\">{}</text>",
                self.px(x),
                self.bottom - 6.0,
                escape(&note.text)
            );
        }
    }

    /// The title and, under it, the legend: a swatch and a label for every labelled series and
    /// reference line.
    fn draw_heading(&self, chart: &Chart, svg: &mut String) {
        let mut y = PAD;
        if chart.title_shown {
            y += ROW;
            let _ = write!(
                svg,
                "<text x=\"{:.1}\" y=\"{y:.1}\" font-size=\"{TITLE_FONT}\" font-weight=\"bold\">{}</text>",
                self.left,
                escape(&chart.title)
            );
            y += 6.0;
        }
        for row in &self.legend {
            y += ROW;
            let mut x = self.left;
            for entry in row {
                let (colour, mid) = (&entry.colour, y - 4.0);
                let swatch = match entry.swatch {
                    Swatch::Line => format!(
                        "<line x1=\"{x:.1}\" y1=\"{mid:.1}\" x2=\"{:.1}\" y2=\"{mid:.1}\" stroke=\"{colour}\" stroke-width=\"2.5\"/>",
                        x + 16.0
                    ),
                    Swatch::Rule => format!(
                        "<line x1=\"{x:.1}\" y1=\"{mid:.1}\" x2=\"{:.1}\" y2=\"{mid:.1}\" stroke=\"{colour}\" stroke-width=\"1.5\" stroke-dasharray=\"{RULE_DASH}\"/>",
                        x + 16.0
                    ),
                    Swatch::Point => format!(
                        "<circle cx=\"{:.1}\" cy=\"{mid:.1}\" r=\"4\" fill=\"{colour}\"/>",
                        x + 8.0
                    ),
                    Swatch::Bar => format!(
                        "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{colour}\"/>",
                        x + 3.0,
                        y - 9.0
                    ),
                };
                let _ = write!(
                    svg,
                    "<g class=\"legend\">{swatch}<text x=\"{:.1}\" y=\"{y:.1}\">{}</text></g>",
                    x + 20.0,
                    escape(&entry.label)
                );
                x += legend_width(&entry.label);
            }
        }
    }
}

/// The width a legend entry takes: swatch, label, gap.
fn legend_width(label: &str) -> f64 {
    20.0 + text_width(label) + 16.0
}

/// The legend's entries: every labelled series, then every labelled reference line.
fn legend_entries(chart: &Chart, colours: &[String]) -> Vec<Entry> {
    let series = chart.series.iter().zip(colours).map(|(s, colour)| Entry {
        label: s.label.clone(),
        colour: colour.clone(),
        swatch: match s.marks {
            Marks::Line(_) => Swatch::Line,
            Marks::Points(_) => Swatch::Point,
            Marks::Bars { .. } => Swatch::Bar,
        },
    });
    let rules = chart.rules.iter().map(|r| Entry {
        label: r.label.clone(),
        colour: r.colour.clone(),
        swatch: Swatch::Rule,
    });
    series
        .chain(rules)
        .filter(|e| !e.label.is_empty())
        .collect()
}

/// `entries` in rows that fit `width`.
fn legend_rows(entries: Vec<Entry>, width: f64) -> Vec<Vec<Entry>> {
    let mut rows: Vec<Vec<Entry>> = Vec::new();
    let mut used = f64::INFINITY;
    for entry in entries {
        let w = legend_width(&entry.label);
        if used + w > width {
            rows.push(Vec::new());
            used = 0.0;
        }
        used += w;
        if let Some(row) = rows.last_mut() {
            row.push(entry);
        }
    }
    rows
}
