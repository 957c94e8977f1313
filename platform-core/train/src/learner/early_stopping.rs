//! Early stopping (Keras' and Lightning's `EarlyStopping`), as a callback.

use serde::{Deserialize, Serialize};

use super::callback::{Callback, Context, Flow};
use super::config::EpochRecord;
use crate::checkpoint::MonitorMode;
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::error::{Error, Result};

/// Stops training when a monitored metric has not improved for `patience` epochs
/// (Keras' and Lightning's `EarlyStopping`). Its count of epochs without an
/// improvement and the best value are in every checkpoint, so a resumed run
/// stops where an uninterrupted one would.
#[derive(Clone, Debug, PartialEq)]
pub struct EarlyStopping {
    monitor: String,
    mode: MonitorMode,
    patience: u64,
    min_delta: f64,
    best: Option<f64>,
    bad_epochs: u64,
}

/// What a checkpoint keeps of an [`EarlyStopping`] (Lightning's
/// `wait_count` and `best_score`, with the monitor it counted for).
#[derive(Serialize, Deserialize)]
struct Saved {
    monitor: String,
    best: Option<f64>,
    bad_epochs: u64,
}

/// Early stopping's settings as a config section reads them (the `kiln` CLI's
/// `[early_stopping]`): only `monitor` is required.
///
/// ```
/// use kiln_train::{EarlyStopping, EarlyStoppingConfig, MonitorMode};
///
/// let config: EarlyStoppingConfig = serde_json::from_str(r#"{"monitor": "val_loss"}"#)?;
/// assert_eq!((config.mode, config.patience, config.min_delta), (MonitorMode::Min, 5, 0.0));
/// let _callback = EarlyStopping::from_config(&config);
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EarlyStoppingConfig {
    /// The metric watched (`val_loss`, `val_accuracy`, ...).
    pub monitor: String,
    /// Whether smaller or larger is better.
    #[serde(default)]
    pub mode: MonitorMode,
    /// Epochs without improvement before stopping (5 by default).
    #[serde(default = "five")]
    pub patience: u64,
    /// The least change that counts as an improvement.
    #[serde(default)]
    pub min_delta: f64,
}

fn five() -> u64 {
    5
}

impl EarlyStopping {
    /// The callback `config` describes.
    pub fn from_config(config: &EarlyStoppingConfig) -> Self {
        Self::new(
            config.monitor.clone(),
            config.mode,
            config.patience,
            config.min_delta,
        )
    }

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

    /// Counts epoch `epoch`'s `metrics`: [`Flow::Stop`] after `patience`
    /// epochs in a row without an improvement.
    pub fn observe(&mut self, epoch: u64, metrics: &EpochRecord) -> Result<Flow> {
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

    /// What a checkpoint keeps of it ([`Callback::state_dict`]).
    fn saved_state(&self) -> Result<serde_json::Value> {
        let saved = Saved {
            monitor: self.monitor.clone(),
            best: self.best,
            bad_epochs: self.bad_epochs,
        };
        serde_json::to_value(saved)
            .map_err(|e| Error::invalid_argument("early_stopping", e.to_string()))
    }

    /// Takes back [`saved_state`](Self::saved_state). A state counted for
    /// another metric is left out (the count starts again, said in the log):
    /// the run changed what it monitors.
    fn load_saved_state(&mut self, state: &serde_json::Value) -> Result<()> {
        let saved: Saved = serde_json::from_value(state.clone()).map_err(|e| {
            Error::invalid_argument(
                "early_stopping",
                format!("the checkpoint's early-stopping state does not read: {e}"),
            )
        })?;
        if saved.monitor != self.monitor {
            log::info!(
                "early stopping counts afresh: the checkpoint's counted `{}`, this run monitors `{}`",
                saved.monitor,
                self.monitor
            );
            return Ok(());
        }
        self.best = saved.best;
        self.bad_epochs = saved.bad_epochs;
        Ok(())
    }
}

impl<B: TrainBackend, M: Trainable<B>> Callback<B, M> for EarlyStopping {
    /// It watches epoch metrics only.
    fn needs_step_loss(&self) -> bool {
        false
    }

    fn on_epoch_end(&mut self, cx: &mut Context<'_, B, M>, record: &EpochRecord) -> Result<Flow> {
        self.observe(cx.state.epoch, record)
    }

    fn state_dict(&self) -> Result<Option<serde_json::Value>> {
        self.saved_state().map(Some)
    }

    fn load_state_dict(&mut self, state: &serde_json::Value) -> Result<()> {
        self.load_saved_state(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(v: f64) -> EpochRecord {
        EpochRecord::from([("val_loss".to_owned(), v)])
    }

    #[test]
    fn stops_after_patience_epochs_without_improvement() {
        let mut es = EarlyStopping::new("val_loss", MonitorMode::Min, 2, 0.01);
        let flows: Vec<Flow> = [1.0, 0.5, 0.495, 0.6, 0.4, 0.41, 0.405]
            .iter()
            .enumerate()
            .map(|(e, v)| es.observe(e as u64, &metrics(*v)).unwrap())
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
        let err = es.observe(0, &metrics(1.0)).unwrap_err().to_string();
        assert!(err.contains("val_acc") && err.contains("val_loss"), "{err}");
    }

    /// The state a checkpoint keeps makes a fresh callback count on, as the
    /// one that wrote it would.
    #[test]
    fn its_state_resumes_the_count() {
        let mut first = EarlyStopping::new("val_loss", MonitorMode::Min, 2, 0.0);
        first.observe(0, &metrics(1.0)).unwrap();
        first.observe(1, &metrics(1.5)).unwrap(); // one bad epoch
        let saved = first.saved_state().unwrap();
        let mut resumed = EarlyStopping::new("val_loss", MonitorMode::Min, 2, 0.0);
        resumed.load_saved_state(&saved).unwrap();
        assert_eq!(resumed, first);
        assert_eq!(resumed.observe(2, &metrics(1.2)).unwrap(), Flow::Stop);

        // Counted for another metric: counting starts again.
        let mut other = EarlyStopping::new("val_accuracy", MonitorMode::Max, 2, 0.0);
        other.load_saved_state(&saved).unwrap();
        assert_eq!(other.bad_epochs, 0);
        let bad = serde_json::json!({"monitor": 3});
        let err = other.load_saved_state(&bad).unwrap_err();
        assert!(err.to_string().contains("does not read"), "{err}");
    }
}
