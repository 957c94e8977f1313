//! Full sharding's units on a model: [`TorchModel::plan_shard_units`] and
//! [`TorchModel::shard_units`], and what a sharded part runs with.

use std::sync::Arc;

use kiln_core::{model::ParamKind, module::name_matches, Error, Result};
use tch::Tensor;

use super::{every_pattern_matches, Entry, Node, TorchModel};
use crate::layers::join;
use crate::sharded_unit::UnitCollectives;

/// What a sharded part needs to run: which of the model's tensors it gathers,
/// and from where.
pub(super) struct UnitParams {
    /// The unit's parameters, as indices of the model's entries, in the
    /// order of [`ShardedUnit::names`].
    pub(super) indices: Vec<usize>,
    pub(super) collectives: Arc<dyn UnitCollectives>,
    pub(super) reshard_after_forward: bool,
}

impl std::fmt::Debug for UnitParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitParams")
            .field("indices", &self.indices)
            .field("reshard_after_forward", &self.reshard_after_forward)
            .finish_non_exhaustive()
    }
}

/// One unit of full sharding, as [`TorchModel::plan_shard_units`] plans it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedUnit {
    /// The unit's layer path; `""` for the root unit, which holds the
    /// parameters no other unit holds.
    pub path: String,
    /// The state-dict names of the parameters the unit gathers (frozen ones
    /// included: they take memory too), in the order its [`UnitCollectives`]
    /// gathers and reduces them.
    pub names: Vec<String>,
}

/// The model's tensors with a sharded unit's parameters replaced by the
/// gathered ones.
pub(super) struct Overlay<'a> {
    pub(super) base: &'a dyn crate::layers::Tensors,
    pub(super) indices: &'a [usize],
    pub(super) full: &'a [Tensor],
}

impl crate::layers::Tensors for Overlay<'_> {
    fn tensor(&self, index: usize) -> &Tensor {
        match self.indices.iter().position(|&i| i == index) {
            Some(at) => &self.full[at],
            None => self.base.tensor(index),
        }
    }
    fn count(&self) -> usize {
        self.base.count()
    }
    fn router_log(&self) -> Option<&Arc<crate::layers::RouterLog>> {
        self.base.router_log()
    }
}

/// Whether `node` is or holds a sharded unit.
pub(super) fn has_sharded(node: &Node) -> bool {
    match node {
        Node::Sharded { .. } => true,
        Node::Sequential(children) | Node::Parallel(children) => children.iter().any(has_sharded),
        Node::Residual(block) => has_sharded(block),
        Node::Checkpoint { inner, .. } => has_sharded(inner),
        Node::Leaf { .. } | Node::Script { .. } => false,
    }
}

impl TorchModel {
    /// Plans full sharding's units, as PyTorch's `fully_shard` on each
    /// matching layer and then on the root: each layer whose path matches one
    /// of `patterns` (globs, as for [`checkpoint_activations`](Self::checkpoint_activations);
    /// the outermost match wins) is a unit of the parameters under it, and the
    /// root unit (path `""`) holds the rest, when there are any. Nothing
    /// changes: [`shard_units`](Self::shard_units) applies the plan.
    ///
    /// A pattern that matches no layer, a model with a torchscript layer
    /// (which reads its own tensors), a model already sharded, and tied
    /// parameters that would fall in two units are errors.
    pub fn plan_shard_units(&self, patterns: &[&str]) -> Result<Vec<ShardedUnit>> {
        if self.has_scripts() {
            return Err(Error::unsupported(
                "full sharding of a model with a torchscript layer (it reads its own tensors)",
            ));
        }
        if has_sharded(&self.root) {
            return Err(Error::invalid_argument(
                "units",
                "the model is sharded already",
            ));
        }
        every_pattern_matches(&self.root, patterns, "units")?;
        fn matched(node: &Node, path: &str, patterns: &[&str], out: &mut Vec<String>) {
            if !path.is_empty() && patterns.iter().any(|p| name_matches(p, path)) {
                out.push(path.to_owned());
                return;
            }
            match node {
                Node::Sequential(children) | Node::Parallel(children) => {
                    for (i, child) in children.iter().enumerate() {
                        matched(child, &join(path, &i.to_string()), patterns, out);
                    }
                }
                Node::Residual(block) => matched(block, &join(path, "block"), patterns, out),
                Node::Checkpoint { inner, .. } | Node::Sharded { inner, .. } => {
                    matched(inner, path, patterns, out)
                }
                Node::Leaf { .. } | Node::Script { .. } => {}
            }
        }
        let mut paths = Vec::new();
        matched(&self.root, "", patterns, &mut paths);
        let params: Vec<(usize, &Entry)> = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.kind == ParamKind::Parameter)
            .collect();
        let unit_of = |name: &str| {
            paths
                .iter()
                .position(|p| name.starts_with(&format!("{p}.")))
        };
        // Tied parameters (one tensor under two names) must share a unit.
        for (a, (_, ea)) in params.iter().enumerate() {
            for (_, eb) in &params[a + 1..] {
                if ea.tensor.data_ptr() == eb.tensor.data_ptr()
                    && unit_of(&ea.name) != unit_of(&eb.name)
                {
                    return Err(Error::unsupported(format!(
                        "full sharding with the tied parameters `{}` and `{}` in two units: \
                         choose units that hold both (or shard their common parent)",
                        ea.name, eb.name
                    )));
                }
            }
        }
        // A layer that reads another's weight (a tied head) must be in that
        // weight's unit: a unit's backward pass computes gradients for its own
        // parameters only.
        fn readers(node: &Node, path: &str, out: &mut Vec<(String, usize)>) {
            match node {
                Node::Leaf { layer, .. } => out.extend(
                    layer
                        .shared_tensors()
                        .into_iter()
                        .map(|i| (path.to_owned(), i)),
                ),
                Node::Sequential(children) | Node::Parallel(children) => {
                    for (i, child) in children.iter().enumerate() {
                        readers(child, &join(path, &i.to_string()), out);
                    }
                }
                Node::Residual(block) => readers(block, &join(path, "block"), out),
                Node::Checkpoint { inner, .. } | Node::Sharded { inner, .. } => {
                    readers(inner, path, out)
                }
                Node::Script { .. } => {}
            }
        }
        let mut shared = Vec::new();
        readers(&self.root, "", &mut shared);
        for (layer, index) in shared {
            let weight = &self.entries[index].name;
            let layer_unit = paths
                .iter()
                .position(|p| layer == *p || layer.starts_with(&format!("{p}.")));
            if layer_unit != unit_of(weight) {
                return Err(Error::unsupported(format!(
                    "full sharding with the layer `{layer}` in another unit than the weight \
                     `{weight}` it reads (tied weights): choose units that hold both (or \
                     shard their common parent)"
                )));
            }
        }
        let mut units: Vec<ShardedUnit> = paths
            .iter()
            .map(|p| ShardedUnit {
                path: p.clone(),
                names: Vec::new(),
            })
            .collect();
        let mut rest = Vec::new();
        for (_, e) in &params {
            match unit_of(&e.name) {
                Some(u) => units[u].names.push(e.name.clone()),
                None => rest.push(e.name.clone()),
            }
        }
        if !rest.is_empty() {
            units.push(ShardedUnit {
                path: String::new(),
                names: rest,
            });
        }
        Ok(units)
    }

    /// Applies a plan of [`plan_shard_units`](Self::plan_shard_units): from
    /// now on each unit gathers its parameters through its `collectives` (one
    /// per unit, in the plan's order) for its forward pass, frees them after
    /// it when `reshard_after_forward` (the root unit keeps them until its
    /// backward pass, as `fully_shard`'s root does), gathers them again for its
    /// backward pass, hands their gradients to the collectives and frees them
    /// (see [`crate::sharded_unit`]). What the model's own parameter tensors
    /// hold in between is the strategy's business (its shards).
    ///
    /// A plan that is not this model's, or a count of collectives that is not
    /// the plan's, is an error, and nothing changes.
    pub fn shard_units(
        &mut self,
        plan: &[ShardedUnit],
        collectives: Vec<Arc<dyn UnitCollectives>>,
        reshard_after_forward: bool,
    ) -> Result<()> {
        let patterns: Vec<&str> = plan
            .iter()
            .filter(|u| !u.path.is_empty())
            .map(|u| u.path.as_str())
            .collect();
        if let Some((losses, _)) = self.routers.as_ref().filter(|(l, _)| l.adds_to_loss()) {
            // A unit runs its part inside one autograd node, whose only
            // inputs are the part's input and parameters.
            return Err(Error::unsupported(format!(
                "sharding the parameters of a model whose mixture-of-experts router losses \
                 are part of the training loss (router_aux_loss_coef = {}, router_z_loss_coef \
                 = {}): their gradient cannot reach the routers inside a sharded unit; set \
                 both to 0 (the losses are still logged) or train with ddp",
                losses.aux_loss_coef, losses.z_loss_coef
            )));
        }
        if self.plan_shard_units(&patterns)? != plan {
            return Err(Error::invalid_argument(
                "units",
                "the plan is not this model's (plan it with plan_shard_units)",
            ));
        }
        if collectives.len() != plan.len() {
            return Err(Error::invalid_argument(
                "units",
                format!("{} collectives for {} units", collectives.len(), plan.len()),
            ));
        }
        fn wrap_at(node: &mut Node, path: &str, at: &str, unit: &Arc<UnitParams>) {
            if path == at {
                let inner = std::mem::replace(node, Node::Sequential(Vec::new()));
                *node = Node::Sharded {
                    inner: Arc::new(inner),
                    unit: Arc::clone(unit),
                };
                return;
            }
            match node {
                Node::Sequential(children) | Node::Parallel(children) => {
                    for (i, child) in children.iter_mut().enumerate() {
                        wrap_at(child, &join(path, &i.to_string()), at, unit);
                    }
                }
                Node::Residual(block) => wrap_at(block, &join(path, "block"), at, unit),
                Node::Checkpoint { inner, .. } | Node::Sharded { inner, .. } => {
                    if let Some(inner) = Arc::get_mut(inner) {
                        wrap_at(inner, path, at, unit);
                    }
                }
                Node::Leaf { .. } | Node::Script { .. } => {}
            }
        }
        // Every unit's entries found before the tree changes.
        let indices = plan
            .iter()
            .map(|unit| {
                unit.names
                    .iter()
                    .map(|n| {
                        self.entries
                            .iter()
                            .position(|e| &e.name == n)
                            .ok_or_else(|| {
                                Error::invalid_argument("units", format!("no parameter `{n}`"))
                            })
                    })
                    .collect::<Result<Vec<usize>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        for ((unit, collectives), indices) in plan.iter().zip(collectives).zip(indices) {
            let root = unit.path.is_empty();
            let params = Arc::new(UnitParams {
                indices,
                collectives,
                reshard_after_forward: reshard_after_forward && !root,
            });
            if root {
                let inner = std::mem::replace(&mut self.root, Node::Sequential(Vec::new()));
                self.root = Node::Sharded {
                    inner: Arc::new(inner),
                    unit: params,
                };
            } else {
                wrap_at(&mut self.root, "", &unit.path, &params);
            }
        }
        Ok(())
    }
}
