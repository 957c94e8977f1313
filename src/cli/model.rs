//! The model a command works on: the config's definition with the shapes only
//! running it finds ([`resolve_model`]), and a backend's model with a
//! checkpoint's weights ([`build_model`]).

use std::path::Path;

use anyhow::Result;
use kiln_core::backend::TrainBackend;
use kiln_core::module::Module;

use crate::config::RunConfig;
use crate::engines::{Engines, Source};
use crate::prelude::*;

/// The config's model with the output shape of each torchscript layer (torch)
/// and saved_model layer (TensorFlow) found, by running it once on an example
/// of `inputs` (a batch of the data) or from its signature.
pub(crate) fn resolve_model<E: Engines>(
    config: &RunConfig,
    inputs: &HostTensor,
    device: Device,
) -> Result<Layer> {
    let example = inputs.dims().get(1..).unwrap_or_default();
    let mut model = config.model.clone();
    if !model.torchscript_layers().is_empty() {
        model = kiln_torch::resolve_torchscript_shapes(&model, example, inputs.dtype(), device)?;
    }
    if !model.saved_model_layers().is_empty() {
        model = E::resolve_saved_model_shapes(&model, example, inputs.dtype())?;
    }
    Ok(model)
}

/// The model built on backend `B` with the source's weights, in eval mode.
pub fn build_model<B: TrainBackend>(source: &Source, path: &Path) -> Result<B::Model> {
    let mut model = B::build_model(&source.definition, Device::Cpu)?;
    load_for_eval::<B>(
        &mut model,
        &source.state,
        path,
        "does not fit the model definition",
    )?;
    Ok(model)
}

/// Loads the weights `state` (from the checkpoint at `path`) into `model`,
/// their dtypes checked first, and puts it in eval mode; weights that do not
/// fit are a checkpoint error saying `mismatch`.
pub(crate) fn load_for_eval<B: TrainBackend>(
    model: &mut B::Model,
    state: &StateDict,
    path: &Path,
    mismatch: &str,
) -> Result<()> {
    state
        .check_dtypes(&model.state_dict()?)
        .and_then(|()| model.load_state_dict(state))
        .map_err(|e| kiln_core::Error::checkpoint_caused_by(path, mismatch, e))?;
    model.set_mode(Mode::Eval);
    Ok(())
}
