//! `SparseMoe` on libtorch: the router's top-k in float32, then each expert
//! on the tokens routed to it only (the assignments sorted by expert, the
//! tokens gathered, each expert's weighted outputs added back at their rows),
//! as `transformers`' MoE blocks compute it.

use kiln_core::model::{GatedActivation, Layer, RouterLosses};
use kiln_core::Result;
use tch::{Kind, Tensor};

use super::{DecodeStep, Forward, ForwardResult, Lookup, Projection, RouterRecord, Tensors};

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
        self.run(tensors, x, train, true)
    }

    /// Generation records no router logits.
    fn decode(&self, tensors: &dyn Tensors, x: &Tensor, _step: &mut DecodeStep) -> ForwardResult {
        self.run(tensors, x, false, false)
    }
}

impl SparseMoe {
    /// The block on `x`; its router logits go to the model's
    /// [`RouterLog`](super::RouterLog) when `record`.
    fn run(&self, tensors: &dyn Tensors, x: &Tensor, train: bool, record: bool) -> ForwardResult {
        let size = x.size();
        let dim = size.last().copied().unwrap_or(0);
        let tokens = x.f_reshape([-1, dim])?;
        // Qwen2-MoE runs its shared expert first and gates it last.
        let shared = match &self.shared {
            Some((expert, _)) => Some(expert.forward(tensors, &tokens, self.activation, train)?),
            None => None,
        };
        let logits = self.router.forward(tensors, &tokens, train)?;
        if let (true, Some(log)) = (record, tensors.router_log()) {
            log.record(&logits);
        }
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
        // Every assignment's token and weight, gathered once in expert order;
        // each expert reads its run of them as a view.
        let inputs = tokens.f_index_select(0, &rows)?;
        let scales = weights
            .f_reshape([-1])?
            .f_index_select(0, &order)?
            .f_unsqueeze(1)?;
        // One expert after another on its tokens, its outputs weighted; then
        // one `index_add` adds them into the output in this order, row by
        // row (each add rounded to the output's dtype), which is
        // transformers' order and decides bfloat16's rounding of the sums.
        let mut outputs = Vec::with_capacity(self.experts.len());
        let mut start = 0;
        for (expert, &n) in self.experts.iter().zip(&counts) {
            if n == 0 {
                continue;
            }
            let input = inputs.f_narrow(0, start, n)?;
            let y = expert.forward(tensors, &input, self.activation, train)?;
            outputs.push(y.f_mul(&scales.f_narrow(0, start, n)?)?);
            start += n;
        }
        let mut out = tokens.f_zeros_like()?;
        if !outputs.is_empty() {
            let added = Tensor::f_cat(&outputs, 0)?.f_to_kind(out.kind())?;
            out = out.f_index_add(0, &rows, &added)?;
        }
        if let (Some(y), Some((_, gate))) = (shared, &self.shared) {
            let g = gate.forward(tensors, &tokens, train)?.f_sigmoid()?;
            out = out.f_add(&g.f_mul(&y)?)?;
        }
        Ok(out.f_reshape(size)?)
    }
}

/// The router losses over every MoE layer's router logits in `record`
/// (`[tokens, experts]` each), as [`RouterLosses`] defines them:
/// `(aux_loss, router_z_loss)`, float32 scalars. The load-balancing loss
/// follows `transformers`' `load_balancing_loss_func`: the softmax in the
/// logits' dtype, its top-k counted per expert (no gradient), its
/// probabilities summed in float32; with an attention mask, only the tokens
/// count, in both means (its `attention_mask` branch), and the z-loss is the
/// mean over the tokens too.
pub(crate) fn router_losses(
    record: &RouterRecord,
    losses: &RouterLosses,
) -> Result<(Tensor, Tensor), tch::TchError> {
    let logits = &record.logits;
    let experts = losses.num_experts as i64;
    let device = logits.first().map_or(tch::Device::Cpu, Tensor::device);
    let tokens = match &record.tokens {
        Some(mask) => Some(mask.f_to_kind(Kind::Float)?.f_to_device(device)?),
        None => None,
    };
    let mut counts = Tensor::f_zeros([experts], (Kind::Float, device))?;
    let mut probs = Tensor::f_zeros([experts], (Kind::Float, device))?;
    let mut z = Tensor::f_zeros([], (Kind::Float, device))?;
    // The rows counted: every row (known here), or the tokens of a padded
    // batch (a sum on the device, not read back).
    let (mut rows, mut kept) = (0i64, None::<Tensor>);
    for l in logits {
        let n = l.size().first().copied().unwrap_or(0);
        // `[rows, 1]`: 1 on a token, 0 on padding; `None`: every row counts.
        let weight = match &tokens {
            Some(mask) if mask.size() == [n] => Some(mask.f_unsqueeze(1)?),
            Some(mask) => {
                return Err(tch::TchError::Shape(format!(
                    "a router's {n} tokens against the attention mask's {:?}",
                    mask.size()
                )))
            }
            None => None,
        };
        let p = l.f_softmax(-1, l.kind())?;
        let (_, chosen) = p.f_topk(losses.top_k as i64, -1, true, true)?;
        let mut p = p.f_to_kind(Kind::Float)?;
        let mut squared = l
            .f_to_kind(Kind::Float)?
            .f_logsumexp(-1, false)?
            .f_square()?;
        let each = match &weight {
            Some(w) => {
                p = p.f_mul(w)?;
                squared = squared.f_mul(&w.f_squeeze_dim(1)?)?;
                let sum = w.f_sum(Kind::Float)?;
                kept = Some(match kept {
                    Some(k) => k.f_add(&sum)?,
                    None => sum,
                });
                w.f_expand_as(&chosen)?.f_reshape([-1])?
            }
            None => {
                rows += n;
                chosen
                    .f_ones_like()?
                    .f_to_kind(Kind::Float)?
                    .f_reshape([-1])?
            }
        };
        // Counted by a scatter, not `bincount`, which reads the largest index
        // back to the host on CUDA.
        counts = counts.f_scatter_add(0, &chosen.f_reshape([-1])?, &each)?;
        probs = probs.f_add(&p.f_sum_dim_intlist(0, false, Kind::Float)?)?;
        z = z.f_add(&squared.f_sum(Kind::Float)?)?;
    }
    let per_row = |t: &Tensor| match &kept {
        Some(k) => t.f_div(&k.f_clamp_min(1.0)?),
        None => t.f_div_scalar(rows.max(1) as f64),
    };
    let aux = per_row(&counts)?
        .f_mul(&per_row(&probs)?)?
        .f_sum(Kind::Float)?
        .f_mul_scalar(experts as f64)?;
    Ok((aux, per_row(&z)?))
}
