//! Dynamic loss scaling for `16-mixed` training: `torch.amp.GradScaler`'s
//! algorithm on libtorch's own kernels (`_amp_foreach_non_finite_check_and_unscale_`,
//! `_amp_update_scale_`), with its state on the parameters' device.

use kiln_core::{precision::LossScaling, Error, Result};
use tch::{Kind, Tensor};

use crate::error::torch_error;

use super::fused;

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
