//! The benchmark report picture: accuracy curves and update sizes, as one SVG document.
//!
//! A benchmark compares update codecs. The question it answers is "how much traffic does a
//! codec save, and what does it cost in accuracy", so the picture puts the two side by side:
//! on the left every node's held-out accuracy over time (one colour per codec), on the right
//! the bytes each codec puts on the wire per update, on a log scale, with the compression
//! ratio against dense `f32`.
//!
//! Rendering is pure Rust and in memory (plotters' SVG backend, no system fonts: text is
//! written as SVG `<text>` and the viewer picks the font), so it works on a headless machine.
//! Odd input (no runs, empty or single-point curves, flat curves, zero or non-finite sizes)
//! gives a sparser picture, never a panic or an error.

use anyhow::{Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Size of the whole picture in pixels.
const SIZE: (u32, u32) = (1100, 500);
/// Width of the accuracy panel; the bytes panel gets the rest.
const LEFT_WIDTH: u32 = 640;
/// Share of the time axis, from the start, ignored when choosing the lower accuracy bound:
/// every node starts near chance, and showing that would squash the interesting part.
const WARMUP_SHARE: f64 = 0.1;
/// Label of the reference bar added when no run is dense.
const DENSE_LABEL: &str = "dense f32";

/// A panel of the picture: part of the in-memory SVG drawing area.
type Panel<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// One colour per codec, cycled when there are more codecs than colours.
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];
/// Colour of the dense reference bar.
const DENSE_COLOUR: RGBColor = RGBColor(127, 127, 127);

/// One node's accuracy curve.
///
/// The report draws every node, not an average, so that a node that lags behind or
/// diverges is visible.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NodeCurve {
    /// Name of the node. Nodes are shaded in label order, so the same node has the same shade
    /// in every run (the legend names codecs, not nodes).
    pub label: String,
    /// `(seconds since the start of the run, held-out accuracy in 0..=1)`; non-finite
    /// points are skipped, order does not matter.
    pub points: Vec<(f64, f64)>,
}

/// One benchmark run (one codec).
///
/// Carries what both panels need: the nodes' curves for the accuracy panel, and the update
/// sizes for the bytes panel.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunSeries {
    /// Name of the codec; it names the run in the legend and under its bar.
    pub codec: String,
    /// The curves of the run's nodes, all drawn in the run's colour.
    pub nodes: Vec<NodeCurve>,
    /// Mean bytes on the wire per update with this codec.
    pub bytes_per_update: f64,
    /// Bytes the same update would take as dense `f32`: the reference for the compression
    /// ratio (and for the "dense f32" bar when no run is dense).
    pub dense_bytes_per_update: f64,
}

/// Renders the report picture as an SVG document.
///
/// Returns the document as a string (starting with `<svg`) so the caller decides where it
/// goes: a file next to the JSON report, or stdout. Fails only if plotters itself fails;
/// degenerate data draws an emptier picture instead.
pub fn render_svg(title: &str, runs: &[RunSeries]) -> Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).context("filling the background")?;
        let body = root
            .titled(title, ("sans-serif", 22))
            .context("drawing the title")?;
        let (left, right) = body.split_horizontally(LEFT_WIDTH);
        draw_accuracy(&left, runs)?;
        draw_bytes(&right, runs)?;
        root.present().context("finishing the SVG document")?;
    }
    Ok(svg)
}

/// One line of [`render_curves_svg`]: a kind of run's median curve (labelled, drawn bold) or
/// one of its seeds' runs (unlabelled, drawn faint in the same colour, so the spread shows
/// behind the median without crowding the legend).
#[derive(Debug, Clone)]
pub struct CurveLine {
    /// The legend's entry; `None` for a faint line.
    pub label: Option<String>,
    /// `(seconds, value)` points.
    pub points: Vec<(f64, f64)>,
    /// Which palette colour: the kind of run's index.
    pub colour: usize,
}

/// Any metric against wall time (`bench scaling`): the y axis spans the points, with a
/// margin; faint lines first, so the labelled ones lie on top.
pub fn render_curves_svg(title: &str, y_desc: &str, lines: &[CurveLine]) -> Result<String> {
    let points = lines.iter().flat_map(|l| l.points.iter());
    let (mut x_hi, mut y_lo, mut y_hi) = (1.0f64, f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in points {
        x_hi = x_hi.max(x);
        y_lo = y_lo.min(y);
        y_hi = y_hi.max(y);
    }
    if !y_lo.is_finite() {
        (y_lo, y_hi) = (0.0, 1.0);
    }
    let pad = ((y_hi - y_lo) * 0.05).max(1e-3);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).context("filling the background")?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..x_hi * 1.02, (y_lo - pad)..(y_hi + pad))
            .context("building the chart")?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .y_desc(y_desc)
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .context("drawing the axes")?;
        let faint_first = lines
            .iter()
            .filter(|l| l.label.is_none())
            .chain(lines.iter().filter(|l| l.label.is_some()));
        for line in faint_first {
            let colour = run_colour(line.colour);
            let Some(label) = &line.label else {
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        line.points.clone(),
                        lighten(colour, 0.65).stroke_width(1),
                    )))
                    .context("drawing a run's curve")?;
                continue;
            };
            chart
                .draw_series(std::iter::once(PathElement::new(
                    line.points.clone(),
                    colour.stroke_width(3),
                )))
                .context("drawing a curve")?
                .label(label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(3))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.3))
            .draw()
            .context("drawing the legend")?;
        root.present().context("finishing the SVG document")?;
    }
    Ok(svg)
}

/// The colour of the `index`-th run.
fn run_colour(index: usize) -> RGBColor {
    PALETTE[index % PALETTE.len()]
}

/// `colour` mixed with white by `amount` (0: unchanged, 1: white), to tell a run's nodes apart
/// while keeping them recognisably the run's colour.
fn lighten(colour: RGBColor, amount: f64) -> RGBColor {
    let amount = amount.clamp(0.0, 1.0);
    let mix = |c: u8| -> u8 {
        let value = f64::from(c) + (255.0 - f64::from(c)) * amount;
        // Rounded and clamped to 0..=255 first, so the cast is exact.
        value.round().clamp(0.0, 255.0) as u8
    };
    RGBColor(mix(colour.0), mix(colour.1), mix(colour.2))
}

/// A curve's finite points as `(seconds, accuracy in %)`, sorted by time.
fn percent_points(curve: &NodeCurve) -> Vec<(f64, f64)> {
    let mut points: Vec<(f64, f64)> = curve
        .points
        .iter()
        .filter(|(t, a)| t.is_finite() && a.is_finite())
        .map(|&(t, a)| (t, a * 100.0))
        .collect();
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    points
}

/// Axis ranges of the accuracy panel: `(time range, accuracy range in %)`.
///
/// Time runs from the start (0, or earlier if a point is earlier) to the last point. Accuracy
/// runs from a round number a little below the lowest point after the warm-up share of the
/// time, up to 100 (or higher if some point is, which only bad data does). Both ranges have a
/// positive width whatever the data.
fn accuracy_ranges(curves: &[Vec<(f64, f64)>]) -> ((f64, f64), (f64, f64)) {
    let all = || curves.iter().flatten();
    let t_min = all().map(|p| p.0).fold(f64::INFINITY, f64::min);
    let t_max = all().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
    if !t_min.is_finite() || !t_max.is_finite() {
        return ((0.0, 1.0), (0.0, 100.0));
    }
    let x_lo = t_min.min(0.0);
    let x_hi = if t_max - x_lo > 1e-9 {
        t_max
    } else {
        x_lo + 1.0
    };
    let cutoff = x_lo + WARMUP_SHARE * (t_max - x_lo);

    let late_min = all()
        .filter(|p| p.0 >= cutoff)
        .map(|p| p.1)
        .fold(f64::INFINITY, f64::min);
    let any_min = all().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let lowest = if late_min.is_finite() {
        late_min
    } else {
        any_min
    };
    let highest = all().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let y_hi = highest.max(100.0);
    // A little below the lowest point, down to a multiple of 5, never below 0.
    let y_lo = (((lowest - 2.0) / 5.0).floor() * 5.0).clamp(0.0, 95.0);
    let y_lo = if y_hi - y_lo > 1e-9 { y_lo } else { y_hi - 5.0 };
    ((x_lo, x_hi), (y_lo, y_hi))
}

/// Cuts a polyline to the horizontal band `lo..=hi`, returning the pieces inside it.
///
/// plotters does not clip lines to the plotting area, and the accuracy axis deliberately
/// starts above the warm-up points, so without this the early part of every curve would be
/// drawn over the axis labels.
fn clip_to_band(points: &[(f64, f64)], lo: f64, hi: f64) -> Vec<Vec<(f64, f64)>> {
    let inside = |y: f64| (lo..=hi).contains(&y);
    let mut pieces = Vec::new();
    if let [only] = points {
        if inside(only.1) {
            pieces.push(vec![*only]);
        }
        return pieces;
    }
    let mut current: Vec<(f64, f64)> = Vec::new();
    for pair in points.windows(2) {
        let ((x0, y0), (x1, y1)) = (pair[0], pair[1]);
        let dy = y1 - y0;
        let (t_in, t_out) = if dy == 0.0 {
            if inside(y0) {
                (0.0, 1.0)
            } else {
                (1.0, 0.0)
            }
        } else {
            let ta = (lo - y0) / dy;
            let tb = (hi - y0) / dy;
            (ta.min(tb).max(0.0), ta.max(tb).min(1.0))
        };
        if t_in > t_out {
            if current.len() > 1 {
                pieces.push(std::mem::take(&mut current));
            }
            current.clear();
            continue;
        }
        let at = |t: f64| (x0 + t * (x1 - x0), (y0 + t * dy).clamp(lo, hi));
        if t_in > 0.0 || current.is_empty() {
            if current.len() > 1 {
                pieces.push(std::mem::take(&mut current));
            }
            current.clear();
            current.push(at(t_in));
        }
        current.push(at(t_out));
        if t_out < 1.0 {
            pieces.push(std::mem::take(&mut current));
        }
    }
    if current.len() > 1 {
        pieces.push(current);
    }
    pieces
}

/// Draws the left panel: one line per node per run, one colour per run, a legend of codecs.
fn draw_accuracy(area: &Panel<'_>, runs: &[RunSeries]) -> Result<()> {
    let curves: Vec<Vec<Vec<(f64, f64)>>> = runs
        .iter()
        .map(|run| {
            // In label order, so that a node gets the same shade in every run.
            let mut nodes: Vec<&NodeCurve> = run.nodes.iter().collect();
            nodes.sort_by(|a, b| a.label.cmp(&b.label));
            nodes.into_iter().map(percent_points).collect()
        })
        .collect();
    let flat: Vec<Vec<(f64, f64)>> = curves.iter().flatten().cloned().collect();
    let ((x_lo, x_hi), (y_lo, y_hi)) = accuracy_ranges(&flat);

    let mut chart = ChartBuilder::on(area)
        .caption("held-out accuracy vs time", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(x_lo..x_hi, y_lo..y_hi)
        .context("building the accuracy chart")?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("accuracy (%)")
        .x_label_formatter(&|value| format_tick(*value, x_hi - x_lo))
        .y_label_formatter(&|value| format_tick(*value, y_hi - y_lo))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .context("drawing the accuracy axes")?;

    let mut any_point = false;
    for (index, (run, run_curves)) in runs.iter().zip(&curves).enumerate() {
        let colour = run_colour(index);
        let count = run_curves.len().max(1) as f64;
        for (node, points) in run_curves.iter().enumerate() {
            // The first node (by label) in the run's own colour, later ones progressively lighter.
            let shade = lighten(colour, 0.5 * node as f64 / count);
            let style = shade.stroke_width(2);
            for piece in clip_to_band(points, y_lo, y_hi) {
                any_point = true;
                if let [only] = piece.as_slice() {
                    chart
                        .draw_series(std::iter::once(Circle::new(*only, 3, shade.filled())))
                        .context("drawing a one-point curve")?;
                } else {
                    chart
                        .draw_series(std::iter::once(PathElement::new(piece, style)))
                        .context("drawing an accuracy curve")?;
                }
            }
        }
        // An empty series carries the legend entry, so a run without points is still named.
        chart
            .draw_series(std::iter::empty::<PathElement<(f64, f64)>>())
            .context("adding a legend entry")?
            .label(run.codec.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(3))
            });
    }

    if !any_point {
        let note = ("sans-serif", 16)
            .into_font()
            .color(&BLACK.mix(0.6))
            .pos(Pos::new(HPos::Center, VPos::Center));
        chart
            .draw_series(std::iter::once(Text::new(
                "no accuracy data",
                ((x_lo + x_hi) / 2.0, (y_lo + y_hi) / 2.0),
                note,
            )))
            .context("drawing the no-data note")?;
    }
    if !runs.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.5))
            .label_font(("sans-serif", 14))
            .draw()
            .context("drawing the legend")?;
    }
    Ok(())
}

/// One bar of the bytes panel.
struct Bar {
    /// Name under the bar.
    label: String,
    /// Bytes per update; may be zero or non-finite, which draws no bar.
    bytes: f64,
    /// Reference dense size for the ratio; not positive when unknown.
    dense: f64,
    /// Fill colour.
    colour: RGBColor,
}

/// Whether `run` is the dense codec itself (then no extra reference bar is needed).
fn is_dense(run: &RunSeries) -> bool {
    run.codec.to_ascii_lowercase().contains("dense")
        || (run.dense_bytes_per_update > 0.0
            && run.bytes_per_update >= 0.98 * run.dense_bytes_per_update)
}

/// The bars to draw: one per run, plus the dense reference when no run is dense.
fn bars(runs: &[RunSeries]) -> Vec<Bar> {
    let mut bars: Vec<Bar> = runs
        .iter()
        .enumerate()
        .map(|(index, run)| Bar {
            label: run.codec.clone(),
            bytes: run.bytes_per_update,
            dense: run.dense_bytes_per_update,
            colour: run_colour(index),
        })
        .collect();
    if let Some(first) = runs.first() {
        let dense = first.dense_bytes_per_update;
        if !runs.iter().any(is_dense) && dense.is_finite() && dense > 0.0 {
            bars.push(Bar {
                label: DENSE_LABEL.to_string(),
                bytes: dense,
                dense,
                colour: DENSE_COLOUR,
            });
        }
    }
    bars
}

/// A byte count with a decimal unit and three significant digits, e.g. `25.9 KB`.
fn format_bytes(bytes: f64) -> String {
    if !bytes.is_finite() {
        return "? B".to_string();
    }
    const UNITS: [&str; 5] = ["B", "KB", "MB", "GB", "TB"];
    let mut value = bytes;
    let mut unit = 0;
    while value.abs() >= 999.5 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{value:.0} B")
    } else if value.abs() < 9.995 {
        format!("{value:.2} {}", UNITS[unit])
    } else if value.abs() < 99.95 {
        format!("{value:.1} {}", UNITS[unit])
    } else {
        format!("{value:.0} {}", UNITS[unit])
    }
}

/// An axis tick value with no more decimals than the axis `width` needs (`20`, not `20.0`).
fn format_tick(value: f64, width: f64) -> String {
    if width >= 10.0 {
        format!("{value:.0}")
    } else if width >= 1.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

/// A tick of the log bytes axis: like [`format_bytes`], without trailing zeros (`10 KB`).
fn format_tick_bytes(bytes: f64) -> String {
    let text = format_bytes(bytes);
    match text.split_once(' ') {
        Some((number, unit)) if number.contains('.') => {
            let number = number.trim_end_matches('0').trim_end_matches('.');
            format!("{number} {unit}")
        }
        _ => text,
    }
}

/// A bar's compression ratio against dense, e.g. `31.4x`, when both sizes are known.
fn ratio_label(bar: &Bar) -> Option<String> {
    if bar.bytes.is_finite() && bar.bytes > 0.0 && bar.dense.is_finite() && bar.dense > 0.0 {
        let ratio = bar.dense / bar.bytes;
        Some(if ratio < 999.5 {
            format!("{ratio:.1}x")
        } else {
            format!("{ratio:.0}x")
        })
    } else {
        None
    }
}

/// The one-line label over a bar: its size and, when known, its ratio, e.g. `25.9 KB (31.4x)`.
fn bar_label(bar: &Bar) -> String {
    let size = format_bytes(bar.bytes);
    match ratio_label(bar) {
        Some(ratio) => format!("{size} ({ratio})"),
        None => size,
    }
}

/// How bar labels are laid out, chosen by the number of bars so that neighbours' labels do
/// not overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LabelLayout {
    /// `25.9 KB (31.4x)` on one line: few, wide bars.
    OneLine,
    /// Size over ratio: medium bars.
    TwoLines,
    /// One line turned to run upwards: many narrow bars.
    Rotated,
}

impl LabelLayout {
    /// The layout for `bars` bars in the bytes panel.
    fn for_bars(bars: usize) -> LabelLayout {
        match bars {
            0..=3 => LabelLayout::OneLine,
            4..=6 => LabelLayout::TwoLines,
            _ => LabelLayout::Rotated,
        }
    }

    /// Share of the log axis to keep free above the tallest bar for its label.
    fn headroom(self) -> f64 {
        match self {
            LabelLayout::OneLine => 0.1,
            LabelLayout::TwoLines => 0.15,
            LabelLayout::Rotated => 0.4,
        }
    }
}

/// The log axis range of the bytes panel: a decade boundary below the smallest bar (so it
/// still has height) to one far enough above the tallest to leave the `headroom` share of the
/// axis for its label.
fn bytes_range(bars: &[Bar], headroom: f64) -> (f64, f64) {
    let positive = || {
        bars.iter()
            .map(|b| b.bytes)
            .filter(|b| b.is_finite() && *b > 0.0)
    };
    let min = positive().fold(f64::INFINITY, f64::min);
    let max = positive().fold(f64::NEG_INFINITY, f64::max);
    if !min.is_finite() || !max.is_finite() {
        return (1.0, 100.0);
    }
    let lo_log = (min * 0.5).log10().floor();
    let max_log = max.log10();
    let hi_log = ((max * 2.0).log10()).max((max_log - headroom * lo_log) / (1.0 - headroom));
    let lo = 10f64.powf(lo_log);
    let hi = 10f64.powf(hi_log.ceil());
    // At least two decades: over one, plotters labels the top tick twice.
    (lo, hi.max(lo * 100.0))
}

/// Draws the right panel: bytes per update per codec on a log axis, each bar labelled with its
/// size and compression ratio.
fn draw_bytes(area: &Panel<'_>, runs: &[RunSeries]) -> Result<()> {
    let bars = bars(runs);
    if bars.is_empty() {
        // No axes: a log axis over nothing would only show made-up numbers.
        let inner = area
            .margin(10, 10, 10, 10)
            .titled("bytes per update", ("sans-serif", 18))
            .context("drawing the bytes caption")?;
        let (width, height) = inner.dim_in_pixel();
        let centre = (
            i32::try_from(width / 2).unwrap_or(0),
            i32::try_from(height / 2).unwrap_or(0),
        );
        let note = ("sans-serif", 16)
            .into_font()
            .color(&BLACK.mix(0.6))
            .pos(Pos::new(HPos::Center, VPos::Center));
        inner
            .draw(&Text::new("no runs", centre, note))
            .context("drawing the no-data note")?;
        return Ok(());
    }
    let layout = LabelLayout::for_bars(bars.len());
    let (lo, hi) = bytes_range(&bars, layout.headroom());
    let names: Vec<String> = bars.iter().map(|b| b.label.clone()).collect();

    let mut chart = ChartBuilder::on(area)
        .caption("bytes per update", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(70)
        // Bar `i` is centred on x = i, on a plain f64 axis whose ticks fall on the integers;
        // plotters' segmented integer axis divides by zero when there is a single bar.
        .build_cartesian_2d(-0.5..bars.len() as f64 - 0.5, (lo..hi).log_scale())
        .context("building the bytes chart")?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(WHITE.mix(0.0))
        .x_labels(bars.len() + 1)
        .x_label_formatter(&|value| {
            let index = value.round();
            if (value - index).abs() < 1e-6 && index >= 0.0 {
                names.get(index as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|value| format_tick_bytes(*value))
        .y_desc("bytes (log scale)")
        .draw()
        .context("drawing the bytes axes")?;

    for (index, bar) in bars.iter().enumerate() {
        let drawn = bar.bytes.is_finite() && bar.bytes > 0.0;
        let top = if drawn { bar.bytes.clamp(lo, hi) } else { lo };
        let centre = index as f64;
        if drawn {
            let rect = Rectangle::new(
                [(centre - 0.4, lo), (centre + 0.4, top)],
                bar.colour.mix(0.85).filled(),
            );
            chart
                .draw_series(std::iter::once(rect))
                .context("drawing a bar")?;
        }
        // Lines of the label, each with its pixel offset above the top of the bar.
        let lines = match (layout, ratio_label(bar)) {
            (LabelLayout::TwoLines, Some(ratio)) => {
                vec![(format_bytes(bar.bytes), -20), (ratio, -4)]
            }
            _ => vec![(bar_label(bar), -4)],
        };
        let font = ("sans-serif", 13).into_font().color(&BLACK);
        let style = if layout == LabelLayout::Rotated {
            font.transform(FontTransform::Rotate270)
                .pos(Pos::new(HPos::Left, VPos::Center))
        } else {
            font.pos(Pos::new(HPos::Center, VPos::Bottom))
        };
        for (text, offset) in lines {
            let label =
                EmptyElement::at((centre, top)) + Text::new(text, (0, offset), style.clone());
            chart
                .draw_series(std::iter::once(label))
                .context("drawing a bar label")?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn curve(label: &str, points: Vec<(f64, f64)>) -> NodeCurve {
        NodeCurve {
            label: label.to_string(),
            points,
        }
    }

    fn rising(seconds: f64, ceiling: f64, phase: f64) -> Vec<(f64, f64)> {
        (0..=60)
            .map(|i| {
                let t = seconds * f64::from(i) / 60.0;
                let acc = 0.1 + (ceiling - 0.1) * (1.0 - (-(t + phase) / (seconds / 6.0)).exp());
                (t, acc)
            })
            .collect()
    }

    fn sample_runs() -> Vec<RunSeries> {
        let dense = 812_000.0;
        vec![
            RunSeries {
                codec: "int8".to_string(),
                nodes: (0..3)
                    .map(|n| curve(&format!("node{n}"), rising(120.0, 0.95, f64::from(n))))
                    .collect(),
                bytes_per_update: 203_100.0,
                dense_bytes_per_update: dense,
            },
            RunSeries {
                codec: "topk-1%".to_string(),
                nodes: (0..3)
                    .map(|n| curve(&format!("node{n}"), rising(130.0, 0.91, f64::from(n) * 2.0)))
                    .collect(),
                bytes_per_update: 25_900.0,
                dense_bytes_per_update: dense,
            },
        ]
    }

    fn check(svg: &str) {
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        assert!(svg.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn sample_picture_names_every_codec() {
        let runs = sample_runs();
        let svg = render_svg("digits: codec comparison", &runs).expect("renders");
        check(&svg);
        for run in &runs {
            assert!(svg.contains(&run.codec), "missing {}", run.codec);
        }
        assert!(svg.contains(DENSE_LABEL));
        assert!(svg.contains("25.9 KB (31.4x)"));
        assert!(svg.contains("held-out accuracy vs time"));
    }

    #[test]
    fn dense_run_gets_no_extra_bar() {
        let mut runs = sample_runs();
        runs.push(RunSeries {
            codec: "dense".to_string(),
            nodes: vec![curve("a", rising(100.0, 0.97, 0.0))],
            bytes_per_update: 812_040.0,
            dense_bytes_per_update: 812_000.0,
        });
        let svg = render_svg("t", &runs).expect("renders");
        check(&svg);
        assert!(!svg.contains(DENSE_LABEL));
        assert!(svg.contains("dense"));
    }

    #[test]
    fn no_runs() {
        let svg = render_svg("", &[]).expect("renders");
        check(&svg);
    }

    #[test]
    fn degenerate_runs() {
        let runs = vec![
            RunSeries {
                codec: "empty".to_string(),
                nodes: vec![],
                bytes_per_update: 0.0,
                dense_bytes_per_update: 0.0,
            },
            RunSeries {
                codec: "no-points".to_string(),
                nodes: vec![curve("a", vec![])],
                bytes_per_update: f64::NAN,
                dense_bytes_per_update: f64::INFINITY,
            },
            RunSeries {
                codec: "one-point".to_string(),
                nodes: vec![curve("a", vec![(3.0, 0.5)])],
                bytes_per_update: 10.0,
                dense_bytes_per_update: -1.0,
            },
            RunSeries {
                codec: "flat".to_string(),
                nodes: vec![curve("a", vec![(0.0, 1.0), (5.0, 1.0), (9.0, 1.0)])],
                bytes_per_update: 1e12,
                dense_bytes_per_update: 4e12,
            },
            RunSeries {
                codec: "junk".to_string(),
                nodes: vec![curve(
                    "a",
                    vec![
                        (f64::NAN, 0.3),
                        (1.0, f64::INFINITY),
                        (2.0, 7.0),
                        (-4.0, -1.0),
                    ],
                )],
                bytes_per_update: -5.0,
                dense_bytes_per_update: 100.0,
            },
        ];
        let svg = render_svg("<edge & cases>", &runs).expect("renders");
        check(&svg);
        for run in &runs {
            assert!(svg.contains(&run.codec), "missing {}", run.codec);
        }
        assert!(svg.contains("&lt;edge &amp; cases&gt;"));
        assert!(!svg.contains("NaN") && !svg.contains("inf"));

        // Each edge alone, too: the ranges come out differently then.
        for run in &runs {
            check(&render_svg("one", std::slice::from_ref(run)).expect("renders"));
        }
        let single = [RunSeries {
            codec: "same-time".to_string(),
            nodes: vec![curve("a", vec![(0.0, 0.2), (0.0, 0.9)])],
            bytes_per_update: 0.0,
            dense_bytes_per_update: 10.0,
        }];
        check(&render_svg("t", &single).expect("renders"));
    }

    #[test]
    fn clipping_keeps_inside_pieces() {
        let pieces = clip_to_band(&[(0.0, 0.0), (1.0, 100.0), (2.0, 100.0)], 50.0, 100.0);
        assert_eq!(pieces, vec![vec![(0.5, 50.0), (1.0, 100.0), (2.0, 100.0)]]);
        let pieces = clip_to_band(&[(0.0, 60.0), (1.0, 0.0), (2.0, 60.0)], 50.0, 100.0);
        assert_eq!(pieces.len(), 2);
        assert!(clip_to_band(&[(0.0, 10.0), (1.0, 20.0)], 50.0, 100.0).is_empty());
        assert_eq!(
            clip_to_band(&[(1.0, 70.0)], 50.0, 100.0),
            vec![vec![(1.0, 70.0)]]
        );
    }

    #[test]
    fn formats() {
        assert_eq!(format_bytes(0.0), "0 B");
        assert_eq!(format_bytes(999.0), "999 B");
        assert_eq!(format_bytes(25_900.0), "25.9 KB");
        assert_eq!(format_bytes(812_000.0), "812 KB");
        assert_eq!(format_bytes(3_250_000.0), "3.25 MB");
        assert_eq!(format_tick_bytes(10_000.0), "10 KB");
        assert_eq!(format_tick_bytes(1_000_000.0), "1 MB");
        assert_eq!(format_tick_bytes(100.0), "100 B");
        assert_eq!(format_tick(20.0, 120.0), "20");
        assert_eq!(format_tick(0.5, 1.0), "0.5");
    }
}
