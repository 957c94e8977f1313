//! [`Module`] for [`TorchModel`]: forward, modes, parameters and state.

use kiln_core::{
    backend::Mode,
    model::{Layer, ParamKind, RouterLosses},
    module::{Module, WithAuxiliaryLosses},
    precision::FloatPrecision,
    state_dict::StateDict,
    state_tensors::StateTensors,
    Error, Result,
};
use tch::{Kind, Tensor};

use super::{cast_float, TorchModel};
use crate::backend::TorchBackend;
use crate::custom::copy_state;
use crate::error::torch_error;
use crate::layers::Failure;

impl Module<TorchBackend> for TorchModel {
    /// Shapes are checked by libtorch as the layers run; only on failure does the
    /// definition's shape inference run, to name the layer and both shapes
    /// (the training step does no shape bookkeeping of its own).
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let cast;
        let input = match self.precision {
            FloatPrecision::Bf16True => {
                cast = cast_float(input, Kind::BFloat16, "casting the input to bfloat16")?;
                &cast
            }
            FloatPrecision::F16True => {
                cast = cast_float(input, Kind::Half, "casting the input to float16")?;
                &cast
            }
            FloatPrecision::F32 | FloatPrecision::Bf16Mixed | FloatPrecision::F16Mixed => input,
        };
        self.check_input(input)?;
        if let Some((_, log)) = &self.routers {
            log.start();
        }
        let run = || {
            self.run(&self.root, input, self.mode.is_train())
                .map_err(|e| match e {
                    Failure::Torch(e) => self.explain_failure(input, e),
                    Failure::Layer(e) => e,
                })
        };
        match self.precision.autocast_dtype() {
            None => run(),
            Some(dtype) => {
                let output = crate::autocast(self.device, dtype, run)??;
                cast_float(&output, Kind::Float, "casting the output to float32")
            }
        }
    }

    fn mode(&self) -> Mode {
        self.mode
    }

    /// `aux_loss` and `router_z_loss` for a model with mixture-of-experts
    /// layers ([`RouterLosses`]); none otherwise.
    fn auxiliary_loss_names(&self) -> Vec<String> {
        match &self.routers {
            Some(_) => RouterLosses::names(),
            None => Vec::new(),
        }
    }

    /// The router losses of the last forward pass, over every MoE layer's
    /// router logits, added to `loss` with their weights.
    fn add_auxiliary_losses(&self, loss: Tensor) -> Result<WithAuxiliaryLosses<Tensor>> {
        let Some((losses, log)) = &self.routers else {
            return Ok(WithAuxiliaryLosses {
                loss,
                values: Vec::new(),
            });
        };
        let logits = log.take().ok_or_else(|| {
            Error::invalid_argument(
                "model",
                "its router losses come from a forward pass, and none was run since they \
                 were last added",
            )
        })?;
        let (aux, z) = crate::layers::router_losses(&logits, losses)
            .map_err(|e| torch_error("the router losses of the mixtures of experts", e))?;
        let mut total = loss;
        for (coef, term) in [(losses.aux_loss_coef, &aux), (losses.z_loss_coef, &z)] {
            if coef > 0.0 {
                total = term
                    .f_mul_scalar(coef)
                    .and_then(|t| total.f_add(&t))
                    .map_err(|e| torch_error("adding a router loss to the loss", e))?;
            }
        }
        let values = [aux, z]
            .iter()
            .map(|t| t.f_detach())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| torch_error("reading the router losses", e))?;
        Ok(WithAuxiliaryLosses {
            loss: total,
            values,
        })
    }

    fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// Handles sharing storage with the model; never fails.
    fn named_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .entries
            .iter()
            .filter(|e| e.kind == ParamKind::Parameter)
            .map(|e| (e.name.clone(), e.tensor.shallow_clone()))
            .collect())
    }

    /// Handles sharing storage with the model; never fails.
    fn named_buffers(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .entries
            .iter()
            .filter(|e| e.kind == ParamKind::Buffer)
            .map(|e| (e.name.clone(), e.tensor.shallow_clone()))
            .collect())
    }

    /// The batch-norm layers of the definition (a TorchScript layer's own are
    /// not described).
    fn running_stats(&self) -> Result<Vec<kiln_core::module::RunningStats>> {
        Ok(self.spec.running_stats())
    }

    /// Handles to the parameters and buffers: a checkpoint reads them in place.
    fn state_tensors(&self) -> Result<StateTensors<TorchBackend>> {
        StateTensors::from_handles(
            self.named_parameters()?
                .into_iter()
                .chain(self.named_buffers()?),
        )
    }

    /// Strict, like PyTorch's default: every parameter and buffer must be present
    /// with its shape, and no other key; dtypes convert. Nothing changes on error.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let targets: Vec<(String, Tensor)> = self
            .entries
            .iter()
            .map(|e| (e.name.clone(), e.tensor.shallow_clone()))
            .collect();
        copy_state(&targets, state)
    }
}

impl kiln_core::model::Definition for TorchModel {
    fn definition(&self) -> &Layer {
        &self.spec
    }
}
