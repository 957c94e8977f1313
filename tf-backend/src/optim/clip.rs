//! Gradient clipping in the graph, as `torch.nn.utils.clip_grad_*_` does it.

use kiln_core::{optim::GradClip, Result};
use tensorflow::{DataType, Output};

use crate::graph::Builder;

/// Clips `grads` (`None`: a parameter without a gradient) as
/// `torch.nn.utils.clip_grad_value_` or `clip_grad_norm_` would.
pub(crate) fn clip_gradients(
    b: &mut Builder,
    grads: Vec<Option<Output>>,
    clip: &GradClip,
) -> Result<Vec<Option<Output>>> {
    match clip {
        GradClip::Value { clip_value } => grads
            .into_iter()
            .map(|g| {
                g.map(|g| {
                    let hi = b.scalar(*clip_value as f32)?;
                    let lo = b.scalar(-*clip_value as f32)?;
                    let g = b.minimum(&g, &hi)?;
                    b.maximum(&g, &lo)
                })
                .transpose()
            })
            .collect(),
        GradClip::Norm {
            max_norm,
            norm_type,
        } => clip_norm(b, grads, *max_norm, *norm_type),
    }
}

/// Scales all gradients by `min(1, max_norm / (total_norm + 1e-6))`.
fn clip_norm(
    b: &mut Builder,
    grads: Vec<Option<Output>>,
    max_norm: f64,
    norm_type: f64,
) -> Result<Vec<Option<Output>>> {
    let mut norms = Vec::new();
    for g in &grads {
        let Some(g) = g else { continue };
        let flat = b.reshape(g, &[-1], DataType::Float)?;
        let abs = b.unary("Abs", &flat)?;
        let norm = if norm_type.is_infinite() {
            b.reduce("Max", &abs, &[0], false)?
        } else if norm_type == 2.0 {
            let sq = b.mul(&flat, &flat)?;
            b.reduce("Sum", &sq, &[0], false)?
        } else {
            let p = b.scalar(norm_type as f32)?;
            let pw = b.op("Pow", &[&abs, &p], &|nd| {
                nd.set_attr_type("T", DataType::Float)?;
                Ok(())
            })?;
            b.reduce("Sum", &pw, &[0], false)?
        };
        norms.push(norm);
    }
    if norms.is_empty() {
        return Ok(grads);
    }
    let parts = norms
        .iter()
        .map(|n| b.reshape(n, &[1], DataType::Float))
        .collect::<Result<Vec<_>>>()?;
    let all = b.concat(&parts, 0)?;
    let total = if norm_type.is_infinite() {
        b.reduce("Max", &all, &[0], false)?
    } else {
        let sum = b.reduce("Sum", &all, &[0], false)?;
        if norm_type == 2.0 {
            b.unary("Sqrt", &sum)?
        } else {
            let inv = b.scalar((1.0 / norm_type) as f32)?;
            b.op("Pow", &[&sum, &inv], &|nd| {
                nd.set_attr_type("T", DataType::Float)?;
                Ok(())
            })?
        }
    };
    let denom = b.add_scalar(&total, 1e-6)?;
    let max = b.scalar(max_norm as f32)?;
    let coef = b.div(&max, &denom)?;
    let one = b.scalar(1.0)?;
    let coef = b.minimum(&coef, &one)?;
    grads
        .into_iter()
        .map(|g| g.map(|g| b.mul(&g, &coef)).transpose())
        .collect()
}
