//! Kiln's layers on libtorch, one file per family: each turns its layers'
//! definitions into nodes, finding their tensors by name, and runs them.
//! [`TorchModel`](crate::TorchModel) keeps the tree (`Sequential`, `Residual`,
//! `Parallel`) and walks it, giving the layers its tensors ([`Tensors`]).
//!
//! Adding a layer to a family touches only that family's file: [`build`] asks
//! each family in turn, and so does [`script::script`], the TorchScript each
//! family writes for an export.

mod activation;
mod attention;
mod conv;
mod custom;
mod dropout;
mod embedding;
mod linear;
mod moe;
pub(crate) use moe::router_losses;
mod norm;
mod pool;
pub(crate) mod script;
mod structure;
mod transformer;
mod transformer_script;

use std::collections::HashMap;

use kiln_core::{model::Layer, Error, Result};
use tch::{TchError, Tensor};

/// Why a forward pass failed: libtorch rejected an op, or a custom layer failed.
pub(crate) enum Failure {
    Torch(TchError),
    Layer(Error),
}

impl From<TchError> for Failure {
    fn from(e: TchError) -> Self {
        Failure::Torch(e)
    }
}

/// What running a node gives: its output, or why it failed.
pub(crate) type ForwardResult = std::result::Result<Tensor, Failure>;

/// The tensors built layers read, by index: a model's parameters and buffers
/// ([`TorchModel`](crate::TorchModel) is one), so that the layers need
/// nothing else of the model.
pub(crate) trait Tensors {
    /// The parameter or buffer at `index`.
    fn tensor(&self, index: usize) -> &Tensor;

    /// How many there are.
    fn count(&self) -> usize;

    /// The parameter or buffer at `index`, when the layer has it.
    fn opt(&self, index: Option<usize>) -> Option<&Tensor> {
        index.map(|i| self.tensor(i))
    }

    /// Where the mixture-of-experts layers record their router logits for the
    /// model's router losses; `None` (the default) where nothing records.
    fn router_log(&self) -> Option<&std::sync::Arc<RouterLog>> {
        None
    }
}

/// The router logits of one forward pass's mixture-of-experts layers, in the
/// order they ran: what [`RouterLosses`](kiln_core::model::RouterLosses) are
/// computed from. Records only between [`start`](RouterLog::start) and
/// [`take`](RouterLog::take) (a model's forward pass and its loss), so that a
/// part run again in the backward pass, or generation, adds nothing.
#[derive(Debug, Default)]
pub(crate) struct RouterLog(std::sync::Mutex<Option<RouterRecord>>);

/// What a [`RouterLog`] recorded over one forward pass.
#[derive(Debug)]
pub(crate) struct RouterRecord {
    /// Each MoE layer's `[tokens, experts]` router logits, in the order they ran.
    pub(crate) logits: Vec<Tensor>,
    /// `[tokens]` booleans over the batch's tokens in the layers' order
    /// (row-major `[batch, seq]`), `true` on the tokens and `false` on the
    /// padding, when the pass had an attention mask: the padding is left out
    /// of the losses, as `transformers` leaves it out given `attention_mask`.
    pub(crate) tokens: Option<Tensor>,
}

impl RouterLog {
    fn slot(&self) -> std::sync::MutexGuard<'_, Option<RouterRecord>> {
        // A panic elsewhere while holding it leaves only a list of handles.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts recording a new pass over a batch whose tokens are
    /// `padding`'s `true` entries (`[batch, seq]`; `None`: every token);
    /// what an earlier pass left is dropped.
    pub(crate) fn start(&self, padding: Option<&Tensor>) -> Result<(), TchError> {
        let tokens = match padding {
            Some(mask) => Some(mask.f_reshape([-1])?),
            None => None,
        };
        *self.slot() = Some(RouterRecord {
            logits: Vec::new(),
            tokens,
        });
        Ok(())
    }

    /// Records one layer's `[tokens, experts]` logits, when recording.
    pub(crate) fn record(&self, logits: &Tensor) {
        if let Some(record) = self.slot().as_mut() {
            record.logits.push(logits.shallow_clone());
        }
    }

    /// What the pass recorded, and stops recording (`None`: not started).
    pub(crate) fn take(&self) -> Option<RouterRecord> {
        self.slot().take()
    }
}

/// What one forward pass gives every layer besides its input: training
/// behaviour, and which tokens of the batch are padding.
#[derive(Debug)]
pub(crate) struct Pass {
    /// Training behaviour (dropout, batch statistics).
    pub(crate) train: bool,
    /// `[batch, seq]` booleans, `true` on the tokens and `false` on the
    /// padding (`transformers`' `attention_mask`); `None`: no padding.
    pub(crate) padding: Option<Tensor>,
}

impl Pass {
    /// A pass over a batch without padding.
    pub(crate) fn plain(train: bool) -> Self {
        Pass {
            train,
            padding: None,
        }
    }

    /// The same pass with training behaviour `train`.
    pub(crate) fn with_train(&self, train: bool) -> Self {
        Pass {
            train,
            padding: self.padding.as_ref().map(Tensor::shallow_clone),
        }
    }
}

impl Clone for Pass {
    fn clone(&self) -> Self {
        self.with_train(self.train)
    }
}

/// A built layer without children. Its tensors are indices into the model's
/// entries, so that moving the model to another device only replaces the entries.
pub(crate) trait Forward: std::fmt::Debug + Send + Sync {
    /// Runs the layer on `x` with the model's `tensors`, in training behaviour
    /// (dropout, batch statistics) when `train`.
    fn forward(&self, tensors: &dyn Tensors, x: &Tensor, train: bool) -> ForwardResult;

    /// Runs the layer in `pass`: by default, as [`forward`](Forward::forward)
    /// (a layer that reads no padding mask).
    fn forward_pass(&self, tensors: &dyn Tensors, x: &Tensor, pass: &Pass) -> ForwardResult {
        self.forward(tensors, x, pass.train)
    }

    /// Runs the layer on this decoding step's tokens `x` in eval behaviour,
    /// reading and extending `step`'s cache; by default, as [`forward`](Forward::forward).
    fn decode(&self, tensors: &dyn Tensors, x: &Tensor, _step: &mut DecodeStep) -> ForwardResult {
        self.forward(tensors, x, false)
    }

    /// The model's tensors this layer reads that are another layer's (a tied
    /// weight), as indices; none by default.
    fn shared_tensors(&self) -> Vec<usize> {
        Vec::new()
    }
}

/// What one step of cached decoding gives the layers: the positions of its
/// tokens, the keys each may attend to, and every attention layer's keys and
/// values so far, one slot per attention layer in the order they run.
#[derive(Debug)]
pub(crate) struct DecodeStep {
    /// Position ids of this step's tokens, `[batch, seq]` int64 (left padding
    /// shifts each row's positions, as `transformers` does).
    pub(crate) positions: Tensor,
    /// `[batch, 1, seq, past + seq]` booleans: which keys a causal layer's
    /// queries see (earlier non-padding tokens, and always themselves).
    pub(crate) causal_mask: Tensor,
    /// The same for a non-causal layer: every non-padding token.
    pub(crate) padding_mask: Tensor,
    /// Keys and values `[batch, kv_heads, past, head_dim]` of each attention layer.
    pub(crate) cache: Vec<Option<(Tensor, Tensor)>>,
    /// The slot of the next attention layer to run in this step.
    slot: usize,
}

impl DecodeStep {
    /// A step with `positions` and the masks, over `cache` from the step before.
    pub(crate) fn new(
        positions: Tensor,
        causal_mask: Tensor,
        padding_mask: Tensor,
        cache: Vec<Option<(Tensor, Tensor)>>,
    ) -> Self {
        DecodeStep {
            positions,
            causal_mask,
            padding_mask,
            cache,
            slot: 0,
        }
    }

    /// Takes the next attention layer's slot.
    pub(crate) fn next_slot(&mut self) -> usize {
        self.slot += 1;
        self.slot - 1
    }

    /// Stores the keys and values (past and new) of the attention layer at `slot`.
    pub(crate) fn store(&mut self, slot: usize, keys: Tensor, values: Tensor) {
        if self.cache.len() <= slot {
            self.cache.resize_with(slot + 1, || None);
        }
        self.cache[slot] = Some((keys, values));
    }
}

/// Finds a layer's tensors by their names under the layer's path while the
/// model is built.
pub(crate) struct Lookup<'a> {
    /// The layer's path.
    pub(crate) prefix: &'a str,
    /// Every entry's index by full name.
    pub(crate) index: &'a HashMap<&'a str, usize>,
    /// The model's LoRA adapters, when it has them: `(scale, dropout)`.
    pub(crate) lora: Option<(f64, f64)>,
}

/// A LoRA adapter on a projection: `scale * B (A dropout(x))`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Adapter {
    a: usize,
    b: usize,
    scale: f64,
    dropout: f64,
}

/// A projection `x W^T + b`, with its LoRA adapter when it has one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Projection {
    weight: usize,
    bias: Option<usize>,
    adapter: Option<Adapter>,
}

impl Projection {
    /// The projection on `x`, with the adapter's update (its dropout when `train`).
    pub(crate) fn forward(&self, tensors: &dyn Tensors, x: &Tensor, train: bool) -> ForwardResult {
        let y = x.f_linear(tensors.tensor(self.weight), tensors.opt(self.bias))?;
        let Some(ad) = self.adapter else {
            return Ok(y);
        };
        let input = if train && ad.dropout > 0.0 {
            x.f_dropout(ad.dropout, true)?
        } else {
            x.shallow_clone()
        };
        let down = input.f_linear(tensors.tensor(ad.a), None::<Tensor>)?;
        let up = down.f_linear(tensors.tensor(ad.b), None::<Tensor>)?;
        Ok(y.f_add(&up.f_mul_scalar(ad.scale)?)?)
    }
}

impl Lookup<'_> {
    /// The projection `module` of the layer (`None`: the layer itself, a
    /// `linear`): its `weight`, optional `bias` and LoRA adapter.
    pub(crate) fn projection(&self, module: Option<&str>) -> Result<Projection> {
        let name = |leaf: &str| match module {
            Some(m) => format!("{m}.{leaf}"),
            None => leaf.to_owned(),
        };
        let adapter = match self.lora {
            Some((scale, dropout)) => match (
                self.find(&name(kiln_core::lora::LORA_A)),
                self.find(&name(kiln_core::lora::LORA_B)),
            ) {
                (Some(a), Some(b)) => Some(Adapter {
                    a,
                    b,
                    scale,
                    dropout,
                }),
                _ => None,
            },
            None => None,
        };
        Ok(Projection {
            weight: self.need(&name("weight"))?,
            bias: self.find(&name("bias")),
            adapter,
        })
    }

    /// The index of the layer's tensor `name`, if the layer has it.
    pub(crate) fn find(&self, name: &str) -> Option<usize> {
        self.index.get(join(self.prefix, name).as_str()).copied()
    }

    /// The index of the tensor with the full name `name` (a tied weight), which
    /// the model must have.
    pub(crate) fn need_absolute(&self, name: &str) -> Result<usize> {
        self.index
            .get(name)
            .copied()
            .ok_or_else(|| Error::MissingKey {
                key: name.to_owned(),
                available: self.index.len(),
            })
    }

    /// The index of the layer's tensor `name`, which it must have.
    pub(crate) fn need(&self, name: &str) -> Result<usize> {
        self.find(name).ok_or_else(|| Error::MissingKey {
            key: join(self.prefix, name),
            available: self.index.len(),
        })
    }
}

/// Builds one family's node for `layer`, or `None` when the layer belongs to
/// another family.
type Build = fn(&Layer, &Lookup<'_>) -> Result<Option<Box<dyn Forward>>>;

/// Every family's [`Build`].
const FAMILIES: [Build; 12] = [
    linear::build,
    conv::build,
    pool::build,
    norm::build,
    dropout::build,
    embedding::build,
    structure::build,
    activation::build,
    attention::build,
    custom::build,
    transformer::build,
    moe::build,
];

/// Builds the node of `layer`, a layer without children, at `at.prefix`.
pub(crate) fn build(layer: &Layer, at: &Lookup<'_>) -> Result<Box<dyn Forward>> {
    if let Layer::SavedModel(config) = layer {
        return Err(Error::unsupported(format!(
            "the saved_model layer `{}` ({}) on the torch backend: a SavedModel's graph \
             runs on TensorFlow; train this model with the TensorFlow backend \
             (backend = \"tensorflow\")",
            if at.prefix.is_empty() {
                "(root)"
            } else {
                at.prefix
            },
            config.path.display()
        )));
    }
    for build in FAMILIES {
        if let Some(node) = build(layer, at)? {
            return Ok(node);
        }
    }
    Err(Error::unsupported(format!("layer {layer:?} on libtorch")))
}

/// `prefix.name`, or `name` at the root.
pub(crate) fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}

/// A `[height, width]` size as libtorch takes it.
fn pair(v: [usize; 2]) -> [i64; 2] {
    [v[0] as i64, v[1] as i64]
}
