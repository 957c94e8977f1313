//! Activations as TensorFlow graph ops: `Relu`, `LeakyRelu`, `Gelu`, `Silu`,
//! `Tanh`, `Sigmoid`, `Softmax`, `LogSoftmax`.

use kiln_core::{
    model::{GeluApproximation, Layer},
    Error, Result,
};

use tensorflow::Output;

use super::{Built, Ctx, Val};
use crate::graph::Builder;

/// Builds `layer` on `x` when it is one of this family's; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, _prefix: &str, x: Val) -> Result<Built> {
    let y = match layer {
        Layer::Relu => ctx.elementwise(x, |b, v| b.unary("Relu", v)),
        Layer::LeakyRelu { negative_slope } => {
            let slope = *negative_slope as f32;
            ctx.elementwise(x, move |b, v| b.leaky_relu(v, slope))
        }
        Layer::Gelu { approximate } => match approximate {
            GeluApproximation::Tanh => ctx.elementwise(x, gelu_tanh),
            _ => ctx.elementwise(x, gelu),
        },
        Layer::Silu => ctx.elementwise(x, silu),
        Layer::Tanh => ctx.elementwise(x, |b, v| b.unary("Tanh", v)),
        Layer::Scale { factor } => {
            let factor = *factor as f32;
            ctx.elementwise(x, move |b, v| b.mul_scalar(v, factor))
        }
        Layer::Sigmoid => ctx.elementwise(x, |b, v| b.unary("Sigmoid", v)),
        Layer::Softmax { dim } => ctx.along(x, *dim, |b, v| b.softmax(v)),
        Layer::LogSoftmax { dim } => {
            let rank = x.dims.len() as isize + 1;
            let d = if *dim < 0 { dim + rank } else { *dim };
            if d == 0 {
                return Err(Error::unsupported(
                    "LogSoftmax over the batch dimension on TensorFlow",
                ));
            }
            let classes = x.dims[d as usize - 1];
            ctx.along(x, *dim, move |b, v| {
                crate::loss::log_softmax_last(b, v, rank as usize, classes)
            })
        }
        _ => return Ok(Built::Pass(x)),
    };
    y.map(Built::Out)
}

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub(super) fn gelu_tanh(b: &mut Builder, v: &Output) -> Result<Output> {
    let x3 = b.mul(v, v)?;
    let x3 = b.mul(&x3, v)?;
    let inner = b.mul_scalar(&x3, 0.044715)?;
    let inner = b.add(v, &inner)?;
    let inner = b.mul_scalar(&inner, (2.0f64 / std::f64::consts::PI).sqrt() as f32)?;
    let t = b.unary("Tanh", &inner)?;
    let t = b.add_scalar(&t, 1.0)?;
    let half = b.mul_scalar(v, 0.5)?;
    b.mul(&half, &t)
}

/// `x * 0.5 * (1 + erf(x / sqrt(2)))`.
pub(super) fn gelu(b: &mut Builder, v: &Output) -> Result<Output> {
    let scaled = b.mul_scalar(v, std::f64::consts::FRAC_1_SQRT_2 as f32)?;
    let e = b.unary("Erf", &scaled)?;
    let e = b.add_scalar(&e, 1.0)?;
    let half = b.mul_scalar(v, 0.5)?;
    b.mul(&half, &e)
}

/// `x * sigmoid(x)`.
pub(super) fn silu(b: &mut Builder, v: &Output) -> Result<Output> {
    let s = b.unary("Sigmoid", v)?;
    b.mul(v, &s)
}
