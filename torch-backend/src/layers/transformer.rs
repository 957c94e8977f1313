//! `SelfAttention`, `GatedMlp`, `PositionEmbedding` and `TiedLinear` on
//! libtorch, with the Hugging Face modules' arithmetic op for op (so that
//! logits match `transformers`), and the cached decoding path generation uses.

use kiln_core::model::{GatedActivation, Layer, PositionEncoding, RopeConfig, RopeFrequencies};
use kiln_core::{Error, Result};
use tch::{Kind, Tensor};

use super::{DecodeStep, Failure, Forward, ForwardResult, Lookup, Pass, Projection, Tensors};

/// A built [`Layer::SelfAttention`].
#[derive(Debug)]
struct Attention {
    q: Projection,
    k: Projection,
    v: Projection,
    o: Projection,
    /// `q_norm` and `k_norm`: their weights, eps, weight offset, and whether
    /// the weight scales before the cast back.
    norms: Option<(usize, usize, f64, f64, bool)>,
    /// Whether the norms take the whole projections (OLMoE), not each head.
    norms_across_heads: bool,
    /// The factor of the scores (`None`: `1 / sqrt(head_dim)`).
    scale: Option<f64>,
    /// The scores' softcap: `cap * tanh(scores / cap)`.
    softcap: Option<f64>,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    causal: bool,
    /// The sliding window of a causal layer, in tokens.
    window: Option<i64>,
    dropout: f64,
    rope: Option<Rope>,
}

/// A built rotary embedding.
#[derive(Debug)]
struct Rope {
    config: RopeConfig,
    /// Features per head.
    head_dim: usize,
    /// Features rotated per head.
    rot: i64,
    /// The frequencies of `config` where they do not depend on the length.
    fixed: RopeFrequencies,
    /// `fixed.inverse` on the device the model last ran on.
    on_device: std::sync::Mutex<Option<Tensor>>,
}

/// A built [`Layer::GatedMlp`].
#[derive(Debug)]
struct GatedMlp {
    gate: Projection,
    up: Projection,
    down: Projection,
    activation: GatedActivation,
}

/// A built [`Layer::PositionEmbedding`]: the learned table, or the sinusoidal one.
#[derive(Debug)]
enum Positions {
    Learned(usize),
    /// The `[max_positions, dim]` table, row-major.
    Sinusoidal(Vec<f32>, [i64; 2]),
}

/// A built [`Layer::TiedLinear`]: the shared weight's index.
#[derive(Debug)]
struct TiedLinear(usize);

/// A built [`Layer::TokenTypeEmbedding`]: the table's index.
#[derive(Debug)]
struct TokenType(usize);

/// A built [`Layer::ClassToken`]: the token's index.
#[derive(Debug)]
struct ClassToken(usize);

/// The node of `layer` when it is one of this family's; `None` otherwise.
pub(super) fn build(layer: &Layer, at: &Lookup<'_>) -> Result<Option<Box<dyn Forward>>> {
    let proj = |name: &str| at.projection(Some(name));
    Ok(Some(match layer {
        Layer::SelfAttention(c) => Box::new(Attention {
            q: proj("q_proj")?,
            k: proj("k_proj")?,
            v: proj("v_proj")?,
            o: proj("o_proj")?,
            norms: match c.qk_norm_eps {
                Some(eps) => Some((
                    at.need("q_norm.weight")?,
                    at.need("k_norm.weight")?,
                    eps,
                    c.qk_norm_offset,
                    c.qk_norm_scale_in_float32,
                )),
                None => None,
            },
            norms_across_heads: c.qk_norm_across_heads,
            scale: c.scale,
            softcap: c.softcap,
            heads: c.num_heads as i64,
            kv_heads: c.kv_heads() as i64,
            head_dim: c.head_dim() as i64,
            causal: c.causal,
            window: c.sliding_window.map(|w| w as i64),
            dropout: c.dropout,
            rope: c.rope.as_ref().map(|r| Rope {
                config: r.clone(),
                head_dim: c.head_dim(),
                rot: r.rotary_dim(c.head_dim()) as i64,
                fixed: r.frequencies(c.head_dim(), 0),
                on_device: std::sync::Mutex::new(None),
            }),
        }),
        Layer::GatedMlp(c) => Box::new(GatedMlp {
            gate: proj("gate_proj")?,
            up: proj("up_proj")?,
            down: proj("down_proj")?,
            activation: c.activation,
        }),
        Layer::PositionEmbedding(c) => Box::new(match c.encoding {
            PositionEncoding::Learned => Positions::Learned(at.need("weight")?),
            PositionEncoding::Sinusoidal => {
                Positions::Sinusoidal(c.sinusoidal_table(), [c.max_positions as i64, c.dim as i64])
            }
        }),
        Layer::TiedLinear(c) => Box::new(TiedLinear(at.need_absolute(&c.weight)?)),
        Layer::TokenTypeEmbedding(_) => Box::new(TokenType(at.need("weight")?)),
        Layer::ClassToken(_) => Box::new(ClassToken(at.need("weight")?)),
        _ => return Ok(None),
    }))
}

/// `x / sqrt(mean(x², -1) + eps)` in float32.
fn normalized(x: &Tensor, eps: f64) -> ForwardResult {
    let h = x.f_to_kind(Kind::Float)?;
    let var = h.f_pow_tensor_scalar(2)?.f_mean_dim(-1, true, None)?;
    Ok(h.f_mul(&var.f_add_scalar(eps)?.f_rsqrt()?)?)
}

/// Gemma's RMSNorm: `x / sqrt(mean(x², -1) + eps) * (offset + weight)`, all
/// in float32 and cast to `x`'s dtype at the end (`Gemma3RMSNorm`'s order,
/// and `Olmo2RMSNorm`'s with offset 0, which differs from LLaMA's in reduced
/// precision).
pub(super) fn offset_rms_norm(x: &Tensor, weight: &Tensor, eps: f64, offset: f64) -> ForwardResult {
    let w = weight.f_to_kind(Kind::Float)?.f_add_scalar(offset)?;
    Ok(normalized(x, eps)?.f_mul(&w)?.f_to_kind(x.kind())?)
}

/// `x / sqrt(mean(x², -1) + eps) * weight`, in float32 as `LlamaRMSNorm`
/// (the weight scales after the cast back to `x`'s dtype).
pub(super) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> ForwardResult {
    Ok(weight.f_mul(&normalized(x, eps)?.f_to_kind(x.kind())?)?)
}

impl Rope {
    /// `[batch, 1, seq, rotary_dim]` cosines and sines of `positions` (`[batch, seq]`
    /// or `[1, seq]`), as the Hugging Face rotary modules compute them. Plain
    /// RoPE computes its frequencies on the device (nothing crosses from the
    /// host, so CUDA graphs capture it); a scaled one takes them from
    /// [`RopeConfig::frequencies`], copied to the device once, or for
    /// `max(position) + 1` on every call where they depend on the length
    /// (dynamic NTK, LongRoPE), as `transformers` does.
    fn tables(&self, positions: &Tensor, kind: Kind) -> Result<(Tensor, Tensor), Failure> {
        let device = positions.device();
        let rot = self.rot;
        let (inv_freq, factor) = match &self.config.scaling {
            None => {
                let exponents = Tensor::f_arange_start_step(0, rot, 2, (Kind::Int64, device))?
                    .f_to_kind(Kind::Float)?
                    .f_div_scalar(rot as f64)?;
                (
                    Tensor::f_pow_scalar(self.config.theta, &exponents)?.f_reciprocal()?,
                    1.0,
                )
            }
            Some(_) if self.config.depends_on_length() => {
                let len = positions.f_max()?.int64_value(&[]).max(0) as usize + 1;
                let f = self.config.frequencies(self.head_dim, len);
                (
                    Tensor::from_slice(&f.inverse).f_to_device(device)?,
                    f.attention_factor,
                )
            }
            // Fixed frequencies cross to the device once, not every step.
            Some(_) => {
                let f = &self.fixed;
                let mut cached = self
                    .on_device
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let inv_freq = match cached.as_ref() {
                    Some(t) if t.device() == device => t.shallow_clone(),
                    _ => {
                        let t = Tensor::from_slice(&f.inverse).f_to_device(device)?;
                        *cached = Some(t.shallow_clone());
                        t
                    }
                };
                (inv_freq, f.attention_factor)
            }
        };
        let freqs = positions
            .f_to_kind(Kind::Float)?
            .f_unsqueeze(-1)?
            .f_mul(&inv_freq)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_unsqueeze(1)?;
        let (mut cos, mut sin) = (emb.f_cos()?, emb.f_sin()?);
        if factor != 1.0 {
            cos = cos.f_mul_scalar(f64::from(factor))?;
            sin = sin.f_mul_scalar(f64::from(factor))?;
        }
        Ok((cos.f_to_kind(kind)?, sin.f_to_kind(kind)?))
    }
}

/// `[seq, past + seq]` booleans: whether query `past + i` sees key `j`
/// under causal attention within a window of `window` tokens
/// (`j <= past + i` and `j > past + i - window`, as transformers'
/// `sliding_window_overlay`).
fn window_band(seq: i64, past: i64, window: i64, device: tch::Device) -> ForwardResult {
    let queries =
        Tensor::f_arange_start(past, past + seq, (Kind::Int64, device))?.f_unsqueeze(1)?;
    let keys = Tensor::f_arange(past + seq, (Kind::Int64, device))?.f_unsqueeze(0)?;
    let causal = keys.f_le_tensor(&queries)?;
    let recent = keys.f_gt_tensor(&queries.f_sub_scalar(window)?)?;
    Ok(causal.f_logical_and(&recent)?)
}

/// `torch.finfo(kind).min`, what transformers' masks add.
fn lowest(kind: Kind) -> f64 {
    match kind {
        Kind::Half => -65504.0,
        // bfloat16's lowest finite value, exactly: float32's bits 0xff7f0000.
        Kind::BFloat16 => f64::from(f32::from_bits(0xff7f_0000)),
        Kind::Double => f64::MIN,
        _ => f64::from(f32::MIN),
    }
}

/// Rotates the first `rot` features of `x` (`[batch, heads, seq, head_dim]`).
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor, rot: i64, head_dim: i64) -> ForwardResult {
    let (xr, pass) = if rot == head_dim {
        (x.shallow_clone(), None)
    } else {
        (
            x.f_narrow(-1, 0, rot)?,
            Some(x.f_narrow(-1, rot, head_dim - rot)?),
        )
    };
    let half = rot / 2;
    let rotated = Tensor::f_cat(
        &[
            &xr.f_narrow(-1, half, half)?.f_neg()?,
            &xr.f_narrow(-1, 0, half)?,
        ],
        -1,
    )?;
    let out = xr.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)?;
    Ok(match pass {
        None => out,
        Some(pass) => Tensor::f_cat(&[&out, &pass], -1)?,
    })
}

impl Attention {
    /// The heads of `x`: queries `[b, heads, s, d]`, keys and values
    /// `[b, kv_heads, s, d]`, normalised and rotated at `positions`.
    fn heads(
        &self,
        tensors: &dyn Tensors,
        x: &Tensor,
        positions: &Tensor,
        train: bool,
    ) -> Result<(Tensor, Tensor, Tensor), Failure> {
        let size = x.size();
        let (b, s) = (size[0], size[1]);
        let split = |t: Tensor, heads: i64| t.f_reshape([b, s, heads, self.head_dim]);
        let norm = |t: Tensor, which: usize| -> ForwardResult {
            match self.norms {
                None => Ok(t),
                Some((qn, kn, eps, offset, in_float32)) => {
                    let w = tensors.tensor(if which == 0 { qn } else { kn });
                    if offset == 0.0 && !in_float32 {
                        rms_norm(&t, w, eps)
                    } else {
                        offset_rms_norm(&t, w, eps, offset)
                    }
                }
            }
        };
        let (mut q, mut k) = (
            self.q.forward(tensors, x, train)?,
            self.k.forward(tensors, x, train)?,
        );
        if self.norms_across_heads {
            q = norm(q, 0)?;
            k = norm(k, 1)?;
        }
        let mut q = split(q, self.heads)?;
        let mut k = split(k, self.kv_heads)?;
        let v = split(self.v.forward(tensors, x, train)?, self.kv_heads)?.f_transpose(1, 2)?;
        if !self.norms_across_heads {
            q = norm(q, 0)?;
            k = norm(k, 1)?;
        }
        let (mut q, mut k) = (q.f_transpose(1, 2)?, k.f_transpose(1, 2)?);
        if let Some(rope) = &self.rope {
            // In the input's dtype, as transformers' rotary module returns them:
            // under autocast q is bfloat16 and the rotation runs in float32.
            let (cos, sin) = rope.tables(positions, x.kind())?;
            q = apply_rope(&q, &cos, &sin, rope.rot, self.head_dim)?;
            k = apply_rope(&k, &cos, &sin, rope.rot, self.head_dim)?;
        }
        Ok((q, k, v))
    }

    /// The attended values `[b, heads, s, d]` of queries `q` over keys `k`
    /// and values `v` where the boolean `mask` (or, without one, `causal`)
    /// lets them see, with dropout `p`: the fused kernel, or, with a softcap,
    /// transformers' eager arithmetic (which the kernel cannot do).
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        p: f64,
        causal: bool,
    ) -> ForwardResult {
        let Some(cap) = self.softcap else {
            return Ok(Tensor::f_scaled_dot_product_attention(
                q,
                k,
                v,
                mask,
                p,
                causal,
                self.scale,
                self.kv_heads != self.heads,
            )?);
        };
        // `repeat_kv`: each key/value head serves its group of query heads.
        let groups = self.heads / self.kv_heads;
        let repeat = |t: &Tensor| -> ForwardResult {
            if groups == 1 {
                Ok(t.shallow_clone())
            } else {
                Ok(t.f_repeat_interleave_self_int(groups, Some(1), None)?)
            }
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let scale = self
            .scale
            .unwrap_or_else(|| 1.0 / (self.head_dim as f64).sqrt());
        let scores = q
            .f_matmul(&k.f_transpose(2, 3)?)?
            .f_mul_scalar(scale)?
            .f_div_scalar(cap)?
            .f_tanh()?
            .f_mul_scalar(cap)?;
        let causal_mask;
        let mask = match mask {
            Some(m) => Some(m),
            None if causal => {
                let (s, t) = (q.size()[2], k.size()[2]);
                causal_mask = Tensor::f_ones([s, t], (Kind::Bool, q.device()))?.f_tril(t - s)?;
                Some(&causal_mask)
            }
            None => None,
        };
        // transformers adds the dtype's lowest value where a key is hidden.
        let scores = match mask {
            Some(m) => scores.f_masked_fill(&m.f_logical_not()?, lowest(scores.kind()))?,
            None => scores,
        };
        let mut weights = scores.f_softmax(-1, Kind::Float)?.f_to_kind(q.kind())?;
        if p > 0.0 {
            weights = weights.f_dropout(p, true)?;
        }
        Ok(weights.f_matmul(&v)?)
    }

    /// `o_proj` of the attended heads `[b, heads, s, d]`.
    fn merge(&self, tensors: &dyn Tensors, attended: &Tensor, train: bool) -> ForwardResult {
        let size = attended.size();
        let merged = attended.f_transpose(1, 2)?.f_reshape([
            size[0],
            size[2],
            self.heads * self.head_dim,
        ])?;
        self.o.forward(tensors, &merged, train)
    }
}

/// `[batch, 1, seq, seq]` booleans: which keys each query sees in a padded
/// batch, `band` (`[seq, seq]`, `None`: every key) and the keys that are
/// tokens (`padding`, `[batch, seq]`, `true` on them), as `transformers`'
/// `and_masks(..., padding_mask_function)`; and always the query itself,
/// so that a padding query that would see nothing (left padding under a
/// causal mask) attends somewhere instead of giving NaN. Only padding
/// queries see more than `transformers` lets them: their outputs are
/// never read.
fn padded_mask(band: Option<&Tensor>, padding: &Tensor) -> ForwardResult {
    let size = padding.size();
    let (batch, seq) = (size[0], size[1]);
    let keys = padding
        .f_to_kind(Kind::Bool)?
        .f_reshape([batch, 1, 1, seq])?;
    let seen = match band {
        Some(band) => keys.f_logical_and(band)?,
        None => keys.f_expand([batch, 1, seq, seq], false)?,
    };
    let itself = Tensor::f_eye(seq, (Kind::Bool, padding.device()))?;
    Ok(seen.f_logical_or(&itself)?)
}

impl Forward for Attention {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, train: bool) -> ForwardResult {
        self.forward_pass(tensors, x, &Pass::plain(train))
    }

    fn forward_pass(&self, tensors: &dyn Tensors, x: &Tensor, pass: &Pass) -> ForwardResult {
        let train = pass.train;
        let s = x.size()[1];
        let positions = Tensor::f_arange(s, (Kind::Int64, x.device()))?.f_unsqueeze(0)?;
        let (q, k, v) = self.heads(tensors, x, &positions, train)?;
        let p = if train { self.dropout } else { 0.0 };
        // A window as long as the sequence changes nothing: the causal kernel.
        let band = match self.window {
            Some(w) if s > w => Some(window_band(s, 0, w, x.device())?),
            _ => None,
        };
        let attended = match &pass.padding {
            None => self.attend(&q, &k, &v, band.as_ref(), p, self.causal && band.is_none())?,
            Some(padding) => {
                let causal;
                let band = match (&band, self.causal) {
                    (Some(band), _) => Some(band),
                    (None, true) => {
                        causal = Tensor::f_ones([s, s], (Kind::Bool, x.device()))?.f_tril(0)?;
                        Some(&causal)
                    }
                    (None, false) => None,
                };
                let mask = padded_mask(band, padding)?;
                self.attend(&q, &k, &v, Some(&mask), p, false)?
            }
        };
        self.merge(tensors, &attended, train)
    }

    fn decode(&self, tensors: &dyn Tensors, x: &Tensor, step: &mut DecodeStep) -> ForwardResult {
        let (q, k, v) = self.heads(tensors, x, &step.positions, false)?;
        let slot = step.next_slot();
        let (k, v) = match step.cache.get(slot).and_then(Option::as_ref) {
            Some((past_k, past_v)) => (
                Tensor::f_cat(&[past_k, &k], 2)?,
                Tensor::f_cat(&[past_v, &v], 2)?,
            ),
            None => (k, v),
        };
        let banded;
        let (seq, kept) = (x.size()[1], k.size()[2]);
        let mask = match (self.causal, self.window) {
            (true, Some(w)) => {
                // This layer holds only the last `kept` keys of the sequence
                // (see below): their columns of the mask, and the band over
                // them (it depends on distances only).
                let full = step.causal_mask.size()[3];
                banded = step
                    .causal_mask
                    .f_narrow(3, full - kept, kept)?
                    .f_logical_and(&window_band(seq, kept - seq, w, x.device())?)?;
                &banded
            }
            (true, None) => &step.causal_mask,
            (false, _) => &step.padding_mask,
        };
        let attended = self.attend(&q, &k, &v, Some(mask), 0.0, false)?;
        // A sliding-window layer keeps only its window: the next token sees
        // the `window - 1` keys before it and itself, never further back.
        let (k, v) = match (self.causal, self.window) {
            (true, Some(w)) if kept > w - 1 => (
                k.f_narrow(2, kept - (w - 1), w - 1)?,
                v.f_narrow(2, kept - (w - 1), w - 1)?,
            ),
            _ => (k, v),
        };
        step.store(slot, k, v);
        self.merge(tensors, &attended, false)
    }
}

impl Forward for GatedMlp {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, train: bool) -> ForwardResult {
        let gate = self.gate.forward(tensors, x, train)?;
        let gate = match self.activation {
            GatedActivation::Silu => gate.f_silu()?,
            GatedActivation::Gelu => gate.f_gelu("none")?,
            GatedActivation::GeluTanh => gate.f_gelu("tanh")?,
        };
        let hidden = gate.f_mul(&self.up.forward(tensors, x, train)?)?;
        self.down.forward(tensors, &hidden, train)
    }
}

impl Positions {
    fn add(&self, tensors: &dyn Tensors, x: &Tensor, positions: &Tensor) -> ForwardResult {
        let table = match self {
            Positions::Learned(w) => tensors.tensor(*w).shallow_clone(),
            Positions::Sinusoidal(table, shape) => Tensor::from_slice(table)
                .f_reshape(shape)?
                .f_to_device(x.device())?
                .f_to_kind(x.kind())?,
        };
        let max = table.size()[0];
        let last = positions.max().int64_value(&[]);
        if last >= max {
            return Err(Failure::Layer(Error::invalid_argument(
                "positions",
                format!(
                    "PositionEmbedding: position {last} is past the table's {max} rows \
                     (max_positions); shorten the sequence"
                ),
            )));
        }
        Ok(x.f_add(&Tensor::f_embedding(&table, positions, -1, false, false)?)?)
    }
}

impl Forward for Positions {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        let s = x.size()[1];
        let positions = Tensor::f_arange(s, (Kind::Int64, x.device()))?.f_unsqueeze(0)?;
        self.add(tensors, x, &positions)
    }

    fn decode(&self, tensors: &dyn Tensors, x: &Tensor, step: &mut DecodeStep) -> ForwardResult {
        self.add(tensors, x, &step.positions)
    }
}

impl Forward for TiedLinear {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        Ok(x.f_linear(tensors.tensor(self.0), None::<Tensor>)?)
    }

    fn shared_tensors(&self) -> Vec<usize> {
        vec![self.0]
    }
}

impl Forward for TokenType {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        Ok(x.f_add(&tensors.tensor(self.0).f_select(0, 0)?)?)
    }
}

impl Forward for ClassToken {
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, _train: bool) -> ForwardResult {
        let size = x.size();
        let token = tensors
            .tensor(self.0)
            .f_expand([size[0], 1, size[2]], false)?;
        Ok(Tensor::f_cat(&[&token, x], 1)?)
    }
}
