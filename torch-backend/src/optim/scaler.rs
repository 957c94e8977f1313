//! Dynamic loss scaling for `16-mixed` training: `torch.amp.GradScaler`'s
//! algorithm on libtorch's own kernels (`_amp_foreach_non_finite_check_and_unscale_`,
//! `_amp_update_scale_`), with its state on the parameters' device.

use kiln_core::{precision::LossScaling, Error, Result};
use tch::{Kind, Tensor};

use crate::error::torch_error;

use super::{fused, TorchOptimizer};

/// Loss scaling of a [`TorchOptimizer`]: `torch.amp.GradScaler`'s `scale` and
/// `unscale_`; its `step` and `update` are the optimizer's `step`.
impl TorchOptimizer {
    /// Turns dynamic loss scaling on (`16-mixed`, `torch.amp.GradScaler`'s
    /// algorithm, see [`LossScaling`]) or off (`None`). With it on, the training
    /// step multiplies the loss by [`scale_loss`](Self::scale_loss) before the
    /// backward pass, and [`step`](kiln_core::optim::Optimizer::step) divides the gradients by the
    /// scale (unless [`unscale_gradients`](Self::unscale_gradients) already did,
    /// for clipping), skips the update when any gradient is inf or NaN, and
    /// updates the scale. The scale lives on the parameters' device (all must
    /// share one) and is part of [`state_dict`](kiln_core::optim::Optimizer::state_dict)
    /// (`grad_scaler.scale`, `grad_scaler.growth_tracker`), so a checkpoint
    /// resumes it exactly. Turning it on again restarts at `init_scale`.
    ///
    /// Deciding to skip needs the flag: with the step counts on the device
    /// ([`set_steps_on_device`](Self::set_steps_on_device), Adam and AdamW) the
    /// fused kernel reads it there; otherwise `step` reads it back, as
    /// `torch.amp.GradScaler` does for optimizers without a fused kernel.
    ///
    /// ```no_run
    /// use kiln_core::{optim::{AdamConfig, Optimizer, OptimizerConfig}, precision::LossScaling};
    /// use kiln_torch::TorchOptimizer;
    ///
    /// let w = tch::Tensor::zeros([3], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    /// let mut opt = TorchOptimizer::new(
    ///     OptimizerConfig::Adam(AdamConfig::new(1e-3)),
    ///     vec![("w".to_owned(), w.shallow_clone())],
    ///     &[],
    /// )?;
    /// opt.set_loss_scaling(Some(LossScaling::default()))?;
    /// let loss = (&w - 1.0).square().sum(tch::Kind::Float);
    /// opt.scale_loss(&loss)?.backward();   // scaler.scale(loss).backward()
    /// opt.step()?;                         // scaler.step(opt); scaler.update()
    /// assert_eq!(opt.loss_scale()?, Some(65536.0));
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn set_loss_scaling(&mut self, scaling: Option<LossScaling>) -> Result<()> {
        self.found_inf = None;
        let Some(config) = scaling else {
            self.scaler = None;
            return Ok(());
        };
        let mut devices = self.params.iter().map(|s| s.tensor.device());
        let device = devices.next().unwrap_or(tch::Device::Cpu);
        if let Some(other) = devices.find(|d| *d != device) {
            return Err(Error::unsupported(format!(
                "loss scaling over parameters on several devices ({device:?} and {other:?}); \
                 keep the model on one device"
            )));
        }
        self.scaler = Some(GradScaler::new(config, device)?);
        Ok(())
    }

    /// The loss scaling settings, when it is on.
    pub fn loss_scaling(&self) -> Option<&LossScaling> {
        self.scaler.as_ref().map(GradScaler::config)
    }

    /// The current loss scale, when scaling is on (one read from the device).
    pub fn loss_scale(&self) -> Result<Option<f64>> {
        self.scaler.as_ref().map(GradScaler::scale).transpose()
    }

    /// `loss` times the current loss scale (on the device, keeping the autograd
    /// graph), or `loss` itself when scaling is off: PyTorch's `scaler.scale(loss)`.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        match &self.scaler {
            Some(scaler) => scaler.scale_loss(loss),
            None => Ok(loss.shallow_clone()),
        }
    }

    /// Divides the gradients by the loss scale in place and checks them for inf
    /// and NaN on the device, once per step (`scaler.unscale_(optimizer)`): call it
    /// before clipping. [`step`](kiln_core::optim::Optimizer::step) calls it when it has not run.
    /// Nothing happens when scaling is off.
    pub fn unscale_gradients(&mut self) -> Result<()> {
        if self.found_inf.is_some() {
            return Ok(());
        }
        let Some(scaler) = &self.scaler else {
            return Ok(());
        };
        let grads = self.gradients()?;
        let defined: Vec<&Tensor> = grads.iter().flatten().collect();
        self.found_inf = Some(tch::no_grad(|| scaler.unscale(&defined))?);
        Ok(())
    }
}

/// The scale and growth tracker of a `GradScaler`, as 0-dim tensors on the
/// parameters' device (float32 and int32, as PyTorch keeps them), so that scaling,
/// unscaling and updating never wait for the device.
#[derive(Debug)]
pub(crate) struct GradScaler {
    config: LossScaling,
    /// The current scale.
    scale: Tensor,
    /// Finite steps in a row since the scale last changed.
    growth_tracker: Tensor,
}

impl GradScaler {
    /// A scaler at `config.init_scale` on `device`.
    pub(crate) fn new(config: LossScaling, device: tch::Device) -> Result<Self> {
        config.validate()?;
        let fail = |e| torch_error("creating the loss scale", e);
        let scale =
            Tensor::f_full([0i64; 0], config.init_scale, (Kind::Float, device)).map_err(fail)?;
        let growth_tracker = Tensor::f_zeros([0i64; 0], (Kind::Int, device)).map_err(fail)?;
        Ok(Self {
            config,
            scale,
            growth_tracker,
        })
    }

    pub(crate) fn config(&self) -> &LossScaling {
        &self.config
    }

    /// `loss * scale` (keeping the autograd graph), computed on the device.
    pub(crate) fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        loss.f_mul(&self.scale.f_to_device(loss.device()).map_err(fail_scale)?)
            .map_err(fail_scale)
    }

    /// GradScaler's `unscale_`: divides every gradient by the scale in place and
    /// returns a 0-dim float32 flag on the device, 1 when any gradient has an inf
    /// or NaN. `grads` must share the scaler's device.
    pub(crate) fn unscale(&self, grads: &[&Tensor]) -> Result<Tensor> {
        let fail = |e| torch_error("unscaling the gradients", e);
        // As GradScaler: the reciprocal in double precision, then float32.
        let inv_scale = self
            .scale
            .f_to_kind(Kind::Double)
            .and_then(|s| s.f_reciprocal())
            .and_then(|s| s.f_to_kind(Kind::Float))
            .map_err(fail)?;
        let found_inf = self.scale.f_zeros_like().map_err(fail)?;
        if !grads.is_empty() {
            fused::non_finite_check_and_unscale(grads, &found_inf, &inv_scale)
                .map_err(|e| Error::backend_with_source("torch", "unscaling the gradients", e))?;
        }
        Ok(found_inf)
    }

    /// GradScaler's `update`: halves (`backoff_factor`) the scale after a step
    /// with `found_inf` set, doubles it (`growth_factor`) after `growth_interval`
    /// finite steps in a row; on the device.
    pub(crate) fn update(&mut self, found_inf: &Tensor) -> Result<()> {
        let c = &self.config;
        let _ = self
            .scale
            .f_internal_amp_update_scale_(
                &self.growth_tracker,
                found_inf,
                c.growth_factor,
                c.backoff_factor,
                i64::from(c.growth_interval),
            )
            .map_err(|e| torch_error("updating the loss scale", e))?;
        Ok(())
    }

    /// The current scale (one read from the device).
    pub(crate) fn scale(&self) -> Result<f64> {
        self.scale.f_double_value(&[]).map_err(fail_scale)
    }

    /// The current growth tracker (one read from the device).
    pub(crate) fn growth_tracker(&self) -> Result<i64> {
        self.growth_tracker
            .f_int64_value(&[])
            .map_err(|e| torch_error("reading the loss scale's growth tracker", e))
    }

    /// Restores a saved scale and growth tracker (in place: a captured step reads
    /// these tensors).
    pub(crate) fn load(&mut self, scale: f64, growth_tracker: i64) -> Result<()> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::invalid_argument(
                "grad_scaler.scale",
                format!("the saved loss scale {scale} is not a positive finite number"),
            ));
        }
        if growth_tracker < 0 {
            return Err(Error::invalid_argument(
                "grad_scaler.growth_tracker",
                format!("the saved growth tracker {growth_tracker} is negative"),
            ));
        }
        let fail = |e| torch_error("loading the loss scale", e);
        let _ = self.scale.f_fill_(scale).map_err(fail)?;
        let _ = self.growth_tracker.f_fill_(growth_tracker).map_err(fail)?;
        Ok(())
    }
}

fn fail_scale(e: tch::TchError) -> Error {
    torch_error("scaling the loss", e)
}
