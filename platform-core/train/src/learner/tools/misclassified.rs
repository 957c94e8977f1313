//! Images of the validation samples a classifier gets wrong, for TensorBoard's
//! Images view, with a table of what each one is and was taken for.

use std::fmt::Write as _;

use crate::learner::callback::{Callback, Context, FitInfo, ValidationBatch};
use crate::logger::LoggedImage;
use crate::metric::argmax;
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::dtype::DType;
use kiln_core::error::{Error, Result};
use kiln_core::loss::Loss;
use kiln_core::tensor::HostTensor;

/// The tag of the grid of misclassified images and of its table.
pub const MISCLASSIFIED_TAG: &str = "val_misclassified";

/// Images per row of the grid, and the pixels between and around them
/// (`torchvision.utils.make_grid`'s defaults).
const GRID_ROW: usize = 8;
const GRID_PADDING: usize = 2;

/// The targets a classification loss leaves out (PyTorch's `ignore_index`).
const IGNORED_TARGET: i64 = -100;

/// After each epoch's validation, the first `count` validation samples the
/// model misclassified, as one image and a table, in TensorBoard (`[logging]
/// misclassified_images = N` in a CLI config).
///
/// The image is what `SummaryWriter.add_image(tag, make_grid(images, nrow=8,
/// padding=2, normalize=True, scale_each=True), epoch)` writes: each sample
/// scaled from its own minimum and maximum to black and white (undoing any
/// normalisation), eight to a row, under the tag `val_misclassified` at the
/// epoch's number (as the `epoch/` scalars). The Text view's table of the same
/// tag lists, in grid order, each sample's place in the validation data, its
/// class, the predicted class and the probability the model gave it.
///
/// The inputs are images, `[N, C, H, W]` with 1 (grey) or 3 (RGB) channels, or
/// `[N, H, W]`, and the model's outputs class scores `[N, classes]` for class
/// index targets (`cross_entropy` or `nll`). On a data-parallel run rank 0
/// draws from its share of the validation data, and numbers the samples within
/// it.
///
/// ```
/// use kiln_train::MisclassifiedImages;
///
/// let view = MisclassifiedImages::new(16).with_class_names(vec!["cat".into(), "dog".into()]);
/// assert_eq!(view.count, 16);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MisclassifiedImages {
    /// At most this many samples per validation (at least 1).
    pub count: usize,
    /// The classes' names by index (an image folder's folders); the table
    /// gives the indices without them.
    pub class_names: Option<Vec<String>>,
}

impl MisclassifiedImages {
    /// The first `count` misclassified samples of each validation.
    pub fn new(count: usize) -> Self {
        Self {
            count,
            class_names: None,
        }
    }

    /// Names the classes in the table.
    pub fn with_class_names(mut self, names: Vec<String>) -> Self {
        self.class_names = Some(names);
        self
    }

    /// Checks the settings against the run's loss, before the first step.
    pub(crate) fn validate(&self, loss: Option<&Loss>, objective: &str) -> Result<()> {
        if self.count == 0 {
            return Err(Error::invalid_argument(
                "logging.misclassified_images",
                "is 0: give the number of samples to show (at least 1)",
            ));
        }
        let Some(loss) = loss else {
            return Err(Error::invalid_argument(
                "logging.misclassified_images",
                format!(
                    "needs a classifier trained on class indices (loss cross_entropy or nll); \
                     this run trains the {objective} objective"
                ),
            ));
        };
        if !matches!(loss, Loss::CrossEntropy(_) | Loss::Nll(_)) {
            return Err(Error::invalid_argument(
                "logging.misclassified_images",
                format!(
                    "needs a classifier trained on class indices (loss cross_entropy or nll); \
                     this run's loss is {}",
                    loss.torch_name()
                ),
            ));
        }
        Ok(())
    }

    /// The name of class `c`, as the table shows it.
    fn class(&self, c: usize) -> String {
        match self.class_names.as_ref().and_then(|names| names.get(c)) {
            Some(name) => format!("{name} ({c})"),
            None => c.to_string(),
        }
    }
}

/// One misclassified sample.
#[derive(Debug)]
struct Found {
    /// Its number in the validation data.
    sample: usize,
    target: usize,
    predicted: usize,
    /// The softmax of its scores at the predicted class.
    probability: f64,
    /// Its pixels, `[C, H, W]`.
    pixels: Vec<f32>,
}

/// Gathers one validation's misclassified samples, batch by batch.
#[derive(Debug)]
pub(crate) struct Collector {
    config: MisclassifiedImages,
    /// The number of ranks; with more than one, rank 0's share is numbered
    /// (and the table says so).
    world: usize,
    /// Samples seen, and misclassified among them.
    seen: usize,
    wrong: usize,
    /// `(C, H, W)` of the images, from the first batch.
    image: Option<(usize, usize, usize)>,
    found: Vec<Found>,
}

impl Collector {
    /// A collector on rank 0 of `world` ranks.
    pub(crate) fn new(config: MisclassifiedImages, world: usize) -> Self {
        Self {
            config,
            world: world.max(1),
            seen: 0,
            wrong: 0,
            image: None,
            found: Vec::new(),
        }
    }

    /// Adds a batch: its `inputs`, the model's `output` and the `targets`.
    pub(crate) fn add(
        &mut self,
        inputs: &HostTensor,
        output: &HostTensor,
        targets: &HostTensor,
    ) -> Result<()> {
        let (c, h, w) = image_dims(inputs)?;
        if let Some(first) = self.image.filter(|&first| first != (c, h, w)) {
            return Err(Error::ShapeMismatch {
                context: "logging.misclassified_images: a validation batch's images".into(),
                expected: format!(
                    "[N, {}, {}, {}] as the first batch's",
                    first.0, first.1, first.2
                ),
                actual: inputs.shape().to_string(),
            });
        }
        self.image = Some((c, h, w));
        let rows = inputs.dims()[0];
        let classes = match output.dims() {
            &[n, classes] if n == rows && classes > 0 && output.dtype().is_float() => classes,
            _ => {
                return Err(Error::ShapeMismatch {
                    context: format!(
                        "logging.misclassified_images: the model's {} output for {rows} images",
                        output.dtype()
                    ),
                    expected: format!("float class scores [{rows}, classes]"),
                    actual: output.shape().to_string(),
                })
            }
        };
        if targets.dtype() != DType::I64 || targets.dims() != [rows] {
            return Err(Error::ShapeMismatch {
                context: format!(
                    "logging.misclassified_images: the targets of {rows} images (a {} tensor)",
                    targets.dtype()
                ),
                expected: format!("int64 class indices [{rows}]"),
                actual: targets.shape().to_string(),
            });
        }
        let scores = output.to_f64_vec();
        let labels = targets.as_slice::<i64>()?;
        // The pixels are converted only while there are samples to keep.
        let mut pixels: Option<HostTensor> = None;
        let size = c * h * w;
        for (row, &label) in labels.iter().enumerate() {
            let sample = self.seen + row;
            if label == IGNORED_TARGET {
                continue;
            }
            let target = usize::try_from(label)
                .ok()
                .filter(|&t| t < classes)
                .ok_or_else(|| {
                    Error::invalid_argument(
                        "target",
                        format!(
                            "logging.misclassified_images: class {label} of validation sample \
                             {sample} is out of range for {classes} classes"
                        ),
                    )
                })?;
            let row_scores = &scores[row * classes..(row + 1) * classes];
            let predicted = argmax(row_scores);
            if predicted == target {
                continue;
            }
            self.wrong += 1;
            if self.found.len() < self.config.count {
                let all = pixels.get_or_insert_with(|| inputs.to_dtype(DType::F32));
                self.found.push(Found {
                    sample,
                    target,
                    predicted,
                    probability: softmax_at(row_scores, predicted),
                    pixels: all.as_slice::<f32>()?[row * size..(row + 1) * size].to_vec(),
                });
            }
        }
        self.seen += rows;
        Ok(())
    }

    /// The grid of the samples found (none when there are none) and the
    /// table of them, for validation after epoch `epoch`.
    pub(crate) fn finish(self, epoch: u64) -> Result<(Option<LoggedImage>, String)> {
        let mut table = String::new();
        let share = if self.world > 1 {
            format!(
                " in rank 0's share of the validation data ({} ranks; the samples are \
                 numbered within the share)",
                self.world
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            table,
            "Epoch {epoch}: {} of {} validation samples misclassified{share}; the first {} \
             shown, left to right and top to bottom.\n",
            self.wrong,
            self.seen,
            self.found.len()
        );
        if self.found.is_empty() {
            return Ok((None, table));
        }
        table.push_str("| # | sample | class | predicted | probability |\n");
        table.push_str("| ---: | ---: | --- | --- | ---: |\n");
        for (i, found) in self.found.iter().enumerate() {
            let _ = writeln!(
                table,
                "| {} | {} | {} | {} | {:.3} |",
                i + 1,
                found.sample,
                self.config.class(found.target),
                self.config.class(found.predicted),
                found.probability
            );
        }
        let (c, h, w) = self.image.unwrap_or((1, 1, 1));
        let images: Vec<&[f32]> = self.found.iter().map(|f| f.pixels.as_slice()).collect();
        let (width, height, grid) = make_grid(&images, c, h, w);
        let png = encode_png(&grid, width, height, c)?;
        Ok((
            Some(LoggedImage {
                tag: MISCLASSIFIED_TAG.to_owned(),
                height: height as u32,
                width: width as u32,
                channels: c as u8,
                png,
            }),
            table,
        ))
    }
}

/// The callback that logs a run's [`MisclassifiedImages`]
/// ([`Trainer::with_misclassified_images`](crate::Trainer::with_misclassified_images)
/// registers it): a collector per epoch's validation, on rank 0.
#[derive(Debug)]
pub struct MisclassifiedLogger {
    config: MisclassifiedImages,
    collecting: Option<Collector>,
}

impl MisclassifiedLogger {
    /// Logs `config`'s images.
    pub fn new(config: MisclassifiedImages) -> Self {
        Self {
            config,
            collecting: None,
        }
    }
}

impl<B: TrainBackend, M: Trainable<B>> Callback<B, M> for MisclassifiedLogger {
    /// Checks the loss, and that there is validation data to draw from.
    fn on_fit_start(&mut self, _cx: &mut Context<'_, B, M>, run: &FitInfo<'_>) -> Result<()> {
        self.config.validate(run.loss, run.objective)?;
        if !run.has_validation {
            return Err(Error::invalid_argument(
                "logging.misclassified_images",
                "draws from the validation data, and there is none (give fit a validation \
                 loader)",
            ));
        }
        Ok(())
    }

    /// A collector for this validation, on rank 0.
    fn on_validation_start(&mut self, cx: &mut Context<'_, B, M>) -> Result<()> {
        let config = self.config.clone();
        self.collecting = match cx.state.model.collectives() {
            Some(group) if group.rank() != 0 => None,
            Some(group) => Some(Collector::new(config, group.world_size())),
            None => Some(Collector::new(config, 1)),
        };
        Ok(())
    }

    fn on_validation_batch_end(&mut self, batch: &ValidationBatch<'_>) -> Result<()> {
        match self.collecting.as_mut() {
            Some(found) => found.add(batch.inputs, batch.outputs, batch.targets),
            None => Ok(()),
        }
    }

    /// Logs the samples found to every sink: the grid as an image, the table
    /// as text, at the epoch's number.
    fn on_validation_end(
        &mut self,
        cx: &mut Context<'_, B, M>,
        _metrics: &[(String, f64)],
    ) -> Result<()> {
        let Some(found) = self.collecting.take() else {
            return Ok(());
        };
        let epoch = cx.state.epoch;
        let (image, table) = found.finish(epoch)?;
        if let Some(image) = &image {
            cx.sinks.log_images(epoch, std::slice::from_ref(image))?;
        }
        cx.sinks.log_text(epoch, MISCLASSIFIED_TAG, &table)
    }

    fn needs_step_loss(&self) -> bool {
        false
    }
}

/// `(C, H, W)` of a batch of images `[N, C, H, W]` (C 1 or 3) or `[N, H, W]`.
fn image_dims(inputs: &HostTensor) -> Result<(usize, usize, usize)> {
    match *inputs.dims() {
        [_, c, h, w] if (c == 1 || c == 3) && h > 0 && w > 0 => Ok((c, h, w)),
        [_, h, w] if h > 0 && w > 0 => Ok((1, h, w)),
        _ => Err(Error::ShapeMismatch {
            context: format!(
                "logging.misclassified_images: the validation inputs (a {} tensor)",
                inputs.dtype()
            ),
            expected: "images [N, C, H, W] with 1 or 3 channels, or [N, H, W]".into(),
            actual: inputs.shape().to_string(),
        }),
    }
}

/// `softmax(row)[c]`, computed stably.
fn softmax_at(row: &[f64], c: usize) -> f64 {
    let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = row.iter().map(|v| (v - max).exp()).sum();
    (row[c] - max).exp() / sum
}

/// `make_grid(images, nrow=8, padding=2, normalize=True, scale_each=True)`
/// as 8-bit pixels, channel-last: `(width, height, pixels)`. Each image is
/// scaled from its minimum and maximum to 0..1 and then, as `add_image` does,
/// multiplied by 255 and truncated; the padding is black. One image comes
/// without padding, as `make_grid` returns it.
fn make_grid(images: &[&[f32]], c: usize, h: usize, w: usize) -> (usize, usize, Vec<u8>) {
    let pad = if images.len() == 1 { 0 } else { GRID_PADDING };
    let across = images.len().clamp(1, GRID_ROW);
    let down = images.len().div_ceil(across);
    let (width, height) = (across * (w + pad) + pad, down * (h + pad) + pad);
    let mut grid = vec![0u8; width * height * c];
    for (k, image) in images.iter().enumerate() {
        let (low, high) = image
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        // As `norm_ip`: the range as a Python float, at least 1e-5.
        let range = (f64::from(high) - f64::from(low)).max(1e-5) as f32;
        let (x0, y0) = (
            (k % across) * (w + pad) + pad,
            (k / across) * (h + pad) + pad,
        );
        for ch in 0..c {
            for y in 0..h {
                for x in 0..w {
                    let v = image[(ch * h + y) * w + x].clamp(low, high);
                    let unit = (v - low) / range;
                    let byte = (unit * 255.0).clamp(0.0, 255.0) as u8;
                    grid[((y0 + y) * width + x0 + x) * c + ch] = byte;
                }
            }
        }
    }
    (width, height, grid)
}

/// `pixels` (channel-last, 1 or 3 channels) as a PNG file's bytes.
fn encode_png(pixels: &[u8], width: usize, height: usize, channels: usize) -> Result<Vec<u8>> {
    let fail = |e: png::EncodingError| {
        Error::invalid_argument(
            "logging.misclassified_images",
            format!("encoding a {width}x{height} PNG: {e}"),
        )
    };
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width as u32, height as u32);
    encoder.set_color(if channels == 3 {
        png::ColorType::Rgb
    } else {
        png::ColorType::Grayscale
    });
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(fail)?;
    writer.write_image_data(pixels).map_err(fail)?;
    writer.finish().map_err(fail)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(images: Vec<f32>, dims: Vec<usize>) -> HostTensor {
        HostTensor::new(images, dims).expect("a tensor")
    }

    #[test]
    fn the_grid_places_and_scales_each_image() {
        // Two 1x2x2 images: 0..3 and a constant one.
        let a = [0.0f32, 1.0, 2.0, 3.0];
        let b = [5.0f32; 4];
        let (width, height, grid) = make_grid(&[&a, &b], 1, 2, 2);
        assert_eq!((width, height), (2 * 4 + 2, 2 + 4));
        let at = |x: usize, y: usize| grid[y * width + x];
        // Scaled by its own range: 0, 85, 170, 255 (255 * k / 3, truncated).
        assert_eq!([at(2, 2), at(3, 2), at(2, 3), at(3, 3)], [0, 85, 170, 255]);
        // A constant image is black; so is the padding.
        assert_eq!([at(6, 2), at(7, 3), at(0, 0), at(4, 2)], [0, 0, 0, 0]);
        // One image comes without padding.
        let (width, height, one) = make_grid(&[&a], 1, 2, 2);
        assert_eq!((width, height, one), (2, 2, vec![0, 85, 170, 255]));
    }

    #[test]
    fn collects_the_first_misclassified_samples_with_their_classes() -> Result<()> {
        let config = MisclassifiedImages::new(2).with_class_names(vec!["a".into(), "b".into()]);
        let mut collector = Collector::new(config.clone(), 1);
        let inputs = batch((0..12).map(|v| v as f32).collect(), vec![3, 1, 2, 2]);
        // Rows 0 and 2 are wrong, row 1 right.
        let output = HostTensor::new(vec![2.0f32, 0.0, 0.0, 1.0, 0.0, 3.0], [3, 2])?;
        let targets = HostTensor::new(vec![1i64, 1, 0], [3])?;
        collector.add(&inputs, &output, &targets)?;
        // A second batch: three more wrong, beyond the count.
        let targets = HostTensor::new(vec![1i64, 0, 0], [3])?;
        collector.add(&inputs, &output, &targets)?;
        let (image, table) = collector.finish(4)?;
        assert!(table.starts_with("Epoch 4: 5 of 6 validation samples misclassified;"));
        assert!(
            table.contains("| 1 | 0 | b (1) | a (0) | 0.881 |"),
            "{table}"
        );
        assert!(
            table.contains("| 2 | 2 | a (0) | b (1) | 0.953 |"),
            "{table}"
        );
        let image = image.expect("a grid");
        assert_eq!((image.width, image.height, image.channels), (10, 6, 1));
        let decoder = png::Decoder::new(std::io::Cursor::new(image.png));
        let mut reader = decoder.read_info().expect("a PNG");
        let mut pixels = vec![0; reader.output_buffer_size().expect("a size")];
        reader.next_frame(&mut pixels).expect("a frame");
        assert_eq!(pixels[2 * 10 + 2..2 * 10 + 4], [0, 85]);
        Ok(())
    }

    #[test]
    fn bad_batches_are_typed_errors() -> Result<()> {
        let config = MisclassifiedImages::new(4);
        let mut collector = Collector::new(config.clone(), 1);
        let flat = batch(vec![0.0; 8], vec![2, 4]);
        let output = HostTensor::new(vec![0.0f32; 4], [2, 2])?;
        let targets = HostTensor::new(vec![0i64, 1], [2])?;
        let err = collector.add(&flat, &output, &targets).unwrap_err();
        assert!(err.to_string().contains("[N, C, H, W]"), "{err}");
        let images = batch(vec![0.0; 8], vec![2, 1, 2, 2]);
        let out_of_range = HostTensor::new(vec![0i64, 2], [2])?;
        let err = collector.add(&images, &output, &out_of_range).unwrap_err();
        assert!(
            err.to_string().contains("class 2 of validation sample 1"),
            "{err}"
        );
        assert!(config
            .validate(Some(&Loss::mse()), "supervised mse")
            .is_err());
        assert!(MisclassifiedImages::new(0)
            .validate(Some(&Loss::cross_entropy()), "supervised cross_entropy")
            .is_err());
        Ok(())
    }
}
