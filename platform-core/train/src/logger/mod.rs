//! Where metric values go: CSV files, TensorBoard event files, a progress
//! bar, `log` lines, an in-memory [`History`], and plots of it.
//!
//! Every sink implements [`MetricSink`]; the trainer calls
//! [`log_step`](MetricSink::log_step) with per-step values (the running
//! training loss, the learning rate, ...) and [`log_epoch`](MetricSink::log_epoch)
//! with per-epoch values (training and validation metrics, named like Keras:
//! `loss`, `accuracy`, `val_loss`, `val_accuracy`). Sinks that show progress
//! within an epoch also get [`start_epoch`](MetricSink::start_epoch) and
//! [`log_batch`](MetricSink::log_batch), which the others ignore.

mod csv;
mod history;
mod log_sink;
mod plot;
mod progress;
mod tensorboard;

pub use self::csv::CsvSink;
pub(crate) use self::csv::{EPOCHS_FILE, STEPS_FILE};
pub use history::{EpochValues, History};
pub use log_sink::LogSink;
pub use plot::{plot_curves, plot_lr_finder, CurveSource, PlotOptions};
pub use progress::ProgressSink;
pub use tensorboard::TensorBoardSink;

use std::collections::HashSet;
use std::fmt::Write as _;

use kiln_core::error::{Error, Result};
use kiln_core::tensor::HostTensor;

/// A destination for named metric values.
///
/// Values are `(name, value)` pairs; a name appears at most once per call.
///
/// ```
/// use kiln_train::{History, MetricSink};
///
/// let mut sink = History::new();
/// sink.log_step(10, &[("loss".into(), 0.7)])?;
/// sink.log_epoch(1, &[("loss".into(), 0.5), ("val_loss".into(), 0.6)])?;
/// sink.finish()?;
/// assert_eq!(sink.series("val_loss"), vec![(1, 0.6)]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
pub trait MetricSink: Send {
    /// Records values at global training step `step` (steps only grow within
    /// one run).
    fn log_step(&mut self, step: u64, values: &[(String, f64)]) -> Result<()>;

    /// Records values for the end of epoch `epoch`.
    fn log_epoch(&mut self, epoch: u64, values: &[(String, f64)]) -> Result<()>;

    /// Called when training epoch `epoch` starts, with its number of batches
    /// when known. Only sinks that show progress within an epoch (like
    /// [`ProgressSink`]) use it; the default does nothing.
    fn start_epoch(&mut self, epoch: u64, batches: Option<u64>) -> Result<()> {
        let _ = (epoch, batches);
        Ok(())
    }

    /// Called after every training batch with its number of samples and its
    /// mean loss. Only sinks that show progress within an epoch use it; the
    /// default does nothing.
    fn log_batch(&mut self, batch_size: usize, loss: f64) -> Result<()> {
        let _ = (batch_size, loss);
        Ok(())
    }

    /// Called after every optimizer step, whether or not the trainer logged
    /// values at it ([`log_every`](crate::TrainerConfig::log_every)); sinks that
    /// stamp epoch records with the step use it. The default does nothing.
    fn end_step(&mut self, step: u64) -> Result<()> {
        let _ = step;
        Ok(())
    }

    /// Writes out anything buffered.
    fn flush(&mut self) -> Result<()>;

    /// Records the distribution of each tensor's values at step `step`
    /// (weights and gradients, as TensorBoard's histograms); ignored by sinks
    /// that show only numbers (the default).
    fn log_histograms(&mut self, step: u64, tensors: &[(String, HostTensor)]) -> Result<()> {
        let _ = (step, tensors);
        Ok(())
    }

    /// Records the model's dataflow graph, a serialised TensorFlow `GraphDef`
    /// ([`Module::graph_def`](kiln_core::module::Module::graph_def)), for
    /// TensorBoard's Graphs view; ignored by other sinks (the default).
    fn log_graph(&mut self, graph_def: &[u8]) -> Result<()> {
        let _ = graph_def;
        Ok(())
    }

    /// Records images at step `step` (the misclassified validation samples
    /// [`MisclassifiedImages`](crate::MisclassifiedImages) draws, logged at each
    /// epoch's number as the epoch values are); ignored by sinks that show only
    /// numbers (the default).
    fn log_images(&mut self, step: u64, images: &[LoggedImage]) -> Result<()> {
        let _ = (step, images);
        Ok(())
    }

    /// Records a Markdown text under `tag` at step `step` (TensorBoard's Text
    /// view); ignored by sinks that show only numbers (the default).
    fn log_text(&mut self, step: u64, tag: &str, markdown: &str) -> Result<()> {
        let _ = (step, tag, markdown);
        Ok(())
    }

    /// Flushes and closes the sink at the end of training; nothing should be
    /// logged afterwards.
    fn finish(&mut self) -> Result<()>;
}

/// A PNG image and what a viewer needs to know of it without decoding it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggedImage {
    /// The name it is shown under.
    pub tag: String,
    /// Height in pixels.
    pub height: u32,
    /// Width in pixels.
    pub width: u32,
    /// 1 (grey) or 3 (RGB).
    pub channels: u8,
    /// The PNG file's bytes.
    pub png: Vec<u8>,
}

/// Checks that no name is empty or repeated in one call.
fn check_names(values: &[(String, f64)]) -> Result<()> {
    let mut seen = HashSet::with_capacity(values.len());
    for (name, _) in values {
        if name.is_empty() {
            return Err(Error::invalid_argument("values", "a metric name is empty"));
        }
        if !seen.insert(name.as_str()) {
            return Err(Error::invalid_argument(
                "values",
                format!("metric `{name}` appears twice in one call"),
            ));
        }
    }
    Ok(())
}

/// A value for people: 4 decimals, or 4 significant digits in scientific
/// notation when it is very small or very large.
fn human(value: f64) -> String {
    let a = value.abs();
    if value != 0.0 && a.is_finite() && !(1e-3..1e5).contains(&a) {
        format!("{value:.3e}")
    } else {
        format!("{value:.4}")
    }
}

/// `name value, name value, ...` with [`human`] values.
fn human_list(values: &[(String, f64)]) -> String {
    let mut out = String::new();
    for (i, (name, value)) in values.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "{name} {}", human(*value));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_formats() {
        assert_eq!(human(0.123456), "0.1235");
        assert_eq!(human(0.0), "0.0000");
        assert_eq!(human(2.5e-5), "2.500e-5");
        assert_eq!(human(-123456.0), "-1.235e5");
        assert_eq!(human(f64::NAN), "NaN");
        assert_eq!(
            human_list(&[("loss".into(), 1.0), ("lr".into(), 1e-4)]),
            "loss 1.0000, lr 1.000e-4"
        );
    }

    #[test]
    fn names_are_checked() {
        assert!(check_names(&[("a".into(), 1.0), ("b".into(), 2.0)]).is_ok());
        let err = check_names(&[("a".into(), 1.0), ("a".into(), 2.0)]).err();
        assert_eq!(
            err.map(|e| e.to_string()).as_deref(),
            Some("invalid argument `values`: metric `a` appears twice in one call")
        );
        assert!(check_names(&[(String::new(), 1.0)]).is_err());
    }
}
