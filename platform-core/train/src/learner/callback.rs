//! Hooks into the training loop: early stopping and user callbacks.

use std::collections::BTreeMap;

use crate::checkpoint::MonitorMode;
use kiln_core::error::{Error, Result};

/// Whether training goes on after a callback ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Keep training.
    Continue,
    /// Stop after this step or epoch (a clean stop, not an error).
    Stop,
}

/// A hook into [`Trainer::fit`](super::Trainer::fit). Every method has a default
/// that does nothing, so a callback implements only what it needs.
pub trait Callback: Send {
    /// After each optimizer step, with the step count and the step's loss (the
    /// loss of its last micro-batch; NaN when [`needs_step_loss`](Self::needs_step_loss)
    /// is false and the trainer has not read it back at this step).
    fn on_step_end(&mut self, _step: u64, _loss: f64) -> Result<Flow> {
        Ok(Flow::Continue)
    }

    /// Whether [`on_step_end`](Self::on_step_end) needs every step's loss, which
    /// makes the trainer read each loss back from the device as it is computed
    /// ([`LossReads::EveryStep`](super::LossReads::EveryStep)). `true` by
    /// default, so a callback written for the values gets them; a callback that
    /// only looks at epochs should return `false`, letting a GPU run ahead.
    fn needs_step_loss(&self) -> bool {
        true
    }

    /// After each epoch (0-based) with its training and validation metrics
    /// (`loss`, `val_loss`, `val_accuracy`, ...).
    fn on_epoch_end(&mut self, _epoch: u64, _metrics: &BTreeMap<String, f64>) -> Result<Flow> {
        Ok(Flow::Continue)
    }
}

/// Stops training when a monitored metric has not improved for `patience` epochs
/// (Keras' and Lightning's `EarlyStopping`).
#[derive(Clone, Debug, PartialEq)]
pub struct EarlyStopping {
    monitor: String,
    mode: MonitorMode,
    patience: u64,
    min_delta: f64,
    best: Option<f64>,
    bad_epochs: u64,
}

impl EarlyStopping {
    /// Stops after `patience` epochs without an improvement of `monitor` by more
    /// than `min_delta` in the direction of `mode`.
    pub fn new(
        monitor: impl Into<String>,
        mode: MonitorMode,
        patience: u64,
        min_delta: f64,
    ) -> Self {
        Self {
            monitor: monitor.into(),
            mode,
            patience,
            min_delta: min_delta.abs(),
            best: None,
            bad_epochs: 0,
        }
    }
}

impl Callback for EarlyStopping {
    /// It watches epoch metrics only.
    fn needs_step_loss(&self) -> bool {
        false
    }

    fn on_epoch_end(&mut self, epoch: u64, metrics: &BTreeMap<String, f64>) -> Result<Flow> {
        let value = *metrics.get(&self.monitor).ok_or_else(|| {
            Error::invalid_argument(
                "early_stopping.monitor",
                format!(
                    "`{}` is not a metric of this run (available: {})",
                    self.monitor,
                    metrics.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            )
        })?;
        let improved = match self.best {
            None => true,
            Some(best) => match self.mode {
                MonitorMode::Min => value < best - self.min_delta,
                MonitorMode::Max => value > best + self.min_delta,
            },
        };
        if improved {
            self.best = Some(value);
            self.bad_epochs = 0;
            return Ok(Flow::Continue);
        }
        self.bad_epochs += 1;
        if self.bad_epochs >= self.patience {
            let best = self
                .best
                .map_or_else(|| "its first value".to_owned(), |b| format!("{b}"));
            log::info!(
                "early stopping after epoch {epoch}: {} has not improved on {best} for {} epochs",
                self.monitor,
                self.bad_epochs
            );
            return Ok(Flow::Stop);
        }
        Ok(Flow::Continue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(v: f64) -> BTreeMap<String, f64> {
        BTreeMap::from([("val_loss".to_owned(), v)])
    }

    #[test]
    fn stops_after_patience_epochs_without_improvement() {
        let mut es = EarlyStopping::new("val_loss", MonitorMode::Min, 2, 0.01);
        let flows: Vec<Flow> = [1.0, 0.5, 0.495, 0.6, 0.4, 0.41, 0.405]
            .iter()
            .enumerate()
            .map(|(e, v)| es.on_epoch_end(e as u64, &metrics(*v)).unwrap())
            .collect();
        // 0.495 is not better than 0.5 by more than 0.01 (bad 1), 0.6 (bad 2): stop.
        assert_eq!(
            flows[..4],
            [Flow::Continue, Flow::Continue, Flow::Continue, Flow::Stop]
        );
        assert_eq!(flows[4], Flow::Continue); // 0.4 improves; counting restarts
        assert_eq!(flows[6], Flow::Stop);
    }

    #[test]
    fn unknown_metric_is_an_error_listing_the_available_ones() {
        let mut es = EarlyStopping::new("val_acc", MonitorMode::Max, 1, 0.0);
        let err = es.on_epoch_end(0, &metrics(1.0)).unwrap_err().to_string();
        assert!(err.contains("val_acc") && err.contains("val_loss"), "{err}");
    }
}
