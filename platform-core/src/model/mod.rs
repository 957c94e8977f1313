//! Declarative model definitions.
//!
//! A [`Layer`] describes a network in backend-neutral terms: its sizes, its
//! initialisers and how layers compose. It knows its own shapes
//! ([`Layer::output_shape`]) and the exact names, shapes and initial
//! distributions of its parameters and buffers ([`Layer::parameter_specs`]),
//! which are those of the equivalent `torch.nn` module's `state_dict()`.
//! Each backend builds the layer natively.

mod init;
mod layer;
mod registry;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::Shape;

pub use init::{fan_in_and_fan_out, FanMode, Init, InitDistribution, Nonlinearity};
pub use layer::{
    AttentionConfig, BatchNormConfig, Conv1dConfig, Conv2dConfig, ConvTranspose2dConfig,
    CustomConfig, CustomParam, EmbeddingConfig, GeluApproximation, GroupNormConfig,
    LayerNormConfig, LinearConfig, Pool2dConfig,
};
pub use registry::CustomLayerRegistry;

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
/// use kiln_core::{BatchNormConfig, Conv2dConfig, Layer, LinearConfig, Pool2dConfig};
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
        #[serde(deserialize_with = "layer::pair")]
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
    /// An op registered by a backend extension (kiln-ops, or a user's crate),
    /// with the parameters the layer declares; see [`CustomConfig`].
    Custom(CustomConfig),
}

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

/// `prefix.name`, or `name` at the root.
fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}

/// The layer path and type as errors show them: `2.block.0 (Linear)`.
fn context(path: &str, kind: &str) -> String {
    if path.is_empty() {
        kind.to_owned()
    } else {
        format!("{path} ({kind})")
    }
}

fn dims(shape: &[usize]) -> String {
    Shape::from(shape).to_string()
}

/// Builds invalid-argument errors for one layer's fields.
struct FieldCheck<'a> {
    path: &'a str,
    kind: &'static str,
}

impl FieldCheck<'_> {
    fn invalid(&self, field: &str, reason: impl std::fmt::Display) -> Error {
        Error::invalid_argument(join(self.path, field), format!("{}: {reason}", self.kind))
    }

    fn positive(&self, field: &str, v: usize) -> Result<()> {
        if v == 0 {
            return Err(self.invalid(field, "must be at least 1, got 0"));
        }
        Ok(())
    }

    fn positive_all(&self, field: &str, v: &[usize]) -> Result<()> {
        if v.contains(&0) {
            return Err(self.invalid(field, format!("every size must be at least 1, got {v:?}")));
        }
        Ok(())
    }

    fn probability(&self, field: &str, p: f64) -> Result<()> {
        if !(0.0..1.0).contains(&p) {
            return Err(self.invalid(field, format!("must be in [0, 1), got {p}")));
        }
        Ok(())
    }

    fn non_negative(&self, field: &str, v: f64) -> Result<()> {
        if !(v.is_finite() && v >= 0.0) {
            return Err(self.invalid(field, format!("must be finite and >= 0, got {v}")));
        }
        Ok(())
    }

    fn divisible(&self, field: &str, what: &str, value: usize, groups: usize) -> Result<()> {
        if groups != 0 && !value.is_multiple_of(groups) {
            return Err(self.invalid(
                field,
                format!("{what} ({value}) must be divisible by {field} ({groups})"),
            ));
        }
        Ok(())
    }
}

/// Output length of a convolution or pooling window along one dimension
/// (PyTorch's formula with `ceil_mode=False`), or `None` when the padded
/// input is shorter than the dilated kernel.
fn window_out(
    len: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
) -> Option<usize> {
    let effective = dilation
        .checked_mul(kernel.checked_sub(1)?)?
        .checked_add(1)?;
    let padded = len.checked_add(padding.checked_mul(2)?)?;
    let span = padded.checked_sub(effective)?;
    Some(span.checked_div(stride)? + 1)
}

/// Output length of a transposed convolution along one dimension:
/// `(len - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1`,
/// or `None` when that is below 1.
fn transposed_out(
    len: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    output_padding: usize,
    dilation: usize,
) -> Option<usize> {
    let [len, kernel, stride, padding, output_padding, dilation] =
        [len, kernel, stride, padding, output_padding, dilation].map(|v| v as i128);
    let out = (len - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1;
    usize::try_from(out).ok().filter(|&o| o >= 1)
}

/// Normalises a possibly negative dimension index for a tensor of `rank` dimensions.
fn normalize_dim(dim: isize, rank: usize) -> Option<usize> {
    if dim < 0 {
        rank.checked_sub(dim.unsigned_abs())
    } else {
        Some(dim.unsigned_abs()).filter(|&d| d < rank)
    }
}

impl Layer {
    /// A [`Layer::Sequential`] of `layers`.
    pub fn sequential(layers: impl IntoIterator<Item = Layer>) -> Self {
        Layer::Sequential {
            layers: layers.into_iter().collect(),
        }
    }

    /// A [`Layer::Residual`] around `block`.
    pub fn residual(block: Layer) -> Self {
        Layer::Residual {
            block: Box::new(block),
        }
    }

    /// A pre-norm transformer encoder block on `[batch, seq, embed_dim]`:
    ///
    /// ```text
    /// Sequential[
    ///   Residual(Sequential[LayerNorm(E), MultiHeadSelfAttention(E, heads, causal, dropout)]),
    ///   Residual(Sequential[LayerNorm(E), Linear(E, F), Gelu, Linear(F, E), Dropout(dropout)]),
    /// ]
    /// ```
    ///
    /// ```
    /// use kiln_core::Layer;
    ///
    /// let block = Layer::transformer_encoder_block(64, 4, 256, true, 0.1);
    /// assert_eq!(block.output_shape(&[2, 10, 64])?, vec![2, 10, 64]);
    /// let specs = block.parameter_specs("encoder.0")?;
    /// assert_eq!(specs[2].name, "encoder.0.0.block.1.in_proj_weight");
    /// assert_eq!(specs[2].shape, vec![192, 64]);
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn transformer_encoder_block(
        embed_dim: usize,
        num_heads: usize,
        ff_dim: usize,
        causal: bool,
        dropout: f64,
    ) -> Self {
        Layer::sequential([
            Layer::residual(Layer::sequential([
                Layer::LayerNorm(LayerNormConfig::new([embed_dim])),
                Layer::MultiHeadSelfAttention(
                    AttentionConfig::new(embed_dim, num_heads)
                        .with_causal(causal)
                        .with_dropout(dropout),
                ),
            ])),
            Layer::residual(Layer::sequential([
                Layer::LayerNorm(LayerNormConfig::new([embed_dim])),
                Layer::Linear(LinearConfig::new(embed_dim, ff_dim)),
                Layer::Gelu {
                    approximate: GeluApproximation::None,
                },
                Layer::Linear(LinearConfig::new(ff_dim, embed_dim)),
                Layer::Dropout { p: dropout },
            ])),
        ])
    }

    /// The layer's type name as errors show it (`"Linear"`, `"Conv2d"`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Layer::Linear(_) => "Linear",
            Layer::Conv1d(_) => "Conv1d",
            Layer::Conv2d(_) => "Conv2d",
            Layer::ConvTranspose2d(_) => "ConvTranspose2d",
            Layer::MaxPool2d(_) => "MaxPool2d",
            Layer::AvgPool2d(_) => "AvgPool2d",
            Layer::AdaptiveAvgPool2d { .. } => "AdaptiveAvgPool2d",
            Layer::BatchNorm1d(_) => "BatchNorm1d",
            Layer::BatchNorm2d(_) => "BatchNorm2d",
            Layer::LayerNorm(_) => "LayerNorm",
            Layer::GroupNorm(_) => "GroupNorm",
            Layer::Dropout { .. } => "Dropout",
            Layer::Embedding(_) => "Embedding",
            Layer::Flatten { .. } => "Flatten",
            Layer::Relu => "Relu",
            Layer::LeakyRelu { .. } => "LeakyRelu",
            Layer::Gelu { .. } => "Gelu",
            Layer::Silu => "Silu",
            Layer::Tanh => "Tanh",
            Layer::Sigmoid => "Sigmoid",
            Layer::Softmax { .. } => "Softmax",
            Layer::LogSoftmax { .. } => "LogSoftmax",
            Layer::MultiHeadSelfAttention(_) => "MultiHeadSelfAttention",
            Layer::Sequential { .. } => "Sequential",
            Layer::Residual { .. } => "Residual",
            Layer::Custom(_) => "Custom",
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
    /// Fails with [`Error::InvalidArgument`] naming the field by its path
    /// (`"1.block.groups"`).
    ///
    /// ```
    /// use kiln_core::{AttentionConfig, Layer};
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
        self.collect_specs("", &mut specs)
    }

    /// Checks this layer's own fields (not its children's).
    fn validate_own(&self, path: &str) -> Result<()> {
        let kind = self.kind();
        let check = FieldCheck { path, kind };
        match self {
            Layer::Linear(c) => {
                check.positive("in_features", c.in_features)?;
                check.positive("out_features", c.out_features)
            }
            Layer::Conv1d(c) => {
                check.positive("in_channels", c.in_channels)?;
                check.positive("out_channels", c.out_channels)?;
                check.positive("kernel_size", c.kernel_size)?;
                check.positive("stride", c.stride)?;
                check.positive("dilation", c.dilation)?;
                check.positive("groups", c.groups)?;
                check.divisible("groups", "in_channels", c.in_channels, c.groups)?;
                check.divisible("groups", "out_channels", c.out_channels, c.groups)
            }
            Layer::Conv2d(c) => {
                check.positive("in_channels", c.in_channels)?;
                check.positive("out_channels", c.out_channels)?;
                check.positive_all("kernel_size", &c.kernel_size)?;
                check.positive_all("stride", &c.stride)?;
                check.positive_all("dilation", &c.dilation)?;
                check.positive("groups", c.groups)?;
                check.divisible("groups", "in_channels", c.in_channels, c.groups)?;
                check.divisible("groups", "out_channels", c.out_channels, c.groups)
            }
            Layer::ConvTranspose2d(c) => {
                check.positive("in_channels", c.in_channels)?;
                check.positive("out_channels", c.out_channels)?;
                check.positive_all("kernel_size", &c.kernel_size)?;
                check.positive_all("stride", &c.stride)?;
                check.positive_all("dilation", &c.dilation)?;
                check.positive("groups", c.groups)?;
                check.divisible("groups", "in_channels", c.in_channels, c.groups)?;
                check.divisible("groups", "out_channels", c.out_channels, c.groups)?;
                for i in 0..2 {
                    let op = c.output_padding[i];
                    if op >= c.stride[i] && op >= c.dilation[i] {
                        return Err(check.invalid(
                            "output_padding",
                            format!(
                                "must be smaller than either stride or dilation, got \
                                 output_padding {:?}, stride {:?}, dilation {:?}",
                                c.output_padding, c.stride, c.dilation
                            ),
                        ));
                    }
                }
                Ok(())
            }
            Layer::MaxPool2d(c) | Layer::AvgPool2d(c) => {
                check.positive_all("kernel_size", &c.kernel_size)?;
                if let Some(stride) = c.stride {
                    check.positive_all("stride", &stride)?;
                }
                for i in 0..2 {
                    if c.padding[i] > c.kernel_size[i] / 2 {
                        return Err(check.invalid(
                            "padding",
                            format!(
                                "must be at most half the kernel size {:?}, got {:?}",
                                c.kernel_size, c.padding
                            ),
                        ));
                    }
                }
                Ok(())
            }
            Layer::AdaptiveAvgPool2d { output_size } => {
                check.positive_all("output_size", output_size)
            }
            Layer::BatchNorm1d(c) | Layer::BatchNorm2d(c) => {
                check.positive("num_features", c.num_features)?;
                check.non_negative("eps", c.eps)?;
                if !(0.0..=1.0).contains(&c.momentum) {
                    return Err(
                        check.invalid("momentum", format!("must be in [0, 1], got {}", c.momentum))
                    );
                }
                Ok(())
            }
            Layer::LayerNorm(c) => {
                if c.normalized_shape.is_empty() {
                    return Err(check.invalid("normalized_shape", "must not be empty"));
                }
                check.positive_all("normalized_shape", &c.normalized_shape)?;
                check.non_negative("eps", c.eps)
            }
            Layer::GroupNorm(c) => {
                check.positive("num_groups", c.num_groups)?;
                check.positive("num_channels", c.num_channels)?;
                check.divisible("num_groups", "num_channels", c.num_channels, c.num_groups)?;
                check.non_negative("eps", c.eps)
            }
            Layer::Dropout { p } => check.probability("p", *p),
            Layer::Embedding(c) => {
                check.positive("num_embeddings", c.num_embeddings)?;
                check.positive("embedding_dim", c.embedding_dim)?;
                match c.padding_idx {
                    Some(idx) if idx >= c.num_embeddings => Err(check.invalid(
                        "padding_idx",
                        format!(
                            "must be below num_embeddings ({}), got {idx}",
                            c.num_embeddings
                        ),
                    )),
                    _ => Ok(()),
                }
            }
            Layer::LeakyRelu { negative_slope } => {
                if negative_slope.is_finite() {
                    Ok(())
                } else {
                    Err(check.invalid(
                        "negative_slope",
                        format!("must be finite, got {negative_slope}"),
                    ))
                }
            }
            Layer::MultiHeadSelfAttention(c) => {
                check.positive("embed_dim", c.embed_dim)?;
                check.positive("num_heads", c.num_heads)?;
                check.divisible("num_heads", "embed_dim", c.embed_dim, c.num_heads)?;
                check.probability("dropout", c.dropout)
            }
            Layer::Flatten { .. }
            | Layer::Relu
            | Layer::Gelu { .. }
            | Layer::Silu
            | Layer::Tanh
            | Layer::Sigmoid
            | Layer::Softmax { .. }
            | Layer::LogSoftmax { .. }
            | Layer::Sequential { .. }
            | Layer::Residual { .. } => Ok(()),
            Layer::Custom(c) => {
                let valid_op =
                    c.op.split_once("::")
                        .is_some_and(|(ns, name)| !ns.is_empty() && !name.is_empty());
                if !valid_op {
                    return Err(
                        check.invalid("op", format!("expected `namespace::name`, got {:?}", c.op))
                    );
                }
                let mut seen = std::collections::HashSet::new();
                for param in &c.params {
                    if param.name.is_empty() || param.name.contains('.') {
                        return Err(check.invalid(
                            "params",
                            format!(
                                "parameter name {:?} must be non-empty without dots",
                                param.name
                            ),
                        ));
                    }
                    if !seen.insert(param.name.as_str()) {
                        return Err(check.invalid(
                            "params",
                            format!("parameter {:?} declared twice", param.name),
                        ));
                    }
                }
                match c.attrs.iter().find(|(_, v)| !v.is_finite()) {
                    Some((name, v)) => {
                        Err(check
                            .invalid(&format!("attrs.{name}"), format!("must be finite, got {v}")))
                    }
                    None => Ok(()),
                }
            }
        }
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
    /// Fails with [`Error::ShapeMismatch`] whose context names the layer by
    /// its path and type (`"2.block.0 (Linear)"`), or with the
    /// [`validate`](Layer::validate) error of an invalid configuration.
    ///
    /// ```
    /// use kiln_core::{Layer, LinearConfig};
    ///
    /// let net = Layer::sequential([
    ///     LinearConfig::new(4, 8).into(),
    ///     Layer::Relu,
    ///     Layer::residual(Layer::sequential([LinearConfig::new(16, 8).into()])),
    /// ]);
    /// let err = net.output_shape(&[2, 4]).expect_err("8 features reach a Linear(16, 8)");
    /// assert_eq!(err.to_string(), "2.block.0 (Linear): expected shape [*, 16], got [2, 8]");
    /// ```
    pub fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>> {
        self.infer("", input)
    }

    fn infer(&self, path: &str, input: &[usize]) -> Result<Vec<usize>> {
        self.validate_own(path)?;
        let kind = self.kind();
        let mismatch = |expected: String| Error::ShapeMismatch {
            context: context(path, kind),
            expected,
            actual: dims(input),
        };
        match self {
            Layer::Linear(c) => match input.split_last() {
                Some((&last, rest)) if last == c.in_features => {
                    let mut out = rest.to_vec();
                    out.push(c.out_features);
                    Ok(out)
                }
                _ => Err(mismatch(format!("[*, {}]", c.in_features))),
            },
            Layer::Conv1d(c) => match *input {
                [n, ch, len] if ch == c.in_channels => {
                    let out = window_out(len, c.kernel_size, c.stride, c.padding, c.dilation)
                        .ok_or_else(|| {
                            mismatch(format!(
                                "[N, {}, L] with L + 2 * padding ({}) >= dilation * (kernel_size - 1) + 1 ({})",
                                c.in_channels,
                                c.padding.saturating_mul(2),
                                c.dilation.saturating_mul(c.kernel_size - 1).saturating_add(1)
                            ))
                        })?;
                    Ok(vec![n, c.out_channels, out])
                }
                _ => Err(mismatch(format!("[N, {}, L]", c.in_channels))),
            },
            Layer::Conv2d(c) => match *input {
                [n, ch, h, w] if ch == c.in_channels => {
                    let mut out = [0usize; 2];
                    for (i, len) in [h, w].into_iter().enumerate() {
                        out[i] = window_out(
                            len,
                            c.kernel_size[i],
                            c.stride[i],
                            c.padding[i],
                            c.dilation[i],
                        )
                        .ok_or_else(|| {
                            mismatch(format!(
                                "[N, {}, H, W] at least as large as the dilated kernel {:?} after padding {:?}",
                                c.in_channels,
                                [0, 1].map(|j| c.dilation[j].saturating_mul(c.kernel_size[j] - 1).saturating_add(1)),
                                c.padding
                            ))
                        })?;
                    }
                    Ok(vec![n, c.out_channels, out[0], out[1]])
                }
                _ => Err(mismatch(format!("[N, {}, H, W]", c.in_channels))),
            },
            Layer::ConvTranspose2d(c) => match *input {
                [n, ch, h, w] if ch == c.in_channels => {
                    let mut out = [0usize; 2];
                    for (i, len) in [h, w].into_iter().enumerate() {
                        out[i] = transposed_out(
                            len,
                            c.kernel_size[i],
                            c.stride[i],
                            c.padding[i],
                            c.output_padding[i],
                            c.dilation[i],
                        )
                        .ok_or_else(|| {
                            mismatch(format!(
                                "[N, {}, H, W] large enough for a positive output with padding {:?}",
                                c.in_channels, c.padding
                            ))
                        })?;
                    }
                    Ok(vec![n, c.out_channels, out[0], out[1]])
                }
                _ => Err(mismatch(format!("[N, {}, H, W]", c.in_channels))),
            },
            Layer::MaxPool2d(c) | Layer::AvgPool2d(c) => match *input {
                [n, ch, h, w] => {
                    let stride = c.effective_stride();
                    let mut out = [0usize; 2];
                    for (i, len) in [h, w].into_iter().enumerate() {
                        out[i] = window_out(len, c.kernel_size[i], stride[i], c.padding[i], 1)
                            .ok_or_else(|| {
                                mismatch(format!(
                                    "[N, C, H, W] at least as large as the kernel {:?} after padding {:?}",
                                    c.kernel_size, c.padding
                                ))
                            })?;
                    }
                    Ok(vec![n, ch, out[0], out[1]])
                }
                _ => Err(mismatch("[N, C, H, W]".to_owned())),
            },
            Layer::AdaptiveAvgPool2d { output_size } => match *input {
                [n, ch, h, w] if h > 0 && w > 0 => Ok(vec![n, ch, output_size[0], output_size[1]]),
                _ => Err(mismatch("[N, C, H, W] with H, W >= 1".to_owned())),
            },
            Layer::BatchNorm1d(c) => match *input {
                [_, ch] | [_, ch, _] if ch == c.num_features => Ok(input.to_vec()),
                _ => Err(mismatch(format!("[N, {0}] or [N, {0}, L]", c.num_features))),
            },
            Layer::BatchNorm2d(c) => match *input {
                [_, ch, _, _] if ch == c.num_features => Ok(input.to_vec()),
                _ => Err(mismatch(format!("[N, {}, H, W]", c.num_features))),
            },
            Layer::LayerNorm(c) => {
                if input.ends_with(&c.normalized_shape) {
                    Ok(input.to_vec())
                } else {
                    let trailing: Vec<String> =
                        c.normalized_shape.iter().map(ToString::to_string).collect();
                    Err(mismatch(format!("[*, {}]", trailing.join(", "))))
                }
            }
            Layer::GroupNorm(c) => match input {
                [_, ch, ..] if *ch == c.num_channels => Ok(input.to_vec()),
                _ => Err(mismatch(format!("[N, {}, *]", c.num_channels))),
            },
            Layer::Embedding(c) => {
                let mut out = input.to_vec();
                out.push(c.embedding_dim);
                Ok(out)
            }
            Layer::Flatten { start_dim, end_dim } => {
                // torch.flatten treats a scalar as a 1-d tensor of one element.
                let rank = input.len().max(1);
                let padded: Vec<usize> = if input.is_empty() {
                    vec![1]
                } else {
                    input.to_vec()
                };
                let (start, end) = match (
                    normalize_dim(*start_dim, rank),
                    normalize_dim(*end_dim, rank),
                ) {
                    (Some(s), Some(e)) if s <= e => (s, e),
                    _ => {
                        return Err(mismatch(format!(
                            "a tensor where start_dim {start_dim} is a dimension at or before end_dim {end_dim}"
                        )))
                    }
                };
                let merged = padded[start..=end]
                    .iter()
                    .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                    .ok_or_else(|| mismatch("dimensions whose product fits in usize".to_owned()))?;
                let mut out = padded[..start].to_vec();
                out.push(merged);
                out.extend_from_slice(&padded[end + 1..]);
                Ok(out)
            }
            Layer::Softmax { dim } | Layer::LogSoftmax { dim } => {
                // Like torch.softmax, a scalar accepts dim 0 and -1.
                match normalize_dim(*dim, input.len().max(1)) {
                    Some(_) => Ok(input.to_vec()),
                    None => Err(mismatch(format!("a tensor with dimension {dim}"))),
                }
            }
            Layer::MultiHeadSelfAttention(c) => match *input {
                [_, _, e] if e == c.embed_dim => Ok(input.to_vec()),
                _ => Err(mismatch(format!("[batch, seq, {}]", c.embed_dim))),
            },
            Layer::Dropout { .. }
            | Layer::Relu
            | Layer::LeakyRelu { .. }
            | Layer::Gelu { .. }
            | Layer::Silu
            | Layer::Tanh
            | Layer::Sigmoid
            | Layer::Custom(_) => Ok(input.to_vec()),
            Layer::Sequential { layers } => {
                let mut shape = input.to_vec();
                for (i, layer) in layers.iter().enumerate() {
                    shape = layer.infer(&join(path, &i.to_string()), &shape)?;
                }
                Ok(shape)
            }
            Layer::Residual { block } => {
                let out = block.infer(&join(path, "block"), input)?;
                if out != input {
                    return Err(Error::ShapeMismatch {
                        context: format!(
                            "{}: block output, added to the input",
                            context(path, kind)
                        ),
                        expected: dims(input),
                        actual: dims(&out),
                    });
                }
                Ok(out)
            }
        }
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
        Ok(specs)
    }

    /// Total number of elements of the trainable parameters.
    ///
    /// ```
    /// use kiln_core::{Layer, LinearConfig};
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

    fn collect_specs(&self, path: &str, out: &mut Vec<ParamSpec>) -> Result<()> {
        self.validate_own(path)?;
        let mut params = Params {
            path,
            kind: self.kind(),
            out,
        };
        match self {
            Layer::Linear(c) => {
                params.weight_and_bias(
                    vec![c.out_features, c.in_features],
                    c.bias.then_some(c.out_features),
                    c.weight_init.as_ref(),
                    c.bias_init.as_ref(),
                )?;
            }
            Layer::Conv1d(c) => {
                params.weight_and_bias(
                    vec![c.out_channels, c.in_channels / c.groups, c.kernel_size],
                    c.bias.then_some(c.out_channels),
                    c.weight_init.as_ref(),
                    c.bias_init.as_ref(),
                )?;
            }
            Layer::Conv2d(c) => {
                params.weight_and_bias(
                    vec![
                        c.out_channels,
                        c.in_channels / c.groups,
                        c.kernel_size[0],
                        c.kernel_size[1],
                    ],
                    c.bias.then_some(c.out_channels),
                    c.weight_init.as_ref(),
                    c.bias_init.as_ref(),
                )?;
            }
            Layer::ConvTranspose2d(c) => {
                params.weight_and_bias(
                    vec![
                        c.in_channels,
                        c.out_channels / c.groups,
                        c.kernel_size[0],
                        c.kernel_size[1],
                    ],
                    c.bias.then_some(c.out_channels),
                    c.weight_init.as_ref(),
                    c.bias_init.as_ref(),
                )?;
            }
            Layer::BatchNorm1d(c) | Layer::BatchNorm2d(c) => {
                let n = c.num_features;
                if c.affine {
                    params.constant("weight", vec![n], 1.0, ParamKind::Parameter);
                    params.constant("bias", vec![n], 0.0, ParamKind::Parameter);
                }
                if c.track_running_stats {
                    params.constant("running_mean", vec![n], 0.0, ParamKind::Buffer);
                    params.constant("running_var", vec![n], 1.0, ParamKind::Buffer);
                    params.push(
                        "num_batches_tracked",
                        Vec::new(),
                        DType::I64,
                        ParamKind::Buffer,
                        InitDistribution::Constant { value: 0.0 },
                    );
                }
            }
            Layer::LayerNorm(c) => {
                if c.elementwise_affine {
                    let shape = c.normalized_shape.clone();
                    params.constant("weight", shape.clone(), 1.0, ParamKind::Parameter);
                    if c.bias {
                        params.constant("bias", shape, 0.0, ParamKind::Parameter);
                    }
                }
            }
            Layer::GroupNorm(c) => {
                if c.affine {
                    params.constant("weight", vec![c.num_channels], 1.0, ParamKind::Parameter);
                    params.constant("bias", vec![c.num_channels], 0.0, ParamKind::Parameter);
                }
            }
            Layer::Embedding(c) => {
                let shape = vec![c.num_embeddings, c.embedding_dim];
                let init = match &c.weight_init {
                    Some(init) => params.resolve("weight_init", init, &shape)?,
                    None => InitDistribution::Normal {
                        mean: 0.0,
                        std: 1.0,
                    },
                };
                params.push("weight", shape, DType::F32, ParamKind::Parameter, init);
                if let Some(last) = params.out.last_mut() {
                    last.zero_row = c.padding_idx;
                }
            }
            Layer::MultiHeadSelfAttention(c) => {
                let e = c.embed_dim;
                let e3 = e.saturating_mul(3);
                let in_proj = vec![e3, e];
                let xavier = params.resolve(
                    "in_proj_weight",
                    &Init::XavierUniform { gain: 1.0 },
                    &in_proj,
                )?;
                params.push(
                    "in_proj_weight",
                    in_proj,
                    DType::F32,
                    ParamKind::Parameter,
                    xavier,
                );
                if c.bias {
                    params.constant("in_proj_bias", vec![e3], 0.0, ParamKind::Parameter);
                }
                let out_proj = vec![e, e];
                let default =
                    params.resolve("out_proj.weight", &Init::torch_default_weight(), &out_proj)?;
                params.push(
                    "out_proj.weight",
                    out_proj,
                    DType::F32,
                    ParamKind::Parameter,
                    default,
                );
                if c.bias {
                    params.constant("out_proj.bias", vec![e], 0.0, ParamKind::Parameter);
                }
            }
            Layer::Sequential { layers } => {
                for (i, layer) in layers.iter().enumerate() {
                    layer.collect_specs(&join(path, &i.to_string()), out)?;
                }
            }
            Layer::Residual { block } => block.collect_specs(&join(path, "block"), out)?,
            Layer::Custom(c) => {
                for param in &c.params {
                    let init = params.resolve(
                        &format!("params.{}", param.name),
                        &param.init,
                        &param.shape,
                    )?;
                    params.push(
                        &param.name,
                        param.shape.clone(),
                        DType::F32,
                        ParamKind::Parameter,
                        init,
                    );
                }
            }
            Layer::MaxPool2d(_)
            | Layer::AvgPool2d(_)
            | Layer::AdaptiveAvgPool2d { .. }
            | Layer::Dropout { .. }
            | Layer::Flatten { .. }
            | Layer::Relu
            | Layer::LeakyRelu { .. }
            | Layer::Gelu { .. }
            | Layer::Silu
            | Layer::Tanh
            | Layer::Sigmoid
            | Layer::Softmax { .. }
            | Layer::LogSoftmax { .. } => {}
        }
        Ok(())
    }
}

/// Appends one layer's parameters to the spec list.
struct Params<'a> {
    path: &'a str,
    kind: &'static str,
    out: &'a mut Vec<ParamSpec>,
}

impl Params<'_> {
    fn push(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        dtype: DType,
        kind: ParamKind,
        init: InitDistribution,
    ) {
        self.out.push(ParamSpec {
            name: join(self.path, name),
            shape,
            dtype,
            kind,
            init,
            zero_row: None,
        });
    }

    fn constant(&mut self, name: &str, shape: Vec<usize>, value: f64, kind: ParamKind) {
        self.push(
            name,
            shape,
            DType::F32,
            kind,
            InitDistribution::Constant { value },
        );
    }

    /// Resolves `init` for the parameter configured by `field`, naming the field on error.
    fn resolve(&self, field: &str, init: &Init, shape: &[usize]) -> Result<InitDistribution> {
        init.resolve(shape).map_err(|e| match e {
            Error::InvalidArgument { name, reason } => Error::invalid_argument(
                join(self.path, field),
                format!("{}: {name}: {reason}", self.kind),
            ),
            other => other,
        })
    }

    /// A `Linear`/convolution weight and optional bias with PyTorch's defaults.
    fn weight_and_bias(
        &mut self,
        weight_shape: Vec<usize>,
        bias_len: Option<usize>,
        weight_init: Option<&Init>,
        bias_init: Option<&Init>,
    ) -> Result<()> {
        let weight = self.resolve(
            "weight_init",
            weight_init.unwrap_or(&Init::torch_default_weight()),
            &weight_shape,
        )?;
        let bias = match bias_len {
            None => None,
            Some(len) => {
                let init = match bias_init {
                    Some(init) => self.resolve("bias_init", init, &[len])?,
                    None => {
                        let (fan_in, _) = fan_in_and_fan_out(&weight_shape)?;
                        let bound = if fan_in > 0 {
                            1.0 / (fan_in as f64).sqrt()
                        } else {
                            0.0
                        };
                        InitDistribution::Uniform {
                            low: -bound,
                            high: bound,
                        }
                    }
                };
                Some((len, init))
            }
        };
        self.push(
            "weight",
            weight_shape,
            DType::F32,
            ParamKind::Parameter,
            weight,
        );
        if let Some((len, init)) = bias {
            self.push("bias", vec![len], DType::F32, ParamKind::Parameter, init);
        }
        Ok(())
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
    CustomConfig => Custom,
}

#[cfg(test)]
mod tests;
