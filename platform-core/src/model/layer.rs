//! Configurations of the layers a [`Layer`](super::Layer) can hold.
//!
//! Every config is built with `XxxConfig::new(required...)` and refined with
//! `with_*` methods; optional fields have PyTorch's defaults, also when a
//! config is read from a file.

use serde::{Deserialize, Deserializer, Serialize};

use super::init::Init;

fn yes() -> bool {
    true
}

fn ones2() -> [usize; 2] {
    [1, 1]
}

fn default_eps() -> f64 {
    1e-5
}

fn default_bn_momentum() -> f64 {
    0.1
}

fn one_usize() -> usize {
    1
}

/// Reads a 2-d size written either as one number (`3`, meaning `[3, 3]`) or as a pair.
pub(crate) fn pair<'de, D: Deserializer<'de>>(d: D) -> Result<[usize; 2], D::Error> {
    #[derive(Deserialize)]
    #[serde(
        untagged,
        expecting = "a size: one non-negative integer or a pair [h, w]"
    )]
    enum Pair {
        One(usize),
        Two([usize; 2]),
    }
    Ok(match Pair::deserialize(d)? {
        Pair::One(v) => [v, v],
        Pair::Two(p) => p,
    })
}

/// Like [`pair`], for an optional size.
fn opt_pair<'de, D: Deserializer<'de>>(d: D) -> Result<Option<[usize; 2]>, D::Error> {
    pair(d).map(Some)
}

/// `nn.Linear(in_features, out_features, bias)`: `y = x W^T + b` on the last dimension.
///
/// ```
/// use kiln_core::{Init, Layer, LinearConfig};
///
/// let layer: Layer = LinearConfig::new(64, 10)
///     .with_bias(false)
///     .with_weight_init(Init::XavierUniform { gain: 1.0 })
///     .into();
/// assert_eq!(layer.output_shape(&[32, 64])?, vec![32, 10]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinearConfig {
    /// Size of the input's last dimension.
    pub in_features: usize,
    /// Size of the output's last dimension.
    pub out_features: usize,
    /// Whether to add a learnable bias (default `true`).
    #[serde(default = "yes")]
    pub bias: bool,
    /// Initialiser of `weight`; `None` is PyTorch's default, `U(-1/sqrt(in), 1/sqrt(in))`.
    #[serde(default)]
    pub weight_init: Option<Init>,
    /// Initialiser of `bias`; `None` is PyTorch's default, `U(-1/sqrt(in), 1/sqrt(in))`.
    #[serde(default)]
    pub bias_init: Option<Init>,
}

impl LinearConfig {
    /// A linear layer with bias and PyTorch's default initialisation.
    pub fn new(in_features: usize, out_features: usize) -> Self {
        LinearConfig {
            in_features,
            out_features,
            bias: true,
            weight_init: None,
            bias_init: None,
        }
    }

    /// Sets whether the layer has a bias.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// Sets the initialiser of `weight`.
    pub fn with_weight_init(mut self, init: Init) -> Self {
        self.weight_init = Some(init);
        self
    }

    /// Sets the initialiser of `bias`.
    pub fn with_bias_init(mut self, init: Init) -> Self {
        self.bias_init = Some(init);
        self
    }
}

/// `nn.Conv1d` on `[batch, channels, length]` (zero padding).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conv1dConfig {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel length.
    pub kernel_size: usize,
    /// Stride (default 1).
    #[serde(default = "one_usize")]
    pub stride: usize,
    /// Zero padding on both sides (default 0).
    #[serde(default)]
    pub padding: usize,
    /// Spacing between kernel elements (default 1).
    #[serde(default = "one_usize")]
    pub dilation: usize,
    /// Number of blocked connections from input to output channels (default 1).
    #[serde(default = "one_usize")]
    pub groups: usize,
    /// Whether to add a learnable bias (default `true`).
    #[serde(default = "yes")]
    pub bias: bool,
    /// Initialiser of `weight`; `None` is PyTorch's default.
    #[serde(default)]
    pub weight_init: Option<Init>,
    /// Initialiser of `bias`; `None` is PyTorch's default.
    #[serde(default)]
    pub bias_init: Option<Init>,
}

impl Conv1dConfig {
    /// A convolution with stride 1, no padding, dilation 1, one group and a bias.
    pub fn new(in_channels: usize, out_channels: usize, kernel_size: usize) -> Self {
        Conv1dConfig {
            in_channels,
            out_channels,
            kernel_size,
            stride: 1,
            padding: 0,
            dilation: 1,
            groups: 1,
            bias: true,
            weight_init: None,
            bias_init: None,
        }
    }

    /// Sets the stride.
    pub fn with_stride(mut self, stride: usize) -> Self {
        self.stride = stride;
        self
    }

    /// Sets the zero padding.
    pub fn with_padding(mut self, padding: usize) -> Self {
        self.padding = padding;
        self
    }

    /// Sets the dilation.
    pub fn with_dilation(mut self, dilation: usize) -> Self {
        self.dilation = dilation;
        self
    }

    /// Sets the number of groups.
    pub fn with_groups(mut self, groups: usize) -> Self {
        self.groups = groups;
        self
    }

    /// Sets whether the layer has a bias.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// Sets the initialiser of `weight`.
    pub fn with_weight_init(mut self, init: Init) -> Self {
        self.weight_init = Some(init);
        self
    }

    /// Sets the initialiser of `bias`.
    pub fn with_bias_init(mut self, init: Init) -> Self {
        self.bias_init = Some(init);
        self
    }
}

/// `nn.Conv2d` on `[batch, channels, height, width]` (zero padding).
///
/// Sizes are `[height, width]`; in a config file a single number means both.
///
/// ```
/// use kiln_core::{Conv2dConfig, Layer};
///
/// let conv: Layer = Conv2dConfig::new(3, 16, [3, 3]).with_padding([1, 1]).with_stride([2, 2]).into();
/// assert_eq!(conv.output_shape(&[8, 3, 32, 32])?, vec![8, 16, 16, 16]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conv2dConfig {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel size `[kh, kw]`.
    #[serde(deserialize_with = "pair")]
    pub kernel_size: [usize; 2],
    /// Stride (default `[1, 1]`).
    #[serde(default = "ones2", deserialize_with = "pair")]
    pub stride: [usize; 2],
    /// Zero padding on both sides of each dimension (default `[0, 0]`).
    #[serde(default, deserialize_with = "pair")]
    pub padding: [usize; 2],
    /// Spacing between kernel elements (default `[1, 1]`).
    #[serde(default = "ones2", deserialize_with = "pair")]
    pub dilation: [usize; 2],
    /// Number of blocked connections from input to output channels (default 1).
    #[serde(default = "one_usize")]
    pub groups: usize,
    /// Whether to add a learnable bias (default `true`).
    #[serde(default = "yes")]
    pub bias: bool,
    /// Initialiser of `weight`; `None` is PyTorch's default.
    #[serde(default)]
    pub weight_init: Option<Init>,
    /// Initialiser of `bias`; `None` is PyTorch's default.
    #[serde(default)]
    pub bias_init: Option<Init>,
}

impl Conv2dConfig {
    /// A convolution with stride 1, no padding, dilation 1, one group and a bias.
    pub fn new(in_channels: usize, out_channels: usize, kernel_size: [usize; 2]) -> Self {
        Conv2dConfig {
            in_channels,
            out_channels,
            kernel_size,
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
            bias: true,
            weight_init: None,
            bias_init: None,
        }
    }

    /// Sets the stride.
    pub fn with_stride(mut self, stride: [usize; 2]) -> Self {
        self.stride = stride;
        self
    }

    /// Sets the zero padding.
    pub fn with_padding(mut self, padding: [usize; 2]) -> Self {
        self.padding = padding;
        self
    }

    /// Sets the dilation.
    pub fn with_dilation(mut self, dilation: [usize; 2]) -> Self {
        self.dilation = dilation;
        self
    }

    /// Sets the number of groups.
    pub fn with_groups(mut self, groups: usize) -> Self {
        self.groups = groups;
        self
    }

    /// Sets whether the layer has a bias.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// Sets the initialiser of `weight`.
    pub fn with_weight_init(mut self, init: Init) -> Self {
        self.weight_init = Some(init);
        self
    }

    /// Sets the initialiser of `bias`.
    pub fn with_bias_init(mut self, init: Init) -> Self {
        self.bias_init = Some(init);
        self
    }
}

/// `nn.ConvTranspose2d` on `[batch, channels, height, width]`.
///
/// Its weight is `[in_channels, out_channels / groups, kh, kw]`, as in PyTorch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConvTranspose2dConfig {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel size `[kh, kw]`.
    #[serde(deserialize_with = "pair")]
    pub kernel_size: [usize; 2],
    /// Stride (default `[1, 1]`).
    #[serde(default = "ones2", deserialize_with = "pair")]
    pub stride: [usize; 2],
    /// Implicit zero padding removed from both sides of the output (default `[0, 0]`).
    #[serde(default, deserialize_with = "pair")]
    pub padding: [usize; 2],
    /// Extra size added to one side of the output (default `[0, 0]`); must be
    /// smaller than the stride or the dilation.
    #[serde(default, deserialize_with = "pair")]
    pub output_padding: [usize; 2],
    /// Spacing between kernel elements (default `[1, 1]`).
    #[serde(default = "ones2", deserialize_with = "pair")]
    pub dilation: [usize; 2],
    /// Number of blocked connections from input to output channels (default 1).
    #[serde(default = "one_usize")]
    pub groups: usize,
    /// Whether to add a learnable bias (default `true`).
    #[serde(default = "yes")]
    pub bias: bool,
    /// Initialiser of `weight`; `None` is PyTorch's default.
    #[serde(default)]
    pub weight_init: Option<Init>,
    /// Initialiser of `bias`; `None` is PyTorch's default.
    #[serde(default)]
    pub bias_init: Option<Init>,
}

impl ConvTranspose2dConfig {
    /// A transposed convolution with stride 1, no padding, dilation 1, one group and a bias.
    pub fn new(in_channels: usize, out_channels: usize, kernel_size: [usize; 2]) -> Self {
        ConvTranspose2dConfig {
            in_channels,
            out_channels,
            kernel_size,
            stride: [1, 1],
            padding: [0, 0],
            output_padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
            bias: true,
            weight_init: None,
            bias_init: None,
        }
    }

    /// Sets the stride.
    pub fn with_stride(mut self, stride: [usize; 2]) -> Self {
        self.stride = stride;
        self
    }

    /// Sets the padding.
    pub fn with_padding(mut self, padding: [usize; 2]) -> Self {
        self.padding = padding;
        self
    }

    /// Sets the output padding.
    pub fn with_output_padding(mut self, output_padding: [usize; 2]) -> Self {
        self.output_padding = output_padding;
        self
    }

    /// Sets the dilation.
    pub fn with_dilation(mut self, dilation: [usize; 2]) -> Self {
        self.dilation = dilation;
        self
    }

    /// Sets the number of groups.
    pub fn with_groups(mut self, groups: usize) -> Self {
        self.groups = groups;
        self
    }

    /// Sets whether the layer has a bias.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// Sets the initialiser of `weight`.
    pub fn with_weight_init(mut self, init: Init) -> Self {
        self.weight_init = Some(init);
        self
    }

    /// Sets the initialiser of `bias`.
    pub fn with_bias_init(mut self, init: Init) -> Self {
        self.bias_init = Some(init);
        self
    }
}

/// `nn.MaxPool2d` / `nn.AvgPool2d` (PyTorch defaults: `ceil_mode=False`,
/// `count_include_pad=True`, dilation 1).
///
/// ```
/// use kiln_core::{Layer, Pool2dConfig};
///
/// let pool = Layer::MaxPool2d(Pool2dConfig::new([2, 2]));
/// assert_eq!(pool.output_shape(&[1, 8, 7, 7])?, vec![1, 8, 3, 3]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool2dConfig {
    /// Window size `[kh, kw]`.
    #[serde(deserialize_with = "pair")]
    pub kernel_size: [usize; 2],
    /// Stride; `None` (the default) means the kernel size.
    #[serde(
        default,
        deserialize_with = "opt_pair",
        skip_serializing_if = "Option::is_none"
    )]
    pub stride: Option<[usize; 2]>,
    /// Implicit padding on both sides (default `[0, 0]`); at most half the kernel size.
    #[serde(default, deserialize_with = "pair")]
    pub padding: [usize; 2],
}

impl Pool2dConfig {
    /// A pooling window with stride equal to its size and no padding.
    pub fn new(kernel_size: [usize; 2]) -> Self {
        Pool2dConfig {
            kernel_size,
            stride: None,
            padding: [0, 0],
        }
    }

    /// Sets the stride.
    pub fn with_stride(mut self, stride: [usize; 2]) -> Self {
        self.stride = Some(stride);
        self
    }

    /// Sets the padding.
    pub fn with_padding(mut self, padding: [usize; 2]) -> Self {
        self.padding = padding;
        self
    }

    /// The stride in effect: the configured one, or the kernel size.
    pub fn effective_stride(&self) -> [usize; 2] {
        self.stride.unwrap_or(self.kernel_size)
    }
}

/// `nn.BatchNorm1d` / `nn.BatchNorm2d`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchNormConfig {
    /// Number of channels (`C` of `[N, C, ...]`).
    pub num_features: usize,
    /// Added to the variance for stability (default 1e-5).
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Weight of the newest batch in the running statistics (default 0.1).
    #[serde(default = "default_bn_momentum")]
    pub momentum: f64,
    /// Whether to learn a per-channel scale and shift (default `true`).
    #[serde(default = "yes")]
    pub affine: bool,
    /// Whether to keep running statistics for evaluation (default `true`).
    #[serde(default = "yes")]
    pub track_running_stats: bool,
}

impl BatchNormConfig {
    /// Batch normalisation with PyTorch's defaults.
    pub fn new(num_features: usize) -> Self {
        BatchNormConfig {
            num_features,
            eps: 1e-5,
            momentum: 0.1,
            affine: true,
            track_running_stats: true,
        }
    }

    /// Sets `eps`.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// Sets the running-statistics momentum.
    pub fn with_momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// Sets whether the layer has a learnable scale and shift.
    pub fn with_affine(mut self, affine: bool) -> Self {
        self.affine = affine;
        self
    }

    /// Sets whether running statistics are kept.
    pub fn with_track_running_stats(mut self, track: bool) -> Self {
        self.track_running_stats = track;
        self
    }
}

/// `nn.LayerNorm` over the trailing `normalized_shape` dimensions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerNormConfig {
    /// The trailing dimensions to normalise over.
    pub normalized_shape: Vec<usize>,
    /// Added to the variance for stability (default 1e-5).
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Whether to learn an element-wise scale (and shift, see `bias`) (default `true`).
    #[serde(default = "yes")]
    pub elementwise_affine: bool,
    /// Whether the affine transform has a shift (default `true`; PyTorch's `bias`).
    #[serde(default = "yes")]
    pub bias: bool,
}

impl LayerNormConfig {
    /// Layer normalisation over `normalized_shape` with PyTorch's defaults.
    pub fn new(normalized_shape: impl Into<Vec<usize>>) -> Self {
        LayerNormConfig {
            normalized_shape: normalized_shape.into(),
            eps: 1e-5,
            elementwise_affine: true,
            bias: true,
        }
    }

    /// Sets `eps`.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// Sets whether the layer has a learnable scale and shift.
    pub fn with_elementwise_affine(mut self, affine: bool) -> Self {
        self.elementwise_affine = affine;
        self
    }

    /// Sets whether the affine transform has a shift.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
}

/// `nn.GroupNorm` on `[N, C, ...]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupNormConfig {
    /// Number of groups the channels are split into; must divide `num_channels`.
    pub num_groups: usize,
    /// Number of channels.
    pub num_channels: usize,
    /// Added to the variance for stability (default 1e-5).
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Whether to learn a per-channel scale and shift (default `true`).
    #[serde(default = "yes")]
    pub affine: bool,
}

impl GroupNormConfig {
    /// Group normalisation with PyTorch's defaults.
    pub fn new(num_groups: usize, num_channels: usize) -> Self {
        GroupNormConfig {
            num_groups,
            num_channels,
            eps: 1e-5,
            affine: true,
        }
    }

    /// Sets `eps`.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// Sets whether the layer has a learnable scale and shift.
    pub fn with_affine(mut self, affine: bool) -> Self {
        self.affine = affine;
        self
    }
}

/// `nn.Embedding`: a lookup table from indices to vectors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingConfig {
    /// Number of rows (the vocabulary size).
    pub num_embeddings: usize,
    /// Size of each vector.
    pub embedding_dim: usize,
    /// A row that is initialised to zero and receives no gradient.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padding_idx: Option<usize>,
    /// Initialiser of `weight`; `None` is PyTorch's default, `N(0, 1)`.
    #[serde(default)]
    pub weight_init: Option<Init>,
}

impl EmbeddingConfig {
    /// An embedding table without padding row and with `N(0, 1)` initialisation.
    pub fn new(num_embeddings: usize, embedding_dim: usize) -> Self {
        EmbeddingConfig {
            num_embeddings,
            embedding_dim,
            padding_idx: None,
            weight_init: None,
        }
    }

    /// Sets the padding row.
    pub fn with_padding_idx(mut self, padding_idx: usize) -> Self {
        self.padding_idx = Some(padding_idx);
        self
    }

    /// Sets the initialiser of `weight` (the padding row is still zeroed).
    pub fn with_weight_init(mut self, init: Init) -> Self {
        self.weight_init = Some(init);
        self
    }
}

/// Multi-head self-attention on `[batch, seq, embed_dim]`, with the
/// parameters of `nn.MultiheadAttention(embed_dim, num_heads, dropout, bias,
/// batch_first=True)` and query = key = value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionConfig {
    /// Model width; must be divisible by `num_heads`.
    pub embed_dim: usize,
    /// Number of parallel heads.
    pub num_heads: usize,
    /// Whether position `i` may only attend to positions `<= i` (default `false`).
    #[serde(default)]
    pub causal: bool,
    /// Dropout on the attention weights, in `[0, 1)` (default 0).
    #[serde(default)]
    pub dropout: f64,
    /// Whether the input and output projections have biases (default `true`).
    #[serde(default = "yes")]
    pub bias: bool,
}

impl AttentionConfig {
    /// Non-causal attention without dropout, with biases.
    pub fn new(embed_dim: usize, num_heads: usize) -> Self {
        AttentionConfig {
            embed_dim,
            num_heads,
            causal: false,
            dropout: 0.0,
            bias: true,
        }
    }

    /// Sets whether the attention is causal.
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Sets the attention dropout.
    pub fn with_dropout(mut self, dropout: f64) -> Self {
        self.dropout = dropout;
        self
    }

    /// Sets whether the projections have biases.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
}

/// Which formula [`Layer::Gelu`](super::Layer::Gelu) uses (PyTorch's `approximate`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GeluApproximation {
    /// The exact `x * Phi(x)` (`approximate="none"`, the default).
    #[default]
    None,
    /// The tanh approximation (`approximate="tanh"`).
    Tanh,
}

/// A layer computed by an op a backend extension registered under `op`
/// (Kiln's fused ops in kiln-ops, or a user's own): the backend creates the
/// declared parameters and calls the op with the input, the parameters in
/// declaration order, and the attributes.
///
/// Custom layers keep their input's shape (activations, fused bias and
/// activation, normalisations); the backends check the op's output against it.
/// The op must be registered with the backend that builds the model
/// (`kiln_torch::register_custom_layer`, `kiln_tf::register_custom_layer`,
/// or `kiln_ops::register_layers()` for `kiln::bias_gelu` and `kiln::swish`).
///
/// ```
/// use kiln_core::{CustomConfig, Init, Layer};
///
/// // Swish-β with one learned β starting at 1, as kiln-ops declares it.
/// let layer: Layer = CustomConfig::new("kiln::swish")
///     .with_param("beta", [1], Init::Ones)
///     .into();
/// assert_eq!(layer.output_shape(&[8, 16])?, vec![8, 16]);
/// assert_eq!(layer.parameter_specs("act")?[0].name, "act.beta");
///
/// // The same layer in a config file.
/// let toml = r#"
///     type = "custom"
///     op = "kiln::swish"
///     params = [{ name = "beta", shape = [1], init = { type = "ones" } }]
/// "#;
/// assert_eq!(toml::from_str::<Layer>(toml).expect("valid"), layer);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomConfig {
    /// The registered op, `namespace::name` as in `torch.ops` (`"kiln::swish"`).
    pub op: String,
    /// The learned parameters, passed to the op after the input in this order.
    #[serde(default)]
    pub params: Vec<CustomParam>,
    /// Scalar attributes passed to the op (a slope, an epsilon), by name.
    #[serde(default)]
    pub attrs: std::collections::BTreeMap<String, f64>,
}

/// One learned parameter of a [`CustomConfig`] layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomParam {
    /// The name in the state dict, under the layer's path (`"bias"`).
    pub name: String,
    /// Its dimensions (`[]` for a scalar).
    pub shape: Vec<usize>,
    /// Its initialiser.
    pub init: Init,
}

impl CustomConfig {
    /// A layer calling `op`, without parameters or attributes.
    pub fn new(op: impl Into<String>) -> Self {
        Self {
            op: op.into(),
            params: Vec::new(),
            attrs: Default::default(),
        }
    }

    /// Declares the next learned parameter.
    pub fn with_param(
        mut self,
        name: impl Into<String>,
        shape: impl Into<Vec<usize>>,
        init: Init,
    ) -> Self {
        self.params.push(CustomParam {
            name: name.into(),
            shape: shape.into(),
            init,
        });
        self
    }

    /// Sets a scalar attribute.
    pub fn with_attr(mut self, name: impl Into<String>, value: f64) -> Self {
        self.attrs.insert(name.into(), value);
        self
    }

    /// The value of attribute `name`, or `default` when the layer does not set it.
    pub fn attr_or(&self, name: &str, default: f64) -> f64 {
        self.attrs.get(name).copied().unwrap_or(default)
    }
}
