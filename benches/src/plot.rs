//! `--plot FILE.svg`: the figures of a run as a picture (plotters' SVG
//! backend: no system fonts or libraries needed).
//!
//! - `compare`: run-phase throughput per target (bars), and each
//!   operation's latency percentiles per target on a log axis;
//! - `run`/`load`: throughput over time of each phase, and each
//!   operation's latency percentiles.

use std::path::Path;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

use crate::driver::{Phase, PhaseResult};

const SIZE: (u32, u32) = (1280, 520);
/// The percentiles the latency panels show.
const PERCENTILES: [f64; 6] = [50.0, 90.0, 99.0, 99.9, 99.99, 100.0];
/// Tableau's ten colours: told apart on screen and in print.
const COLORS: [RGBColor; 10] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0xff, 0x9d, 0xa7),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xba, 0xb0, 0xac),
];

/// Dash and gap of each operation's line (by `OpKind`), None: solid.
const DASHES: [Option<(i32, i32)>; 4] = [None, Some((8, 4)), Some((3, 3)), Some((12, 3))];

fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

/// One named phase result to draw (a target's run phase, or a phase).
pub struct Series<'a> {
    pub name: &'a str,
    pub result: &'a PhaseResult,
}

/// The comparison of several targets on one workload.
pub fn compare(path: &Path, title: &str, targets: &[Series]) -> Result<(), String> {
    draw(path, title, |left, right| {
        throughput_bars(left, targets)?;
        latency_percentiles(right, targets)
    })
}

/// One target's phases: throughput over time, latency percentiles.
pub fn run(path: &Path, title: &str, phases: &[Series]) -> Result<(), String> {
    draw(path, title, |left, right| {
        throughput_over_time(left, phases)?;
        latency_percentiles(right, phases)
    })
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

fn draw(
    path: &Path,
    title: &str,
    panels: impl FnOnce(&Area, &Area) -> Result<(), String>,
) -> Result<(), String> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 22)).map_err(err)?;
    let (left, right) = root.split_horizontally(SIZE.0 / 2);
    panels(&left, &right)?;
    root.present()
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn err<E: std::fmt::Display>(e: E) -> String {
    format!("drawing the plot: {e}")
}

fn throughput_bars(area: &Area, targets: &[Series]) -> Result<(), String> {
    let top = targets
        .iter()
        .map(|t| t.result.throughput())
        .fold(1.0, f64::max);
    let n = targets.len();
    let mut chart = ChartBuilder::on(area)
        .caption("run phase throughput", ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(36)
        .y_label_area_size(80)
        .build_cartesian_2d(-0.5..n as f64 - 0.5, 0.0..top * 1.15)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = x.round();
            targets
                .get(i as usize)
                .filter(|_| (x - i).abs() < 0.01 && i >= 0.0)
                .map_or(String::new(), |t| t.name.to_string())
        })
        .y_desc("operations per second")
        .y_label_formatter(&|y| human(*y))
        .draw()
        .map_err(err)?;
    for (i, t) in targets.iter().enumerate() {
        let x = i as f64;
        let ops = t.result.throughput();
        let color = color(i);
        chart
            .draw_series([Rectangle::new(
                [(x - 0.3, 0.0), (x + 0.3, ops)],
                color.filled(),
            )])
            .map_err(err)?;
        chart
            .draw_series([Text::new(
                human(ops),
                (x - 0.12, ops * 1.03),
                ("sans-serif", 14),
            )])
            .map_err(err)?;
    }
    Ok(())
}

fn throughput_over_time(area: &Area, phases: &[Series]) -> Result<(), String> {
    // Operations per second over each sampling step.
    let rates: Vec<Vec<(f64, f64)>> = phases
        .iter()
        .map(|p| {
            p.result
                .timeline
                .windows(2)
                .filter(|w| w[1].0 > w[0].0)
                .map(|w| (w[1].0, (w[1].1 - w[0].1) as f64 / (w[1].0 - w[0].0)))
                .collect()
        })
        .collect();
    let end = phases
        .iter()
        .map(|p| p.result.runtime.as_secs_f64())
        .fold(0.1, f64::max);
    let top = rates.iter().flatten().map(|&(_, r)| r).fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption("throughput over time", ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(36)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..end, 0.0..top * 1.1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("seconds since the phase started")
        .y_desc("operations per second")
        .y_label_formatter(&|y| human(*y))
        .draw()
        .map_err(err)?;
    for (i, (p, points)) in phases.iter().zip(rates).enumerate() {
        let color = color(i);
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(err)?
            .label(p.name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    legend(&mut chart)
}

/// One line per (series, operation): its latency at each percentile, µs.
/// A series keeps its colour across both panels; the operation picks the
/// dash.
fn percentile_lines(series: &[Series]) -> Vec<Line> {
    series
        .iter()
        .enumerate()
        .flat_map(|(i, s)| {
            s.result
                .ops
                .iter()
                .filter(|(_, o)| o.operations() > 0)
                .map(move |(kind, o)| {
                    let points = PERCENTILES
                        .iter()
                        .enumerate()
                        .map(|(i, &p)| {
                            let ns = o.latency.value_at_quantile(p / 100.0);
                            (i as f64, (ns as f64 / 1000.0).max(0.01))
                        })
                        .collect();
                    Line {
                        name: format!("{} {}", s.name, kind.ycsb_name()),
                        series: i,
                        op: *kind as usize,
                        points,
                    }
                })
        })
        .collect()
}

/// One operation's latency percentiles in one series.
struct Line {
    name: String,
    series: usize,
    op: usize,
    /// (percentile index, µs).
    points: Vec<(f64, f64)>,
}

fn latency_percentiles(area: &Area, series: &[Series]) -> Result<(), String> {
    let lines = percentile_lines(series);
    let values = || lines.iter().flat_map(|l| l.points.iter().map(|&(_, v)| v));
    let low = values().fold(f64::MAX, f64::min).min(1.0);
    let high = values().fold(low * 10.0, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption("latency percentiles", ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(36)
        .y_label_area_size(80)
        .build_cartesian_2d(
            -0.25..PERCENTILES.len() as f64 - 0.75,
            (low / 1.5..high * 1.5).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_labels(PERCENTILES.len())
        .x_label_formatter(&|x| {
            let i = x.round();
            match PERCENTILES.get(i as usize) {
                Some(&p) if (x - i).abs() < 0.01 && i >= 0.0 => format!("p{p}"),
                _ => String::new(),
            }
        })
        .x_desc("percentile")
        .y_desc("latency, µs (log)")
        .y_label_formatter(&|y| match *y {
            y if y >= 1.0 => human(y),
            y => format!("{y:.2}"),
        })
        .draw()
        .map_err(err)?;
    for Line {
        name,
        series,
        op,
        points,
    } in lines
    {
        let style = color(series).stroke_width(2);
        let swatch = |(x, y): (i32, i32)| [(x, y), (x + 16, y)];
        match DASHES.get(op).copied().flatten() {
            None => chart
                .draw_series(LineSeries::new(points.clone(), style))
                .map_err(err)?
                .label(name)
                .legend(move |at| PathElement::new(swatch(at), style)),
            Some((dash, gap)) => chart
                .draw_series(DashedLineSeries::new(points.clone(), dash, gap, style))
                .map_err(err)?
                .label(name)
                .legend(move |at| DashedPathElement::new(swatch(at), dash, gap, style)),
        };
        chart
            .draw_series(points.into_iter().map(|p| Circle::new(p, 3, style)))
            .map_err(err)?;
    }
    legend(&mut chart)
}

fn legend<'a, X: Ranged, Y: Ranged>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(err)
}

/// 1234567 → "1.23M".
fn human(v: f64) -> String {
    match v {
        v if v >= 1e6 => format!("{:.2}M", v / 1e6),
        v if v >= 1e3 => format!("{:.0}k", v / 1e3),
        v => format!("{v:.0}"),
    }
}

/// What a phase is called in a legend.
pub fn phase_name(phase: Phase) -> &'static str {
    match phase {
        Phase::Load => "load",
        Phase::Run => "run",
    }
}
