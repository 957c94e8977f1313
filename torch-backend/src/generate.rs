//! Text generation with a key/value cache on libtorch: [`KvCache`] holds the
//! keys and values of every attention layer between steps, and [`generate`]
//! runs a batch of prompts of different lengths (padded on the left, the
//! padding never attended to) to their new tokens.

use kiln_core::generation::{GenerationConfig, Sampler};
use kiln_core::model::{Layer, RopeScaling};
use kiln_core::{Error, Result};
use tch::{Kind, Tensor};

use crate::error::torch_error;
use crate::layers::DecodeStep;
use crate::model::TorchModel;

/// The state of a batch being decoded: every attention layer's keys and
/// values, which earlier tokens are padding, and the last position of each row.
///
/// ```no_run
/// use kiln_torch::{KvCache, TorchModel};
/// # fn run(model: &TorchModel) -> kiln_core::Result<()> {
/// let mut cache = KvCache::new();
/// let prompt = tch::Tensor::from_slice(&[1i64, 5, 9]).unsqueeze(0);
/// let logits = model.forward_cached(&prompt, None, &mut cache)?; // [1, 3, vocab]
/// let next = logits.select(1, -1).argmax(-1, true); // [1, 1]
/// let logits = model.forward_cached(&next, None, &mut cache)?; // [1, 1, vocab]
/// assert_eq!(cache.len(), 4);
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// `[batch, len]` int64: 1 for a token, 0 for padding.
    attention_mask: Option<Tensor>,
    /// `[batch, 1]` int64: the position of each row's last token.
    last_positions: Option<Tensor>,
}

impl KvCache {
    /// An empty cache, for a new batch.
    pub fn new() -> Self {
        KvCache::default()
    }

    /// How many tokens (padding included) each row holds.
    pub fn len(&self) -> usize {
        self.attention_mask
            .as_ref()
            .map_or(0, |m| m.size()[1] as usize)
    }

    /// Whether nothing has run yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many positions the `layer`-th attention layer (in the order they
    /// run) holds keys and values for: [`len`](Self::len) for full
    /// attention, at most `sliding_window - 1` for a sliding-window layer;
    /// `None` before that layer has run.
    pub fn keys_held(&self, layer: usize) -> Option<usize> {
        self.layers
            .get(layer)?
            .as_ref()
            .map(|(keys, _)| keys.size()[2] as usize)
    }
}

impl TorchModel {
    /// Runs `tokens` (`[batch, seq]` int64) as the next step of `cache`'s
    /// sequences and returns their logits `[batch, seq, vocab]` in float32,
    /// in eval behaviour whatever the model's mode. `attention_mask`
    /// (`[batch, seq]`, 1 for a token and 0 for left padding) marks the
    /// padding of a first step; `None` means no padding.
    ///
    /// Positions continue each row's count (padding does not count, as in
    /// `transformers`), and the attention layers see the cached keys of the
    /// earlier steps. Every attention layer must be a
    /// [`Layer::SelfAttention`](kiln_core::model::Layer::SelfAttention).
    pub fn forward_cached(
        &self,
        tokens: &Tensor,
        attention_mask: Option<&Tensor>,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let size = tokens.size();
        let [batch, seq] = size[..] else {
            return Err(Error::ShapeMismatch {
                context: "forward_cached: tokens".to_owned(),
                expected: "[batch, seq]".to_owned(),
                actual: format!("{size:?}"),
            });
        };
        let err = |e| torch_error("preparing a decoding step", e);
        let device = tokens.device();
        let mask = match attention_mask {
            Some(m) if m.size() != size => {
                return Err(Error::ShapeMismatch {
                    context: "forward_cached: attention_mask".to_owned(),
                    expected: format!("{size:?} (as the tokens)"),
                    actual: format!("{:?}", m.size()),
                })
            }
            Some(m) => m.f_to_kind(Kind::Int64).map_err(err)?,
            None => Tensor::f_ones([batch, seq], (Kind::Int64, device)).map_err(err)?,
        };
        if let Some(prev) = &cache.attention_mask {
            if prev.size()[0] != batch {
                return Err(Error::ShapeMismatch {
                    context: "forward_cached: tokens, against the cache".to_owned(),
                    expected: format!("[{}, seq] (the cached batch)", prev.size()[0]),
                    actual: format!("{size:?}"),
                });
            }
        }
        let last = match &cache.last_positions {
            Some(l) => l.shallow_clone(),
            None => Tensor::f_full([batch, 1], -1, (Kind::Int64, device)).map_err(err)?,
        };
        // Each token's position is the count of real tokens before it; padding gets 1.
        let counted = mask
            .f_cumsum(1, Kind::Int64)
            .map_err(err)?
            .f_add(&last)
            .map_err(err)?;
        let positions = counted
            .f_masked_fill(&mask.f_eq(0).map_err(err)?, 1)
            .map_err(err)?;
        let full_mask = match &cache.attention_mask {
            Some(prev) => Tensor::f_cat(&[prev, &mask], 1).map_err(err)?,
            None => mask.shallow_clone(),
        };
        let past = cache.len() as i64;
        let total = past + seq;
        let keys = Tensor::f_arange(total, (Kind::Int64, device))
            .map_err(err)?
            .f_view([1, 1, 1, total])
            .map_err(err)?;
        let queries = Tensor::f_arange_start(past, total, (Kind::Int64, device))
            .map_err(err)?
            .f_view([1, 1, seq, 1])
            .map_err(err)?;
        let real = full_mask
            .f_ne(0)
            .map_err(err)?
            .f_view([batch, 1, 1, total])
            .map_err(err)?;
        // Every query also sees itself, so that a padding row is never empty
        // (an all-masked softmax row would be NaN).
        let itself = keys.f_eq_tensor(&queries).map_err(err)?;
        let causal_mask = keys
            .f_le_tensor(&queries)
            .map_err(err)?
            .f_logical_and(&real)
            .map_err(err)?
            .f_logical_or(&itself)
            .map_err(err)?;
        let padding_mask = real.f_logical_or(&itself).map_err(err)?;
        let mut step = DecodeStep::new(
            positions.shallow_clone(),
            causal_mask,
            padding_mask,
            std::mem::take(&mut cache.layers),
        );
        let result = tch::no_grad(|| self.decode_step(tokens, &mut step));
        match result {
            Ok(logits) => {
                cache.layers = step.cache;
                cache.attention_mask = Some(full_mask);
                cache.last_positions = Some(positions.f_narrow(1, seq - 1, 1).map_err(err)?);
                Ok(logits)
            }
            // A failed step leaves the cache empty: its layers may be half-updated.
            Err(e) => {
                *cache = KvCache::new();
                Err(e)
            }
        }
    }
}

/// Generates up to `config.max_new_tokens` tokens after each prompt and
/// returns them (without the prompt), each ending at its first stop token,
/// which is kept.
///
/// Prompts of different lengths run as one batch, padded on the left with
/// `config.pad_token`, which no token attends to. With `config.use_cache`
/// each step runs only the new tokens against the cache; without, it reruns
/// the whole sequence (the same logits, slower).
///
/// ```no_run
/// use kiln_core::generation::GenerationConfig;
/// use kiln_torch::{generate, TorchModel};
/// # fn run(model: &TorchModel) -> kiln_core::Result<()> {
/// let out = generate(model, &[vec![1, 5, 9], vec![1, 7]], &GenerationConfig::greedy(16))?;
/// assert_eq!(out.len(), 2);
/// # Ok(()) }
/// ```
pub fn generate(
    model: &TorchModel,
    prompts: &[Vec<i64>],
    config: &GenerationConfig,
) -> Result<Vec<Vec<i64>>> {
    config.validate()?;
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        return Err(Error::invalid_argument(
            "prompts",
            format!("prompt {i} is empty: generation needs at least one token to start from"),
        ));
    }
    let err = |e| torch_error("generating", e);
    let device = crate::device::device_to_tch(model.device())?;
    let batch = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut tokens = Vec::with_capacity(batch * longest);
    let mut mask = Vec::with_capacity(batch * longest);
    for p in prompts {
        let pad = longest - p.len();
        tokens.extend(std::iter::repeat_n(config.pad_token, pad).chain(p.iter().copied()));
        mask.extend(std::iter::repeat_n(0i64, pad).chain(std::iter::repeat_n(1, p.len())));
    }
    let shape = [batch as i64, longest as i64];
    let mut sequence = Tensor::from_slice(&tokens)
        .f_reshape(shape)
        .map_err(err)?
        .f_to_device(device)
        .map_err(err)?;
    let mut full_mask = Tensor::from_slice(&mask)
        .f_reshape(shape)
        .map_err(err)?
        .f_to_device(device)
        .map_err(err)?;
    let mut sampler = Sampler::new(&config.decoding, config.seed);
    let mut out: Vec<Vec<i64>> = vec![Vec::new(); batch];
    let mut done = vec![false; batch];
    let mut cache = KvCache::new();
    let mut step_tokens = sequence.shallow_clone();
    let mut step_mask = Some(full_mask.shallow_clone());
    let switch = longrope_switch(model.spec());
    for _ in 0..config.max_new_tokens {
        // LongRoPE's keys change frequencies once the sequence outgrows the
        // original context: the cache of shorter keys is recomputed then, as
        // Phi-3's `prepare_inputs_for_generation` does.
        if let Some(original) = switch {
            let width = sequence.size()[1] as usize;
            if !cache.is_empty() && cache.len() <= original && width > original {
                cache = KvCache::new();
                step_tokens = sequence.shallow_clone();
                step_mask = Some(full_mask.shallow_clone());
            }
        }
        let logits = if config.use_cache {
            model.forward_cached(&step_tokens, step_mask.as_ref(), &mut cache)?
        } else {
            let mut fresh = KvCache::new();
            model.forward_cached(&sequence, Some(&full_mask), &mut fresh)?
        };
        if logits.dim() != 3 {
            return Err(Error::ShapeMismatch {
                context: "generate: the model's output (generation needs [batch, seq, vocab] \
                          logits, a causal language model's)"
                    .to_owned(),
                expected: "[batch, seq, vocab]".to_owned(),
                actual: format!("{:?}", logits.size()),
            });
        }
        let last = logits
            .f_select(1, -1)
            .map_err(err)?
            .f_to_device(tch::Device::Cpu)
            .map_err(err)?
            .f_contiguous()
            .map_err(err)?;
        let vocab = last.size()[1] as usize;
        let mut rows = vec![0f32; batch * vocab];
        last.f_copy_data(&mut rows, batch * vocab).map_err(err)?;
        let mut next = Vec::with_capacity(batch);
        for (row, logits) in rows.chunks(vocab).enumerate() {
            // Finished rows keep decoding padding, which nobody reads.
            let token = if done[row] {
                config.pad_token
            } else {
                let t = sampler.pick(logits)? as i64;
                out[row].push(t);
                done[row] = config.stop_tokens.contains(&t);
                t
            };
            next.push(token);
        }
        if done.iter().all(|d| *d) {
            break;
        }
        step_tokens = Tensor::from_slice(&next)
            .f_view([batch as i64, 1])
            .map_err(err)?
            .f_to_device(device)
            .map_err(err)?;
        step_mask = None;
        sequence = Tensor::f_cat(&[&sequence, &step_tokens], 1).map_err(err)?;
        full_mask = Tensor::f_cat(&[&full_mask, &step_tokens.f_ones_like().map_err(err)?], 1)
            .map_err(err)?;
    }
    Ok(out)
}

/// The shortest original context of the LongRoPE attention layers of
/// `spec`, past which their frequencies switch to the long factors.
fn longrope_switch(spec: &Layer) -> Option<usize> {
    spec.layers()
        .into_iter()
        .filter_map(|(_, layer)| match layer {
            Layer::SelfAttention(c) => match &c.rope.as_ref()?.scaling {
                Some(RopeScaling::LongRope {
                    original_max_positions,
                    ..
                }) => Some(*original_max_positions),
                _ => None,
            },
            _ => None,
        })
        .min()
}

#[cfg(test)]
mod tests {
    use kiln_core::model::{EmbeddingConfig, LinearConfig, RopeConfig, SelfAttentionConfig};

    use super::*;

    #[test]
    fn a_sliding_window_layer_keeps_only_its_window_and_changes_no_logit() {
        let attention = SelfAttentionConfig::new(8, 2)
            .with_causal(true)
            .with_rope(RopeConfig::new(10_000.0));
        let spec = Layer::sequential([
            EmbeddingConfig::new(20, 8).into(),
            attention.clone().with_sliding_window(3).into(),
            attention.into(),
            LinearConfig::new(8, 20).into(),
        ]);
        let model = TorchModel::new(&spec, kiln_core::Device::Cpu).expect("model");
        let ids = Tensor::from_slice(&[3i64, 7, 1, 9, 4, 12, 5, 8, 2]).view([1, 9]);
        let whole = tch::no_grad(|| model.forward_cached(&ids, None, &mut KvCache::new()))
            .expect("one step");
        let mut cache = KvCache::new();
        let mut steps = vec![model
            .forward_cached(&ids.narrow(1, 0, 6), None, &mut cache)
            .expect("prompt")];
        assert_eq!((cache.keys_held(0), cache.keys_held(1)), (Some(2), Some(6)));
        for t in 6..9 {
            steps.push(
                model
                    .forward_cached(&ids.narrow(1, t, 1), None, &mut cache)
                    .expect("step"),
            );
            assert_eq!(cache.keys_held(0), Some(2), "the window's keys only");
            assert_eq!(cache.keys_held(1), Some(t as usize + 1));
        }
        assert_eq!(cache.keys_held(2), None);
        let stepped = Tensor::cat(&steps, 1);
        let diff = (stepped - whole).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "cached logits differ by {diff}");
    }
}
