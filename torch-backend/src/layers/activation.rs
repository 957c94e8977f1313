//! Activations on libtorch: `Relu`, `LeakyRelu`, `Gelu`, `Silu`, `Tanh`,
//! `Sigmoid`, `Softmax`, `LogSoftmax`.

use kiln_core::{
    model::{GeluApproximation, Layer},
    Result,
};
use tch::{Kind, Tensor};

use super::script::{float, ScriptLeaf, Scripted};
use super::{Forward, ForwardResult, Lookup, Tensors};

/// A built activation.
#[derive(Debug)]
enum Activation {
    Relu,
    LeakyRelu { slope: f64 },
    Gelu { approximate: &'static str },
    Silu,
    Tanh,
    Scale { factor: f64 },
    Sigmoid,
    Softmax { dim: i64 },
    LogSoftmax { dim: i64 },
}

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, _at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    let node = match layer {
        Layer::Relu => Activation::Relu,
        Layer::LeakyRelu { negative_slope } => Activation::LeakyRelu {
            slope: *negative_slope,
        },
        Layer::Gelu { approximate } => Activation::Gelu {
            approximate: match approximate {
                GeluApproximation::Tanh => "tanh",
                _ => "none",
            },
        },
        Layer::Silu => Activation::Silu,
        Layer::Tanh => Activation::Tanh,
        Layer::Scale { factor } => Activation::Scale { factor: *factor },
        Layer::Sigmoid => Activation::Sigmoid,
        Layer::Softmax { dim } => Activation::Softmax { dim: *dim as i64 },
        Layer::LogSoftmax { dim } => Activation::LogSoftmax { dim: *dim as i64 },
        _ => return Ok(None),
    };
    Ok(Some(Box::new(node)))
}

/// The TorchScript of `layer` when it is one of this family's.
pub(super) fn script(layer: &Layer, _leaf: &ScriptLeaf<'_>) -> Result<Option<Scripted>> {
    let (class, expr) = match layer {
        Layer::Relu => ("ReLU", "torch.relu(x)".to_owned()),
        // As this family computes it: x > 0 ? x : slope * x.
        Layer::LeakyRelu { negative_slope } => (
            "LeakyReLU",
            format!(
                "torch.where(torch.gt(x, 0.0), x, torch.mul(x, {}))",
                float(*negative_slope)
            ),
        ),
        Layer::Gelu { approximate } => (
            "GELU",
            format!(
                "torch.gelu(x, approximate=\"{}\")",
                match approximate {
                    GeluApproximation::Tanh => "tanh",
                    _ => "none",
                }
            ),
        ),
        Layer::Silu => ("SiLU", "torch.silu(x)".to_owned()),
        Layer::Tanh => ("Tanh", "torch.tanh(x)".to_owned()),
        Layer::Scale { factor } => ("Scale", format!("torch.mul(x, {})", float(*factor))),
        Layer::Sigmoid => ("Sigmoid", "torch.sigmoid(x)".to_owned()),
        Layer::Softmax { dim } => ("Softmax", format!("torch.softmax(x, {dim})")),
        Layer::LogSoftmax { dim } => ("LogSoftmax", format!("torch.log_softmax(x, {dim})")),
        _ => return Ok(None),
    };
    Ok(Some(Scripted::returning(class, expr)))
}

impl Forward for Activation {
    fn forward(&self, _tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        Ok(match self {
            Activation::Relu => x.f_relu(),
            Activation::LeakyRelu { slope } => {
                // PyTorch: x > 0 ? x : slope * x (gradient `slope` at 0).
                let positive = x.f_gt(0.0)?;
                x.f_where_self(&positive, &x.f_mul_scalar(*slope)?)
            }
            Activation::Gelu { approximate } => x.f_gelu(approximate),
            Activation::Silu => x.f_silu(),
            Activation::Tanh => x.f_tanh(),
            Activation::Scale { factor } => x.f_mul_scalar(*factor),
            Activation::Sigmoid => x.f_sigmoid(),
            Activation::Softmax { dim } => x.f_softmax(*dim, None::<Kind>),
            Activation::LogSoftmax { dim } => x.f_log_softmax(*dim, None::<Kind>),
        }?)
    }
}
