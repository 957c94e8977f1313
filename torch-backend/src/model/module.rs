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
use crate::layers::{Failure, Pass};

impl Module<TorchBackend> for TorchModel {
    /// Shapes are checked by libtorch as the layers run; only on failure does the
    /// definition's shape inference run, to name the layer and both shapes
    /// (the training step does no shape bookkeeping of its own).
    ///
    /// A model that [takes an attention mask](Layer::takes_attention_mask)
    /// reads a `[batch, 2, seq]` int64 input as its token ids and their
    /// attention mask ([`kiln_core::model::stack_attention_mask`]).
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        if input.dim() == 3 && input.size()[1] == 2 && self.spec.takes_attention_mask() {
            let ids = input
                .f_select(1, 0)
                .map_err(|e| torch_error("the token ids", e))?;
            let mask = input
                .f_select(1, 1)
                .map_err(|e| torch_error("the attention mask", e))?;
            return self.forward_masked(&ids, Some(&mask));
        }
        self.forward_masked(input, None)
    }

    /// `[input_ids]`, or `[input_ids, attention_mask]` (both `[batch, seq]`,
    /// the mask 1 on the tokens and 0 on the padding) for a model that
    /// [takes an attention mask](Layer::takes_attention_mask).
    fn forward_many(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        match inputs {
            [input] => Ok(vec![self.forward(input)?]),
            [ids, mask] if self.spec.takes_attention_mask() => {
                if mask.size() != ids.size() {
                    return Err(Error::ShapeMismatch {
                        context: "the attention mask (one entry per token id)".to_owned(),
                        expected: format!("{:?}", ids.size()),
                        actual: format!("{:?}", mask.size()),
                    });
                }
                Ok(vec![self.forward_masked(ids, Some(mask))?])
            }
            _ => Err(Error::invalid_argument(
                "inputs",
                format!(
                    "this model takes [input_ids]{}, got {} inputs",
                    if self.spec.takes_attention_mask() {
                        " or [input_ids, attention_mask]"
                    } else {
                        ""
                    },
                    inputs.len()
                ),
            )),
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
        let record = log.take().ok_or_else(|| {
            Error::invalid_argument(
                "model",
                "its router losses come from a forward pass, and none was run since they \
                 were last added",
            )
        })?;
        let (aux, z) = crate::layers::router_losses(&record, losses)
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

impl TorchModel {
    /// The forward pass over token ids `input` with their attention `mask`
    /// (`None`: no padding).
    pub(crate) fn forward_masked(&self, input: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
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
        let pass = Pass {
            train: self.mode.is_train(),
            padding: match mask {
                Some(m) => Some(
                    m.f_ne(0)
                        .map_err(|e| torch_error("the attention mask", e))?,
                ),
                None => None,
            },
        };
        if let Some((_, log)) = &self.routers {
            log.start(pass.padding.as_ref())
                .map_err(|e| torch_error("the attention mask of the router losses", e))?;
        }
        let run = || {
            self.run(&self.root, input, &pass).map_err(|e| match e {
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
}
