//! The weight average put into the model at the end of a run (the
//! [`WeightAverager`](crate::WeightAverager) callback keeps it during the run).

use super::Trainer;
use crate::learner::averaging::AveragingConfig;
use crate::learner::batch_norm::update_batch_norm;
use crate::learner::state::TrainingState;
use kiln_core::backend::{TrainBackend, Trainable};
use kiln_core::error::Result;
use kiln_data::DataLoader;

impl<B: TrainBackend, M: Trainable<B>> Trainer<B, M> {
    /// Ends a run that keeps a weight average with the average in the model,
    /// as Lightning's `WeightAveraging` and `StochasticWeightAveraging` leave
    /// it after `fit`: the averaged weights replace the training weights, and
    /// for SWA with `update_bn` batch norm's running statistics are
    /// recomputed for them with one pass over `train`
    /// ([`update_batch_norm`]). Returns whether there was an average to apply
    /// (none, or one not yet updated, leaves the model as it is).
    pub fn apply_average(
        &self,
        state: &mut TrainingState<B, M>,
        train: &dyn DataLoader,
    ) -> Result<bool> {
        let Some(averaging) = state.averaging.as_ref().filter(|a| a.updates() > 0) else {
            return Ok(false);
        };
        let training = averaging.swap_into(&mut state.model)?;
        if let AveragingConfig::Swa(swa) = averaging.config() {
            if swa.update_bn {
                let epoch = state.epoch;
                if let Err(e) =
                    update_batch_norm::<B, M>(&mut state.model, train, epoch, self.config.device)
                {
                    state.model.load_state_dict(&training)?;
                    return Err(e);
                }
            }
        }
        Ok(true)
    }
}
