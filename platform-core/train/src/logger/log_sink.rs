//! Metric values as `log::info!` lines.

use super::{check_names, human_list, MetricSink};
use kiln_core::error::{Error, Result};

/// Writes values as `log::info!` lines, for example
/// `step 100: loss 0.2345, lr 1.000e-3` and
/// `epoch 3: loss 0.1200, val_loss 0.1500`.
///
/// ```
/// use kiln_train::{LogSink, MetricSink};
///
/// let mut sink = LogSink::every(100)?;
/// sink.log_step(100, &[("loss".into(), 0.25)])?; // logged
/// sink.log_step(101, &[("loss".into(), 0.24)])?; // skipped
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct LogSink {
    every: u64,
}

impl Default for LogSink {
    fn default() -> Self {
        Self::new()
    }
}

impl LogSink {
    /// Logs every step and every epoch.
    pub fn new() -> Self {
        LogSink { every: 1 }
    }

    /// Logs the steps that are multiples of `every` (which must be at least
    /// 1), and every epoch.
    pub fn every(every: u64) -> Result<Self> {
        if every == 0 {
            return Err(Error::invalid_argument(
                "every",
                "the logging interval must be at least 1 step",
            ));
        }
        Ok(LogSink { every })
    }
}

impl MetricSink for LogSink {
    fn log_step(&mut self, step: u64, values: &[(String, f64)]) -> Result<()> {
        check_names(values)?;
        if step.is_multiple_of(self.every) && !values.is_empty() {
            log::info!("step {step}: {}", human_list(values));
        }
        Ok(())
    }

    fn log_epoch(&mut self, epoch: u64, values: &[(String, f64)]) -> Result<()> {
        check_names(values)?;
        log::info!("epoch {epoch}: {}", human_list(values));
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}
