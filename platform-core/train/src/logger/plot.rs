//! Training curves as PNG images.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use super::History;
use kiln_core::error::{Error, Result};

/// Colour of training curves (matplotlib's `tab:blue`).
pub(crate) const TRAIN_COLOR: RGBColor = RGBColor(31, 119, 180);
/// Colour of validation curves (matplotlib's `tab:orange`).
pub(crate) const VAL_COLOR: RGBColor = RGBColor(255, 127, 14);
/// Series longer than this are drawn as lines without a dot per epoch.
const MAX_DOTS: usize = 40;
/// Font family the plots use; registered with the embedded font.
const FONT: &str = "sans-serif";

/// Where [`plot_curves`] reads the values from.
#[derive(Clone, Copy, Debug)]
pub enum CurveSource<'a> {
    /// A history in memory.
    History(&'a History),
    /// An `epochs.csv` written by [`CsvSink`](crate::CsvSink), or its directory.
    Csv(&'a Path),
}

impl<'a> From<&'a History> for CurveSource<'a> {
    fn from(h: &'a History) -> Self {
        CurveSource::History(h)
    }
}

impl<'a> From<&'a Path> for CurveSource<'a> {
    fn from(p: &'a Path) -> Self {
        CurveSource::Csv(p)
    }
}

impl<'a> From<&'a std::path::PathBuf> for CurveSource<'a> {
    fn from(p: &'a std::path::PathBuf) -> Self {
        CurveSource::Csv(p)
    }
}

/// What [`plot_curves`] draws and how large.
#[derive(Clone, Debug, PartialEq)]
pub struct PlotOptions {
    /// Image width in pixels (100 to 8192).
    pub width: u32,
    /// Image height in pixels (100 to 8192).
    pub height: u32,
    /// A title above the panels.
    pub title: Option<String>,
    /// The quantities to draw, one panel each, side by side: the training
    /// curve is the value named `name`, the validation curve `val_<name>`.
    /// Quantities with neither are left out.
    pub metrics: Vec<String>,
}

impl Default for PlotOptions {
    /// 1200 x 450 pixels, no title, panels for `loss` and `accuracy`.
    fn default() -> Self {
        PlotOptions {
            width: 1200,
            height: 450,
            title: None,
            metrics: vec!["loss".into(), "accuracy".into()],
        }
    }
}

/// Draws training and validation curves per epoch (by default loss, and
/// accuracy if present) into a PNG file at `out_png`.
///
/// Each quantity gets a panel with the epoch on the x axis, the training
/// values (`loss`) in blue and the validation values (`val_loss`) in orange,
/// each a line with a dot per epoch (up to 40 epochs), and a legend. Text is
/// drawn with Noto Sans embedded in the binary, so no system font is needed.
/// Non-finite values are left out.
///
/// ```
/// use kiln_train::{plot_curves, History, PlotOptions};
///
/// let mut h = History::new();
/// for epoch in 1..=5u32 {
///     let e = f64::from(epoch);
///     h.record(epoch.into(), &[("loss".into(), 1.0 / e), ("val_loss".into(), 1.2 / e)])?;
/// }
/// let out = std::env::temp_dir().join(format!("kiln-curves-doc-{}.png", std::process::id()));
/// plot_curves(&h, &out, &PlotOptions::default())?;
/// # std::fs::remove_file(&out).ok();
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub fn plot_curves<'a>(
    source: impl Into<CurveSource<'a>>,
    out_png: impl AsRef<Path>,
    options: &PlotOptions,
) -> Result<()> {
    let out = out_png.as_ref();
    let loaded;
    let history = match source.into() {
        CurveSource::History(h) => h,
        CurveSource::Csv(path) => {
            loaded = History::from_csv(path)?;
            &loaded
        }
    };
    for (name, v) in [("width", options.width), ("height", options.height)] {
        if !(100..=8192).contains(&v) {
            return Err(Error::invalid_argument(
                name,
                format!("the image {name} must be 100 to 8192 pixels, got {v}"),
            ));
        }
    }
    let panels: Vec<Panel<'_>> = options
        .metrics
        .iter()
        .map(|name| Panel {
            name,
            train: finite(history.series(name)),
            val: finite(history.series(&format!("val_{name}"))),
        })
        .filter(|p| !p.train.is_empty() || !p.val.is_empty())
        .collect();
    if panels.is_empty() {
        let wanted: Vec<String> = options
            .metrics
            .iter()
            .flat_map(|m| [m.clone(), format!("val_{m}")])
            .collect();
        return Err(Error::invalid_argument(
            "history",
            format!(
                "it has no finite value named {} (it has {:?})",
                wanted.join(", "),
                history.names()
            ),
        ));
    }
    register_font()?;

    let (w, h) = (options.width, options.height);
    let mut pixels = vec![255u8; w as usize * h as usize * 3];
    draw(&mut pixels, (w, h), options.title.as_deref(), &panels)
        .map_err(|e| drawing_error(out, &*e))?;
    write_png(out, w, h, &pixels)
}

/// One panel: a quantity's training and validation series.
struct Panel<'a> {
    name: &'a str,
    train: Vec<(u64, f64)>,
    val: Vec<(u64, f64)>,
}

fn finite(series: Vec<(u64, f64)>) -> Vec<(u64, f64)> {
    series.into_iter().filter(|(_, v)| v.is_finite()).collect()
}

/// Registers the embedded font once per process.
fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(Error::unsupported(
            "plotting: the embedded Noto Sans font could not be loaded",
        ))
    }
}

type DrawResult<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn draw(
    pixels: &mut [u8],
    size: (u32, u32),
    title: Option<&str>,
    panels: &[Panel<'_>],
) -> DrawResult<()> {
    let root = BitMapBackend::with_buffer(pixels, size).into_drawing_area();
    root.fill(&WHITE)?;
    let root = match title {
        Some(t) => root.titled(t, (FONT, 24))?,
        None => root,
    };
    let areas = root.split_evenly((1, panels.len()));
    for (area, panel) in areas.iter().zip(panels) {
        draw_panel(area, panel)?;
    }
    root.present()?;
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    panel: &Panel<'_>,
) -> DrawResult<()>
where
    DB::ErrorType: 'static,
{
    let all = panel.train.iter().chain(&panel.val);
    let (x0, x1) = all
        .clone()
        .fold((u64::MAX, 0), |(lo, hi), &(x, _)| (lo.min(x), hi.max(x)));
    let (mut y0, mut y1) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &(_, y)| {
        (lo.min(y), hi.max(y))
    });
    // Half an epoch on each side keeps the first and last dots inside the frame.
    let (x0, x1) = (x0 as f64 - 0.5, x1 as f64 + 0.5);
    let pad = if y1 > y0 {
        (y1 - y0) * 0.05
    } else {
        y0.abs().max(1.0) * 0.1
    };
    // The legend goes in the corner the curves end away from: lower right
    // for rising curves such as accuracy, upper right for falling ones.
    let ends_high = [&panel.train, &panel.val]
        .iter()
        .filter_map(|s| s.last())
        .any(|&(_, y)| y > (y0 + y1) / 2.0);
    let legend_at = if ends_high {
        SeriesLabelPosition::LowerRight
    } else {
        SeriesLabelPosition::UpperRight
    };
    y0 -= pad;
    y1 += pad;

    let mut chart = ChartBuilder::on(area)
        .caption(panel.name, (FONT, 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    let whole_epochs = |x: &f64| {
        if x.fract() == 0.0 {
            format!("{x:.0}")
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc(panel.name)
        .x_labels(((x1 - x0) as usize).clamp(2, 10))
        .x_label_formatter(&whole_epochs)
        .light_line_style(TRANSPARENT)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()?;
    for (label, color, series) in [
        ("train", TRAIN_COLOR, &panel.train),
        ("validation", VAL_COLOR, &panel.val),
    ] {
        if series.is_empty() {
            continue;
        }
        let points: Vec<(f64, f64)> = series.iter().map(|&(x, y)| (x as f64, y)).collect();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        // Dots mark the epochs while there are few enough to tell apart.
        if points.len() <= MAX_DOTS {
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
    }
    chart
        .configure_series_labels()
        .position(legend_at)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// What went wrong drawing the picture for `out`.
fn drawing_error(out: &Path, e: &(dyn std::error::Error + Send + Sync)) -> Error {
    Error::backend(
        "plotters",
        format!("drawing {}", out.display()),
        e.to_string(),
    )
}

/// Encodes 8-bit RGB `pixels` as a PNG file.
/// Written atomically ([`kiln_core::fs::write_atomically`]): a plot being
/// redrawn is never seen half-written, and a link at `path` is replaced, not
/// written through.
fn write_png(path: &Path, width: u32, height: u32, pixels: &[u8]) -> Result<()> {
    kiln_core::fs::write_atomically(path, |out| {
        let mut encoder = png::Encoder::new(out, width, height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let to_io = |e: png::EncodingError| match e {
            png::EncodingError::IoError(e) => Error::io(path, e),
            other => Error::io(path, std::io::Error::other(other)),
        };
        let mut writer = encoder.write_header().map_err(to_io)?;
        writer.write_image_data(pixels).map_err(to_io)?;
        writer.finish().map_err(to_io)
    })
}

/// Plots a learning-rate range test ([`find_lr`](crate::find_lr)): the
/// smoothed loss against the learning rate (a log scale for an exponential
/// sweep), the `suggested` rate marked, as Lightning's `lr_finder.plot(suggest=True)`.
pub fn plot_lr_finder(
    result: &crate::LrFinderResult,
    log_scale: bool,
    suggested: Option<f64>,
    out_png: impl AsRef<Path>,
) -> Result<()> {
    let out = out_png.as_ref();
    let x = |lr: f64| if log_scale { lr.log10() } else { lr };
    let points: Vec<(f64, f64)> = result
        .lrs
        .iter()
        .zip(&result.losses)
        .filter(|(lr, loss)| loss.is_finite() && **lr > 0.0)
        .map(|(&lr, &loss)| (x(lr), loss))
        .collect();
    if points.len() < 2 {
        return Err(Error::invalid_argument(
            "learning-rate finder",
            format!(
                "{} finite losses to plot; at least 2 are needed",
                points.len()
            ),
        ));
    }
    let marked = suggested
        .and_then(|lr| result.lrs.iter().position(|&r| r == lr))
        .map(|i| (x(result.lrs[i]), result.losses[i]));
    register_font()?;
    let (w, h) = (900u32, 600u32);
    let mut pixels = vec![255u8; w as usize * h as usize * 3];
    let drawn = (|| -> DrawResult<()> {
        let root = BitMapBackend::with_buffer(&mut pixels, (w, h)).into_drawing_area();
        root.fill(&WHITE)?;
        let (x0, x1) = points
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
                (lo.min(p.0), hi.max(p.0))
            });
        let (y0, y1) = points
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
                (lo.min(p.1), hi.max(p.1))
            });
        let pad = ((y1 - y0) * 0.05).max(1e-6);
        let mut chart = ChartBuilder::on(&root)
            .caption("learning-rate finder", (FONT, 22))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(x0..x1.max(x0 + 1e-12), (y0 - pad)..(y1 + pad))?;
        let label = |v: &f64| {
            if log_scale {
                format!("1e{v:.0}")
            } else {
                format!("{v:.3}")
            }
        };
        chart
            .configure_mesh()
            .x_desc("learning rate")
            .y_desc("smoothed loss")
            .x_label_formatter(&label)
            .light_line_style(TRANSPARENT)
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 16))
            .draw()?;
        chart.draw_series(LineSeries::new(
            points.iter().copied(),
            TRAIN_COLOR.stroke_width(2),
        ))?;
        if let Some(p) = marked {
            chart.draw_series(std::iter::once(Circle::new(p, 6, RED.filled())))?;
        }
        root.present()?;
        Ok(())
    })();
    drawn.map_err(|e| drawing_error(out, &*e))?;
    write_png(out, w, h, &pixels)
}
