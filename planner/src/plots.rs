//! SVG plots of a plan, drawn with plotters' SVG backend. Text is emitted as SVG `<text>` and
//! sized by plotters' built-in estimate (no font files, no fontconfig), so the plots render the
//! same anywhere and embed inline in the HTML report.

use crate::search::Evaluated;
use parallax_sim::{Resources, TaskGraph, TaskKind, Trace};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use thiserror::Error;

/// A plot could not be drawn.
#[derive(Debug, Error)]
#[error("plot {plot}: {message}")]
pub struct PlotError {
    pub plot: &'static str,
    pub message: String,
}

fn err(plot: &'static str) -> impl Fn(String) -> PlotError {
    move |message| PlotError { plot, message }
}

/// An SVG document of `size` pixels on a white background, drawn by `draw`.
fn svg(
    e: &impl Fn(String) -> PlotError,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<SVGBackend, plotters::coord::Shift>) -> Result<(), PlotError>,
) -> Result<String, PlotError> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
        draw(&root)?;
        root.present().map_err(|x| e(x.to_string()))?;
    }
    Ok(out)
}

/// The charts here: both axes `f64`, on an SVG drawing area.
type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// A chart over `x` × `y` with the house caption font and margin; `label_areas` are the
/// pixels kept for the x and y axis labels.
fn chart<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    caption: &str,
    label_areas: (u32, u32),
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
) -> Result<Chart<'a, 'b>, String> {
    ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(label_areas.0)
        .y_label_area_size(label_areas.1)
        .build_cartesian_2d(x, y)
        .map_err(|x| x.to_string())
}

/// The series legend at `pos`, on a translucent white box.
fn legend<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>, pos: SeriesLabelPosition) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(pos)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| x.to_string())
}

/// Writes `labels[i]` left of row `i` of a chart whose rows are centred on `y = n - 1 - i + 0.5`
/// (row 0 at the top); plotters' own tick labels cannot be pinned to category rows.
fn row_labels<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    chart: &ChartContext<DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    labels: &[String],
    x0: f64,
) -> Result<(), String> {
    let n = labels.len();
    let style =
        TextStyle::from(("sans-serif", 12).into_font()).pos(Pos::new(HPos::Right, VPos::Center));
    for (i, label) in labels.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(x0, (n - 1 - i) as f64 + 0.5));
        root.draw(&Text::new(label.clone(), (px - 6, py), style.clone()))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Colours of the breakdown parts ([`parallax_sim::Breakdown::parts`]), in drawing order.
const PARTS: [(&str, RGBColor); 8] = [
    ("compute", RGBColor(76, 114, 176)),
    ("bubble", RGBColor(200, 200, 200)),
    ("optimizer", RGBColor(129, 114, 179)),
    ("tp", RGBColor(221, 132, 82)),
    ("cp", RGBColor(147, 120, 96)),
    ("ep", RGBColor(218, 139, 195)),
    ("dp", RGBColor(85, 168, 104)),
    ("zero", RGBColor(196, 78, 82)),
];

fn part_value(e: &Evaluated, part: &str) -> f64 {
    e.prediction
        .breakdown
        .parts()
        .into_iter()
        .find(|x| x.0 == part)
        .map_or(0.0, |x| x.1)
}

/// Stacked horizontal bars: the step time of each plan by where it goes. `labels` name the
/// plans (one per entry of `plans`).
pub fn breakdown_svg(plans: &[Evaluated], labels: &[String]) -> Result<String, PlotError> {
    let e = err("breakdown");
    let n = plans.len().max(1);
    let height = 90 + 34 * n as u32;
    let xmax = plans
        .iter()
        .map(|p| {
            PARTS
                .iter()
                .map(|(k, _)| part_value(p, k))
                .sum::<f64>()
                .max(p.prediction.step_time_s)
        })
        .fold(0.0, f64::max)
        * 1.3;
    svg(&e, (900, height), |root| {
        let mut chart = chart(
            root,
            "Step time of the top plans, by where it goes",
            (30, 260),
            0.0..xmax.max(1e-9),
            0.0..n as f64,
        )
        .map_err(&e)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .x_desc("seconds per step")
            .draw()
            .map_err(|x| e(x.to_string()))?;
        row_labels(root, &chart, labels, 0.0).map_err(&e)?;
        for (k, (part, color)) in PARTS.iter().enumerate() {
            let mut rects = Vec::new();
            for (i, p) in plans.iter().enumerate() {
                let y = (n - 1 - i) as f64;
                let x0: f64 = PARTS[..k].iter().map(|(q, _)| part_value(p, q)).sum();
                let w = part_value(p, part);
                if w > 0.0 {
                    rects.push(Rectangle::new(
                        [(x0, y + 0.15), (x0 + w, y + 0.85)],
                        color.filled(),
                    ));
                }
            }
            chart
                .draw_series(rects)
                .map_err(|x| e(x.to_string()))?
                .label(*part)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
                });
        }
        legend(&mut chart, SeriesLabelPosition::LowerRight).map_err(&e)?;
        Ok(())
    })
}

/// Peak memory of each pipeline stage of a plan against the device capacity.
pub fn memory_svg(stage_gib: &[f64], capacity_gib: f64) -> Result<String, PlotError> {
    memory_bars_svg(stage_gib, capacity_gib, "stage")
}

/// Peak memory of each device of a per-op plan against the device's capacity.
pub fn device_memory_svg(device_gib: &[f64], capacity_gib: f64) -> Result<String, PlotError> {
    memory_bars_svg(device_gib, capacity_gib, "device")
}

/// One bar of peak memory per `what` (a pipeline stage, a device), the capacity as a line.
fn memory_bars_svg(stage_gib: &[f64], capacity_gib: f64, what: &str) -> Result<String, PlotError> {
    let e = err("memory");
    let n = stage_gib.len().max(1);
    let ymax = stage_gib.iter().copied().fold(capacity_gib, f64::max) * 1.1;
    let title = if what == "stage" {
        "Peak memory per pipeline stage (best plan)".to_string()
    } else {
        format!("Peak memory per {what} (best plan)")
    };
    svg(&e, (900, 360), |root| {
        let mut chart = chart(
            root,
            &title,
            (35, 50),
            -0.5..n as f64 - 0.5,
            0.0..ymax.max(1e-9),
        )
        .map_err(&e)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n.min(32))
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 {
                    format!("{}", i as i64)
                } else {
                    String::new()
                }
            })
            .x_desc(what)
            .y_desc("GiB")
            .draw()
            .map_err(|x| e(x.to_string()))?;
        chart
            .draw_series(stage_gib.iter().enumerate().map(|(i, &g)| {
                let color = if g > capacity_gib {
                    RGBColor(196, 78, 82)
                } else {
                    RGBColor(76, 114, 176)
                };
                Rectangle::new([(i as f64 - 0.4, 0.0), (i as f64 + 0.4, g)], color.filled())
            }))
            .map_err(|x| e(x.to_string()))?
            .label("peak memory")
            .legend(|(x, y)| {
                Rectangle::new(
                    [(x, y - 5), (x + 10, y + 5)],
                    RGBColor(76, 114, 176).filled(),
                )
            });
        chart
            .draw_series(LineSeries::new(
                [(-0.5, capacity_gib), (n as f64 - 0.5, capacity_gib)],
                RED.stroke_width(2),
            ))
            .map_err(|x| e(x.to_string()))?
            .label(format!("capacity {capacity_gib:.0} GiB"))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 10, y)], RED.stroke_width(2)));
        legend(&mut chart, SeriesLabelPosition::LowerRight).map_err(&e)?;
        Ok(())
    })
}

fn kind_color(k: TaskKind) -> RGBColor {
    match k {
        TaskKind::Forward => RGBColor(76, 114, 176),
        TaskKind::BackwardInput => RGBColor(85, 168, 104),
        TaskKind::BackwardWeight => RGBColor(140, 200, 150),
        TaskKind::Optimizer => RGBColor(129, 114, 179),
        TaskKind::Comm(_) => RGBColor(221, 132, 82),
        TaskKind::Other => RGBColor(140, 140, 140),
    }
}

/// Most rows the timeline shows (the compute streams come first).
pub const GANTT_MAX_ROWS: usize = 48;

/// The predicted timeline of one step: a row per resource (stage compute streams, pipeline
/// links, gradient-reduction streams), a bar per task coloured by kind.
pub fn gantt_svg(
    graph: &TaskGraph,
    resources: &Resources,
    trace: &Trace,
) -> Result<String, PlotError> {
    let e = err("timeline");
    let resources = resources.as_slice();
    // Rows: resources that ran something, compute streams first, in resource order.
    let mut used = vec![false; resources.len()];
    for s in &trace.spans {
        if let Some(u) = used.get_mut(s.resource.index()) {
            *u = true;
        }
    }
    let mut rows: Vec<usize> = (0..resources.len()).filter(|&r| used[r]).collect();
    rows.sort_by_key(|&r| (!resources[r].name.contains("compute"), r));
    rows.truncate(GANTT_MAX_ROWS);
    let mut row_of = vec![usize::MAX; resources.len()];
    for (i, &r) in rows.iter().enumerate() {
        row_of[r] = i;
    }
    let n = rows.len().max(1);
    let makespan = trace.makespan.0.max(1e-9);
    let height = 110 + 22 * n as u32;
    svg(&e, (1100, height), |root| {
        let mut chart = chart(
            root,
            "Predicted timeline of one step (best plan)",
            (30, 150),
            0.0..makespan * 1.18,
            0.0..n as f64,
        )
        .map_err(&e)?;
        let names: Vec<String> = rows.iter().map(|&r| resources[r].name.clone()).collect();
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .x_desc("seconds")
            .draw()
            .map_err(|x| e(x.to_string()))?;
        row_labels(root, &chart, &names, 0.0).map_err(&e)?;
        let bars = trace.spans.iter().filter_map(|s| {
            let row = *row_of.get(s.resource.index())?;
            if row == usize::MAX || s.end.0 <= s.start.0 {
                return None;
            }
            let y = (n - 1 - row) as f64;
            let kind = graph.task(s.task).kind;
            Some(Rectangle::new(
                [(s.start.0, y + 0.15), (s.end.0, y + 0.85)],
                kind_color(kind).filled(),
            ))
        });
        chart.draw_series(bars).map_err(|x| e(x.to_string()))?;
        for (label, kind) in [
            ("forward", TaskKind::Forward),
            ("backward (input)", TaskKind::BackwardInput),
            ("backward (weight)", TaskKind::BackwardWeight),
            ("optimizer", TaskKind::Optimizer),
            (
                "communication",
                TaskKind::Comm(parallax_sim::CommKind::Other),
            ),
        ] {
            let c = kind_color(kind);
            chart
                .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
                .map_err(|x| e(x.to_string()))?
                .label(label)
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], c.filled()));
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight).map_err(&e)?;
        Ok(())
    })
}

/// Throughput of the best plan at each GPU count of a sweep: `(gpus, tokens/s)`.
pub fn sweep_svg(points: &[(u32, f64)]) -> Result<String, PlotError> {
    let e = err("sweep");
    let xmax = points.iter().map(|p| p.0).max().unwrap_or(1) as f64 * 1.1;
    let ymax = points.iter().map(|p| p.1).fold(0.0, f64::max) * 1.15;
    svg(&e, (900, 400), |root| {
        let mut chart = chart(
            root,
            "Throughput of the best plan versus GPU count",
            (35, 70),
            0.0..xmax.max(1.0),
            0.0..ymax.max(1e-9),
        )
        .map_err(&e)?;
        chart
            .configure_mesh()
            .x_desc("GPUs")
            .y_desc("tokens / s")
            .y_label_formatter(&|y| format!("{:.2e}", y))
            .draw()
            .map_err(|x| e(x.to_string()))?;
        let blue = RGBColor(76, 114, 176);
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|&(g, t)| (f64::from(g), t)),
                blue.stroke_width(2),
            ))
            .map_err(|x| e(x.to_string()))?
            .label("best plan")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 10, y)], blue.stroke_width(2)));
        chart
            .draw_series(
                points
                    .iter()
                    .map(|&(g, t)| Circle::new((f64::from(g), t), 4, blue.filled())),
            )
            .map_err(|x| e(x.to_string()))?;
        // Linear scaling from the smallest count, for reference.
        if let Some(&(g0, t0)) = points.first() {
            let grey = RGBColor(160, 160, 160);
            chart
                .draw_series(LineSeries::new(
                    points
                        .iter()
                        .map(|&(g, _)| (f64::from(g), t0 * f64::from(g) / f64::from(g0))),
                    grey.stroke_width(1),
                ))
                .map_err(|x| e(x.to_string()))?
                .label("linear scaling")
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 10, y)], grey));
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft).map_err(&e)?;
        Ok(())
    })
}
