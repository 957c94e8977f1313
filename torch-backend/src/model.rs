//! [`TorchModel`]: a Kiln [`Layer`] definition built natively on libtorch.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use kiln_core::{
    CustomConfig, DType, Device, Error, FloatPrecision, GeluApproximation, InitDistribution, Layer,
    Mode, Module, ParamKind, ParamSpec, Result, Shape, StateDict, StateTensors,
};
use tch::{Kind, TchError, Tensor};

use crate::backend::TorchBackend;
use crate::convert::{dtype_from_kind, is_float_kind, kind_from_dtype};
use crate::custom::copy_state;
use crate::custom_layer::{lookup, CustomLayerFn};
use crate::device::{device_from_tch, device_to_tch};
use crate::error::torch_error;

/// One named tensor of the model: a trainable parameter or a buffer.
#[derive(Debug)]
struct Entry {
    name: String,
    kind: ParamKind,
    tensor: Tensor,
}

/// The built layer tree; tensors are referenced by index into the entries, so that
/// moving the model to another device only replaces the entries.
#[derive(Debug)]
enum Node {
    Linear {
        weight: usize,
        bias: Option<usize>,
    },
    Conv1d {
        weight: usize,
        bias: Option<usize>,
        stride: i64,
        padding: i64,
        dilation: i64,
        groups: i64,
    },
    Conv2d {
        weight: usize,
        bias: Option<usize>,
        stride: [i64; 2],
        padding: [i64; 2],
        dilation: [i64; 2],
        groups: i64,
    },
    ConvTranspose2d {
        weight: usize,
        bias: Option<usize>,
        stride: [i64; 2],
        padding: [i64; 2],
        output_padding: [i64; 2],
        dilation: [i64; 2],
        groups: i64,
    },
    MaxPool2d {
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
    },
    AvgPool2d {
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
    },
    AdaptiveAvgPool2d {
        output_size: [i64; 2],
    },
    BatchNorm {
        weight: Option<usize>,
        bias: Option<usize>,
        running_mean: Option<usize>,
        running_var: Option<usize>,
        num_batches_tracked: Option<usize>,
        momentum: f64,
        eps: f64,
    },
    LayerNorm {
        shape: Vec<i64>,
        weight: Option<usize>,
        bias: Option<usize>,
        eps: f64,
    },
    GroupNorm {
        groups: i64,
        weight: Option<usize>,
        bias: Option<usize>,
        eps: f64,
    },
    Dropout {
        p: f64,
    },
    Embedding {
        weight: usize,
        padding_idx: i64,
    },
    Flatten {
        start: i64,
        end: i64,
    },
    Relu,
    LeakyRelu {
        slope: f64,
    },
    Gelu {
        approximate: &'static str,
    },
    Silu,
    Tanh,
    Sigmoid,
    Softmax {
        dim: i64,
    },
    LogSoftmax {
        dim: i64,
    },
    Attention {
        in_proj_weight: usize,
        in_proj_bias: Option<usize>,
        out_weight: usize,
        out_bias: Option<usize>,
        heads: i64,
        causal: bool,
        dropout: f64,
    },
    Sequential(Vec<Node>),
    Residual(Box<Node>),
    Custom {
        /// The layer's path, for errors.
        path: String,
        op: OpFn,
        params: Vec<usize>,
        config: CustomConfig,
    },
}

/// A registered custom-layer function (shown by its layer's op name).
#[derive(Clone)]
struct OpFn(Arc<CustomLayerFn>);

impl std::fmt::Debug for OpFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OpFn")
    }
}

/// Why a forward pass failed: libtorch rejected an op, or a custom layer failed.
enum Failure {
    Torch(TchError),
    Layer(Error),
}

impl From<TchError> for Failure {
    fn from(e: TchError) -> Self {
        Failure::Torch(e)
    }
}

/// A model built from a Kiln [`Layer`] on libtorch.
///
/// Parameters and buffers carry PyTorch's `state_dict` names, so weights move
/// between Kiln and Python through safetensors files (see [`TorchModel::save`]).
///
/// ```no_run
/// use kiln_core::{Device, Layer, LinearConfig, Module};
/// use kiln_torch::TorchModel;
///
/// let spec = Layer::Sequential {
///     layers: vec![
///         Layer::Linear(LinearConfig::new(64, 128)),
///         Layer::Relu,
///         Layer::Linear(LinearConfig::new(128, 10)),
///     ],
/// };
/// let model = TorchModel::new(&spec, Device::Cpu)?;
/// let x = tch::Tensor::zeros([8, 64], (tch::Kind::Float, tch::Device::Cpu));
/// assert_eq!(model.forward(&x)?.size(), vec![8, 10]);
/// # Ok::<(), kiln_core::Error>(())
/// ```
#[derive(Debug)]
pub struct TorchModel {
    spec: Layer,
    root: Node,
    entries: Vec<Entry>,
    mode: Mode,
    device: Device,
    /// The dtype of the floating-point parameters and buffers (`None` when
    /// the model has none): what a floating-point input must be.
    float_dtype: Option<DType>,
    /// How the forward pass computes ([`set_precision`](TorchModel::set_precision)).
    precision: FloatPrecision,
}

impl TorchModel {
    /// Builds `spec` on `device` with its initialisers (PyTorch's defaults where
    /// none is given), drawing from libtorch's generator (seed it with
    /// [`kiln_core::Backend::manual_seed`] for reproducible weights). Starts in training mode.
    pub fn new(spec: &Layer, device: Device) -> Result<Self> {
        spec.validate()?;
        let target = device_to_tch(device)?;
        let specs = spec.parameter_specs("")?;
        let mut entries = Vec::with_capacity(specs.len());
        tch::no_grad(|| -> Result<()> {
            for p in &specs {
                let tensor = init_tensor(p, target)
                    .map_err(|e| torch_error(&format!("initialising {}", p.name), e))?;
                entries.push(Entry {
                    name: p.name.clone(),
                    kind: p.kind,
                    tensor,
                });
            }
            Ok(())
        })?;
        let index: HashMap<&str, usize> = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.as_str(), i))
            .collect();
        let root = build(spec, "", &index)?;
        let float_dtype = specs
            .iter()
            .any(|p| p.dtype.is_float())
            .then_some(DType::F32);
        Ok(Self {
            spec: spec.clone(),
            root,
            entries,
            mode: Mode::Train,
            device,
            float_dtype,
            precision: FloatPrecision::F32,
        })
    }

    /// The definition this model was built from.
    pub fn spec(&self) -> &Layer {
        &self.spec
    }

    /// The device the parameters live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Moves every parameter and buffer to `device` (like `model.to(device)`).
    /// Build optimizers after moving: they hold the parameters they update.
    pub fn to(&mut self, device: Device) -> Result<()> {
        let target = device_to_tch(device)?;
        self.replace_entries(&format!("moving to {device}"), |t| t.f_to_device(target))?;
        self.device = device;
        Ok(())
    }

    /// The dtype of the floating-point parameters and buffers (`float32` when
    /// built; `None` for a model without any), which floating-point inputs must have.
    pub fn dtype(&self) -> Option<DType> {
        self.float_dtype
    }

    /// Converts the floating-point parameters and buffers to `dtype`, like
    /// `model.to(torch.bfloat16)`; integer buffers stay as they are. Inputs
    /// must then have `dtype` too. Build optimizers after converting: they
    /// hold the parameters they update, and keep their state in the
    /// parameters' dtype (pure bf16 training, as PyTorch's with a bf16 model).
    ///
    /// ```no_run
    /// use kiln_core::{DType, Device, Layer, LinearConfig};
    /// use kiln_torch::TorchModel;
    ///
    /// let mut model = TorchModel::new(&Layer::Linear(LinearConfig::new(64, 10)), Device::Cpu)?;
    /// model.to_dtype(DType::BF16)?;
    /// assert_eq!(model.dtype(), Some(DType::BF16));
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn to_dtype(&mut self, dtype: DType) -> Result<()> {
        if !dtype.is_float() {
            return Err(Error::invalid_argument(
                "dtype",
                format!("a model's parameters convert to a floating-point dtype, not {dtype}"),
            ));
        }
        let kind = kind_from_dtype(dtype)?;
        self.replace_entries(&format!("converting to {dtype}"), |t| {
            if is_float_kind(t.kind()) {
                t.f_to_kind(kind)
            } else {
                Ok(t.shallow_clone())
            }
        })?;
        if self.float_dtype.is_some() {
            self.float_dtype = Some(dtype);
        }
        Ok(())
    }

    /// Trains and runs at `precision`, like Lightning's `Trainer(precision=...)`
    /// (see [`FloatPrecision`]): converts the floating-point parameters and buffers to
    /// [`FloatPrecision::parameter_dtype`] and sets how [`forward`](Module::forward)
    /// computes:
    ///
    /// - `bf16-mixed`: float32 parameters; the layers run under
    ///   [`autocast`](crate::autocast) to bfloat16, and a floating-point output
    ///   comes back in float32 (what Keras recommends for a mixed-precision
    ///   model's last layer), so losses and metrics are computed in float32.
    /// - `bf16-true`: bfloat16 parameters; float inputs are cast to bfloat16 (as
    ///   Lightning's precision plugin does), the output is bfloat16.
    /// - `32-true`: float32 throughout (the default).
    ///
    /// Build optimizers after this: they hold the parameters they update.
    /// Nothing changes on error.
    ///
    /// ```no_run
    /// use kiln_core::{Device, Layer, LinearConfig, Module, FloatPrecision};
    /// use kiln_torch::TorchModel;
    ///
    /// let mut model = TorchModel::new(&Layer::Linear(LinearConfig::new(64, 10)), Device::Cpu)?;
    /// model.set_precision(FloatPrecision::Bf16Mixed)?;
    /// let x = tch::Tensor::randn([8, 64], (tch::Kind::Float, tch::Device::Cpu));
    /// assert_eq!(model.forward(&x)?.kind(), tch::Kind::Float); // computed in bf16
    /// # Ok::<(), kiln_core::Error>(())
    /// ```
    pub fn set_precision(&mut self, precision: FloatPrecision) -> Result<()> {
        self.to_dtype(precision.parameter_dtype())?;
        self.precision = precision;
        Ok(())
    }

    /// The precision set by [`set_precision`](Self::set_precision) (`32-true`
    /// when built; [`to_dtype`](Self::to_dtype) does not change it).
    pub fn precision(&self) -> FloatPrecision {
        self.precision
    }

    /// Replaces every parameter and buffer with `f` of it (detached, parameters
    /// requiring gradients again); nothing changes unless every one succeeds.
    fn replace_entries(
        &mut self,
        what: &str,
        f: impl Fn(&Tensor) -> std::result::Result<Tensor, TchError>,
    ) -> Result<()> {
        let mut replaced = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            let t = f(&e.tensor)
                .and_then(|t| t.f_detach())
                .and_then(|t| {
                    if e.kind == ParamKind::Parameter {
                        t.f_set_requires_grad(true)
                    } else {
                        Ok(t)
                    }
                })
                .map_err(|err| torch_error(&format!("{what}: {}", e.name), err))?;
            replaced.push(t);
        }
        for (e, t) in self.entries.iter_mut().zip(replaced) {
            e.tensor = t;
        }
        Ok(())
    }

    /// Writes the state dict to a safetensors file (atomically) that Python's
    /// `safetensors.torch.load_file` reads into the equivalent `torch.nn` model.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut metadata = std::collections::BTreeMap::new();
        metadata.insert("format".to_owned(), "pt".to_owned());
        self.state_tensors()?
            .save_safetensors(path.as_ref(), &metadata)
    }

    /// Loads a safetensors state dict (from [`save`](Self::save) or Python's
    /// `safetensors.torch.save_file`); nothing changes unless every entry matches.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let (state, _) = StateDict::load_safetensors(path.as_ref())?;
        self.load_state_dict(&state)
    }

    /// The input's device must be the model's, and a floating-point input must
    /// have the model's floating-point dtype (integer inputs feed embeddings).
    fn check_input(&self, input: &Tensor) -> Result<()> {
        let device = device_from_tch(input.device())?;
        if device != self.device {
            return Err(Error::DeviceMismatch {
                context: "model input".to_owned(),
                expected: self.device,
                actual: device,
            });
        }
        let kind = input
            .f_kind()
            .map_err(|e| torch_error("reading the input's dtype", e))?;
        if let Some(expected) = self.float_dtype {
            if is_float_kind(kind) && kind != kind_from_dtype(expected)? {
                return Err(Error::DTypeMismatch {
                    context: "model input (convert it, or the model with `to_dtype`)".to_owned(),
                    expected,
                    actual: dtype_from_kind(kind)?,
                });
            }
        }
        Ok(())
    }

    /// Why libtorch rejected `input`: the definition's shape check names the
    /// layer and both shapes; libtorch's own message when the shapes are fine.
    fn explain_failure(&self, input: &Tensor, error: TchError) -> Error {
        let dims: Vec<usize> = input.size().iter().map(|&d| d as usize).collect();
        match self.spec.output_shape(&dims) {
            Err(shape_error) => shape_error,
            Ok(_) => torch_error("forward", error),
        }
    }

    fn tensor(&self, index: usize) -> &Tensor {
        &self.entries[index].tensor
    }

    fn opt(&self, index: Option<usize>) -> Option<&Tensor> {
        index.map(|i| self.tensor(i))
    }

    fn run(&self, node: &Node, x: &Tensor, train: bool) -> std::result::Result<Tensor, Failure> {
        match node {
            Node::Sequential(children) => {
                let mut out = x.shallow_clone();
                for child in children {
                    out = self.run(child, &out, train)?;
                }
                Ok(out)
            }
            Node::Residual(block) => Ok(x.f_add(&self.run(block, x, train)?)?),
            Node::Custom {
                path,
                op,
                params,
                config,
            } => {
                let params: Vec<&Tensor> = params.iter().map(|&i| self.tensor(i)).collect();
                let y = (op.0)(x, &params, config).map_err(Failure::Layer)?;
                if y.size() != x.size() {
                    let dims = |t: &Tensor| {
                        Shape::from(t.size().iter().map(|&d| d as usize).collect::<Vec<_>>())
                            .to_string()
                    };
                    return Err(Failure::Layer(Error::ShapeMismatch {
                        context: format!("{path} (Custom {}): op output", config.op),
                        expected: dims(x),
                        actual: dims(&y),
                    }));
                }
                Ok(y)
            }
            leaf => Ok(self.run_leaf(leaf, x, train)?),
        }
    }

    /// Runs a node without children.
    fn run_leaf(
        &self,
        node: &Node,
        x: &Tensor,
        train: bool,
    ) -> std::result::Result<Tensor, TchError> {
        match node {
            Node::Linear { weight, bias } => x.f_linear(self.tensor(*weight), self.opt(*bias)),
            Node::Conv1d {
                weight,
                bias,
                stride,
                padding,
                dilation,
                groups,
            } => x.f_conv1d(
                self.tensor(*weight),
                self.opt(*bias),
                [*stride],
                [*padding],
                [*dilation],
                *groups,
            ),
            Node::Conv2d {
                weight,
                bias,
                stride,
                padding,
                dilation,
                groups,
            } => x.f_conv2d(
                self.tensor(*weight),
                self.opt(*bias),
                stride.as_slice(),
                padding.as_slice(),
                dilation.as_slice(),
                *groups,
            ),
            Node::ConvTranspose2d {
                weight,
                bias,
                stride,
                padding,
                output_padding,
                dilation,
                groups,
            } => x.f_conv_transpose2d(
                self.tensor(*weight),
                self.opt(*bias),
                stride.as_slice(),
                padding.as_slice(),
                output_padding.as_slice(),
                *groups,
                dilation.as_slice(),
            ),
            Node::MaxPool2d {
                kernel,
                stride,
                padding,
            } => x.f_max_pool2d(
                kernel.as_slice(),
                stride.as_slice(),
                padding.as_slice(),
                [1, 1],
                false,
            ),
            Node::AvgPool2d {
                kernel,
                stride,
                padding,
            } => x.f_avg_pool2d(
                kernel.as_slice(),
                stride.as_slice(),
                padding.as_slice(),
                false,
                true,
                None,
            ),
            Node::AdaptiveAvgPool2d { output_size } => {
                x.f_adaptive_avg_pool2d(output_size.as_slice())
            }
            Node::BatchNorm {
                weight,
                bias,
                running_mean,
                running_var,
                num_batches_tracked,
                momentum,
                eps,
            } => {
                let tracks = running_mean.is_some();
                // PyTorch: batch statistics in training, or always without running stats.
                let use_batch_stats = train || !tracks;
                if train && tracks {
                    if let Some(n) = num_batches_tracked {
                        let mut count = self.tensor(*n).shallow_clone();
                        let _ = tch::no_grad(|| count.f_add_scalar_(1))?;
                    }
                }
                x.f_batch_norm(
                    self.opt(*weight),
                    self.opt(*bias),
                    self.opt(*running_mean),
                    self.opt(*running_var),
                    use_batch_stats,
                    *momentum,
                    *eps,
                    false,
                )
            }
            Node::LayerNorm {
                shape,
                weight,
                bias,
                eps,
            } => x.f_layer_norm(
                shape.as_slice(),
                self.opt(*weight),
                self.opt(*bias),
                *eps,
                false,
            ),
            Node::GroupNorm {
                groups,
                weight,
                bias,
                eps,
            } => x.f_group_norm(*groups, self.opt(*weight), self.opt(*bias), *eps, false),
            Node::Dropout { p } => x.f_dropout(*p, train),
            Node::Embedding {
                weight,
                padding_idx,
            } => Tensor::f_embedding(self.tensor(*weight), x, *padding_idx, false, false),
            Node::Flatten { start, end } => x.f_flatten(*start, *end),
            Node::Relu => x.f_relu(),
            Node::LeakyRelu { slope } => {
                // PyTorch: x > 0 ? x : slope * x (gradient `slope` at 0).
                let positive = x.f_gt(0.0)?;
                x.f_where_self(&positive, &x.f_mul_scalar(*slope)?)
            }
            Node::Gelu { approximate } => x.f_gelu(approximate),
            Node::Silu => x.f_silu(),
            Node::Tanh => x.f_tanh(),
            Node::Sigmoid => x.f_sigmoid(),
            Node::Softmax { dim } => x.f_softmax(*dim, None::<Kind>),
            Node::LogSoftmax { dim } => x.f_log_softmax(*dim, None::<Kind>),
            Node::Attention {
                in_proj_weight,
                in_proj_bias,
                out_weight,
                out_bias,
                heads,
                causal,
                dropout,
            } => {
                let size = x.size();
                let (batch, seq, embed) = (size[0], size[1], size[2]);
                let head_dim = embed / heads;
                let qkv = x.f_linear(self.tensor(*in_proj_weight), self.opt(*in_proj_bias))?;
                let parts = qkv.f_chunk(3, -1)?;
                let split = |t: &Tensor| {
                    t.f_reshape([batch, seq, *heads, head_dim])?
                        .f_transpose(1, 2)
                };
                let (q, k, v) = (split(&parts[0])?, split(&parts[1])?, split(&parts[2])?);
                let p = if train { *dropout } else { 0.0 };
                let attended = Tensor::f_scaled_dot_product_attention(
                    &q,
                    &k,
                    &v,
                    None::<Tensor>,
                    p,
                    *causal,
                    None,
                    false,
                )?;
                let merged = attended.f_transpose(1, 2)?.f_reshape([batch, seq, embed])?;
                merged.f_linear(self.tensor(*out_weight), self.opt(*out_bias))
            }
            Node::Sequential(_) | Node::Residual(_) | Node::Custom { .. } => Err(TchError::Torch(
                "internal error: a composite layer reached run_leaf".to_owned(),
            )),
        }
    }
}

fn init_tensor(spec: &ParamSpec, device: tch::Device) -> std::result::Result<Tensor, TchError> {
    let kind = match spec.dtype {
        DType::I64 => Kind::Int64,
        DType::F64 => Kind::Double,
        _ => Kind::Float,
    };
    let dims: Vec<i64> = spec.shape.iter().map(|&d| d as i64).collect();
    let mut t = Tensor::f_empty(dims.as_slice(), (kind, device))?;
    match spec.init {
        InitDistribution::Constant { value } => {
            let _ = t.f_fill_(value)?;
        }
        InitDistribution::Uniform { low, high } => {
            let _ = t.f_uniform_(low, high)?;
        }
        InitDistribution::Normal { mean, std } => {
            let _ = t.f_normal_(mean, std)?;
        }
    }
    if let Some(row) = spec.zero_row {
        let _ = t.f_get(row as i64)?.f_zero_()?;
    }
    if spec.kind == ParamKind::Parameter {
        t = t.f_set_requires_grad(true)?;
    }
    Ok(t)
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}

fn pair(v: [usize; 2]) -> [i64; 2] {
    [v[0] as i64, v[1] as i64]
}

/// Builds the node for `layer` at `prefix`, finding its tensors by name.
fn build(layer: &Layer, prefix: &str, index: &HashMap<&str, usize>) -> Result<Node> {
    let find = |name: &str| index.get(join(prefix, name).as_str()).copied();
    let need = |name: &str| {
        find(name).ok_or_else(|| Error::MissingKey {
            key: join(prefix, name),
            available: index.len(),
        })
    };
    Ok(match layer {
        Layer::Linear(_) => Node::Linear {
            weight: need("weight")?,
            bias: find("bias"),
        },
        Layer::Conv1d(c) => Node::Conv1d {
            weight: need("weight")?,
            bias: find("bias"),
            stride: c.stride as i64,
            padding: c.padding as i64,
            dilation: c.dilation as i64,
            groups: c.groups as i64,
        },
        Layer::Conv2d(c) => Node::Conv2d {
            weight: need("weight")?,
            bias: find("bias"),
            stride: pair(c.stride),
            padding: pair(c.padding),
            dilation: pair(c.dilation),
            groups: c.groups as i64,
        },
        Layer::ConvTranspose2d(c) => Node::ConvTranspose2d {
            weight: need("weight")?,
            bias: find("bias"),
            stride: pair(c.stride),
            padding: pair(c.padding),
            output_padding: pair(c.output_padding),
            dilation: pair(c.dilation),
            groups: c.groups as i64,
        },
        Layer::MaxPool2d(c) => Node::MaxPool2d {
            kernel: pair(c.kernel_size),
            stride: pair(c.effective_stride()),
            padding: pair(c.padding),
        },
        Layer::AvgPool2d(c) => Node::AvgPool2d {
            kernel: pair(c.kernel_size),
            stride: pair(c.effective_stride()),
            padding: pair(c.padding),
        },
        Layer::AdaptiveAvgPool2d { output_size } => Node::AdaptiveAvgPool2d {
            output_size: pair(*output_size),
        },
        Layer::BatchNorm1d(c) | Layer::BatchNorm2d(c) => Node::BatchNorm {
            weight: find("weight"),
            bias: find("bias"),
            running_mean: find("running_mean"),
            running_var: find("running_var"),
            num_batches_tracked: find("num_batches_tracked"),
            momentum: c.momentum,
            eps: c.eps,
        },
        Layer::LayerNorm(c) => Node::LayerNorm {
            shape: c.normalized_shape.iter().map(|&d| d as i64).collect(),
            weight: find("weight"),
            bias: find("bias"),
            eps: c.eps,
        },
        Layer::GroupNorm(c) => Node::GroupNorm {
            groups: c.num_groups as i64,
            weight: find("weight"),
            bias: find("bias"),
            eps: c.eps,
        },
        Layer::Dropout { p } => Node::Dropout { p: *p },
        Layer::Embedding(c) => Node::Embedding {
            weight: need("weight")?,
            padding_idx: c.padding_idx.map_or(-1, |i| i as i64),
        },
        Layer::Flatten { start_dim, end_dim } => Node::Flatten {
            start: *start_dim as i64,
            end: *end_dim as i64,
        },
        Layer::Relu => Node::Relu,
        Layer::LeakyRelu { negative_slope } => Node::LeakyRelu {
            slope: *negative_slope,
        },
        Layer::Gelu { approximate } => Node::Gelu {
            approximate: match approximate {
                GeluApproximation::Tanh => "tanh",
                _ => "none",
            },
        },
        Layer::Silu => Node::Silu,
        Layer::Tanh => Node::Tanh,
        Layer::Sigmoid => Node::Sigmoid,
        Layer::Softmax { dim } => Node::Softmax { dim: *dim as i64 },
        Layer::LogSoftmax { dim } => Node::LogSoftmax { dim: *dim as i64 },
        Layer::MultiHeadSelfAttention(c) => Node::Attention {
            in_proj_weight: need("in_proj_weight")?,
            in_proj_bias: find("in_proj_bias"),
            out_weight: need("out_proj.weight")?,
            out_bias: find("out_proj.bias"),
            heads: c.num_heads as i64,
            causal: c.causal,
            dropout: c.dropout,
        },
        Layer::Sequential { layers } => Node::Sequential(
            layers
                .iter()
                .enumerate()
                .map(|(i, l)| build(l, &join(prefix, &i.to_string()), index))
                .collect::<Result<_>>()?,
        ),
        Layer::Residual { block } => {
            Node::Residual(Box::new(build(block, &join(prefix, "block"), index)?))
        }
        Layer::Custom(c) => Node::Custom {
            path: prefix.to_owned(),
            op: OpFn(lookup(prefix, &c.op)?),
            params: c
                .params
                .iter()
                .map(|p| need(&p.name))
                .collect::<Result<_>>()?,
            config: c.clone(),
        },
        other => return Err(Error::unsupported(format!("layer {other:?} on libtorch"))),
    })
}

impl Module<TorchBackend> for TorchModel {
    /// Shapes are checked by libtorch as the layers run; only on failure does the
    /// definition's shape inference run, to name the layer and both shapes
    /// (the training step does no shape bookkeeping of its own).
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let cast;
        let input = match self.precision {
            FloatPrecision::Bf16True => {
                cast = cast_float(input, Kind::BFloat16, "casting the input to bfloat16")?;
                &cast
            }
            FloatPrecision::F32 | FloatPrecision::Bf16Mixed => input,
        };
        self.check_input(input)?;
        let run = || {
            self.run(&self.root, input, self.mode.is_train())
                .map_err(|e| match e {
                    Failure::Torch(e) => self.explain_failure(input, e),
                    Failure::Layer(e) => e,
                })
        };
        match self.precision.autocast_dtype() {
            None => run(),
            Some(dtype) => {
                let output = crate::autocast(self.device, dtype, run)??;
                cast_float(&output, Kind::Float, "casting the output to float32")
            }
        }
    }

    fn mode(&self) -> Mode {
        self.mode
    }

    fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.entries
            .iter()
            .filter(|e| e.kind == ParamKind::Parameter)
            .map(|e| (e.name.clone(), e.tensor.shallow_clone()))
            .collect()
    }

    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.entries
            .iter()
            .filter(|e| e.kind == ParamKind::Buffer)
            .map(|e| (e.name.clone(), e.tensor.shallow_clone()))
            .collect()
    }

    /// Handles to the parameters and buffers: a checkpoint reads them in place.
    fn state_tensors(&self) -> Result<StateTensors<TorchBackend>> {
        StateTensors::from_handles(
            self.named_parameters()
                .into_iter()
                .chain(self.named_buffers()),
        )
    }

    /// Strict, like PyTorch's default: every parameter and buffer must be present
    /// with its shape, and no other key; dtypes convert. Nothing changes on error.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let targets: Vec<(String, Tensor)> = self
            .entries
            .iter()
            .map(|e| (e.name.clone(), e.tensor.shallow_clone()))
            .collect();
        copy_state(&targets, state)
    }
}

/// `tensor` in `kind` when it is floating-point and of another kind; otherwise
/// itself (integer inputs feed embeddings, and keep their kind).
fn cast_float(tensor: &Tensor, kind: Kind, what: &str) -> Result<Tensor> {
    let current = tensor.f_kind().map_err(|e| torch_error(what, e))?;
    if is_float_kind(current) && current != kind {
        tensor.f_to_kind(kind).map_err(|e| torch_error(what, e))
    } else {
        Ok(tensor.shallow_clone())
    }
}
