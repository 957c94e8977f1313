//! `plot_curves` writes a PNG of the requested size with the training and
//! validation curves, from a `History` or from a `CsvSink`'s `epochs.csv`.

use std::collections::HashSet;
use std::path::Path;

use kiln_core::Error;
use kiln_train::{plot_curves, CsvSink, History, MetricSink, PlotOptions};

const TRAIN: [u8; 3] = [31, 119, 180];
const VAL: [u8; 3] = [255, 127, 14];

struct Image {
    width: u32,
    height: u32,
    rgb: Vec<u8>,
}

impl Image {
    fn read(path: &Path) -> Image {
        let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let decoder = png::Decoder::new(std::io::BufReader::new(file));
        let mut reader = decoder.read_info().expect("PNG header");
        let mut rgb = vec![0; reader.output_buffer_size().expect("buffer size")];
        let info = reader.next_frame(&mut rgb).expect("PNG data");
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(info.bit_depth, png::BitDepth::Eight);
        rgb.truncate(info.buffer_size());
        Image {
            width: info.width,
            height: info.height,
            rgb,
        }
    }

    fn pixels(&self) -> impl Iterator<Item = [u8; 3]> + '_ {
        self.rgb.chunks_exact(3).map(|p| [p[0], p[1], p[2]])
    }

    fn count(&self, color: [u8; 3]) -> usize {
        self.pixels().filter(|&p| p == color).count()
    }

    /// Pixels darker than mid-grey in rows `rows` (text and axes are black).
    fn dark_in_rows(&self, rows: std::ops::Range<u32>) -> usize {
        let w = self.width as usize;
        rows.flat_map(|y| (0..w).map(move |x| (y as usize) * w + x))
            .filter(|&i| self.rgb[3 * i..3 * i + 3].iter().all(|&c| c < 100))
            .count()
    }
}

impl Image {
    /// Both curves are drawn, in both panels (the image's halves; a panel is at
    /// least a few hundred pixels of line).
    fn assert_both_curves_in_both_panels(&self) {
        assert!(
            self.count(TRAIN) > 600,
            "{} train pixels",
            self.count(TRAIN)
        );
        assert!(
            self.count(VAL) > 600,
            "{} validation pixels",
            self.count(VAL)
        );
        let w = self.width as usize;
        let half = |x_lo: usize, x_hi: usize, color: [u8; 3]| {
            self.pixels()
                .enumerate()
                .filter(|(i, p)| (x_lo..x_hi).contains(&(i % w)) && *p == color)
                .count()
        };
        for (lo, hi) in [(0, w / 2), (w / 2, w)] {
            assert!(
                half(lo, hi, TRAIN) > 200,
                "train curve in columns {lo}..{hi}"
            );
            assert!(
                half(lo, hi, VAL) > 200,
                "validation curve in columns {lo}..{hi}"
            );
        }
    }

    /// The title is text in the top band, blank without a title (where the
    /// panels' own text starts a few rows lower).
    fn assert_titled(&self) {
        let dark = self.dark_in_rows(TITLE_BAND);
        assert!(dark > 100, "{dark} dark pixels in the title band");
    }
}

/// The rows the title's text fills (measured: none dark without a title, a few
/// hundred with one; the panels' captions start at row 16).
const TITLE_BAND: std::ops::Range<u32> = 0..16;

fn history(epochs: u64) -> History {
    let mut h = History::new();
    for e in 1..=epochs {
        let x = e as f64;
        let values = [
            ("loss".to_string(), 2.0 / x),
            ("val_loss".to_string(), 2.2 / x + 0.01 * x),
            ("accuracy".to_string(), 1.0 - 0.5 / x),
            ("val_accuracy".to_string(), 0.97 - 0.5 / x),
        ];
        h.record(e, &values).expect("record");
    }
    h
}

#[test]
fn curves_from_a_history() {
    let dir = kiln_testkit::TempDir::new("plot");
    let out = dir.path().join("curves.png");
    let options = PlotOptions {
        width: 900,
        height: 360,
        title: Some("digits: CNN".into()),
        ..PlotOptions::default()
    };
    plot_curves(&history(20), &out, &options).expect("plot");
    let img = Image::read(&out);
    assert_eq!((img.width, img.height), (900, 360));
    let colors: HashSet<[u8; 3]> = img.pixels().collect();
    assert!(colors.len() > 20, "{} colours", colors.len());
    img.assert_both_curves_in_both_panels();
    img.assert_titled();
    let untitled = dir.path().join("untitled.png");
    let no_title = PlotOptions {
        title: None,
        ..options.clone()
    };
    plot_curves(&history(20), &untitled, &no_title).expect("plot");
    assert_eq!(Image::read(&untitled).dark_in_rows(TITLE_BAND), 0);
}

#[test]
fn curves_from_csv_and_partial_histories() {
    let dir = kiln_testkit::TempDir::new("plot-csv");
    let mut sink = CsvSink::new(dir.path()).expect("sink");
    for e in 1..=3u64 {
        sink.log_step(e * 10, &[("loss".into(), 1.0)])
            .expect("step");
        // No validation values and no accuracy: one panel, one curve.
        sink.log_epoch(e, &[("loss".into(), 1.0 / e as f64)])
            .expect("epoch");
    }
    sink.finish().expect("finish");
    let out = dir.path().join("loss.png");
    plot_curves(
        &dir.path().join("epochs.csv"),
        &out,
        &PlotOptions::default(),
    )
    .expect("plot");
    let img = Image::read(&out);
    assert_eq!((img.width, img.height), (1200, 450));
    assert!(img.count(TRAIN) > 300, "{}", img.count(TRAIN));
    assert_eq!(img.count(VAL), 0);

    // A single epoch still gives a readable plot (dots, padded axes).
    let mut one = History::new();
    one.log_epoch(1, &[("loss".into(), 0.5), ("val_loss".into(), 0.5)])
        .expect("record");
    let out = dir.path().join("one.png");
    plot_curves(&one, &out, &PlotOptions::default()).expect("plot one epoch");
    let img = Image::read(&out);
    assert!(img.count(VAL) > 10, "{}", img.count(VAL));
}

#[test]
fn nothing_to_draw_and_bad_sizes_are_errors() {
    let dir = kiln_testkit::TempDir::new("plot-errors");
    let out = dir.path().join("x.png");
    let mut h = History::new();
    h.record(1, &[("f1".into(), 0.5)]).expect("record");
    let err = plot_curves(&h, &out, &PlotOptions::default()).expect_err("no loss");
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(err.to_string().contains("val_accuracy"), "{err}");
    // NaN losses alone are nothing to draw either.
    let mut nan = History::new();
    nan.record(1, &[("loss".into(), f64::NAN)]).expect("record");
    assert!(plot_curves(&nan, &out, &PlotOptions::default()).is_err());
    assert!(!out.exists());

    let tiny = PlotOptions {
        width: 10,
        ..PlotOptions::default()
    };
    let err = plot_curves(&history(3), &out, &tiny).expect_err("too small");
    assert!(err.to_string().contains("`width`"), "{err}");

    let f1 = PlotOptions {
        metrics: vec!["f1".into()],
        ..PlotOptions::default()
    };
    plot_curves(&h, &out, &f1).expect("any named metric can be plotted");

    let nowhere = dir.path().join("missing-dir").join("x.png");
    let err = plot_curves(&history(3), &nowhere, &PlotOptions::default()).expect_err("no dir");
    assert!(
        matches!(err, Error::Io { ref path, .. } if *path == nowhere),
        "{err}"
    );
}

/// The plot a person looks at (the default 1200 x 450, a title, 20 epochs):
/// the size asked for, both curves in both panels, the title drawn. Kept at
/// `KILN_PLOT_OUT` when that names a path, to look at.
#[test]
fn sample_plot_at_the_default_size_shows_both_curves_and_the_title() {
    let dir = kiln_testkit::TempDir::new("plot-sample");
    let path =
        std::env::var_os("KILN_PLOT_OUT").map_or_else(|| dir.path().join("sample.png"), Into::into);
    let options = PlotOptions {
        title: Some("digits: CNN, 20 epochs".into()),
        ..PlotOptions::default()
    };
    plot_curves(&history(20), &path, &options).expect("plot");
    let img = Image::read(&path);
    assert_eq!((img.width, img.height), (1200, 450));
    img.assert_both_curves_in_both_panels();
    img.assert_titled();
}
