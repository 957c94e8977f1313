//! Activation checkpointing on a [`TorchModel`]: the layers that keep only
//! their inputs and run again in the backward pass.

use std::sync::Arc;

use kiln_core::{model::Layer, module::name_matches, Error, Result};

use super::{every_pattern_matches, Node, TorchModel};
use crate::layers::join;

impl TorchModel {
    /// Activation checkpointing (PyTorch's `torch.utils.checkpoint`): each
    /// layer whose path matches one of `patterns` (globs, as for
    /// [`Freeze::freeze`](crate::Freeze::freeze): `"2"`, `"1.*"`; the outermost match wins) keeps
    /// only its input while training; the backward pass runs it again, with
    /// the random generators as they were (dropout draws the same mask) and
    /// under the model's autocast, to compute its gradients. The gradients are
    /// an ordinary run's; the activations inside the parts are not held
    /// between the forward and backward passes, at the cost of a second
    /// forward pass through them. Evaluation and generation run the parts
    /// plainly. Returns the checkpointed paths.
    ///
    /// A pattern that matches no layer, or a part holding a batch norm (its
    /// running statistics would be updated twice) or a torchscript layer, is
    /// an error, and nothing changes.
    ///
    /// ```no_run
    /// use kiln_core::{model::{Layer, LinearConfig}, Device};
    /// use kiln_torch::TorchModel;
    ///
    /// let block = Layer::sequential([LinearConfig::new(64, 64).into(), Layer::Tanh]);
    /// let spec = Layer::sequential([block.clone(), block, LinearConfig::new(64, 10).into()]);
    /// let mut model = TorchModel::new(&spec, Device::Cpu)?;
    /// assert_eq!(model.checkpoint_activations(&["0", "1"])?, ["0", "1"]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn checkpoint_activations(&mut self, patterns: &[&str]) -> Result<Vec<String>> {
        fn refusal(node: &Node) -> Option<String> {
            match node {
                Node::Leaf {
                    batch_norm: true,
                    path,
                    ..
                } => Some(format!(
                    "the batch norm `{path}` (a second forward pass would update its running \
                     statistics twice)"
                )),
                Node::Leaf { .. } => None,
                Node::Script { path, .. } => Some(format!("the torchscript layer `{path}`")),
                Node::Sequential(children) | Node::Parallel(children) => {
                    children.iter().find_map(refusal)
                }
                Node::Residual(block) => refusal(block),
                Node::Checkpoint { inner, .. } | Node::Sharded { inner, .. } => refusal(inner),
            }
        }
        fn wrap(node: &mut Node, path: &str, patterns: &[&str], out: &mut Vec<String>) {
            if matches!(node, Node::Checkpoint { .. }) {
                return;
            }
            // Checkpointing goes inside a sharded unit (its second run then
            // reads the parameters gathered again for the backward pass).
            if let Node::Sharded { inner, .. } = node {
                if let Some(inner) = Arc::get_mut(inner) {
                    wrap(inner, path, patterns, out);
                }
                return;
            }
            if !path.is_empty() && patterns.iter().any(|p| name_matches(p, path)) {
                let inner = std::mem::replace(node, Node::Sequential(Vec::new()));
                *node = Node::Checkpoint {
                    inner: Arc::new(inner),
                    path: path.to_owned(),
                };
                out.push(path.to_owned());
                return;
            }
            match node {
                Node::Sequential(children) | Node::Parallel(children) => {
                    for (i, child) in children.iter_mut().enumerate() {
                        wrap(child, &join(path, &i.to_string()), patterns, out);
                    }
                }
                Node::Residual(block) => wrap(block, &join(path, "block"), patterns, out),
                _ => {}
            }
        }
        // Checked first: nothing changes on a refusal.
        every_pattern_matches(&self.root, patterns, "activation_checkpointing")?;
        // The routers whose losses are part of the training loss: a part run
        // again in the backward pass would record their logits without the
        // graph their gradient needs.
        let routers: Vec<String> = match &self.routers {
            Some((losses, _)) if losses.adds_to_loss() => self
                .spec
                .layers()
                .into_iter()
                .filter(|(_, l)| matches!(l, Layer::SparseMoe(_)))
                .map(|(p, _)| p)
                .collect(),
            _ => Vec::new(),
        };
        fn check(node: &Node, path: &str, patterns: &[&str], routers: &[String]) -> Result<()> {
            if !path.is_empty() && patterns.iter().any(|p| name_matches(p, path)) {
                if let Some(why) = refusal(node) {
                    return Err(Error::unsupported(format!(
                        "activation checkpointing of `{path}`: it holds {why}"
                    )));
                }
                let inside = |r: &&String| *r == path || r.starts_with(&format!("{path}."));
                if let Some(router) = routers.iter().find(inside) {
                    return Err(Error::unsupported(format!(
                        "activation checkpointing of `{path}`: it holds the mixture of experts \
                         `{router}`, whose router losses are part of the training loss \
                         (router_aux_loss_coef or router_z_loss_coef above 0), and their \
                         gradient cannot reach a part that runs again in the backward pass; \
                         checkpoint other layers, or set both weights to 0 (the losses are \
                         still logged)"
                    )));
                }
                return Ok(());
            }
            match node {
                Node::Sequential(children) | Node::Parallel(children) => {
                    children.iter().enumerate().try_for_each(|(i, c)| {
                        check(c, &join(path, &i.to_string()), patterns, routers)
                    })
                }
                Node::Residual(block) => check(block, &join(path, "block"), patterns, routers),
                Node::Sharded { inner, .. } => check(inner, path, patterns, routers),
                _ => Ok(()),
            }
        }
        check(&self.root, "", patterns, &routers)?;
        let mut wrapped = Vec::new();
        wrap(&mut self.root, "", patterns, &mut wrapped);
        self.checkpointed
            .extend(patterns.iter().map(|p| (*p).to_owned()));
        Ok(wrapped)
    }
}
