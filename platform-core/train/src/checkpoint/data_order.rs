//! The data order a checkpoint was trained in, and the refusal of a mid-epoch
//! position recorded under another order.
//!
//! A checkpoint's position in its epoch (`kiln.batch_in_epoch`) only means
//! "these samples are done" under the shuffle order that produced it. Kiln's
//! loaders changed theirs once (to PyTorch's `randperm` of `seed + epoch`,
//! [`kiln_core::rng::EPOCH_ORDER`]), so a checkpoint written mid-epoch by an
//! older Kiln would resume on other samples: some seen twice in the epoch,
//! others never. At an epoch boundary the order of the epochs to come is
//! all that matters, and any checkpoint resumes.

use std::path::Path;

use kiln_core::error::{Error, Result};
use kiln_core::rng::EPOCH_ORDER;

use super::Checkpoint;

/// The metadata key recording a checkpoint's data order
/// ([`Checkpoint::data_order`]).
pub const DATA_ORDER_KEY: &str = "kiln.data_order";

impl<S> Checkpoint<S> {
    /// Refuses a checkpoint written mid-epoch (`batch_in_epoch > 0`) under a
    /// data order other than this Kiln's ([`kiln_core::rng::EPOCH_ORDER`]), or
    /// with none recorded (written by a Kiln from before the record, whose
    /// loaders shuffled otherwise), as [`Error::Checkpoint`] naming the file,
    /// what differs and what to do instead. A checkpoint at an epoch boundary
    /// always passes: the next epoch starts afresh in this Kiln's order.
    ///
    /// ```
    /// use std::path::Path;
    /// use kiln_train::Checkpoint;
    ///
    /// # fn checkpoint(batch_in_epoch: u64, data_order: Option<String>) -> Checkpoint {
    /// #     Checkpoint {
    /// #         model: Default::default(), optimizer: Default::default(), step: 7,
    /// #         epoch: 1, batch_in_epoch, seed: 0, world_size: 1, backend: "torch".into(),
    /// #         optimizer_kind: None, model_definition: None, lora: None, data: None, data_order,
    /// #         scheduler: None, metrics: Default::default(), epoch_loss: None, epoch_metrics: Default::default(), averaged: None, callbacks: Default::default(),
    /// #     }
    /// # }
    /// let path = Path::new("old.safetensors");
    /// assert!(checkpoint(0, None).check_data_order(path).is_ok());
    /// assert!(checkpoint(3, None).check_data_order(path).is_err());
    /// let current = Some(kiln_core::rng::EPOCH_ORDER.to_owned());
    /// assert!(checkpoint(3, current).check_data_order(path).is_ok());
    /// ```
    pub fn check_data_order(&self, path: &Path) -> Result<()> {
        if self.batch_in_epoch == 0 || self.data_order.as_deref() == Some(EPOCH_ORDER) {
            return Ok(());
        }
        let written = match &self.data_order {
            None => format!(
                "by an older Kiln, whose shuffled data order differs from this one's (it \
                 records no `{DATA_ORDER_KEY}`; this Kiln shuffles in `{EPOCH_ORDER}` order)"
            ),
            Some(other) => format!(
                "in data order `{other}` (`{DATA_ORDER_KEY}`), and this Kiln shuffles in \
                 `{EPOCH_ORDER}` order"
            ),
        };
        Err(Error::checkpoint(
            path,
            format!(
                "stands at batch {} of epoch {}, and was written {written}: resumed here, the \
                 rest of the epoch would not be the samples the run had left. Resume from a \
                 checkpoint written at the end of an epoch (batch 0 of the next; `kiln \
                 inspect` shows each file's position), or start the run over",
                self.batch_in_epoch, self.epoch
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::state_dict::StateDict;

    fn at(epoch: u64, batch_in_epoch: u64, data_order: Option<&str>) -> Checkpoint {
        Checkpoint {
            model: StateDict::new(),
            optimizer: StateDict::new(),
            step: 12,
            epoch,
            batch_in_epoch,
            seed: 0,
            world_size: 1,
            backend: "torch".into(),
            optimizer_kind: None,
            model_definition: None,
            lora: None,
            data: None,
            data_order: data_order.map(str::to_owned),
            scheduler: None,
            metrics: Default::default(),
            epoch_loss: None,
            epoch_metrics: Default::default(),
            averaged: None,
            callbacks: Default::default(),
        }
    }

    #[test]
    fn mid_epoch_without_the_stamp_is_refused() {
        let path = Path::new("runs/a/checkpoints/step-00000012.safetensors");
        let err = at(2, 5, None).check_data_order(path).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with("checkpoint runs/a/checkpoints/step-00000012.safetensors: "),
            "{text}"
        );
        for part in [
            "stands at batch 5 of epoch 2",
            "by an older Kiln, whose shuffled data order differs",
            "no `kiln.data_order`",
            "`randperm-v2`",
            "Resume from a checkpoint written at the end of an epoch",
            "or start the run over",
        ] {
            assert!(text.contains(part), "no {part:?} in: {text}");
        }
        let err = at(0, 1, Some("shuffle-v9"))
            .check_data_order(path)
            .unwrap_err();
        assert!(
            err.to_string().contains("in data order `shuffle-v9`"),
            "{err}"
        );
    }

    #[test]
    fn an_epoch_boundary_or_the_current_order_resumes() -> Result<()> {
        let path = Path::new("c.safetensors");
        at(3, 0, None).check_data_order(path)?;
        at(3, 0, Some("shuffle-v9")).check_data_order(path)?;
        at(3, 4, Some(EPOCH_ORDER)).check_data_order(path)?;
        at(0, 0, Some(EPOCH_ORDER)).check_data_order(path)?;
        Ok(())
    }
}
