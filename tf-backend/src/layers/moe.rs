//! `SparseMoe` as TensorFlow graph ops: the router's top-k (`TopKV2`), then
//! each expert on the tokens routed to it only (`Where` picks them,
//! `GatherV2` gathers their rows, `ScatterNd` puts the weighted outputs back
//! at those rows), the experts added in order as `transformers` adds them.
//! Only ops with a C++ gradient are differentiated: the choice itself
//! (`TopKV2`'s indices, `Where`) gets none, and each expert's weight is its
//! probability under a mask of the choices.

use kiln_core::model::{GatedActivation, Layer, RouterLosses, SparseMoeConfig};
use kiln_core::Result;
use tensorflow::{DataType, Output};

use super::activation::{gelu, gelu_tanh, silu};
use super::{join, Built, Ctx, Val};
use crate::graph::Builder;

/// One MoE layer's part of the router losses ([`RouterLosses`]): how many of
/// its rows chose each expert (`[experts]`, no gradient), its router
/// probabilities summed over the rows (`[experts]`), and its rows'
/// `logsumexp(logits)^2` summed (a scalar).
#[derive(Clone, Debug)]
pub(crate) struct RouterTerms {
    counts: Output,
    probs: Output,
    z: Output,
}

/// The router losses over every MoE layer's `terms`: `aux_loss` and
/// `router_z_loss` (float scalars, unweighted: the metrics), and their sum
/// times their weights (`None` when neither has a weight: nothing is added
/// to the loss). The rows are counted by the choices (`top_k` per row).
pub(crate) fn router_losses(
    b: &mut Builder,
    terms: &[RouterTerms],
    losses: &RouterLosses,
) -> Result<([Output; 2], Option<Output>)> {
    let mut sums: Option<(Output, Output, Output)> = None;
    for t in terms {
        sums = Some(match sums {
            None => (t.counts.clone(), t.probs.clone(), t.z.clone()),
            Some((c, p, z)) => (
                b.add(&c, &t.counts)?,
                b.add(&p, &t.probs)?,
                b.add(&z, &t.z)?,
            ),
        });
    }
    let Some((counts, probs, z)) = sums else {
        let zero = b.scalar(0.0)?;
        return Ok(([zero.clone(), zero], None));
    };
    let chosen = b.reduce("Sum", &counts, &[0], false)?;
    let rows = b.mul_scalar(&chosen, 1.0 / losses.top_k as f32)?;
    let share = b.div(&counts, &rows)?;
    let mean_p = b.div(&probs, &rows)?;
    let product = b.mul(&share, &mean_p)?;
    let aux = b.reduce("Sum", &product, &[0], false)?;
    let aux = b.mul_scalar(&aux, losses.num_experts as f32)?;
    let z = b.div(&z, &rows)?;
    let mut total: Option<Output> = None;
    for (coef, term) in [(losses.aux_loss_coef, &aux), (losses.z_loss_coef, &z)] {
        if coef > 0.0 {
            let weighted = b.mul_scalar(term, coef as f32)?;
            total = Some(match total {
                None => weighted,
                Some(t) => b.add(&t, &weighted)?,
            });
        }
    }
    Ok(([aux, z], total))
}

/// Builds `layer` on `x` when it is a `SparseMoe`; hands `x` back otherwise.
pub(super) fn build(ctx: &mut Ctx<'_>, layer: &Layer, prefix: &str, x: Val) -> Result<Built> {
    match layer {
        Layer::SparseMoe(c) => ctx.sparse_moe(x, prefix, c).map(Built::Out),
        _ => Ok(Built::Pass(x)),
    }
}

impl Ctx<'_> {
    /// This layer's [`RouterTerms`] from its `[rows, experts]` logits, their
    /// softmax and the mask of each row's choices. In a padded batch only
    /// the tokens count, as in `transformers`' `load_balancing_loss_func`
    /// given `attention_mask`.
    fn record_router(&mut self, logits: &Output, probs: &Output, mask: &Output) -> Result<()> {
        // [rows, 1]: each row's weight, 1 on a token and 0 on padding.
        let weight = match self.padding.clone() {
            Some(p) => Some(self.b.reshape(&p.mask, &[-1, 1], DataType::Float)?),
            None => None,
        };
        let (mask, probs) = match &weight {
            Some(w) => (self.b.mul(mask, w)?, self.b.mul(probs, w)?),
            None => (mask.clone(), probs.clone()),
        };
        let counts = self.b.reduce("Sum", &mask, &[0], false)?;
        let probs = self.b.reduce("Sum", &probs, &[0], false)?;
        let top = self.b.reduce("Max", logits, &[-1], true)?;
        let top = self.b.stop_gradient(&top)?;
        let shifted = self.b.sub(logits, &top)?;
        let exp = self.b.unary("Exp", &shifted)?;
        let total = self.b.reduce("Sum", &exp, &[-1], true)?;
        let log = self.b.unary("Log", &total)?;
        let lse = self.b.add(&log, &top)?;
        let mut squared = self.b.mul(&lse, &lse)?;
        if let Some(w) = &weight {
            squared = self.b.mul(&squared, w)?;
        }
        let z = self.b.reduce("Sum", &squared, &[0, 1], false)?;
        self.routers.push(RouterTerms { counts, probs, z });
        Ok(())
    }

    /// One gated MLP under `prefix` on token rows `x` (`[n, dim]`, dims `[dim]`).
    fn expert(
        &mut self,
        x: &Val,
        prefix: &str,
        hidden: usize,
        dim: usize,
        activation: GatedActivation,
    ) -> Result<Output> {
        let p = |name: &str| join(prefix, name);
        let gate = self.linear(
            x.clone(),
            &p("gate_proj.weight"),
            &p("(no bias)"),
            hidden as i64,
        )?;
        let up = self.linear(
            x.clone(),
            &p("up_proj.weight"),
            &p("(no bias)"),
            hidden as i64,
        )?;
        let act = match activation {
            GatedActivation::Silu => silu(self.b, &gate.out)?,
            GatedActivation::Gelu => gelu(self.b, &gate.out)?,
            GatedActivation::GeluTanh => gelu_tanh(self.b, &gate.out)?,
        };
        let h = self.b.mul(&act, &up.out)?;
        let down = self.linear(
            Val { out: h, ..up },
            &p("down_proj.weight"),
            &p("(no bias)"),
            dim as i64,
        )?;
        Ok(down.out)
    }

    fn sparse_moe(&mut self, x: Val, prefix: &str, c: &SparseMoeConfig) -> Result<Val> {
        let p = |name: &str| join(prefix, name);
        let x = self.nchw(x)?;
        let d = c.dim;
        let shape = self.b.shape_of(&x.out, DataType::Float)?;
        let flat = self.b.reshape(&x.out, &[-1, d as i32], DataType::Float)?;
        let tokens = Val {
            out: flat.clone(),
            dims: vec![d as i64],
            nhwc: false,
        };
        let logits = self.linear(
            tokens.clone(),
            &p("gate.weight"),
            &p("(no bias)"),
            c.num_experts as i64,
        )?;
        let probs = self.b.softmax(&logits.out)?;
        let k = self.b.constant(&[c.top_k as i32], &[])?;
        let top = self.b.op_with("TopKV2", &[&probs, &k], &[], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_bool("sorted", true)?;
            Ok(())
        })?;
        // The chosen experts' probabilities, by a mask of the choices (no
        // gradient through the choice: TensorFlow's C++ registry has none for
        // TopKV2's values), renormalised where the config says.
        let chosen = Output {
            operation: top,
            index: 1,
        };
        let depth = self.b.constant(&[c.num_experts as i32], &[])?;
        let on = self.b.scalar(1.0)?;
        let off = self.b.scalar(0.0)?;
        let one_hot = self.b.op("OneHot", &[&chosen, &depth, &on, &off], &|nd| {
            nd.set_attr_type("T", DataType::Float)?;
            nd.set_attr_type("TI", DataType::Int32)?;
            nd.set_attr_int("axis", -1)?;
            Ok(())
        })?;
        let mask = self.b.reduce("Sum", &one_hot, &[1], false)?;
        let mask = self.b.stop_gradient(&mask)?;
        self.record_router(&logits.out, &probs, &mask)?;
        let mut weights = self.b.mul(&probs, &mask)?;
        if c.norm_topk_prob {
            let total = self.b.reduce("Sum", &weights, &[-1], true)?;
            weights = self.b.div(&weights, &total)?;
        }
        // The tokens' shape, `[rows, dim]`, as the scatter's int64 shape.
        let flat_shape = self.b.shape_of(&flat, DataType::Float)?;
        let flat_shape = self.b.cast(&flat_shape, DataType::Int32, DataType::Int64)?;
        let mut out: Option<Output> = None;
        for j in 0..c.num_experts {
            let expert = self.b.constant(&[j as i32], &[])?;
            let hit = self.b.op("Equal", &[&chosen, &expert], &|nd| {
                nd.set_attr_type("T", DataType::Int32)?;
                Ok(())
            })?;
            // [n, 2] int64: (token, choice) of each assignment to expert j.
            let at = self.b.op("Where", &[&hit], &|nd| {
                nd.set_attr_type("T", DataType::Bool)?;
                Ok(())
            })?;
            let token_col = self.b.slice_of(&at, &[0, 0], &[-1, 1], DataType::Int64)?;
            let token_ids = self.b.reshape(&token_col, &[-1], DataType::Int64)?;
            let column = self.b.slice(&weights, &[0, j as i32], &[-1, 1])?;
            let column = self.b.reshape(&column, &[-1], DataType::Float)?;
            let scale = self.b.gather(&column, &token_ids, DataType::Int64)?;
            let picked = self.b.gather(&flat, &token_ids, DataType::Int64)?;
            let picked = Val {
                out: picked,
                dims: vec![d as i64],
                nhwc: false,
            };
            let y = self.expert(
                &picked,
                &p(&format!("experts.{j}")),
                c.hidden_dim,
                d,
                c.activation,
            )?;
            let scale = self.b.reshape(&scale, &[-1, 1], DataType::Float)?;
            let y = self.b.mul(&y, &scale)?;
            let added = self
                .b
                .op("ScatterNd", &[&token_col, &y, &flat_shape], &|nd| {
                    nd.set_attr_type("T", DataType::Float)?;
                    nd.set_attr_type("Tindices", DataType::Int64)?;
                    Ok(())
                })?;
            out = Some(match out {
                None => added,
                Some(sum) => self.b.add(&sum, &added)?,
            });
        }
        let mut out = match out {
            Some(out) => out,
            None => self.b.unary("ZerosLike", &flat)?,
        };
        if let Some(s) = c.shared_expert_dim {
            let y = self.expert(&tokens, &p("shared_expert"), s, d, c.activation)?;
            let g = self.linear(
                tokens.clone(),
                &p("shared_expert_gate.weight"),
                &p("(no bias)"),
                1,
            )?;
            let g = self.b.unary("Sigmoid", &g.out)?;
            let shared = self.b.mul(&g, &y)?;
            out = self.b.add(&out, &shared)?;
        }
        let out = self.b.reshape_to(&out, &shape, DataType::Float)?;
        Ok(Val { out, ..x })
    }
}
