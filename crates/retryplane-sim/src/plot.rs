//! The report as an SVG line chart: upstream attempts per second over virtual time, one line
//! per variant (the policy as written on top), the upstream's capacity as a grey line and the
//! incident shaded.
//!
//! Drawn with `plotters`' SVG backend only: no system libraries and no fonts are read. Text is
//! written as SVG `<text>` elements for the viewer to render; plotters only estimates its width
//! for the layout. The output is a pure function of the report.

use plotters::prelude::*;

use crate::Report;

/// The chart could not be drawn.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot draw the plot: {0}")]
pub struct PlotError(String);

/// Width and height of the image, in pixels.
pub const SIZE: (u32, u32) = (960, 540);

/// One colour per variant, in [`crate::Variant::ALL`] order.
const COLOURS: [RGBColor; 4] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
];
const SHADE: RGBColor = RGBColor(0xf4, 0xd6, 0xd6);
const CAPACITY: RGBColor = RGBColor(0x80, 0x80, 0x80);

/// The SVG document for `report`.
pub fn svg(report: &Report) -> Result<String, PlotError> {
    let mut out = String::new();
    draw(report, &mut out).map_err(|e| PlotError(e.to_string()))?;
    Ok(out)
}

fn draw(report: &Report, out: &mut String) -> Result<(), Box<dyn std::error::Error>> {
    let seconds = report
        .variants
        .iter()
        .map(|v| v.attempts_per_s.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let peak = report
        .variants
        .iter()
        .flat_map(|v| v.attempts_per_s.iter().copied())
        .max()
        .unwrap_or(0) as f64;
    let y_max = (peak.max(report.capacity_per_s) * 1.15).max(1.0);
    let x_max = seconds as f64;

    let root = SVGBackend::with_string(out, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!(
        "{}: {} clients × {}/s, {}",
        report.endpoint,
        report.clients,
        crate::report::number(report.rate_per_client),
        report.scenario
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_desc("virtual time (s)")
        .y_desc("upstream attempts per second")
        .light_line_style(WHITE)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .draw()?;

    let incident = &report.incident;
    if !report.scenario.starts_with("error-rate") {
        let (a, b) = (incident.start_s, incident.end_s.min(x_max));
        let label = report.scenario.split(':').next().unwrap_or("incident");
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(a, 0.0), (b, y_max)],
                SHADE.filled(),
            )))?
            .label(label.to_owned())
            .legend(|(x, y)| Rectangle::new([(x, y - 6), (x + 20, y + 6)], SHADE.filled()));
    }
    chart
        .draw_series(LineSeries::new(
            [(0.0, report.capacity_per_s), (x_max, report.capacity_per_s)],
            CAPACITY.stroke_width(1),
        ))?
        .label("upstream capacity")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], CAPACITY));
    // The policy as written is drawn last, on top of the variants that coincide with it.
    for (v, colour) in report.variants.iter().zip(COLOURS.iter()).rev() {
        let style = colour.stroke_width(2);
        let points = v
            .attempts_per_s
            .iter()
            .enumerate()
            .map(|(k, &n)| (k as f64, n as f64));
        chart
            .draw_series(LineSeries::new(points, style))?
            .label(v.variant)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()?;
    root.present()?;
    Ok(())
}
