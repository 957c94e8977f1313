//! Per-epoch values kept in memory.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::csv::{read_table, Table, EPOCHS_FILE};
use super::{check_names, MetricSink};
use kiln_core::error::{Error, Result};

/// The values recorded for one epoch, in the order they were first given.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochValues {
    /// The epoch number.
    pub epoch: u64,
    /// `(name, value)` pairs, each name once.
    pub values: Vec<(String, f64)>,
}

impl EpochValues {
    /// The value named `name`, if recorded.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.values.iter().find(|(n, _)| n == name).map(|&(_, v)| v)
    }
}

/// Per-epoch records of named values, like the `History` Keras's `fit()`
/// returns: the trainer fills it (it is a [`MetricSink`] that keeps the epoch
/// values and ignores step values), and [`plot_curves`](crate::plot_curves)
/// draws it. It can also be read back from a [`CsvSink`](crate::CsvSink)'s
/// `epochs.csv`, and serialized with serde.
///
/// ```
/// use kiln_train::History;
///
/// let mut h = History::new();
/// h.record(1, &[("loss".into(), 0.9)])?;
/// h.record(1, &[("val_loss".into(), 1.1)])?; // merged into epoch 1
/// h.record(2, &[("loss".into(), 0.5), ("val_loss".into(), 0.7)])?;
/// assert_eq!(h.len(), 2);
/// assert_eq!(h.names(), ["loss", "val_loss"]);
/// assert_eq!(h.series("val_loss"), [(1, 1.1), (2, 0.7)]);
/// assert_eq!(h.last("loss"), Some(0.5));
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct History {
    records: Vec<EpochValues>,
}

impl History {
    /// An empty history.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `values` for `epoch`. Values for an epoch already recorded
    /// are merged into its record (a name given again replaces its value), so
    /// training and validation values can come in separate calls, and a
    /// resumed run that repeats an epoch replaces it.
    pub fn record(&mut self, epoch: u64, values: &[(String, f64)]) -> Result<()> {
        check_names(values)?;
        let index = match self.records.iter().position(|r| r.epoch == epoch) {
            Some(i) => i,
            None => {
                self.records.push(EpochValues {
                    epoch,
                    values: Vec::with_capacity(values.len()),
                });
                self.records.len() - 1
            }
        };
        let record = &mut self.records[index];
        for (name, value) in values {
            match record.values.iter_mut().find(|(n, _)| n == name) {
                Some(slot) => slot.1 = *value,
                None => record.values.push((name.clone(), *value)),
            }
        }
        Ok(())
    }

    /// The records, in the order their epochs were first recorded.
    pub fn records(&self) -> &[EpochValues] {
        &self.records
    }

    /// Number of epochs recorded.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether no epoch was recorded.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Every value name, in the order of first appearance.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for (name, _) in self.records.iter().flat_map(|r| &r.values) {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        names
    }

    /// `(epoch, value)` for every epoch that has a value named `name`.
    pub fn series(&self, name: &str) -> Vec<(u64, f64)> {
        self.records
            .iter()
            .filter_map(|r| r.get(name).map(|v| (r.epoch, v)))
            .collect()
    }

    /// The value named `name` of epoch `epoch`.
    pub fn get(&self, epoch: u64, name: &str) -> Option<f64> {
        self.records
            .iter()
            .find(|r| r.epoch == epoch)
            .and_then(|r| r.get(name))
    }

    /// The latest recorded value named `name`.
    pub fn last(&self, name: &str) -> Option<f64> {
        self.records.iter().rev().find_map(|r| r.get(name))
    }

    /// Reads the `epochs.csv` a [`CsvSink`](crate::CsvSink) wrote; `path` is
    /// the file or its directory. The `epoch` column gives the epochs, a
    /// `step` column is skipped, and every other column is a value (empty
    /// cells are missing values).
    pub fn from_csv(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = if path.is_dir() {
            path.join(EPOCHS_FILE)
        } else {
            path.to_path_buf()
        };
        let Table { header, rows } = read_table(&file)?;
        let epoch_col = header
            .iter()
            .position(|h| h == "epoch")
            .ok_or_else(|| Error::Data {
                path: file.clone(),
                offset: None,
                reason: format!(
                    "line 1: no `epoch` column in the header `{}`",
                    header.join(",")
                ),
                source: None,
            })?;
        let mut history = History::new();
        for (i, row) in rows.iter().enumerate() {
            let epoch = row[epoch_col]
                .filter(|e| *e >= 0.0 && e.fract() == 0.0 && *e <= u64::MAX as f64)
                .ok_or_else(|| Error::Data {
                    path: file.clone(),
                    offset: None,
                    reason: format!("row {}: the epoch is not a whole number", i + 1),
                    source: None,
                })? as u64;
            let values: Vec<(String, f64)> = header
                .iter()
                .zip(row)
                .enumerate()
                .filter(|&(c, (name, _))| c != epoch_col && name != "step")
                .filter_map(|(_, (name, v))| v.map(|v| (name.clone(), v)))
                .collect();
            history.record(epoch, &values)?;
        }
        Ok(history)
    }
}

impl MetricSink for History {
    /// Step values are not kept.
    fn log_step(&mut self, _step: u64, values: &[(String, f64)]) -> Result<()> {
        check_names(values)
    }

    fn log_epoch(&mut self, epoch: u64, values: &[(String, f64)]) -> Result<()> {
        self.record(epoch, values)
    }

    fn flush(&mut self) -> Result<()> {
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}
