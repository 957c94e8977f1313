//! Frozen batch norm: the batch norms whose parameters are all frozen stay
//! in eval mode while the model trains.

use std::sync::Arc;

use kiln_core::{module::Module, Result};
use tch::Tensor;

use super::{lock_script, Node, TorchModel};
use crate::freeze::{all_frozen, Freeze};
use crate::layers::join;

/// Pins the frozen batch norms under `node` to eval mode; returns their names.
fn pin_frozen_batch_norm(
    node: &mut Node,
    params: &[(String, Tensor)],
    kept: &mut Vec<String>,
) -> Result<()> {
    match node {
        Node::Sequential(children) | Node::Parallel(children) => {
            for child in children {
                pin_frozen_batch_norm(child, params, kept)?;
            }
        }
        Node::Residual(block) => pin_frozen_batch_norm(block, params, kept)?,
        // Holds no batch norm and no torchscript layer (refused when wrapped).
        Node::Checkpoint { .. } => {}
        Node::Sharded { inner, .. } => {
            if let Some(inner) = Arc::get_mut(inner) {
                pin_frozen_batch_norm(inner, params, kept)?;
            }
        }
        Node::Leaf {
            path,
            batch_norm,
            eval,
            ..
        } => {
            if *batch_norm && all_frozen(params, path) {
                *eval = true;
                kept.push(path.clone());
            }
        }
        Node::Script { module, path } => {
            let mut module = lock_script(module)?;
            kept.extend(
                module
                    .keep_frozen_batch_norm_in_eval()?
                    .into_iter()
                    .map(|n| join(path, &n)),
            );
        }
    }
    Ok(())
}

impl Freeze for TorchModel {
    /// Kiln's `BatchNorm1d`/`2d` layers whose weight and bias are frozen, and
    /// the frozen batch norms inside TorchScript layers.
    fn keep_frozen_batch_norm_in_eval(&mut self) -> Result<Vec<String>> {
        let params = self.named_parameters()?;
        let mut kept = Vec::new();
        pin_frozen_batch_norm(&mut self.root, &params, &mut kept)?;
        Ok(kept)
    }
}
