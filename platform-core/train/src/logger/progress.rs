//! A progress bar per epoch, or plain log lines when stderr is not a terminal.

use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::{check_names, human, human_list, MetricSink};
use kiln_core::error::{Error, Result};

/// How often a [`ProgressSink`] without a terminal logs, by default.
const DEFAULT_EVERY: u64 = 50;

/// Shows training progress: on a terminal, an [indicatif] bar per epoch on
/// stderr with the running mean loss and the samples per second; otherwise
/// (output redirected to a file, CI) a `log::info!` line every N batches and
/// at the last batch.
///
/// Through [`MetricSink`], the trainer calls
/// [`start_epoch`](MetricSink::start_epoch) at the start of each epoch,
/// [`log_batch`](MetricSink::log_batch) after each batch and
/// [`log_epoch`](MetricSink::log_epoch) to close the epoch with its values;
/// step values are not shown. Used directly, [`set_total`](ProgressSink::set_total)
/// and [`inc`](ProgressSink::inc) do the same as the first two, numbering
/// epochs from 1 (or from the last epoch given to `log_epoch`).
///
/// ```
/// use kiln_train::{MetricSink, ProgressSink};
///
/// let mut progress = ProgressSink::plain(2)?;
/// progress.set_total(3);
/// for loss in [0.9, 0.7, 0.6] {
///     progress.inc(32, loss); // logs after batches 2 and 3
/// }
/// progress.log_epoch(1, &[("loss".into(), 0.7333), ("val_loss".into(), 0.8)])?;
/// progress.finish()?;
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Debug)]
pub struct ProgressSink {
    /// Log every this many batches when there is no bar.
    every: u64,
    /// Draw a bar (stderr is a terminal) rather than log lines.
    use_bar: bool,
    bar: Option<ProgressBar>,
    /// Whether an epoch was started and not yet closed by `log_epoch`.
    in_epoch: bool,
    epoch: u64,
    total: Option<u64>,
    batches: u64,
    samples: u64,
    loss_sum: f64,
    started: Instant,
}

impl Default for ProgressSink {
    fn default() -> Self {
        Self::new()
    }
}

impl ProgressSink {
    /// A bar if stderr is a terminal, else a log line every 50 batches.
    pub fn new() -> Self {
        Self::with_mode(std::io::stderr().is_terminal(), DEFAULT_EVERY)
    }

    /// Log lines every `every` batches (at least 1), never a bar.
    pub fn plain(every: u64) -> Result<Self> {
        Ok(Self::with_mode(false, check_every(every)?))
    }

    /// Sets how many batches pass between log lines when there is no bar
    /// (at least 1).
    pub fn with_interval(mut self, every: u64) -> Result<Self> {
        self.every = check_every(every)?;
        Ok(self)
    }

    fn with_mode(use_bar: bool, every: u64) -> Self {
        ProgressSink {
            every,
            use_bar,
            bar: None,
            in_epoch: false,
            epoch: 0,
            total: None,
            batches: 0,
            samples: 0,
            loss_sum: 0.0,
            started: Instant::now(),
        }
    }

    /// Starts the next epoch (numbered one more than the last), of `batches`
    /// batches.
    pub fn set_total(&mut self, batches: u64) {
        self.start(self.epoch + 1, Some(batches));
    }

    fn start(&mut self, epoch: u64, total: Option<u64>) {
        if let Some(bar) = self.bar.take() {
            bar.abandon();
        }
        self.epoch = epoch;
        self.in_epoch = true;
        self.total = total;
        self.batches = 0;
        self.samples = 0;
        self.loss_sum = 0.0;
        self.started = Instant::now();
        if self.use_bar {
            let bar = match total {
                Some(n) => ProgressBar::with_draw_target(Some(n), ProgressDrawTarget::stderr()),
                None => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()),
            };
            let template = if total.is_some() {
                "epoch {prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed}<{eta})"
            } else {
                "epoch {prefix} {spinner} {pos} batches {msg} ({elapsed})"
            };
            // The templates are constants; fall back to the default style
            // rather than fail a training run over a progress bar.
            let style = ProgressStyle::with_template(template)
                .map(|s| s.progress_chars("=> "))
                .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_prefix(self.epoch.to_string());
            self.bar = Some(bar);
        }
    }

    /// Records one finished batch of `batch_size` samples with mean loss
    /// `loss`; starts an epoch of unknown length if none was started.
    pub fn inc(&mut self, batch_size: usize, loss: f64) {
        if !self.in_epoch {
            self.start(self.epoch + 1, None);
        }
        self.batches += 1;
        self.samples += batch_size as u64;
        self.loss_sum += loss * batch_size as f64;
        let mean = if self.samples > 0 {
            self.loss_sum / self.samples as f64
        } else {
            loss
        };
        let secs = self.started.elapsed().as_secs_f64();
        let rate = if secs > 0.0 {
            format!("{:.0} samples/s", self.samples as f64 / secs)
        } else {
            "- samples/s".to_string()
        };
        if let Some(bar) = &self.bar {
            bar.set_message(format!("loss {} {rate}", human(mean)));
            bar.inc(1);
        } else if self.batches.is_multiple_of(self.every) || Some(self.batches) == self.total {
            let of = self.total.map_or(String::new(), |n| format!("/{n}"));
            log::info!(
                "epoch {} batch {}{of}: loss {} ({rate})",
                self.epoch,
                self.batches,
                human(mean)
            );
        }
    }

    /// The running mean loss of the current epoch, weighted by batch size.
    pub fn mean_loss(&self) -> Option<f64> {
        (self.samples > 0).then(|| self.loss_sum / self.samples as f64)
    }

    /// Batches recorded in the current epoch.
    pub fn batches(&self) -> u64 {
        self.batches
    }
}

fn check_every(every: u64) -> Result<u64> {
    if every == 0 {
        return Err(Error::invalid_argument(
            "every",
            "the logging interval must be at least 1 batch",
        ));
    }
    Ok(every)
}

impl MetricSink for ProgressSink {
    /// Per-step values are shown by [`inc`](ProgressSink::inc); this only
    /// checks the names.
    fn log_step(&mut self, _step: u64, values: &[(String, f64)]) -> Result<()> {
        check_names(values)
    }

    fn start_epoch(&mut self, epoch: u64, batches: Option<u64>) -> Result<()> {
        self.start(epoch, batches);
        Ok(())
    }

    fn log_batch(&mut self, batch_size: usize, loss: f64) -> Result<()> {
        self.inc(batch_size, loss);
        Ok(())
    }

    fn log_epoch(&mut self, epoch: u64, values: &[(String, f64)]) -> Result<()> {
        check_names(values)?;
        let summary = human_list(values);
        match self.bar.take() {
            Some(bar) => {
                bar.set_prefix(epoch.to_string());
                bar.finish_with_message(summary);
            }
            None => log::info!("epoch {epoch}: {summary}"),
        }
        self.epoch = epoch;
        self.in_epoch = false;
        self.total = None;
        self.batches = 0;
        self.samples = 0;
        self.loss_sum = 0.0;
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        if let Some(bar) = self.bar.take() {
            bar.abandon();
        }
        Ok(())
    }
}
