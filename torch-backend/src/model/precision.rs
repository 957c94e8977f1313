//! A [`TorchModel`]'s dtype and training precision: converting its tensors,
//! and the casts of its inputs and outputs.

use kiln_core::{model::ParamKind, precision::FloatPrecision, DType, Error, Result};
use tch::{Kind, TchError, Tensor};

use super::TorchModel;
use crate::convert::{is_float_kind, kind_from_dtype};
use crate::error::torch_error;

impl TorchModel {
    /// The dtype of the floating-point parameters and buffers (`float32` when
    /// built; `None` for a model without any), which floating-point inputs must have.
    pub fn dtype(&self) -> Option<DType> {
        self.float_dtype
    }

    /// Converts the floating-point parameters and buffers to `dtype`, like
    /// `model.to(torch.bfloat16)`; integer buffers stay as they are. Inputs
    /// must then have `dtype` too. Build optimizers after converting: they
    /// hold the parameters they update, and keep their state in the
    /// parameters' dtype (pure bf16 training, as PyTorch's with a bf16 model).
    ///
    /// ```no_run
    /// use kiln_core::{model::{Layer, LinearConfig}, DType, Device};
    /// use kiln_torch::TorchModel;
    ///
    /// let mut model = TorchModel::new(&Layer::Linear(LinearConfig::new(64, 10)), Device::Cpu)?;
    /// model.to_dtype(DType::BF16)?;
    /// assert_eq!(model.dtype(), Some(DType::BF16));
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn to_dtype(&mut self, dtype: DType) -> Result<()> {
        if !dtype.is_float() {
            return Err(Error::invalid_argument(
                "dtype",
                format!("a model's parameters convert to a floating-point dtype, not {dtype}"),
            ));
        }
        if self.float_dtype.is_none_or(|current| current == dtype) {
            return Ok(()); // already there: nothing to convert
        }
        let kind = kind_from_dtype(dtype)?;
        self.replace_entries(&format!("converting to {dtype}"), |t| {
            if is_float_kind(t.kind()) {
                t.f_to_kind(kind)
            } else {
                Ok(t.shallow_clone())
            }
        })?;
        if self.float_dtype.is_some() {
            self.float_dtype = Some(dtype);
        }
        Ok(())
    }

    /// Trains and runs at `precision`, like Lightning's `Trainer(precision=...)`
    /// (see [`FloatPrecision`]): converts the floating-point parameters and buffers to
    /// [`FloatPrecision::parameter_dtype`] and sets how [`forward`](kiln_core::module::Module::forward)
    /// computes:
    ///
    /// - `bf16-mixed`: float32 parameters; the layers run under
    ///   [`autocast`](crate::autocast) to bfloat16, and a floating-point output
    ///   comes back in float32 (what Keras recommends for a mixed-precision
    ///   model's last layer), so losses and metrics are computed in float32.
    /// - `bf16-true`: bfloat16 parameters; float inputs are cast to bfloat16 (as
    ///   Lightning's precision plugin does), the output is bfloat16.
    /// - `16-mixed` and `16-true`: the same with float16; `16-mixed` optimizers
    ///   scale the loss ([`TorchOptimizer::set_loss_scaling`](crate::TorchOptimizer::set_loss_scaling)).
    /// - `32-true`: float32 throughout (the default).
    ///
    /// Build optimizers after this: they hold the parameters they update.
    /// Nothing changes on error.
    ///
    /// ```no_run
    /// use kiln_core::{model::{Layer, LinearConfig}, module::Module, precision::FloatPrecision, Device};
    /// use kiln_torch::TorchModel;
    ///
    /// let mut model = TorchModel::new(&Layer::Linear(LinearConfig::new(64, 10)), Device::Cpu)?;
    /// model.set_precision(FloatPrecision::Bf16Mixed)?;
    /// let x = tch::Tensor::randn([8, 64], (tch::Kind::Float, tch::Device::Cpu));
    /// assert_eq!(model.forward(&x)?.kind(), tch::Kind::Float); // computed in bf16
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn set_precision(&mut self, precision: FloatPrecision) -> Result<()> {
        self.to_dtype(precision.parameter_dtype())?;
        self.precision = precision;
        Ok(())
    }

    /// The precision set by [`set_precision`](Self::set_precision) (`32-true`
    /// when built; [`to_dtype`](Self::to_dtype) does not change it).
    pub fn precision(&self) -> FloatPrecision {
        self.precision
    }

    /// Replaces every parameter and buffer with `f` of it (detached, parameters
    /// requiring gradients again); nothing changes unless every one succeeds.
    pub(super) fn replace_entries(
        &mut self,
        what: &str,
        f: impl Fn(&Tensor) -> std::result::Result<Tensor, TchError>,
    ) -> Result<()> {
        if self.has_scripts() {
            return Err(Error::unsupported(format!(
                "{what} a model with a torchscript layer: its tensors live in the \
                 TorchScript module; build the model on the device it trains on, in float32"
            )));
        }
        let mut replaced = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            let t = f(&e.tensor)
                .and_then(|t| t.f_detach())
                .and_then(|t| {
                    if e.kind == ParamKind::Parameter {
                        // A frozen parameter stays frozen.
                        t.f_set_requires_grad(e.tensor.requires_grad())
                    } else {
                        Ok(t)
                    }
                })
                .map_err(|err| torch_error(&format!("{what}: {}", e.name), err))?;
            replaced.push(t);
        }
        for (e, t) in self.entries.iter_mut().zip(replaced) {
            e.tensor = t;
        }
        Ok(())
    }
}

/// `tensor` in `kind` when it is floating-point and of another kind; otherwise
/// itself (integer inputs feed embeddings, and keep their kind).
pub(super) fn cast_float(tensor: &Tensor, kind: Kind, what: &str) -> Result<Tensor> {
    let current = tensor.f_kind().map_err(|e| torch_error(what, e))?;
    if is_float_kind(current) && current != kind {
        tensor.f_to_kind(kind).map_err(|e| torch_error(what, e))
    } else {
        Ok(tensor.shallow_clone())
    }
}
