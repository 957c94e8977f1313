//! Cached decoding through a [`TorchModel`]: one step of generation with a
//! key/value cache.

use kiln_core::{Error, Result};
use tch::{Kind, Tensor};

use super::{cast_float, Node, TorchModel};
use crate::error::torch_error;
use crate::layers::{DecodeStep, Failure, ForwardResult};

impl TorchModel {
    /// Runs `node` on one cached decoding step (eval behaviour).
    fn run_decode(&self, node: &Node, x: &Tensor, step: &mut DecodeStep) -> ForwardResult {
        match node {
            Node::Sequential(children) => {
                let mut out = x.shallow_clone();
                for child in children {
                    out = self.run_decode(child, &out, step)?;
                }
                Ok(out)
            }
            Node::Residual(block) => Ok(x.f_add(&self.run_decode(block, x, step)?)?),
            Node::Parallel(branches) => {
                let mut sum: Option<Tensor> = None;
                for branch in branches {
                    let y = self.run_decode(branch, x, step)?;
                    sum = Some(match sum {
                        Some(s) => s.f_add(&y)?,
                        None => y,
                    });
                }
                sum.ok_or_else(|| Failure::Layer(Error::invalid_argument("branches", "no branch")))
            }
            Node::Leaf { layer, .. } => layer.decode(self, x, step),
            Node::Checkpoint { inner, .. } => self.run_decode(inner, x, step),
            Node::Sharded { .. } => Err(Failure::Layer(Error::unsupported(
                "cached decoding through a sharded unit: generate from the consolidated \
                 weights (a model that is not sharded)",
            ))),
            Node::Script { path, .. } => Err(Failure::Layer(Error::unsupported(format!(
                "cached decoding through the torchscript layer `{path}`: Kiln cannot give it \
                 positions or a key/value cache"
            )))),
        }
    }

    /// Runs the model on one step of cached decoding (`step`), in eval
    /// behaviour with the model's precision; the output is float32.
    pub(crate) fn decode_step(&self, tokens: &Tensor, step: &mut DecodeStep) -> Result<Tensor> {
        self.check_input(tokens)?;
        let mut run = || {
            self.run_decode(&self.root, tokens, step)
                .map_err(|e| match e {
                    Failure::Torch(e) => torch_error("decoding", e),
                    Failure::Layer(e) => e,
                })
        };
        let output = match self.precision.autocast_dtype() {
            None => run()?,
            Some(dtype) => crate::autocast(self.device, dtype, run)??,
        };
        cast_float(&output, Kind::Float, "casting the logits to float32")
    }
}
