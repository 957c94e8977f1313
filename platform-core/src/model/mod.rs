//! Declarative model definitions.
//!
//! A [`Layer`] describes a network in backend-neutral terms: its sizes, its
//! initialisers and how layers compose. It knows its own shapes
//! ([`Layer::output_shape`]) and the exact names, shapes and initial
//! distributions of its parameters and buffers ([`Layer::parameter_specs`]),
//! which are those of the equivalent `torch.nn` module's `state_dict()`.
//! Each backend builds the layer natively.
//!
//! Each layer's rules live in its family's file under `layers/`; this file
//! holds the [`Layer`] enum and the one table (`with_spec!`) that sends each
//! variant to them.

mod attention_mask;
mod init;
mod layers;
mod registry;
mod summary;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::Result;
use crate::shape::Shape;

pub use attention_mask::stack_attention_mask;
pub use init::{fan_in_and_fan_out, FanMode, Init, InitDistribution, Nonlinearity};
pub use layers::{
    AttentionConfig, BatchNormConfig, ClassTokenConfig, Conv1dConfig, Conv2dConfig,
    ConvTranspose2dConfig, CustomConfig, CustomParam, EmbeddingConfig, GatedActivation,
    GatedMlpConfig, GeluApproximation, GroupNormConfig, LayerNormConfig, LinearConfig,
    Pool2dConfig, PositionEmbeddingConfig, PositionEncoding, RmsNormConfig, RopeConfig,
    RopeFrequencies, RopeScaling, RouterLosses, SavedModelLayerConfig, SelfAttentionConfig,
    SparseMoeConfig, TiedLinearConfig, TokenTypeEmbeddingConfig, TorchScriptConfig,
};
pub use registry::CustomLayerRegistry;
pub use summary::{LayerSummary, ModelSummary};

use layers::{
    activation, dropout, norm, pool, structure, FieldCheck, LayerSpec, Params, ShapeCheck,
};

fn half() -> f64 {
    0.5
}

fn default_negative_slope() -> f64 {
    0.01
}

fn one_isize() -> isize {
    1
}

fn minus_one() -> isize {
    -1
}

/// One layer of a network, or a composition of layers.
///
/// Built in Rust from the `XxxConfig` builders (each converts `into()` a
/// `Layer`), or read from a config file, where every layer is a table with a
/// `type` (the variant's name in snake case) and its config's fields; optional
/// fields take PyTorch's defaults.
///
/// ```
/// use kiln_core::model::{BatchNormConfig, Conv2dConfig, Layer, LinearConfig, Pool2dConfig};
///
/// let net = Layer::sequential([
///     Conv2dConfig::new(1, 8, [3, 3]).with_padding([1, 1]).into(),
///     Layer::BatchNorm2d(BatchNormConfig::new(8)),
///     Layer::Relu,
///     Layer::MaxPool2d(Pool2dConfig::new([2, 2])),
///     Layer::Flatten { start_dim: 1, end_dim: -1 },
///     LinearConfig::new(8 * 4 * 4, 10).into(),
/// ]);
/// assert_eq!(net.output_shape(&[32, 1, 8, 8])?, vec![32, 10]);
///
/// let names: Vec<String> = net.parameter_specs("")?.into_iter().map(|p| p.name).collect();
/// assert_eq!(names[..3], ["0.weight", "0.bias", "1.weight"]);
/// assert_eq!(names[6], "1.num_batches_tracked");
///
/// // The same network, as a config file would hold it.
/// let json = serde_json::json!({"type": "sequential", "layers": [
///     {"type": "conv2d", "in_channels": 1, "out_channels": 8, "kernel_size": 3, "padding": 1},
///     {"type": "batch_norm2d", "num_features": 8},
///     {"type": "relu"},
///     {"type": "max_pool2d", "kernel_size": 2},
///     {"type": "flatten"},
///     {"type": "linear", "in_features": 128, "out_features": 10},
/// ]});
/// assert_eq!(serde_json::from_value::<Layer>(json).expect("valid"), net);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
#[non_exhaustive]
pub enum Layer {
    /// `nn.Linear`.
    Linear(LinearConfig),
    /// `nn.Conv1d`.
    Conv1d(Conv1dConfig),
    /// `nn.Conv2d`.
    Conv2d(Conv2dConfig),
    /// `nn.ConvTranspose2d`.
    ConvTranspose2d(ConvTranspose2dConfig),
    /// `nn.MaxPool2d`.
    MaxPool2d(Pool2dConfig),
    /// `nn.AvgPool2d` (`count_include_pad=True`, `ceil_mode=False`).
    AvgPool2d(Pool2dConfig),
    /// `nn.AdaptiveAvgPool2d`: average pooling to a fixed `[height, width]`.
    AdaptiveAvgPool2d {
        /// Output size `[height, width]` (one number means both).
        #[serde(deserialize_with = "layers::pair")]
        output_size: [usize; 2],
    },
    /// `nn.BatchNorm1d` on `[N, C]` or `[N, C, L]`.
    BatchNorm1d(BatchNormConfig),
    /// `nn.BatchNorm2d` on `[N, C, H, W]`.
    BatchNorm2d(BatchNormConfig),
    /// `nn.LayerNorm`.
    LayerNorm(LayerNormConfig),
    /// `nn.GroupNorm`.
    GroupNorm(GroupNormConfig),
    /// RMSNorm over the last dimension (`nn.RMSNorm`, LLaMA's `LlamaRMSNorm`).
    RmsNorm(RmsNormConfig),
    /// `nn.Dropout`: zeroes elements with probability `p` in training.
    Dropout {
        /// Probability of zeroing an element, in `[0, 1)` (default 0.5).
        #[serde(default = "half")]
        p: f64,
    },
    /// `nn.Embedding`: maps integer indices `[*]` to vectors `[*, embedding_dim]`.
    Embedding(EmbeddingConfig),
    /// `nn.Flatten`: merges dimensions `start_dim..=end_dim` (negative counts from the end).
    Flatten {
        /// First dimension to merge (default 1, keeping the batch dimension).
        #[serde(default = "one_isize")]
        start_dim: isize,
        /// Last dimension to merge (default -1).
        #[serde(default = "minus_one")]
        end_dim: isize,
    },
    /// `torch.select(x, dim, index)`: the slice at `index` of dimension `dim`,
    /// which it removes (`{ dim = 1, index = -1 }` takes a sequence's last
    /// token, `index = 0` its first, as classification heads pool).
    ///
    /// Over the sequence (`dim = 1`) of a padded batch (an input with its
    /// attention mask, see [`Layer::takes_attention_mask`]), a negative
    /// `index` counts back from each row's last token that is not padding,
    /// as `*ForSequenceClassification` pools a decoder's last token.
    Select {
        /// The dimension (not the batch's, 0; negative counts from the end).
        dim: isize,
        /// The position along it (negative counts from the end).
        index: isize,
    },
    /// `torch.transpose(x, dim0, dim1)`: swaps two dimensions (not the batch's).
    Transpose {
        /// One dimension (negative counts from the end).
        dim0: isize,
        /// The other.
        dim1: isize,
    },
    /// `nn.ReLU`.
    Relu,
    /// `nn.LeakyReLU`.
    LeakyRelu {
        /// Slope for negative inputs (default 0.01).
        #[serde(default = "default_negative_slope")]
        negative_slope: f64,
    },
    /// `nn.GELU`.
    Gelu {
        /// Exact or tanh-approximated (default exact).
        #[serde(default)]
        approximate: GeluApproximation,
    },
    /// `nn.SiLU` (swish).
    Silu,
    /// `nn.Tanh`.
    Tanh,
    /// `x * factor`, a constant multiplier (Granite's residual and logit
    /// multipliers; with `Tanh`, Gemma 2's logit softcapping).
    Scale {
        /// The multiplier (finite).
        factor: f64,
    },
    /// `nn.Sigmoid`.
    Sigmoid,
    /// `nn.Softmax` along `dim` (negative counts from the end).
    Softmax {
        /// The dimension that sums to 1.
        dim: isize,
    },
    /// `nn.LogSoftmax` along `dim` (negative counts from the end).
    LogSoftmax {
        /// The dimension to normalise.
        dim: isize,
    },
    /// Multi-head self-attention on `[batch, seq, embed]` with
    /// `nn.MultiheadAttention`'s parameters (`batch_first=True`).
    MultiHeadSelfAttention(AttentionConfig),
    /// Self-attention with separate projections, grouped-query heads, RoPE and
    /// QK-norm, as in the Hugging Face decoder and encoder families.
    SelfAttention(SelfAttentionConfig),
    /// A gated feed-forward block (SwiGLU, GeGLU).
    GatedMlp(GatedMlpConfig),
    /// A sparse mixture of gated experts with top-k routing (Mixtral, Qwen-MoE, OLMoE).
    SparseMoe(SparseMoeConfig),
    /// Adds a learned or sinusoidal position embedding to `[batch, seq, dim]`.
    PositionEmbedding(PositionEmbeddingConfig),
    /// An output projection sharing another layer's weight (tied embeddings).
    TiedLinear(TiedLinearConfig),
    /// Adds BERT's token-type embedding of segment 0.
    TokenTypeEmbedding(TokenTypeEmbeddingConfig),
    /// Prepends a learned token (ViT's `[CLS]`) to `[batch, seq, dim]`.
    ClassToken(ClassTokenConfig),
    /// `nn.Sequential`: the layers applied in order; children are named `"0"`, `"1"`, ...
    Sequential {
        /// The layers, first applied first.
        layers: Vec<Layer>,
    },
    /// `y = x + block(x)`; the inner layer is named `"block"`.
    Residual {
        /// The residual branch; its output shape must equal its input shape.
        block: Box<Layer>,
    },
    /// `y = branches[0](x) + branches[1](x) + ...`: every branch applied to the
    /// same input and their outputs summed; children are named `"0"`, `"1"`, ...
    ///
    /// Inside a [`Layer::Residual`] it is the parallel residual of GPT-NeoX,
    /// GPT-J and Cohere, `x + attn(ln1(x)) + mlp(ln2(x))`.
    Parallel {
        /// The branches, at least one; each must give the same output shape.
        branches: Vec<Layer>,
    },
    /// An op registered by a backend extension (kiln-fused-ops, or a user's crate),
    /// with the parameters the layer declares; see [`CustomConfig`].
    Custom(CustomConfig),
    /// A TorchScript file as a layer (a pretrained backbone), torch backend
    /// only; see [`TorchScriptConfig`].
    #[serde(rename = "torchscript")]
    TorchScript(TorchScriptConfig),
    /// A SavedModel signature as a frozen feature extractor, TensorFlow
    /// backend only; see [`SavedModelLayerConfig`].
    SavedModel(SavedModelLayerConfig),
}

/// What [`Layer::resolve_shapes`] calls on each layer: `(path, layer, input
/// shape, input dtype)`.
pub type ShapeFill<'a> = dyn FnMut(&str, &mut Layer, &[usize], DType) -> Result<()> + 'a;

/// Whether a [`ParamSpec`] is trained or only saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamKind {
    /// A trainable parameter (`named_parameters()`).
    Parameter,
    /// A non-trainable buffer saved in the state dict (`named_buffers()`).
    Buffer,
}

/// One entry of a layer's state dict, as [`Layer::parameter_specs`] lists it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Full dotted name, as in PyTorch's `state_dict()` (`"0.block.1.in_proj_weight"`).
    pub name: String,
    /// Dimensions (`[]` for a scalar).
    pub shape: Vec<usize>,
    /// Element type: [`DType::F32`], or [`DType::I64`] for `num_batches_tracked`.
    pub dtype: DType,
    /// Parameter or buffer.
    pub kind: ParamKind,
    /// The distribution of the initial values.
    pub init: InitDistribution,
    /// A row (index along dimension 0) set to zero after sampling `init`:
    /// an embedding's `padding_idx`.
    pub zero_row: Option<usize>,
}

/// Runs `$body` for `$layer` with `$kind` bound to its variant's name (the
/// type name errors show) and `$spec` to its rules, a [`LayerSpec`] from its
/// family's file: the one place that maps each variant to its family.
macro_rules! with_spec {
    ($layer:expr, |$kind:ident, $spec:ident| $body:expr) => {
        with_spec!(@table $layer, $kind, $spec, $body;
            Linear(c) => c,
            Conv1d(c) => c,
            Conv2d(c) => c,
            ConvTranspose2d(c) => c,
            MaxPool2d(c) => c,
            AvgPool2d(c) => c,
            AdaptiveAvgPool2d { output_size } => &pool::AdaptiveAvgPool2d(*output_size),
            BatchNorm1d(c) => &norm::BatchNorm1d(c),
            BatchNorm2d(c) => &norm::BatchNorm2d(c),
            LayerNorm(c) => c,
            GroupNorm(c) => c,
            RmsNorm(c) => c,
            Dropout { p } => &dropout::Dropout(*p),
            Embedding(c) => c,
            Flatten { start_dim, end_dim } => &structure::Flatten { start_dim: *start_dim, end_dim: *end_dim },
            Select { dim, index } => &structure::Select { dim: *dim, index: *index },
            Transpose { dim0, dim1 } => &structure::Transpose { dim0: *dim0, dim1: *dim1 },
            Relu {} => &activation::Elementwise,
            LeakyRelu { negative_slope } => &activation::LeakyRelu(*negative_slope),
            Gelu { .. } => &activation::Elementwise,
            Silu {} => &activation::Elementwise,
            Tanh {} => &activation::Elementwise,
            Scale { factor } => &activation::Scale(*factor),
            Sigmoid {} => &activation::Elementwise,
            Softmax { dim } => &activation::Softmax(*dim),
            LogSoftmax { dim } => &activation::Softmax(*dim),
            MultiHeadSelfAttention(c) => c,
            SelfAttention(c) => c,
            GatedMlp(c) => c,
            SparseMoe(c) => c,
            PositionEmbedding(c) => c,
            TiedLinear(c) => c,
            TokenTypeEmbedding(c) => c,
            ClassToken(c) => c,
            Sequential { layers } => &structure::Sequential(layers),
            Residual { block } => &structure::Residual(block),
            Parallel { branches } => &structure::Parallel(branches),
            Custom(c) => c,
            TorchScript(c) => c,
            SavedModel(c) => c,
        )
    };
    (@table $layer:expr, $kind:ident, $spec:ident, $body:expr;
        $($variant:ident $fields:tt => $rules:expr,)*) => {
        match $layer {
            $(Layer::$variant $fields => {
                let $kind: &'static str = stringify!($variant);
                let $spec = $rules;
                $body
            })*
        }
    };
}

impl Layer {
    /// The layer's type name as errors show it (`"Linear"`, `"Conv2d"`, ...).
    pub fn kind(&self) -> &'static str {
        with_spec!(self, |kind, _spec| kind)
    }

    /// The first layer the input reaches, through `Sequential`, `Residual`
    /// and `Parallel` containers (a `Parallel`'s first branch); `None` for an
    /// empty `Sequential`.
    ///
    /// ```
    /// use kiln_core::model::{Layer, LinearConfig};
    ///
    /// let model = Layer::sequential([LinearConfig::new(4, 2).into(), Layer::Relu]);
    /// assert_eq!(model.first_leaf().map(Layer::kind), Some("Linear"));
    /// ```
    pub fn first_leaf(&self) -> Option<&Layer> {
        match self {
            Layer::Sequential { layers } => layers.first().and_then(Layer::first_leaf),
            Layer::Residual { block } => block.first_leaf(),
            Layer::Parallel { branches } => branches.first().and_then(Layer::first_leaf),
            leaf => Some(leaf),
        }
    }

    /// The dtype of the model's input: int64 indices when an `Embedding`
    /// comes first, float32 otherwise; `None` when a `SavedModel` layer comes
    /// first (its signature decides).
    pub fn input_dtype(&self) -> Option<DType> {
        match self.first_leaf() {
            Some(Layer::Embedding(_)) => Some(DType::I64),
            Some(Layer::SavedModel(_)) => None,
            _ => Some(DType::F32),
        }
    }

    /// Checks every layer's configuration for values that can never work:
    /// zero sizes, `groups` not dividing the channels, `embed_dim` not
    /// divisible by `num_heads`, probabilities outside `[0, 1)`, negative
    /// `eps`, an output padding not below stride or dilation, pooling padding
    /// above half the kernel, a padding row outside the table, and
    /// initialisers that cannot apply to their parameter (such as Xavier on a
    /// bias).
    ///
    /// Fails with [`Error::InvalidArgument`](crate::Error::InvalidArgument) naming the field by its path
    /// (`"1.block.groups"`).
    ///
    /// ```
    /// use kiln_core::model::{AttentionConfig, Layer};
    ///
    /// let bad = Layer::sequential([Layer::MultiHeadSelfAttention(AttentionConfig::new(30, 4))]);
    /// let err = bad.validate().expect_err("30 is not divisible by 4");
    /// assert_eq!(
    ///     err.to_string(),
    ///     "invalid argument `0.num_heads`: MultiHeadSelfAttention: embed_dim (30) must be divisible by num_heads (4)"
    /// );
    /// ```
    pub fn validate(&self) -> Result<()> {
        let mut specs = Vec::new();
        self.collect_specs("", &mut specs)?;
        self.check_tied(&specs)
    }

    /// Checks that every [`Layer::TiedLinear`] names a parameter of the model
    /// (whose state dict is `specs`) of shape `[out_features, in_features]`.
    fn check_tied(&self, specs: &[ParamSpec]) -> Result<()> {
        for (path, layer) in self.layers() {
            let Layer::TiedLinear(c) = layer else {
                continue;
            };
            let field = layers::join(&path, "weight");
            let expected = [c.out_features, c.in_features];
            match specs.iter().find(|s| s.name == c.weight) {
                Some(s) if s.kind == ParamKind::Parameter && s.shape == expected => {}
                Some(s) => {
                    return Err(crate::Error::invalid_argument(
                        field,
                        format!(
                            "TiedLinear: `{}` is a {:?} of shape {:?}; the tied weight must be a \
                             parameter of shape {expected:?} ([out_features, in_features])",
                            c.weight, s.kind, s.shape
                        ),
                    ))
                }
                None => {
                    return Err(crate::Error::invalid_argument(
                        field,
                        format!(
                            "TiedLinear: the model has no parameter `{}` to share",
                            c.weight
                        ),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Checks this layer's own fields (not its children's).
    fn validate_own(&self, path: &str) -> Result<()> {
        with_spec!(self, |kind, spec| spec.validate(&FieldCheck { path, kind }))
    }

    /// The output shape for an input of shape `input` (batch dimension
    /// included), with PyTorch's formulas.
    ///
    /// Expected inputs: `[*, in_features]` for `Linear`; `[N, C, L]` for
    /// `Conv1d`; `[N, C, H, W]` for 2-d convolutions, pooling and
    /// `BatchNorm2d`; `[N, C]` or `[N, C, L]` for `BatchNorm1d`; `[N, C, *]`
    /// for `GroupNorm`; `[*, normalized_shape...]` for `LayerNorm`; any shape
    /// of indices for `Embedding`; `[batch, seq, embed_dim]` for attention.
    ///
    /// Fails with [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) whose context names the layer by
    /// its path and type (`"2.block.0 (Linear)"`), or with the
    /// [`validate`](Layer::validate) error of an invalid configuration.
    ///
    /// ```
    /// use kiln_core::model::{Layer, LinearConfig};
    ///
    /// let net = Layer::sequential([
    ///     LinearConfig::new(4, 8).into(),
    ///     Layer::Relu,
    ///     Layer::residual(Layer::sequential([LinearConfig::new(16, 8).into()])),
    /// ]);
    /// let err = net.output_shape(&[2, 4]).expect_err("8 features reach a Linear(16, 8)");
    /// assert_eq!(err.to_string(), "2.block.0 (Linear): expected shape [*, 16], got [2, 8]");
    /// ```
    ///
    /// A model that [takes an attention mask](Layer::takes_attention_mask)
    /// also takes `[batch, 2, seq]`: its token ids and their mask stacked
    /// ([`stack_attention_mask`]).
    pub fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        self.infer("", &self.token_ids_dims(input))
    }

    /// Whether the model reads an attention mask beside its token ids: it
    /// embeds ids first and has `SelfAttention` layers. Such a model takes a
    /// `[batch, 2, seq]` int64 input as the ids (`[:, 0]`) and their mask
    /// (`[:, 1]`: 1 on the tokens, 0 on the padding), what `transformers`
    /// reads from `model(input_ids, attention_mask=...)`.
    ///
    /// ```
    /// use kiln_core::model::{EmbeddingConfig, Layer, SelfAttentionConfig};
    ///
    /// let ids_only = Layer::sequential([EmbeddingConfig::new(10, 8).into()]);
    /// assert!(!ids_only.takes_attention_mask());
    /// let attends = Layer::sequential([
    ///     EmbeddingConfig::new(10, 8).into(),
    ///     Layer::SelfAttention(SelfAttentionConfig::new(8, 2)),
    /// ]);
    /// assert!(attends.takes_attention_mask());
    /// assert_eq!(attends.output_shape(&[3, 2, 5])?, [3, 5, 8]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn takes_attention_mask(&self) -> bool {
        matches!(self.first_leaf(), Some(Layer::Embedding(_)))
            && self
                .layers()
                .iter()
                .any(|(_, l)| matches!(l, Layer::SelfAttention(_)))
    }

    /// The dims of the token ids in an input of `dims`: `[batch, seq]` for a
    /// stacked `[batch, 2, seq]` input of a model that
    /// [takes an attention mask](Layer::takes_attention_mask); `dims` otherwise.
    pub fn token_ids_dims(&self, dims: &[usize]) -> Vec<usize> {
        match dims {
            [batch, 2, seq] if self.takes_attention_mask() => vec![*batch, *seq],
            _ => dims.to_vec(),
        }
    }

    fn infer(&self, path: &str, input: &[usize]) -> Result<Vec<usize>> {
        self.validate_own(path)?;
        with_spec!(self, |kind, spec| spec
            .output_shape(input, &ShapeCheck { path, kind, input }))
    }

    /// Every parameter and buffer, with full dotted names starting with
    /// `prefix` (`""` for none), in the order of PyTorch's `state_dict()`, and
    /// the distribution each starts from.
    ///
    /// Where a layer's initialiser is `None`, this is PyTorch's default for
    /// that layer: `Linear` and convolution weights
    /// `kaiming_uniform(a=sqrt(5))` (`U(-1/sqrt(fan_in), 1/sqrt(fan_in))`) and
    /// biases `U(-1/sqrt(fan_in), 1/sqrt(fan_in))` with the weight's fan-in
    /// (for `ConvTranspose2d` taken from its `[in, out/groups, kh, kw]` weight);
    /// `Embedding` `N(0, 1)` with the padding row zeroed (see
    /// [`ParamSpec::zero_row`]); normalisation weights 1, biases 0, running
    /// means 0, running variances 1, `num_batches_tracked` 0 (an `i64`
    /// scalar); attention `in_proj_weight` Xavier-uniform, `in_proj_bias` 0,
    /// `out_proj.weight` the `Linear` default and `out_proj.bias` 0.
    ///
    /// Also validates the configuration, as [`validate`](Layer::validate).
    pub fn parameter_specs(&self, prefix: &str) -> Result<Vec<ParamSpec>> {
        let mut specs = Vec::new();
        self.collect_specs(prefix, &mut specs)?;
        if prefix.is_empty() {
            self.check_tied(&specs)?;
        }
        Ok(specs)
    }

    /// Total number of elements of the trainable parameters.
    ///
    /// ```
    /// use kiln_core::model::{Layer, LinearConfig};
    ///
    /// assert_eq!(Layer::from(LinearConfig::new(3, 2)).num_parameters()?, 8);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn num_parameters(&self) -> Result<usize> {
        Ok(self
            .parameter_specs("")?
            .iter()
            .filter(|s| s.kind == ParamKind::Parameter)
            .map(|s| Shape::from(s.shape.as_slice()).numel())
            .sum())
    }

    /// Every layer of the tree with its dotted path (`""` for the root), parents
    /// before their children, in the order of the state dict.
    ///
    /// ```
    /// use kiln_core::model::{Layer, LinearConfig};
    ///
    /// let net = Layer::sequential([LinearConfig::new(4, 8).into(), Layer::Relu]);
    /// let paths: Vec<String> = net.layers().into_iter().map(|(path, _)| path).collect();
    /// assert_eq!(paths, ["", "0", "1"]);
    /// ```
    pub fn layers(&self) -> Vec<(String, &Layer)> {
        fn walk<'a>(layer: &'a Layer, path: String, out: &mut Vec<(String, &'a Layer)>) {
            out.push((path.clone(), layer));
            match layer {
                Layer::Sequential { layers } | Layer::Parallel { branches: layers } => {
                    for (i, child) in layers.iter().enumerate() {
                        walk(child, layers::join(&path, &i.to_string()), out);
                    }
                }
                Layer::Residual { block } => walk(block, layers::join(&path, "block"), out),
                _ => {}
            }
        }
        let mut out = Vec::new();
        walk(self, String::new(), &mut out);
        out
    }

    /// The batch-norm layers of the tree that keep running statistics, with
    /// their paths and momenta (what [`Module::running_stats`](crate::module::Module::running_stats)
    /// reports for a model built from this definition).
    ///
    /// ```
    /// use kiln_core::model::{BatchNormConfig, Layer, LinearConfig};
    ///
    /// let net = Layer::sequential([
    ///     LinearConfig::new(4, 8).into(),
    ///     Layer::BatchNorm1d(BatchNormConfig::new(8).with_momentum(0.2)),
    /// ]);
    /// let stats = net.running_stats();
    /// assert_eq!((stats[0].path.as_str(), stats[0].momentum), ("1", 0.2));
    /// ```
    pub fn running_stats(&self) -> Vec<crate::module::RunningStats> {
        self.layers()
            .into_iter()
            .filter_map(|(path, layer)| match layer {
                Layer::BatchNorm1d(c) | Layer::BatchNorm2d(c) if c.track_running_stats => {
                    Some(crate::module::RunningStats {
                        path,
                        momentum: c.momentum,
                    })
                }
                _ => None,
            })
            .collect()
    }

    /// The output shape for `input`, as [`output_shape`](Layer::output_shape),
    /// letting `fill` complete each layer first: `fill(path, layer, input,
    /// dtype)` is called on every layer that is not a `Sequential`,
    /// `Residual` or `Parallel`, with the shape reaching it and its dtype (`dtype`, the
    /// data's, for the first layer; float32 features after it), before its own
    /// output shape is inferred. Backends use
    /// it to record what only running a layer tells (the output shape of a
    /// TorchScript or SavedModel layer).
    ///
    /// ```
    /// use kiln_core::{model::{Layer, LinearConfig}, DType};
    ///
    /// let mut net = Layer::sequential([LinearConfig::new(4, 8).into(), Layer::Relu]);
    /// let mut seen = Vec::new();
    /// let out = net.resolve_shapes(&[2, 4], DType::F64, &mut |path, _layer, input, dtype| {
    ///     seen.push((path.to_owned(), input.to_vec(), dtype));
    ///     Ok(())
    /// })?;
    /// assert_eq!(out, vec![2, 8]);
    /// assert_eq!(seen, [
    ///     ("0".to_owned(), vec![2, 4], DType::F64),
    ///     ("1".to_owned(), vec![2, 8], DType::F32),
    /// ]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn resolve_shapes(
        &mut self,
        input: &[usize],
        dtype: DType,
        fill: &mut ShapeFill<'_>,
    ) -> Result<Vec<usize>> {
        let mut dtype = Some(dtype);
        self.resolve_at("", input, &mut dtype, fill)
    }

    /// `first` is the data's dtype until the first layer has taken it.
    fn resolve_at(
        &mut self,
        path: &str,
        input: &[usize],
        first: &mut Option<DType>,
        fill: &mut ShapeFill<'_>,
    ) -> Result<Vec<usize>> {
        match self {
            Layer::Sequential { layers } => {
                let mut shape = input.to_vec();
                for (i, child) in layers.iter_mut().enumerate() {
                    shape = child.resolve_at(
                        &layers::join(path, &i.to_string()),
                        &shape,
                        first,
                        fill,
                    )?;
                }
                Ok(shape)
            }
            Layer::Residual { block } => {
                block.resolve_at(&layers::join(path, "block"), input, first, fill)?;
                // The residual's own rule checks that the block keeps the shape.
                self.infer(path, input)
            }
            Layer::Parallel { branches } => {
                // Every branch takes the data as it reaches the container.
                let data = *first;
                for (i, child) in branches.iter_mut().enumerate() {
                    let mut dtype = data;
                    child.resolve_at(
                        &layers::join(path, &i.to_string()),
                        input,
                        &mut dtype,
                        fill,
                    )?;
                }
                first.take();
                // The container's own rule checks that the branches agree.
                self.infer(path, input)
            }
            leaf => {
                fill(path, leaf, input, first.take().unwrap_or(DType::F32))?;
                leaf.infer(path, input)
            }
        }
    }

    /// The [`TorchScript`](Layer::TorchScript) layers of the tree with their paths.
    pub fn torchscript_layers(&self) -> Vec<(String, &TorchScriptConfig)> {
        self.layers()
            .into_iter()
            .filter_map(|(path, layer)| match layer {
                Layer::TorchScript(c) => Some((path, c)),
                _ => None,
            })
            .collect()
    }

    /// The [`TorchScript`](Layer::TorchScript) layers with their paths,
    /// mutable, for filling in what a backend finds out (their output shapes).
    pub fn torchscript_layers_mut(&mut self) -> Vec<(String, &mut TorchScriptConfig)> {
        fn walk<'a>(
            layer: &'a mut Layer,
            path: String,
            out: &mut Vec<(String, &'a mut TorchScriptConfig)>,
        ) {
            match layer {
                Layer::Sequential { layers } | Layer::Parallel { branches: layers } => {
                    for (i, child) in layers.iter_mut().enumerate() {
                        walk(child, layers::join(&path, &i.to_string()), out);
                    }
                }
                Layer::Residual { block } => walk(block, layers::join(&path, "block"), out),
                Layer::TorchScript(c) => out.push((path, c)),
                _ => {}
            }
        }
        let mut out = Vec::new();
        walk(self, String::new(), &mut out);
        out
    }

    /// The [`SavedModel`](Layer::SavedModel) layers of the tree with their paths.
    pub fn saved_model_layers(&self) -> Vec<(String, &SavedModelLayerConfig)> {
        self.layers()
            .into_iter()
            .filter_map(|(path, layer)| match layer {
                Layer::SavedModel(c) => Some((path, c)),
                _ => None,
            })
            .collect()
    }

    fn collect_specs(&self, path: &str, out: &mut Vec<ParamSpec>) -> Result<()> {
        self.validate_own(path)?;
        with_spec!(self, |kind, spec| spec.param_specs(&mut Params {
            path,
            kind,
            out
        }))
    }
}

macro_rules! layer_from_config {
    ($($config:ty => $variant:ident),* $(,)?) => {
        $(
            impl From<$config> for Layer {
                fn from(config: $config) -> Self {
                    Layer::$variant(config)
                }
            }
        )*
    };
}

layer_from_config! {
    LinearConfig => Linear,
    Conv1dConfig => Conv1d,
    Conv2dConfig => Conv2d,
    ConvTranspose2dConfig => ConvTranspose2d,
    LayerNormConfig => LayerNorm,
    GroupNormConfig => GroupNorm,
    EmbeddingConfig => Embedding,
    AttentionConfig => MultiHeadSelfAttention,
    RmsNormConfig => RmsNorm,
    SelfAttentionConfig => SelfAttention,
    GatedMlpConfig => GatedMlp,
    SparseMoeConfig => SparseMoe,
    PositionEmbeddingConfig => PositionEmbedding,
    TiedLinearConfig => TiedLinear,
    TokenTypeEmbeddingConfig => TokenTypeEmbedding,
    ClassTokenConfig => ClassToken,
    CustomConfig => Custom,
    TorchScriptConfig => TorchScript,
    SavedModelLayerConfig => SavedModel,
}

#[cfg(test)]
mod tests;

/// A model built from a [`Layer`] definition (a backend's model type), which
/// exporters read: the definition gives the architecture, the module's state
/// dict the weights.
pub trait Definition {
    /// The definition the model was built from.
    fn definition(&self) -> &Layer;
}
