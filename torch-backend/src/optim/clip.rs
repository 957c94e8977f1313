//! Gradient clipping (`torch.nn.utils.clip_grad_norm_`, `clip_grad_value_`).

use kiln_core::{Error, Result};
use tch::Tensor;

use crate::error::torch_error;

/// Scales all gradients so that their joint `norm_type`-norm is at most
/// `max_norm`, and returns the norm before clipping (as PyTorch does).
/// `norm_type` may be `f64::INFINITY`.
pub fn clip_grad_norm(params: &[&Tensor], max_norm: f64, norm_type: f64) -> Result<f64> {
    clip_grad_norm_with(params, max_norm, norm_type, Ok)
}

/// [`clip_grad_norm`] where `global` turns the norm of these gradients into
/// the norm to clip by: the norm over every rank's shard of the gradients
/// under a strategy that shards them. `global` is called even when no
/// parameter here has a gradient (with 0), since it may be a collective.
pub fn clip_grad_norm_with(
    params: &[&Tensor],
    max_norm: f64,
    norm_type: f64,
    global: impl FnOnce(f64) -> Result<f64>,
) -> Result<f64> {
    let fail = |e| torch_error("clip_grad_norm", e);
    let (grads, local) = match joint_norm(params, norm_type)? {
        Some((grads, total)) => (grads, total.f_double_value(&[]).map_err(fail)?),
        None => (Vec::new(), 0.0),
    };
    let total = global(local)?;
    if grads.is_empty() {
        return Ok(total);
    }
    let coef = max_norm / (total + 1e-6);
    if coef < 1.0 {
        tch::no_grad(|| {
            for grad in &grads {
                let mut grad = grad.shallow_clone();
                let _ = grad.f_mul_scalar_(coef).map_err(fail)?;
            }
            Ok::<_, Error>(())
        })?;
    }
    Ok(total)
}

/// [`clip_grad_norm`] without reading anything back to the host, as PyTorch's
/// `clip_grad_norm_` does: every gradient is multiplied on the device by
/// `min(1, max_norm / (norm + 1e-6))`, and the norm is returned as a 0-dim tensor
/// there (`None` when no parameter has a gradient). A step that clips this way can be
/// captured in a CUDA graph.
pub fn clip_grad_norm_on_device(
    params: &[&Tensor],
    max_norm: f64,
    norm_type: f64,
) -> Result<Option<Tensor>> {
    let Some((grads, total)) = joint_norm(params, norm_type)? else {
        return Ok(None);
    };
    let fail = |e| torch_error("clip_grad_norm", e);
    tch::no_grad(|| {
        let coef = total
            .f_add_scalar(1e-6)
            .and_then(|t| t.f_reciprocal())
            .and_then(|t| t.f_mul_scalar(max_norm))
            .and_then(|t| t.f_clamp_max(1.0))
            .map_err(fail)?;
        for grad in &grads {
            let mut grad = grad.shallow_clone();
            let _ = grad.f_mul_(&coef).map_err(fail)?;
        }
        Ok(Some(total))
    })
}

/// The defined gradients and their joint `norm_type`-norm (f64, on their device).
fn joint_norm(params: &[&Tensor], norm_type: f64) -> Result<Option<(Vec<Tensor>, Tensor)>> {
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(Error::invalid_argument(
            "norm_type",
            format!("must be > 0, got {norm_type}"),
        ));
    }
    let grads = defined_grads(params)?;
    if grads.is_empty() {
        return Ok(None);
    }
    let fail = |e| torch_error("clip_grad_norm", e);
    tch::no_grad(|| {
        let norms = grads
            .iter()
            .map(|g| {
                g.f_norm_scalaropt_dtype(norm_type, tch::Kind::Double)
                    .map_err(fail)
            })
            .collect::<Result<Vec<_>>>()?;
        let stacked = Tensor::f_stack(&norms, 0).map_err(fail)?;
        let total = if norm_type.is_infinite() {
            stacked.f_max().map_err(fail)?
        } else {
            stacked
                .f_norm_scalaropt_dtype(norm_type, tch::Kind::Double)
                .map_err(fail)?
        };
        Ok(Some((grads, total)))
    })
}

/// Clamps every gradient element to `[-clip_value, clip_value]`.
pub fn clip_grad_value(params: &[&Tensor], clip_value: f64) -> Result<()> {
    if clip_value.is_nan() || clip_value < 0.0 {
        return Err(Error::invalid_argument(
            "clip_value",
            format!("must be >= 0, got {clip_value}"),
        ));
    }
    for grad in defined_grads(params)? {
        let mut grad = grad;
        let _ = tch::no_grad(|| grad.f_clamp_(-clip_value, clip_value))
            .map_err(|e| torch_error("clip_grad_value", e))?;
    }
    Ok(())
}

fn defined_grads(params: &[&Tensor]) -> Result<Vec<Tensor>> {
    let mut out = Vec::with_capacity(params.len());
    for p in params {
        let grad = p
            .f_grad()
            .map_err(|e| torch_error("reading a gradient", e))?;
        if grad.defined() {
            out.push(grad);
        }
    }
    Ok(out)
}
