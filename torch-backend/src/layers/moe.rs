//! `SparseMoe` on libtorch: the router's top-k in float32, then each expert
//! on the tokens routed to it only (the assignments sorted by expert, the
//! tokens gathered, each expert's weighted outputs added back at their rows),
//! as `transformers`' MoE blocks compute it.

use kiln_core::model::{GatedActivation, Layer};
use kiln_core::Result;
use tch::{Kind, Tensor};

use super::{Forward, ForwardResult, Lookup, Projection, Tensors};

/// One expert's (or the shared expert's) gated MLP.
#[derive(Debug)]
struct Expert {
    gate: Projection,
    up: Projection,
    down: Projection,
}

impl Expert {
    fn forward(
        &self,
        tensors: &dyn Tensors,
        x: &Tensor,
        activation: GatedActivation,
        train: bool,
    ) -> ForwardResult {
        let gate = self.gate.forward(tensors, x, train)?;
        let gate = match activation {
            GatedActivation::Silu => gate.f_silu()?,
            GatedActivation::Gelu => gate.f_gelu("none")?,
            GatedActivation::GeluTanh => gate.f_gelu("tanh")?,
        };
        let hidden = gate.f_mul(&self.up.forward(tensors, x, train)?)?;
        self.down.forward(tensors, &hidden, train)
    }
}

/// A built [`Layer::SparseMoe`].
#[derive(Debug)]
struct SparseMoe {
    router: Projection,
    experts: Vec<Expert>,
    /// The shared expert and its one-output gate.
    shared: Option<(Expert, Projection)>,
    top_k: i64,
    norm_topk_prob: bool,
    activation: GatedActivation,
}

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    let Layer::SparseMoe(c) = layer else {
        return Ok(None);
    };
    let expert = |prefix: &str| -> Result<Expert> {
        Ok(Expert {
            gate: at.projection(Some(&format!("{prefix}.gate_proj")))?,
            up: at.projection(Some(&format!("{prefix}.up_proj")))?,
            down: at.projection(Some(&format!("{prefix}.down_proj")))?,
        })
    };
    Ok(Some(Box::new(SparseMoe {
        router: at.projection(Some("gate"))?,
        experts: (0..c.num_experts)
            .map(|j| expert(&format!("experts.{j}")))
            .collect::<Result<_>>()?,
        shared: match c.shared_expert_dim {
            Some(_) => Some((
                expert("shared_expert")?,
                at.projection(Some("shared_expert_gate"))?,
            )),
            None => None,
        },
        top_k: c.top_k as i64,
        norm_topk_prob: c.norm_topk_prob,
        activation: c.activation,
    })))
}

impl Forward for SparseMoe {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, train: bool) -> ForwardResult {
        let size = x.size();
        let dim = size.last().copied().unwrap_or(0);
        let tokens = x.f_reshape([-1, dim])?;
        // Qwen2-MoE runs its shared expert first and gates it last.
        let shared = match &self.shared {
            Some((expert, _)) => Some(expert.forward(tensors, &tokens, self.activation, train)?),
            None => None,
        };
        let logits = self.router.forward(tensors, &tokens, train)?;
        let probs = logits.f_softmax(-1, Kind::Float)?;
        let (mut weights, chosen) = probs.f_topk(self.top_k, -1, true, true)?;
        if self.norm_topk_prob {
            weights = weights.f_div(&weights.f_sum_dim_intlist(-1, true, Kind::Float)?)?;
        }
        // In the router's dtype (bfloat16 under autocast), as transformers casts them.
        let weights = weights.f_to_kind(logits.kind())?;
        // Each (token, choice) assignment, sorted by expert (stably: in token
        // order within an expert, as transformers visits them).
        let experts = self.experts.len() as i64;
        let flat = chosen.f_reshape([-1])?;
        let (_, order) = flat.f_sort_stable(true, 0, false)?;
        let counts: Vec<i64> = Vec::<i64>::try_from(&flat.f_bincount(None::<Tensor>, experts)?)?;
        let rows = order.f_floor_divide_scalar(self.top_k)?;
        let flat_weights = weights.f_reshape([-1])?;
        // One expert after another: its tokens gathered, its weighted outputs
        // added into the output (each add rounded to the output's dtype), in
        // transformers' order, which decides bfloat16's rounding of the sums.
        let mut out = tokens.f_zeros_like()?;
        let mut start = 0;
        for (expert, &n) in self.experts.iter().zip(&counts) {
            if n == 0 {
                continue;
            }
            let (at, picks) = (rows.f_narrow(0, start, n)?, order.f_narrow(0, start, n)?);
            let input = tokens.f_index_select(0, &at)?;
            let y = expert.forward(tensors, &input, self.activation, train)?;
            let scale = flat_weights.f_index_select(0, &picks)?.f_unsqueeze(1)?;
            out = out.f_index_add(0, &at, &y.f_mul(&scale)?.f_to_kind(out.kind())?)?;
            start += n;
        }
        if let (Some(y), Some((_, gate))) = (shared, &self.shared) {
            let g = gate.forward(tensors, &tokens, train)?.f_sigmoid()?;
            out = out.f_add(&g.f_mul(&y)?)?;
        }
        Ok(out.f_reshape(size)?)
    }
}
