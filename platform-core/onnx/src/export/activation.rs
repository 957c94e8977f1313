//! Activations: `Relu`, `LeakyRelu`, `Gelu` (`approximate` "none" or "tanh"),
//! SiLU as `x * Sigmoid(x)`, `Tanh`, `Sigmoid`, `Softmax`, `LogSoftmax`.

use kiln_core::model::{GeluApproximation, Layer};

use super::graph::attr;
use super::Result;
use super::{wrong_family, Emitter, Value};

impl Emitter<'_> {
    pub(crate) fn activation(&mut self, path: &str, layer: &Layer, x: &Value) -> Result<String> {
        let x = x.name.as_str();
        Ok(match layer {
            Layer::Relu => self.g.op(path, "Relu", &[x], vec![]),
            Layer::LeakyRelu { negative_slope } => self.g.op(
                path,
                "LeakyRelu",
                &[x],
                vec![attr::float("alpha", *negative_slope)],
            ),
            Layer::Gelu { approximate } => {
                let mode = match approximate {
                    GeluApproximation::Tanh => "tanh",
                    _ => "none",
                };
                self.g
                    .op(path, "Gelu", &[x], vec![attr::string("approximate", mode)])
            }
            Layer::Silu => {
                let s = self.g.op(path, "Sigmoid", &[x], vec![]);
                self.g.op(path, "Mul", &[x, &s], vec![])
            }
            Layer::Tanh => self.g.op(path, "Tanh", &[x], vec![]),
            Layer::Scale { factor } => {
                let factor = self.g.scalar(path, "factor", *factor)?;
                self.g.op(path, "Mul", &[x, &factor], vec![])
            }
            Layer::Sigmoid => self.g.op(path, "Sigmoid", &[x], vec![]),
            Layer::Softmax { dim } => {
                self.g
                    .op(path, "Softmax", &[x], vec![attr::int("axis", *dim as i64)])
            }
            Layer::LogSoftmax { dim } => self.g.op(
                path,
                "LogSoftmax",
                &[x],
                vec![attr::int("axis", *dim as i64)],
            ),
            _ => return Err(wrong_family(path, layer)),
        })
    }
}
